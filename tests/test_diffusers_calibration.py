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
from tome_core.calibration import MAX_RUNS
from tome_core.hosts.diffusers import calibrate as door
from tome_core.hosts.diffusers import layer_reuse

STEPS = 10
CALIBRATED = {"reuse_plan": "calibrated", "method": "tome", "ratio": 0.0}  # reuse alone, no token merging


@pytest.fixture(scope="module")
def pipes():
    return {}


@pytest.fixture
def kept_file(tmp_path, monkeypatch):
    path = tmp_path / "calibrations.json"
    monkeypatch.setenv(door.ENVIRONMENT, str(path))
    return path


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
