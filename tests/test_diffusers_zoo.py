"""The diffusers model zoo: every transformer class diffusers exports (``diffusers.*Transformer*Model``), built with
its default config on the meta device (no memory, no weights), through ``tome_core.apply_patch`` and
``remove_patch``.

A class the door knows (a row of ``dit_reuse.LAYOUTS``, found by its exact class name) is patched and comes back
from removal as it was; any other is refused with the ``TypeError`` that names the families it supports, before
anything was changed. Nothing else may happen: no other exception, no half-made patch. The supported families'
sampling, patched and unpatched, is tested on tiny pipelines (``test_diffusers_dit.py``,
``test_diffusers_dit_families.py``); classes whose default config does not build are listed with the reason."""

from __future__ import annotations

import diffusers
import pytest
import torch
from test_diffusers import module_snapshot

import tome_core
from tome_core.hosts.diffusers import dit_reuse

CLASSES = sorted(name for name in dir(diffusers) if name.endswith("Model") and "Transformer" in name)
# Arguments without which a class's default config does not build.
ARGUMENTS = {
    "DreamLiteTransformer2DModel": {"in_channels": 32},
    "Transformer2DModel": {"in_channels": 32},
    "TransformerTemporalModel": {"in_channels": 32},
}
# Classes whose default config leaves out what their constructor needs, and no small set of arguments was found.
HARNESS_CANNOT = {
    "EasyAnimateTransformer3DModel": "its default config has no sample size",
    "HiDreamImageTransformer2DModel": "its default config has no Llama layers or experts' sizes",
    "LatteTransformer3DModel": "its default config has no sample size",
    "OmniGenTransformer2DModel": "its default config has no RoPE scaling",
}


def build(name: str):
    with torch.device("meta"):
        return getattr(diffusers, name)(**ARGUMENTS.get(name, {}))


def test_the_zoo_is_every_transformer_class_diffusers_exports():
    assert len(CLASSES) >= 50
    assert set(dit_reuse.LAYOUTS) <= set(CLASSES) and set(HARNESS_CANNOT) <= set(CLASSES)


@pytest.mark.parametrize("name", CLASSES)
def test_every_transformer_is_patched_or_refused_cleanly(name):
    if name in HARNESS_CANNOT:
        with pytest.raises((TypeError, ValueError)):
            build(name)
        return
    transformer = build(name)
    before = module_snapshot(transformer)
    if name in dit_reuse.LAYOUTS:
        assert tome_core.apply_patch(transformer) is transformer
        assert tome_core.remove_patch(transformer) is transformer
    else:
        with pytest.raises(TypeError, match="FluxTransformer2DModel"):
            tome_core.apply_patch(transformer)
    assert module_snapshot(transformer) == before
