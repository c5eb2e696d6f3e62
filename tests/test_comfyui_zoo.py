"""The model zoo: every model class of the pinned ComfyUI (``comfy.supported_models.models``), built tiny with random
weights through ComfyUI's own classes (``hosts/comfy_zoo.py``), through the node at its defaults.

For each class: sampled unpatched and patched at 8 and 12 steps (and 28 for the DiTs), the node raises nothing;
what comes out is finite and of the unpatched shape; the input model is left as it was; and either reuse engaged
(some calls ran only the outer layers) with an output close to the unpatched one, or nothing was reused and the
output is the unpatched one, bit for bit, with a log line that says why. A class the harness cannot build or sample
is listed in ``comfy_zoo.HARNESS_CANNOT`` with the reason, and checked to still fail here."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from hosts import comfy_host as host  # noqa: I001  (before any ComfyUI import: sys.path, CPU mode)
from hosts import comfy_zoo

CLASSES = [cls.__name__ for cls in host.comfy.supported_models.models]
# Reuse on random weights: the inner layers' output moves as noise does, so what a reusing step predicts is off by
# more than on a trained model. "Close": the patched output lies nearer the unpatched one than half the distance
# between two seeds' unpatched outputs (at the most steps the class runs); a broken prediction (a stream dropped,
# a residual added twice, another layout's record) gives an output as unrelated as another seed's or worse.
# Measured: 0.002 to 0.13 of that distance on every class that reuses, 0.37 on Lotus (a one-step depth model,
# sampled here for 12).
CLOSE = 0.5


@pytest.fixture(scope="module")
def node_classes():
    return host.load_our_package()


def test_the_zoo_is_every_class_of_the_pinned_comfyui():
    assert len(CLASSES) == len(set(CLASSES)) >= 60
    assert set(comfy_zoo.HARNESS_CANNOT) <= set(CLASSES)


@pytest.mark.parametrize("name", CLASSES)
def test_every_model_comfyui_ships_samples_through_the_node(node_classes, name, monkeypatch, caplog):
    cls = comfy_zoo.model_class(name)
    if name in comfy_zoo.HARNESS_CANNOT:
        with pytest.raises(Exception):  # noqa: B017  (what fails is the harness's own making, of any kind)
            comfy_zoo.sample_model(comfy_zoo.build(cls), cls, 2)
        return
    model = comfy_zoo.build(cls)
    options = copy.deepcopy(model.model_options)
    steps = (8, 12) if comfy_zoo.is_unet(cls) else (8, 12, 28)
    with caplog.at_level(logging.INFO, logger="tome_patch"):
        patched = host.patch_with_node(node_classes, model)
    assert model.model_options == options
    plain = comfy_zoo.sample_model(model, cls, steps[0])
    if patched is model:  # passed through: the node returned the model it was given, and said why
        assert "passed through unchanged" in caplog.text or "unchanged" in caplog.text, caplog.text
        return
    runs = host.recorded_runs(monkeypatch)
    seeds_apart = None  # at the most steps, where reuse changes the most
    for count in reversed(steps):
        reference = plain if count == steps[0] else comfy_zoo.sample_model(model, cls, count)
        before = len(runs)
        with caplog.at_level(logging.INFO, logger="tome_patch"):
            out = comfy_zoo.sample_model(patched, cls, count)
        assert out.shape == reference.shape
        assert torch.isfinite(out).all() == torch.isfinite(reference).all()
        reused = sum(run.reused_calls for run in runs[before:])
        if reused:
            if seeds_apart is None:
                seeds_apart = (comfy_zoo.sample_model(model, cls, count, seed=43) - reference).abs().mean()
            share = float((out - reference).abs().mean() / seeds_apart)
            assert share < CLOSE, (count, share)
        else:
            assert torch.equal(out, reference), count
            assert caplog.text, "nothing reused and nothing said"
    assert model.model_options == options
    assert torch.equal(comfy_zoo.sample_model(model, cls, steps[0]), plain)  # the input model, after the patched


@pytest.mark.parametrize(("name", "words"), (("AuraFlow", "AuraFlow (MMDiT)"), ("Omnigen2", "OmniGen2 (OmniGen2")))
def test_a_family_without_a_reference_is_named_and_left_as_it_was_by_default(node_classes, caplog, name, words):
    """AuraFlow (a class called ``MMDiT``, as SD3's) and OmniGen2 (added by the checklist of docs/how-it-works.md:
    its record, this test) are named as themselves; the node passed them through before, and with no reference to
    measure a default on, ``dit_settings`` auto still leaves their output as it was, bit for bit; "as set" with a
    ``reuse_interval`` reuses across steps."""
    import logging

    cls = comfy_zoo.model_class(name)
    model = comfy_zoo.build(cls)
    plain = comfy_zoo.sample_model(model, cls, 12)
    with caplog.at_level(logging.INFO, logger="tome_patch"):
        auto = host.patch_with_node(node_classes, model)
    assert words in caplog.text and "SD3" not in caplog.text
    assert torch.equal(comfy_zoo.sample_model(auto, cls, 12), plain)
    as_set = host.patch_with_node(node_classes, model, dit_settings="as set", downsample_factor=1.0, reuse_interval=3)
    assert not torch.equal(comfy_zoo.sample_model(as_set, cls, 12), plain)
