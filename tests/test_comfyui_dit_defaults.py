"""``dit_settings``: what a freshly added node runs on a DiT (``auto``: each family's measured setting, reuse across
steps guarded by the real model's published step-to-step change, and no ToDo), and what a prompt or workflow saved
before the input existed runs (its inputs as set).

``auto``'s full steps are checked against the same reuse set by hand (``as set``, ``downsample_factor`` 1) and the
family record's curve (``hosts.shared.dit_families``)."""

from __future__ import annotations

import logging

import pytest
import torch
from hosts import comfy_host as host  # noqa: I001  (before any ComfyUI import: sys.path, CPU mode)

from tome_core.hosts.comfyui import dit
from tome_core.hosts.shared import dit_families
from tome_core.reuse import StepCountSchedule
from tome_core.settings import IMPLIED_WHEN_ABSENT, SPECS

SHAPES = {"flux": (1, 9, 13), "wan": (1, 3, 9, 11)}
DEEPER = {"flux": {"depth": 2, "depth_single_blocks": 2}, "wan": {"num_layers": 4}}


@pytest.fixture(scope="module")
def node_classes():
    return host.load_our_package()


@pytest.fixture(scope="module")
def dits():
    return {family: host.tiny_dit(family, **DEEPER[family]) for family in SHAPES}


def run(model, family, shape, steps):
    """A sampling run at CFG 1 (one call a step: quick; the batch layouts of CFG have tests of their own)."""
    return host.sample_dit(model, family, shape, steps=steps, cfg=1.0)


def fresh_node(node_classes, model, **values):
    """The node as added anew: every input at its default (``dit_settings`` auto) unless given."""
    return host.patch_with_node(node_classes, model, **values)


def as_set(node_classes, model, **values):
    return host.patch_with_node(node_classes, model, dit_settings="as set", **values)


def test_the_default_is_auto_and_an_older_prompt_means_as_set():
    assert SPECS["dit_settings"].default == "auto"
    assert IMPLIED_WHEN_ABSENT["dit_settings"] == "as set"


@pytest.mark.parametrize(
    ("family", "name", "steps", "interval"),
    (("flux", "Flux", 28, 3), ("flux", "Flux", 50, 4)),
    ids=("flux-28", "flux-50"),
)
def test_auto_is_the_familys_measured_reuse_guarded_by_its_curve(
    node_classes, dits, family, name, steps, interval, monkeypatch
):
    """A fresh node (ToDo 2 and reuse_interval 3 among its inputs, skip_when_slower off so that ToDo would act)
    runs no ToDo and reuse every ``interval`` (the family's for the step count) with, on top, the steps where
    reuse would accumulate more error on the real model's published curve than its threshold allows."""
    model = dits[family]
    plans = host.recorded_plans(monkeypatch)
    auto = fresh_node(node_classes, model, skip_when_slower=False, reuse_interval=2)
    assert auto.get_wrappers("apply_model", dit.WRAPPER_KEY) == []  # no ToDo
    by_hand = as_set(node_classes, model, skip_when_slower=False, downsample_factor=1.0, reuse_interval=interval)
    out = run(auto, family, SHAPES[family], steps)
    by_hand_out = run(by_hand, family, SHAPES[family], steps)
    assert torch.isfinite(out).all() and len(plans) == 2
    guarded, every_n = plans
    record = dit_families.family(name)
    assert guarded == record.curve.guard(every_n, steps)
    assert max(record.curve.errors(guarded, steps)) <= record.curve.threshold
    # Real Flux moves fast over its first steps: the guard computes some of them (Qwen-Image's and Wan's defaults
    # are guarded by their own first block instead: test_comfyui_dit_families).
    assert guarded > every_n and {1, 2, 3} & guarded
    assert max(record.curve.errors(every_n, steps)) > record.curve.threshold
    assert not torch.equal(out, by_hand_out)


