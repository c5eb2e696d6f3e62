"""ComfyUI: ``reuse_plan`` "calibrated" on DiTs (Flux, and Wan with its first-block guards) in a real ComfyUI with
tiny random-weight models of its own classes: the first job runs unpatched, then its family's plan at other
intervals on the same noise, at most 6 runs, and keeps the interval with the fewest computed steps at the target;
the next job runs it, the same picture every time; a DiT's kept plan is keyed by the patch's own plan."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from hosts import comfy_host as host  # noqa: I001  (before any ComfyUI import: sys.path, CPU mode)

from tome_core.calibration import MAX_RUNS
from tome_core.hosts.comfyui import dit_reuse

DEEPER = {"flux": {"depth": 2, "depth_single_blocks": 2}, "wan": {"num_layers": 4}}
SHAPES = {"flux": (1, 9, 13), "wan": (1, 3, 9, 11)}
STEPS = 14


@pytest.fixture(scope="module")
def node_classes():
    return host.load_our_package()


@pytest.fixture(scope="module")
def dits():
    return {family: host.tiny_dit(family, **DEEPER[family]) for family in DEEPER}


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    import folder_paths

    monkeypatch.setattr(folder_paths, "get_user_directory", lambda: str(tmp_path))
    return tmp_path


def patch(node_classes, model, **values):
    values = {"skip_when_slower": False, "dit_settings": "auto", "reuse_plan": "calibrated", **values}
    return host.patch_with_node(node_classes, model, **values)


def counted(model, family, steps=STEPS):
    """The job's latent, and the calls of the span's last block and of the first block (every call runs it)."""
    diffusion_model = model.model.diffusion_model
    blocks = list(diffusion_model.single_blocks if family == "flux" else diffusion_model.blocks)
    first = diffusion_model.double_blocks[0] if family == "flux" else blocks[0]
    calls = {"span": 0, "all": 0}
    handles = [
        blocks[-1].register_forward_hook(lambda *_: calls.__setitem__("span", calls["span"] + 1)),
        first.register_forward_hook(lambda *_: calls.__setitem__("all", calls["all"] + 1)),
    ]
    try:
        out = host.sample_dit(model, family, SHAPES[family], steps=steps)
    finally:
        for handle in handles:
            handle.remove()
    return out, calls


def kept(user_dir) -> dict:
    return json.loads((user_dir / "tome_patch" / "calibrations.json").read_text())["entries"]


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_the_first_job_calibrates_an_interval_and_the_next_runs_it(node_classes, dits, user_dir, family):
    plain, plain_calls = counted(dits[family], family)
    patched = patch(node_classes, dits[family], calibration_target=0.9)  # a random model moves fast: a loose target
    first, first_calls = counted(patched, family)
    assert (first - plain).abs().max() <= 1e-5 * plain.abs().max()  # unpatched, computed in a batch of two
    (entry,) = kept(user_dir).values()
    result = entry["result"]
    assert result["spacing"] is None and 2 <= result["runs"] <= MAX_RUNS
    assert first_calls["all"] <= result["runs"] * 2 * plain_calls["all"]  # each run a batch of two
    assert any(part.startswith("plan:every") for part in entry["key"]["extra"])
    second, second_calls = counted(patched, family)
    third, _ = counted(patched, family)
    assert torch.equal(second, third)
    assert len(kept(user_dir)) == 1  # nothing calibrated again
    if result["interval"] is None:  # no interval kept the target: every step in full, the unpatched picture
        assert second_calls == plain_calls and torch.equal(second, plain)
    else:  # the span runs at the computed steps only (cond and uncond: two calls a step)
        assert second_calls["all"] == plain_calls["all"]
        assert second_calls["span"] == 2 * result["computed"] <= plain_calls["span"]
        assert family == "wan" or result["computed"] < STEPS  # Wan's first-block guards may run every step


def test_a_looser_target_computes_no_more_steps(node_classes, dits, tmp_path, monkeypatch):
    import folder_paths

    computed = {}
    for target in (0.8, 0.999):
        monkeypatch.setattr(folder_paths, "get_user_directory", lambda t=target: str(tmp_path / str(t)))
        counted(patch(node_classes, dits["flux"], calibration_target=target), "flux")
        (entry,) = kept(tmp_path / str(target)).values()
        computed[target] = entry["result"]["computed"]
        tried = [count for count, _ in entry["result"]["tried"]]
        assert all(count < STEPS for count in tried)  # every candidate reuses some step
    assert computed[0.8] <= computed[0.999]


def test_each_plan_of_the_patch_keeps_its_own_calibration(node_classes, dits, user_dir):
    counted(patch(node_classes, dits["flux"]), "flux")
    counted(patch(node_classes, dits["flux"], dit_settings="as set", reuse_interval=3, downsample_factor=1.0), "flux")
    plans = sorted(part for entry in kept(user_dir).values() for part in entry["key"]["extra"] if "plan:" in part)
    assert len(plans) == 2 and "by noise level" in plans[0] + plans[1]


def test_another_step_count_starts_from_the_kept_interval(node_classes, dits, user_dir):
    patched = patch(node_classes, dits["flux"])
    counted(patched, "flux")
    (first,) = kept(user_dir).values()
    counted(patched, "flux", steps=STEPS + 2)
    (second,) = [entry for entry in kept(user_dir).values() if entry["result"]["steps"] == STEPS + 2]
    if first["result"]["interval"] is not None:  # its share of computed steps is tried first
        share = first["result"]["computed"] / STEPS * (STEPS + 2)
        assert abs(second["result"]["tried"][0][0] - share) <= 2


def test_with_pag_a_dit_calibrates_with_it_under_a_key_of_its_own(node_classes, dits, user_dir):
    """PerturbedAttentionGuidance calls the model once more at each step (a post-CFG function): a DiT's steps reuse
    with it, so the calibration measures the job as it is, and a plan kept without PAG is not used with it."""
    from comfy_extras.nodes_pag import PerturbedAttentionGuidance

    def with_pag(model):
        return PerturbedAttentionGuidance.execute(model, 3.0).result[0]

    plain_pag, plain_calls = counted(with_pag(dits["flux"]), "flux")
    patched = patch(node_classes, dits["flux"], calibration_target=0.9)
    counted(patched, "flux")  # calibrated without PAG
    first, _ = counted(with_pag(patched), "flux")
    assert (first - plain_pag).abs().max() <= 1e-5 * plain_pag.abs().max()  # the unpatched picture, with PAG
    entries = list(kept(user_dir).values())
    assert len(entries) == 2  # PAG calibrated anew
    (pag_entry,) = [entry for entry in entries if any("post_cfg" in part for part in entry["key"]["extra"])]
    assert any("PerturbedAttentionGuidance" in part for part in pag_entry["key"]["extra"])
    second, second_calls = counted(with_pag(patched), "flux")
    third, _ = counted(with_pag(patched), "flux")
    assert torch.equal(second, third) and len(kept(user_dir)) == 2
    result = pag_entry["result"]
    if result["interval"] is not None:  # the span at the kept steps, for each of the three calls of a step
        assert second_calls["all"] == plain_calls["all"] == 3 * STEPS
        assert second_calls["span"] == 3 * result["computed"] < plain_calls["span"]


def test_a_dit_without_reuse_has_nothing_to_calibrate(node_classes, dits, user_dir, caplog):
    with caplog.at_level(logging.INFO, logger="tome_patch"):
        model = patch(node_classes, dits["flux"], dit_settings="as set", reuse_interval=1, downsample_factor=1.0)
    assert "reuse_plan calibrated has nothing to calibrate on Flux" in caplog.text
    plain, _ = counted(dits["flux"], "flux")
    assert torch.equal(counted(model, "flux")[0], plain)
    assert not (user_dir / "tome_patch" / "calibrations.json").exists()


def test_the_patch_keeps_no_calibration_state_on_the_model(node_classes, dits, user_dir):
    model = dits["flux"]
    counted(patch(node_classes, model), "flux")
    assert not any(dit_reuse.PATCH_NAME in str(key) for key in model.model_options.get("transformer_options", {}))
