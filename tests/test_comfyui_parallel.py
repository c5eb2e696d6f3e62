"""ComfyUI has no multi-GPU sampling of its own; in a process of a ``torch.distributed`` group (a worker of Raylight's)
the DiT door runs every block, with one warning."""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

import torch
from hosts import comfy_host as host  # noqa: I001  (before any ComfyUI import: sys.path, CPU mode)

SHAPE, STEPS = (1, 9, 13), 12


def test_comfyui_has_no_multi_gpu_sampling_of_its_own():
    import comfy.model_patcher

    named = re.compile(r"multi_?gpu|torch\.distributed", re.IGNORECASE)
    sources = Path(comfy.model_patcher.__file__).parent.rglob("*.py")
    found = [path for path in sources if named.search(path.read_text(errors="ignore"))]
    assert found == []


def test_in_a_process_group_every_block_runs_with_one_warning(monkeypatch, caplog):
    node_classes = host.load_our_package()
    model = host.tiny_dit("flux", depth=2, depth_single_blocks=2)
    unpatched = host.sample_dit(model, "flux", SHAPE, steps=STEPS)
    for name, module in list(sys.modules.items()):
        if name.endswith("tome_core.hosts.comfyui.dit_reuse"):
            monkeypatch.setattr(module, "several_processes", lambda: True)
    settings = {"dit_settings": "as set", "reuse_interval": 3, "downsample_factor": 1.0}
    patched = host.patch_with_node(node_classes, model, **settings)
    with caplog.at_level(logging.WARNING, logger="tome_patch"):
        out = host.sample_dit(patched, "flux", SHAPE, steps=STEPS)
        host.sample_dit(patched, "flux", SHAPE, steps=STEPS)
    assert torch.equal(out, unpatched)
    assert caplog.text.count("one of several of a torch.distributed group") == 1