def test_a_prompt_saved_before_dit_settings_runs_its_inputs_as_set(node_classes, dits):
    """The node's inputs of a prompt saved before ``dit_settings`` existed (ToDo 2, reuse every 3): ToDo's
    attention wrapper is there and the output is what ``as set`` gives, not what ``auto`` gives."""
    node = node_classes["ToMePatch"]
    inputs = {spec.id: spec.default for spec in node.GET_SCHEMA().inputs[1:] if spec.id != "dit_settings"}
    inputs["skip_when_slower"] = False
    saved = host.run_node(node, model=dits["flux"], **inputs)
    assert saved.get_wrappers("apply_model", dit.WRAPPER_KEY) != []
    out = run(saved, "flux", SHAPES["flux"], 12)
    by_hand = as_set(node_classes, dits["flux"], skip_when_slower=False)
    assert torch.equal(out, run(by_hand, "flux", SHAPES["flux"], 12))
    auto = fresh_node(node_classes, dits["flux"], skip_when_slower=False)
    assert not torch.equal(out, run(auto, "flux", SHAPES["flux"], 12))


def test_under_ten_steps_auto_is_bit_identical_to_off(node_classes, dits):
    """Distilled few-step models (Z-Image Turbo, Flux.2 klein, Lightning LoRAs): every step runs every block."""
    auto = fresh_node(node_classes, dits["flux"])
    for steps in (4, 9):
        unpatched = run(dits["flux"], "flux", SHAPES["flux"], steps)
        assert torch.equal(run(auto, "flux", SHAPES["flux"], steps), unpatched)


def test_a_unet_ignores_dit_settings(node_classes):
    model = host.tiny_model("sd15")
    outs = [
        host.sample(fresh_node(node_classes, model, skip_when_slower=False, dit_settings=choice), steps=12)
        for choice in ("auto", "as set")
    ]
    assert torch.equal(*outs)


def test_auto_says_what_it_runs(node_classes, dits, caplog):
    with caplog.at_level(logging.INFO, logger="tome_patch"):
        fresh_node(node_classes, dits["wan"])
    assert "Wan" in caplog.text and "every 6" in caplog.text and "no ToDo" in caplog.text
    assert "first block's output" in caplog.text  # the guards that decide the rest while the run goes


def test_auto_intervals_by_step_count():
    schedule = dit_families.auto_schedule("Flux")
    assert [schedule.interval(steps) for steps in (10, 28, 39, 40, 50)] == [3, 3, 3, 4, 4]
    assert dit_families.auto_schedule("Wan").interval(30) == 6
    with pytest.raises(ValueError, match="intervals"):
        StepCountSchedule(((10, 3),))
    # Every family reuse runs on has its block layout in its record, under the record's name.
    assert all(f.blocks.family == f.name for f in dit_families.FAMILIES if f.blocks is not None)


def test_start_percent_runs_the_first_steps_in_full_under_auto(node_classes, dits):
    """``start_percent`` bounds reuse with ``auto`` too: the calls before it run every block, on top of the
    interval's full steps (the way to run the first steps in full as EasyCache does; docs/dit.md). Counted as the
    calls of the second double block, which runs only where a call is full."""
    block = dits["flux"].model.diffusion_model.double_blocks[1]
    calls = []
    block.forward = lambda *args, original=block.forward, **kwargs: calls.append(1) or original(*args, **kwargs)
    try:
        full = {}
        for start in (0.0, 0.15):
            calls.clear()
            out = run(fresh_node(node_classes, dits["flux"], start_percent=start), "flux", SHAPES["flux"], 28)
            assert torch.isfinite(out).all()
            full[start] = len(calls)
    finally:
        del block.forward
    # The default's 13 of 28 on this model's noise levels (every 3, and the first steps real Flux moves fast in);
    # from 0.15 the calls above that share of the noise range (ComfyUI's percent_to_sigma) come on top.
    assert full[0.0] == 13 and 13 < full[0.15] <= 17, full
