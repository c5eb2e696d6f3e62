"""ComfyUI: ``reuse_plan`` "calibrated" on the real KSampler path (a tiny random SD1.5 UNet): the first job runs
unpatched (its picture the user's) and then forecasts on the same noise, at most 6 runs, and keeps its result in the
user directory; the next job with the same key runs the kept plan, the same picture every time; a LoRA-like weight
patch at another strength, another step count or CFG calibrates anew; an interrupted calibration keeps nothing."""

from __future__ import annotations

import json

import pytest
import torch
from hosts import comfy_host as host  # noqa: I001  (before any ComfyUI import: sys.path, CPU mode)

from tome_core.calibration import candidates
from tome_core.reuse import Spacing

STEPS = 20


@pytest.fixture(scope="module")
def node_classes():
    return host.load_our_package()


@pytest.fixture(scope="module")
def model():
    return host.tiny_model("sd15")


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    import folder_paths

    monkeypatch.setattr(folder_paths, "get_user_directory", lambda: str(tmp_path))
    return tmp_path


def counted(patched, **options):
    calls = []
    handle = patched.model.diffusion_model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        out = host.sample(patched, "sd15", steps=options.pop("steps", STEPS), **options)
    finally:
        handle.remove()
    return out, len(calls)


def kept(user_dir) -> dict:
    return json.loads((user_dir / "tome_patch" / "calibrations.json").read_text())["entries"]


def test_the_first_job_calibrates_and_the_next_runs_the_kept_plan(node_classes, model, user_dir):
    plain, plain_calls = counted(host.patch_with_node(node_classes, model, reuse_interval=1, downsample_factor=1.0))
    patched = host.patch_with_node(node_classes, model, reuse_plan="calibrated", downsample_factor=1.0)
    first, first_calls = counted(patched)
    assert (first - plain).abs().max() <= 1e-5 * plain.abs().max()  # unpatched, computed in a batch of two
    (entry,) = kept(user_dir).values()
    result = entry["result"]
    assert 2 <= result["runs"] <= 6 and first_calls <= result["runs"] * plain_calls
    second, second_calls = counted(patched)
    third, _ = counted(patched)
    assert torch.equal(second, third)
    assert second_calls == result["computed"] < STEPS or (result["spacing"] is None and second_calls == STEPS)
    assert len(kept(user_dir)) == 1  # nothing calibrated again


def test_the_report_node_shows_the_last_calibrations_picture(node_classes, model, user_dir):
    report = node_classes["ToMeCalibrationReport"]
    assert torch.equal(host.run_node(report, samples={}), torch.zeros(1, 64, 64, 3))  # none yet
    patched = host.patch_with_node(node_classes, model, reuse_plan="calibrated", downsample_factor=1.0)
    out, _ = counted(patched)
    (identity,) = kept(user_dir)
    assert (user_dir / "tome_patch" / "reports" / f"{identity}.png").exists()
    picture = host.run_node(report, samples={"samples": out})
    assert picture.shape[0] == 1 and picture.shape[1] == 192 + 4 + 96 and picture.shape[3] == 3
    chart = picture[0, -1]  # the chart's bottom row: a bar per step, computed steps orange
    orange = (chart[:, 0] > 0.9) & (chart[:, 1] > 0.5) & (chart[:, 1] < 0.6)
    assert orange.any() and 0.0 <= float(picture.min()) and float(picture.max()) <= 1.0


def test_another_strength_step_count_or_cfg_is_another_key(node_classes, model, user_dir):
    patched = host.patch_with_node(node_classes, model, reuse_plan="calibrated", downsample_factor=1.0)
    counted(patched)
    lora = patched.clone()
    key = next(iter(lora.model.state_dict()))
    weight = lora.model.state_dict()[key]
    lora.add_patches({key: (torch.randn_like(weight) * 1e-3,)}, strength_patch=0.5)
    counted(lora)
    stronger = patched.clone()
    stronger.add_patches({key: (lora.patches[key][0][1][0],)}, strength_patch=0.8)
    counted(stronger)
    counted(patched, steps=STEPS + 2)
    counted(patched, cfg=4.0)
    assert len(kept(user_dir)) == 5


def test_an_interrupted_calibration_keeps_nothing(node_classes, model, user_dir, monkeypatch):
    import sys

    def interrupted(*_):
        raise KeyboardInterrupt

    # ComfyUI loads the package under its folder's name: every copy of the module is patched.
    for name, module in list(sys.modules.items()):
        if name.endswith("tome_core.calibration.search"):
            monkeypatch.setattr(module, "latent_ssim", interrupted)
    patched = host.patch_with_node(node_classes, model, reuse_plan="calibrated", downsample_factor=1.0)
    with pytest.raises(KeyboardInterrupt):
        counted(patched)
    assert not (user_dir / "tome_patch" / "calibrations.json").exists()


