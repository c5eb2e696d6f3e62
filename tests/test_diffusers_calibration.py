"""diffusers: ``reuse_plan="calibrated"`` on the suite's tiny SD1 pipeline (random weights, 32 px, Euler): the first
call with a key runs unpatched (the user's picture) and then forecasts on the same noise, at most ``MAX_RUNS`` runs of
two seeds, and keeps the result in the file ``TOME_PATCH_CALIBRATIONS`` names; the next call with the same key runs
the kept plan, the same picture bit for bit; another guidance scale, step count, weight or adapter scale is another
key; an interrupted calibration keeps nothing; ``tome_core.calibrate`` calibrates anew and returns the report.

Runs are 10 steps (the fewest a calibration forecasts); the tests that only need a kept entry cap the search at 2
runs (the unpatched one and one candidate) to keep the file quick."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from hosts import diffusers_host as H

import tome_core
from tome_core.calibration import MAX_RUNS, candidates
from tome_core.hosts.diffusers import calibrate as door
from tome_core.hosts.diffusers import layer_reuse, unet_patch
from tome_core.reuse import Spacing

STEPS = 10
CALIBRATED = {"reuse_plan": "calibrated", "method": "tome", "ratio": 0.0}  # reuse alone, no token merging
EULER = Spacing(0.15, 3).schedule(3)  # the default's Euler plan: the candidates' counts


@pytest.fixture(scope="module")
def pipes():
    return {}


@pytest.fixture
def pipe(pipes, kept_file):
    """The txt2img pipeline on Euler, unpatched and on its own scheduler again after the test."""
    import diffusers

    pipe = H.cached_pipeline(pipes, "txt2img")
    original = pipe.scheduler
    pipe.scheduler = diffusers.EulerDiscreteScheduler.from_config(original.config)
    yield pipe
    tome_core.remove_patch(pipe)
    pipe.scheduler = original


@pytest.fixture
def quick(monkeypatch):
    monkeypatch.setattr(door, "MAX_RUNS", 2)


def entries(path) -> dict:
    return json.loads(path.read_text())["entries"] if path.exists() else {}


def counted(pipe, steps=STEPS, kind="txt2img", **extra):
    """The images and the UNet calls whose layers ran (conv_in's)."""
    calls = []
    handle = pipe.unet.conv_in.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        return H.run(pipe, kind, steps=steps, **extra), len(calls)
    finally:
        handle.remove()


def test_the_first_call_runs_unpatched_and_the_next_runs_the_kept_plan(pipe, kept_file, caplog):
    plain = H.run(pipe, "txt2img", steps=STEPS)
    tome_core.apply_patch(pipe, **CALIBRATED)
    with caplog.at_level(logging.INFO, logger="tome_patch"):
        first, first_calls = counted(pipe)
    assert np.abs(first - plain).max() <= 1e-6  # the user's call is the unpatched run itself
    (entry,) = entries(kept_file).values()
    result = entry["result"]
    assert 2 <= result["runs"] <= MAX_RUNS and entry["seeds"] == 2
    assert first_calls <= 2 * result["runs"] * STEPS  # each run: the user's seed and one more
    assert str(kept_file) in caplog.text
    second, second_calls = counted(pipe)
    third, third_calls = counted(pipe)
    assert np.array_equal(second, third)
    if result["spacing"] is None:
        assert second_calls == third_calls == STEPS
    else:
        assert second_calls == third_calls == result["computed"] < STEPS
    assert len(entries(kept_file)) == 1  # nothing calibrated again


def test_another_guidance_scale_step_count_weight_or_adapter_scale_is_another_key(pipe, kept_file, quick):
    from peft import LoraConfig

    tome_core.apply_patch(pipe, **CALIBRATED)
    counted(pipe)
    counted(pipe)
    assert len(entries(kept_file)) == 1
    counted(pipe, guidance_scale=4.0)
    counted(pipe, steps=STEPS + 1)
    assert len(entries(kept_file)) == 3
    weight = pipe.unet.up_blocks[0].resnets[0].conv1.weight
    saved = weight.detach().clone()
    try:
        weight.data[0, 0, 0, 0] += 0.5  # in place, as a fused LoRA changes it
        counted(pipe)
    finally:
        weight.data.copy_(saved)
    assert len(entries(kept_file)) == 4
    pipe.unet.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_v"]), adapter_name="style")
    try:
        for scale in (1.0, 0.5, 0.5):
            pipe.unet.set_adapters(["style"], weights=[scale])
            counted(pipe)
    finally:
        pipe.unet.delete_adapters("style")
    assert len(entries(kept_file)) == 6
    counted(pipe)  # the model as it was: its plan is still kept
    assert len(entries(kept_file)) == 6


@pytest.mark.parametrize(
    ("kind", "scheduler", "options"),
    [("txt2img", "DPMSolverMultistepScheduler", {"use_karras_sigmas": True}), ("img2img", "DDIMScheduler", {})],
    ids=("dpmpp-2m-karras", "img2img-ddim"),
)
def test_other_schedulers_and_image_to_image_keep_their_plan(pipes, kept_file, quick, kind, scheduler, options):
    """Image to image at strength 0.8 of 13 steps runs 10; another strength is another key."""
    import diffusers

    pipe = H.cached_pipeline(pipes, kind)
    original = pipe.scheduler
    pipe.scheduler = getattr(diffusers, scheduler).from_config(original.config, **options)
    steps = STEPS if kind == "txt2img" else 13
    try:
        plain = H.run(pipe, kind, steps=steps)
        tome_core.apply_patch(pipe, **CALIBRATED)
        first, _ = counted(pipe, steps, kind)
        assert np.abs(first - plain).max() <= 1e-6
        (entry,) = entries(kept_file).values()
        _, calls = counted(pipe, steps, kind)
        assert calls == entry["result"]["computed"] < STEPS and entry["result"]["steps"] == STEPS
        if kind == "img2img":
            counted(pipe, steps, kind, strength=0.9)
            assert len(entries(kept_file)) == 2
    finally:
        tome_core.remove_patch(pipe)
        pipe.scheduler = original


def test_an_interrupted_calibration_keeps_nothing(pipe, kept_file, monkeypatch):
    from tome_core.calibration import search

    def interrupted(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(search, "latent_ssim", interrupted)
    tome_core.apply_patch(pipe, **CALIBRATED)
    with pytest.raises(KeyboardInterrupt):
        counted(pipe)
    assert not kept_file.exists()
    owner = layer_reuse.installed(pipe.unet)
    assert owner.plan == "calibrated" and not owner.suspended


def test_calibrate_calibrates_again_and_returns_the_report(pipe, kept_file, quick):
    plain = H.run(pipe, "txt2img", steps=STEPS)
    with pytest.raises(ValueError, match="reuse_plan='calibrated'"):
        tome_core.calibrate(pipe, **H.call_arguments("txt2img", STEPS))
    tome_core.apply_patch(pipe, **CALIBRATED)
    counted(pipe)
    calls = []
    handle = pipe.unet.conv_in.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with torch.no_grad():
            report = tome_core.calibrate(pipe, **H.call_arguments("txt2img", STEPS))
    finally:
        handle.remove()
    assert report.path == kept_file and report.result is not None and report.why is None
    assert len(calls) > STEPS  # calibrated anew although a plan was kept
    assert np.abs(report.output.images - plain).max() <= 1e-6
    (entry,) = entries(kept_file).values()
    assert entry["result"] == report.result.as_dict() and report.key_id in entries(kept_file)
    assert "kept in" in report.words()


def test_another_step_count_starts_from_the_plan_kept_for_this_one(pipe, kept_file):
    tome_core.apply_patch(pipe, **CALIBRATED, calibration_target=0.8)
    counted(pipe, steps=STEPS + 4)
    (first,) = (entry["result"] for entry in entries(kept_file).values())
    assert first["spacing"] is not None  # a target this low keeps a plan on the tiny pipeline
    counted(pipe, steps=STEPS)
    (second,) = (entry["result"] for entry in entries(kept_file).values() if entry["result"]["steps"] == STEPS)
    wanted = first["computed"] / first["steps"] * STEPS
    counts = [spacing.schedule(spacing.every).full_steps(STEPS) for spacing in candidates(EULER, STEPS)]
    assert second["tried"][0][0] == min(counts, key=lambda count: abs(count - wanted))


def test_a_target_out_of_range_or_a_bare_unet_is_refused(pipe):
    with pytest.raises(ValueError, match=r"calibration_target must be a number from 0.8 to 0.999, got 1.5"):
        tome_core.apply_patch(pipe, **CALIBRATED, calibration_target=1.5)
    with pytest.raises(ValueError, match="pass the pipeline"):
        tome_core.apply_patch(pipe.unet, **CALIBRATED)
    assert not tome_core.hosts.diffusers.patch.is_patched(pipe)


def test_the_target_is_kept_and_is_part_of_the_key(pipe, kept_file, quick):
    tome_core.apply_patch(pipe, **CALIBRATED, calibration_target=0.9)
    counted(pipe)
    (entry,) = entries(kept_file).values()
    assert entry["result"]["target"] == 0.9


@pytest.mark.parametrize(("scheduler", "steps"), [("HeunDiscreteScheduler", STEPS), ("EulerDiscreteScheduler", 8)])
def test_a_scheduler_without_a_forecast_or_a_short_run_runs_forecast_v3(pipe, kept_file, caplog, scheduler, steps):
    import diffusers

    pipe.scheduler = getattr(diffusers, scheduler).from_config(pipe.scheduler.config)
    tome_core.apply_patch(pipe, **{**CALIBRATED, "reuse_plan": "forecast v3"})
    default = H.run(pipe, "txt2img", steps=steps)
    tome_core.apply_patch(pipe, **CALIBRATED)
    with caplog.at_level(logging.INFO, logger="tome_patch"):
        first = H.run(pipe, "txt2img", steps=steps)
        H.run(pipe, "txt2img", steps=steps)
    assert np.array_equal(first, default)
    assert caplog.text.count("ToMe calibration:") == 1 and "forecast v3" in caplog.text
    assert not kept_file.exists()


def test_without_a_generator_every_run_draws_the_same_noise_from_a_random_seed(pipe, kept_file, quick, monkeypatch):
    monkeypatch.setattr(door.random, "randrange", lambda _: 7)
    plain = H.run(pipe, "txt2img", steps=STEPS, seed=7)
    tome_core.apply_patch(pipe, **CALIBRATED)
    first, _ = counted(pipe, generator=None)
    assert np.array_equal(first, plain)
    (entry,) = entries(kept_file).values()
    assert entry["result"]["runs"] == 2


def test_a_batch_of_two_is_calibrated_alone_and_the_users_callback_runs_at_each_step(pipe, kept_file, quick):
    steps_seen = []

    def callback(pipe, step, timestep, tensors):
        steps_seen.append(step)
        return {}

    tome_core.apply_patch(pipe, **CALIBRATED)
    images, calls = counted(pipe, num_images_per_prompt=2, callback_on_step_end=callback)
    assert images.shape[0] == 2
    (entry,) = entries(kept_file).values()
    assert entry["seeds"] == 2 and entry["result"]["runs"] == 2
    assert calls == STEPS + entry["result"]["tried"][0][0]  # no second seed: the batch is two pictures
    assert steps_seen == list(range(STEPS)) * 2


def test_the_file_is_in_the_cache_folder_unless_the_environment_names_one(monkeypatch, tmp_path):
    monkeypatch.delenv(door.ENVIRONMENT, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert door.store_path() == tmp_path / "tome_patch" / "calibrations.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert door.store_path() == tmp_path / ".cache" / "tome_patch" / "calibrations.json"
    monkeypatch.setenv(door.ENVIRONMENT, str(tmp_path / "mine.json"))
    assert door.store_path() == tmp_path / "mine.json"


# --- the picture: the report as an image, beside the kept file ---


def schedulers_own_denoised(pipe) -> list[torch.Tensor]:
    """An unpatched run's denoised image per step of its first sample, as the scheduler itself states it: the step's
    ``pred_original_sample`` (Euler, DDIM), else the model output DPM++ 2M converted (its ``model_outputs[-1]``)."""
    scheduler, seen = pipe.scheduler, []
    original = type(scheduler).step

    def step(*args, **kwargs):
        out = original(scheduler, *args, **{**kwargs, "return_dict": True})
        own = getattr(out, "pred_original_sample", None)
        seen.append((own if own is not None else scheduler.model_outputs[-1])[:1].float().cpu().clone())
        return out if kwargs.get("return_dict", True) else (out.prev_sample,)

    scheduler.__dict__["step"] = step
    try:
        H.run(pipe, "txt2img", steps=STEPS)
    finally:
        del scheduler.__dict__["step"]
    return seen


def not_wrapped(scheduler) -> bool:
    return "step" not in scheduler.__dict__ and scheduler.step.__func__ is type(scheduler).step


def chart_colour(picture, step: int, steps: int) -> tuple[int, ...]:
    """The colour of ``step``'s bar at the chart's bottom row (every bar is at least one pixel high)."""
    width, height = picture.size
    return picture.getpixel((step * width // steps, height - 1))


def as_pixels(colour) -> tuple[int, ...]:
    return tuple(round(channel * 255) for channel in colour)


@pytest.mark.parametrize(
    ("scheduler", "options"),
    [
        ("EulerDiscreteScheduler", {}),
        ("DDIMScheduler", {}),
        ("DPMSolverMultistepScheduler", {"use_karras_sigmas": True}),
    ],
    ids=("euler", "ddim", "dpmpp-2m-karras"),
)
def test_the_report_has_the_calibrations_picture_saved_beside_the_kept_file(pipe, kept_file, quick, scheduler, options):
    """The picture: three square panels (the latents are square) over the chart, one bar per step, orange where the
    kept plan computes; the chart's changes are those of the scheduler's own denoised image per step."""
    import diffusers
    from PIL import Image

    from tome_core.calibration.report import CHART, COMPUTED, GAP, HEIGHT, SKIPPED, step_changes

    pipe.scheduler = getattr(diffusers, scheduler).from_config(pipe.scheduler.config, **options)
    own = step_changes(schedulers_own_denoised(pipe))
    tome_core.apply_patch(pipe, **CALIBRATED)
    with torch.no_grad():
        report = tome_core.calibrate(pipe, **H.call_arguments("txt2img", STEPS))
    result, picture = report.result, report.picture
    assert result is not None and isinstance(picture, Image.Image) and picture.mode == "RGB"
    assert picture.size == (3 * HEIGHT + 2 * GAP, HEIGHT + GAP + CHART)
    assert len(result.changes) == STEPS and all(change > 0 for change in result.changes[1:])
    assert result.changes == pytest.approx(own, rel=1e-3, abs=1e-6)
    schedule = result.schedule()
    for step in range(STEPS):
        computed = schedule is None or schedule.is_full(step, STEPS)
        assert chart_colour(picture, step, STEPS) == as_pixels(COMPUTED if computed else SKIPPED)
    reports = kept_file.parent / door.REPORTS
    assert report.picture_path == reports / f"{report.key_id}.png"
    assert sorted(path.name for path in reports.iterdir()) == sorted([f"{report.key_id}.png", door.LATEST])
    for path in reports.iterdir():
        with Image.open(path) as saved:
            assert np.array_equal(np.asarray(saved.convert("RGB")), np.asarray(picture))
    assert str(report.picture_path) in report.words()
    assert not_wrapped(pipe.scheduler)


def test_the_calibrating_call_names_its_picture_and_the_kept_plans_call_draws_none(pipe, kept_file, quick, caplog):
    tome_core.apply_patch(pipe, **CALIBRATED)
    arguments = H.call_arguments("txt2img", STEPS)
    with caplog.at_level(logging.INFO, logger="tome_patch"), torch.no_grad():
        first = door.Job.call(pipe, (), dict(arguments))
    assert first.result is not None and first.picture is not None and first.picture_path.exists()
    assert f"its picture: {first.picture_path}" in caplog.text
    written = first.picture_path.stat().st_mtime_ns
    with torch.no_grad():
        kept = door.Job.call(pipe, (), H.call_arguments("txt2img", STEPS))
    assert kept.calibration is None and kept.result is None and kept.picture is None and kept.picture_path is None
    assert first.picture_path.stat().st_mtime_ns == written
    assert len(list(first.picture_path.parent.iterdir())) == 2  # its picture and latest.png
    assert not_wrapped(pipe.scheduler)


def test_a_call_that_cannot_calibrate_has_no_picture(pipe, kept_file):
    import diffusers

    pipe.scheduler = diffusers.HeunDiscreteScheduler.from_config(pipe.scheduler.config)
    tome_core.apply_patch(pipe, **CALIBRATED)
    with torch.no_grad():
        report = tome_core.calibrate(pipe, **H.call_arguments("txt2img", STEPS))
    assert report.result is None and report.picture is None and report.picture_path is None
    assert not (kept_file.parent / door.REPORTS).exists()
    assert not_wrapped(pipe.scheduler)


@pytest.mark.parametrize("where", ["unpatched run", "search"])
def test_an_interrupted_calibration_leaves_the_scheduler_unwrapped_and_draws_nothing(pipe, kept_file, monkeypatch,
                                                                                     where):  # fmt: skip
    from tome_core.calibration import search

    def interrupted(*_):
        raise KeyboardInterrupt

    extra, real = {}, search.latent_ssim
    if where == "search":
        monkeypatch.setattr(search, "latent_ssim", interrupted)
    else:  # the user's own callback stops the user's run half way, the scheduler's step wrapped
        extra["callback_on_step_end"] = lambda pipe, step, *_: interrupted() if step == STEPS // 2 else {}
    tome_core.apply_patch(pipe, **CALIBRATED)
    with pytest.raises(KeyboardInterrupt):
        counted(pipe, **extra)
    assert not_wrapped(pipe.scheduler)
    assert not kept_file.exists() and not (kept_file.parent / door.REPORTS).exists()
    owner = layer_reuse.installed(pipe.unet)
    assert owner.plan == "calibrated" and not owner.suspended
    monkeypatch.setattr(search, "latent_ssim", real)
    monkeypatch.setattr(door, "MAX_RUNS", 2)
    with torch.no_grad():
        report = tome_core.calibrate(pipe, **H.call_arguments("txt2img", STEPS))
    assert len(report.result.changes) == STEPS and report.picture_path.exists()  # nothing left of the stopped one


# --- ToDo/ToMe: part of what the search decides; the unpatched run is without them ---

TODO = {"reuse_plan": "calibrated", "method": "todo", "downsample_factor": 2, "skip_when_slower": False}


def with_result(path, key, **changes) -> None:
    """The kept file with entry ``key``'s result changed as named (a plan kept another way)."""
    data = json.loads(path.read_text())
    data["entries"][key]["result"].update(changes)
    path.write_text(json.dumps(data))


def test_with_todo_the_first_call_is_the_unpatched_run_without_todo_either(pipe, kept_file, quick):
    tome_core.apply_patch(pipe, **TODO, reuse_interval=1)
    todo_alone = H.run(pipe, "txt2img", steps=STEPS)
    tome_core.apply_patch(pipe, **TODO)
    first, _ = counted(pipe)
    reduction = unet_patch.reduction_of(pipe.unet)
    assert reduction is not None and not reduction.suspended  # ToDo on again after the job
    tome_core.remove_patch(pipe)
    plain = H.run(pipe, "txt2img", steps=STEPS)
    assert np.abs(todo_alone - plain).max() > 1e-3  # ToDo changes this picture
    assert np.abs(first - plain).max() <= 1e-6  # the user's call is the truly unpatched run
    (entry,) = entries(kept_file).values()
    assert "reduce" in entry["result"]


def test_a_plan_kept_without_todo_runs_without_it(pipe, kept_file, monkeypatch):
    """Runs with ToDo score 0, without it 1: the first candidate misses, then keeps the target without ToDo."""
    from tome_core.calibration import search

    real = search.latent_ssim
    monkeypatch.setattr(door, "MAX_RUNS", 3)  # the unpatched run, the candidate with ToDo and without
    tome_core.apply_patch(pipe, **TODO)
    reduction = unet_patch.reduction_of(pipe.unet)
    monkeypatch.setattr(
        search, "latent_ssim", lambda latent, _: torch.full((latent.shape[0],), float(reduction.suspended))
    )
    counted(pipe)
    (key,) = entries(kept_file)
    result = entries(kept_file)[key]["result"]
    assert result["spacing"] is not None and result["reduce"] is False and result["runs"] == 3
    unreduced, calls = counted(pipe)
    assert calls == result["computed"] < STEPS
    with_result(kept_file, key, reduce=True)
    reduced, _ = counted(pipe)
    monkeypatch.setattr(search, "latent_ssim", real)
    tome_core.apply_patch(pipe, **CALIBRATED)  # no reduction: another key, given the same plan
    counted(pipe)
    (other,) = set(entries(kept_file)) - {key}
    with_result(kept_file, other, **{name: result[name] for name in ("spacing", "computed")})
    kept_plan, _ = counted(pipe)
    assert np.abs(unreduced - kept_plan).max() <= 1e-6
    assert np.abs(reduced - kept_plan).max() > 1e-3  # with "reduce" True the kept plan runs ToDo
    tome_core.apply_patch(pipe, **TODO)  # no plan kept: every step, without ToDo
    with_result(kept_file, key, spacing=None, computed=STEPS, reduce=False)
    every_step, calls = counted(pipe)
    tome_core.remove_patch(pipe)
    assert calls == STEPS and np.abs(every_step - H.run(pipe, "txt2img", steps=STEPS)).max() <= 1e-6