def test_the_advanced_node_sets_the_target_and_refuses_one_out_of_range(node_classes, model, user_dir):
    patched = host.patch_with_node(node_classes, model, advanced=True, reuse_plan="calibrated",
                                   calibration_target=0.9, downsample_factor=1.0)  # fmt: skip
    counted(patched)
    (entry,) = kept(user_dir).values()
    assert entry["result"]["target"] == 0.9
    with pytest.raises(ValueError, match=r"calibration_target must be a number from 0.8 to 0.999, got 1.2"):
        host.patch_with_node(node_classes, model, advanced=True, reuse_plan="calibrated", calibration_target=1.2)


def test_another_step_count_starts_from_the_plan_kept_for_this_one(node_classes, model, user_dir):
    patched = host.patch_with_node(node_classes, model, advanced=True, reuse_plan="calibrated",
                                   calibration_target=0.8, downsample_factor=1.0)  # fmt: skip
    counted(patched)
    (first,) = (entry["result"] for entry in kept(user_dir).values())
    assert first["spacing"] is not None  # a target this low keeps a plan on the tiny model
    counted(patched, steps=STEPS + 5)
    (second,) = (entry["result"] for entry in kept(user_dir).values() if entry["result"]["steps"] == STEPS + 5)
    wanted = first["computed"] / first["steps"] * (STEPS + 5)
    counts = [s.schedule(s.every).full_steps(STEPS + 5) for s in candidates(Spacing(0.15, 3).schedule(3), STEPS + 5)]
    # the first candidate tried is the kept plan's share of computed steps, as near as the candidates come
    assert second["tried"][0][0] == min(counts, key=lambda count: abs(count - wanted))


TODO = {"downsample_factor": 2.0, "skip_when_slower": False}  # ToDo on the tiny UNet, whatever the machine


def test_the_first_job_runs_without_todo_and_the_search_decides_it(node_classes, model, user_dir):
    plain, _ = counted(model)  # the model itself: nothing patched
    reduced, _ = counted(host.patch_with_node(node_classes, model, reuse_interval=1, **TODO))
    assert not torch.equal(reduced, plain)  # ToDo changes this model's picture
    first, _ = counted(host.patch_with_node(node_classes, model, reuse_plan="calibrated", **TODO))
    assert (first - plain).abs().max() <= 1e-5 * plain.abs().max()  # unpatched and unreduced, in a batch of two
    (entry,) = kept(user_dir).values()
    assert isinstance(entry["result"]["reduce"], bool)
    assert any(part.startswith("settings:") for part in entry["key"]["extra"])  # another ToDo is another plan


def test_a_plan_kept_without_todo_runs_without_it(node_classes, model, tmp_path, monkeypatch):
    import folder_paths

    def job(name, settings):
        monkeypatch.setattr(folder_paths, "get_user_directory", lambda: str(tmp_path / name))
        return host.patch_with_node(node_classes, model, reuse_plan="calibrated", **settings)

    todo = job("todo", TODO)
    counted(todo)
    (kept_todo,) = kept(tmp_path / "todo").values()
    # On this model ToDo alone loses the picture: the search keeps its plan without it.
    assert kept_todo["result"]["reduce"] is False and kept_todo["result"]["spacing"] is not None
    assert "without ToDo or ToMe" in search_words(kept_todo)
    plan_of_todo, _ = counted(todo)
    # The same kept plan in the store of a patch without ToDo: the same picture bit for bit.
    plain = job("none", {"downsample_factor": 1.0})
    counted(plain)
    path = tmp_path / "none" / "tome_patch" / "calibrations.json"
    data = json.loads(path.read_text())
    (identity,) = data["entries"]
    data["entries"][identity]["result"] = {**kept_todo["result"], "reduce": True}
    path.write_text(json.dumps(data))
    assert torch.equal(plan_of_todo, counted(plain)[0])


def search_words(entry) -> str:
    from tome_core.calibration import CalibrationResult

    return CalibrationResult.from_dict(entry["result"]).words()


def test_a_controlnet_is_another_key(node_classes, model, user_dir):
    """A plan kept with a ControlNet is not used without one (nor the other way): each calibrates."""
    import nodes as comfy_nodes

    control = host.tiny_controlnet()
    hint = torch.rand(1, 15 * 8, 23 * 8, 3, generator=torch.Generator().manual_seed(4))
    positive, negative = host.conditioning("sd15", 1, seed=1), host.conditioning("sd15", 1, seed=2)
    controlled = comfy_nodes.ControlNetApplyAdvanced().apply_controlnet(
        positive, negative, control, hint, 1.0, 0.0, 1.0
    )
    patched = host.patch_with_node(node_classes, model, reuse_plan="calibrated", downsample_factor=1.0)
    for conds in ((positive, negative), controlled):
        latent = {"samples": torch.zeros(1, 4, 15, 23)}
        comfy_nodes.common_ksampler(patched, 42, STEPS, 5.0, "euler", "normal", *conds, latent)
    extras = sorted(entry["key"]["extra"] for entry in kept(user_dir).values())
    assert sorted(any(part.startswith("control:") for part in extra) for extra in extras) == [False, True]
