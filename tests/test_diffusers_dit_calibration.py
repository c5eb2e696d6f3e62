"""diffusers: ``reuse_plan="calibrated"`` on DiT pipelines (the suite's tiny Flux, Wan 2.1 and Qwen-Image of random
weights, ``hosts/diffusers_dit_host.py``, on their flow-matching Euler): the first call with a key runs unpatched (the
user's picture), then the family's plan at other intervals on the same noise, at most ``MAX_RUNS`` runs of two seeds,
and keeps the interval with the fewest computed steps at the target in the file ``TOME_PATCH_CALIBRATIONS`` names; the
next calls with the same key run it, the same latents bit for bit; an interrupted calibration keeps nothing;
``tome_core.calibrate`` calibrates anew and returns the report; a DiT without reuse has nothing to calibrate.

A random model moves fast from step to step: the tests ask a loose target (``TARGET``). Runs are 12 steps; the tests
that only need a kept entry cap the search at 2 runs (the unpatched one and one candidate)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from hosts import diffusers_dit_host as D
from test_diffusers_calibration import with_result

import tome_core
from tome_core.calibration import MAX_RUNS
from tome_core.hosts.diffusers import calibrate as door
from tome_core.hosts.diffusers import dit_attention, dit_reuse, patch

STEPS = 12
TARGET = 0.9
MAKERS = {
    "flux": D.flux_pipeline,
    "wan": D.wan_pipeline,
    "qwen-image": D.qwen_image_pipeline,
    "wan2.2": lambda: D.wan_pipeline(two_models=True),
}
GUARDED = ("wan", "qwen-image")  # their first-block guards add steps where a seed's picture moves


@pytest.fixture(scope="module")
def pipes():
    return {}


@pytest.fixture
def quick(monkeypatch):
    monkeypatch.setattr(door, "MAX_RUNS", 2)


@pytest.fixture
def flux(pipes, kept_file):
    """The Flux pipeline, unpatched again after the test."""
    pipe = pipeline(pipes, "flux")
    yield pipe
    tome_core.remove_patch(pipe)


def pipeline(pipes, kind):
    """The module's ``kind`` pipeline, made once (its weights are read into every key), unpatched."""
    if kind not in pipes:
        pipes[kind] = MAKERS[kind]()
    pipe = pipes[kind]
    assert not patch.is_patched(pipe)
    return pipe


def calibrated(pipe, **settings):
    """Patch under "calibrated" at the loose target a random model keeps (other settings as named)."""
    return tome_core.apply_patch(pipe, **{"reuse_plan": "calibrated", "calibration_target": TARGET, **settings})


def entries(path) -> dict:
    """The kept file's entries by key (none where nothing was kept)."""
    return json.loads(path.read_text())["entries"] if path.exists() else {}


def generate(pipe, kind: str, steps: int = STEPS, **extra) -> torch.Tensor:
    """One generation's latents, the host's call for ``kind`` (Qwen-Image has a call of its own)."""
    if kind == "qwen-image":
        assert not extra
        return D.family_run(pipe, steps=steps)
    return D.run(pipe, steps=steps, **extra)


def counted(pipe, kind: str, steps: int = STEPS, **extra) -> tuple[torch.Tensor, dict]:
    """The latents, the transformer's calls and the calls that computed the span's last block (its first layer ran:
    a reusing call passes the block's streams on without running it)."""
    transformer = pipe.transformer
    last = dit_reuse.span_of(transformer, dit_reuse.layout_of(transformer))[-1][0]
    calls = {"all": 0, "span": 0}

    def add(name):
        """A hook that counts one call under ``name``."""
        return lambda *_: calls.__setitem__(name, calls[name] + 1)

    handles = [
        transformer.register_forward_pre_hook(add("all")),
        next(last.children()).register_forward_hook(add("span")),
    ]
    try:
        return generate(pipe, kind, steps, **extra), calls
    finally:
        for handle in handles:
            handle.remove()


def flux_arguments(steps: int = STEPS) -> dict:
    """``D.run``'s Flux call, as arguments to hand ``tome_core.calibrate``."""
    prompt, pooled = D._text(100, pooled=True)
    return {"prompt_embeds": prompt, "pooled_prompt_embeds": pooled, "guidance_scale": 3.5, "height": 64,
            "width": 64, "num_inference_steps": steps, "generator": torch.Generator().manual_seed(0),
            "output_type": "latent"}  # fmt: skip


def not_wrapped(scheduler) -> bool:
    """Whether the calibration took its step wrapper off the scheduler (it wraps it for the chart)."""
    return "step" not in scheduler.__dict__


@pytest.mark.parametrize("kind", ["flux", "wan", "qwen-image"])
def test_the_first_call_runs_unpatched_and_the_next_two_run_the_kept_interval(pipes, kept_file, caplog, kind):
    pipe = pipeline(pipes, kind)
    plain, plain_calls = counted(pipe, kind)
    calibrated(pipe)
    try:
        with caplog.at_level(logging.INFO, logger="tome_patch"):
            first, first_calls = counted(pipe, kind)
        assert (first - plain).abs().max() <= 1e-6  # the user's call is the unpatched run itself
        (entry,) = entries(kept_file).values()
        result = entry["result"]
        assert result["spacing"] is None and 2 <= result["runs"] <= MAX_RUNS and entry["seeds"] == 2
        assert first_calls["all"] <= 2 * result["runs"] * plain_calls["all"]  # each run: the user's seed and one more
        assert any(part.startswith("plan:every") for part in entry["key"]["extra"])
        assert str(kept_file) in caplog.text
        second, second_calls = counted(pipe, kind)
        third, third_calls = counted(pipe, kind)
        assert torch.equal(second, third) and second_calls == third_calls
        assert len(entries(kept_file)) == 1  # nothing calibrated again
        per_step = plain_calls["all"] // STEPS
        assert plain_calls["span"] == plain_calls["all"] == per_step * STEPS
        if result["interval"] is None:  # no interval kept the target: every step in full, the unpatched latents
            assert torch.equal(second, plain) and second_calls == plain_calls
        elif kind in GUARDED:  # the kept count is the costlier seed's: the user's seed computes no more
            assert second_calls["all"] == plain_calls["all"]
            assert 0 < second_calls["span"] <= per_step * result["computed"]
        else:
            assert second_calls["all"] == plain_calls["all"]
            assert second_calls["span"] == per_step * result["computed"] < plain_calls["span"]
    finally:
        tome_core.remove_patch(pipe)
    assert not_wrapped(pipe.scheduler) and door._PARENT not in type(pipe).__dict__


def test_flux_keeps_an_interval_at_a_loose_target_and_its_plan_is_in_the_key(flux, kept_file, quick):
    calibrated(flux, calibration_target=0.8)
    counted(flux, "flux")
    tome_core.apply_patch(flux, reuse_plan="calibrated", dit_settings="as set", reuse_interval=3, downsample_factor=1)
    counted(flux, "flux")
    results = {entry["result"]["target"]: entry["result"] for entry in entries(kept_file).values()}  # by key: sorted
    plans = sorted(part for entry in entries(kept_file).values() for part in entry["key"]["extra"] if "plan:" in part)
    assert len(results) == 2 and results[0.8]["interval"] is not None
    assert len(plans) == 2 and "by noise level" in plans[0] + plans[1]


def test_an_interrupted_calibration_keeps_nothing(flux, kept_file, monkeypatch):
    from tome_core.calibration import search

    def interrupted(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(search, "latent_ssim", interrupted)
    calibrated(flux)
    with pytest.raises(KeyboardInterrupt):
        counted(flux, "flux")
    assert not kept_file.exists() and not (kept_file.parent / door.REPORTS).exists()
    owner = dit_reuse.installed(flux.transformer)
    assert owner.calibration_schedule is None and not owner.suspended
    assert not_wrapped(flux.scheduler)


def test_calibrate_calibrates_again_and_returns_the_report(flux, kept_file):
    from PIL import Image

    plain = generate(flux, "flux")
    with pytest.raises(ValueError, match="reuse_plan='calibrated'"):
        tome_core.calibrate(flux, **flux_arguments())
    calibrated(flux)
    counted(flux, "flux")
    calls = []
    handle = flux.transformer.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        report = tome_core.calibrate(flux, **flux_arguments())
    finally:
        handle.remove()
    result = report.result
    assert report.path == kept_file and result is not None and report.why is None
    assert len(calls) > 2 * STEPS  # calibrated anew although a plan was kept
    assert (report.output.images - plain).abs().max() <= 1e-6
    assert result.interval is not None or "every step runs in full" in result.words()
    (entry,) = entries(kept_file).values()
    assert entry["result"] == result.as_dict() and report.key_id in entries(kept_file)
    assert isinstance(report.picture, Image.Image) and report.picture_path == kept_file.parent / door.REPORTS / (
        f"{report.key_id}.png"
    )
    assert report.picture_path.exists() and "kept in" in report.words()
    # The chart: the flow's denoised latent at each step, every step's change above 0.
    assert len(result.changes) == STEPS and all(change > 0 for change in result.changes[1:])


def test_a_dit_without_reuse_has_nothing_to_calibrate(flux, kept_file, caplog):
    plain = generate(flux, "flux")
    with caplog.at_level(logging.INFO, logger="tome_patch"):
        calibrated(flux, dit_settings="as set", reuse_interval=1, downsample_factor=1)
        out = generate(flux, "flux")
    assert "reuse_plan calibrated has nothing to calibrate on Flux" in caplog.text
    assert (out - plain).abs().max() <= 1e-6
    assert not kept_file.exists()
    with pytest.raises(ValueError, match="reuse_plan='calibrated'"):
        tome_core.calibrate(flux, **flux_arguments())


def test_a_bare_transformer_is_refused_and_two_transformers_run_the_familys_plan(pipes, kept_file, caplog):
    flux = pipeline(pipes, "flux")
    with pytest.raises(ValueError, match="pass the pipeline"):
        calibrated(flux.transformer)
    assert not patch.is_patched(flux)
    pipe = pipeline(pipes, "wan2.2")
    steps = 24  # each transformer takes part of the steps
    tome_core.apply_patch(pipe)
    try:
        family = generate(pipe, "wan2.2", steps)
        with caplog.at_level(logging.INFO, logger="tome_patch"):
            calibrated(pipe)
        assert "cannot calibrate Wan's two transformers" in caplog.text
        assert torch.equal(generate(pipe, "wan2.2", steps), family)
    finally:
        tome_core.remove_patch(pipe)
    assert not kept_file.exists()


def test_a_run_too_short_to_reuse_runs_the_familys_plan_with_one_log_line(flux, kept_file, caplog):
    tome_core.apply_patch(flux)
    family = generate(flux, "flux", steps=8)
    calibrated(flux)
    with caplog.at_level(logging.INFO, logger="tome_patch"):
        first = generate(flux, "flux", steps=8)
        generate(flux, "flux", steps=8)
    assert torch.equal(first, family)
    assert caplog.text.count("ToMe calibration:") == 1 and "running its family's plan" in caplog.text
    assert not kept_file.exists()


# --- ToDo: part of what the search decides; the unpatched run is without it ---

TODO = {"dit_settings": "as set", "method": "todo", "downsample_factor": 2, "skip_when_slower": False}


def test_with_todo_the_first_call_is_the_unpatched_run_without_todo_either(flux, kept_file, quick):
    tome_core.apply_patch(flux, **TODO, reuse_interval=1)
    todo_alone = generate(flux, "flux")
    calibrated(flux, **TODO)
    first, _ = counted(flux, "flux")
    reduction = dit_attention.state_of(flux.transformer)
    assert reduction is not None and not reduction.suspended  # ToDo on again after the job
    tome_core.remove_patch(flux)
    plain = generate(flux, "flux")
    assert (todo_alone - plain).abs().max() > 1e-3  # ToDo changes these latents
    assert (first - plain).abs().max() <= 1e-6  # the user's call is the truly unpatched run
    (entry,) = entries(kept_file).values()
    assert "reduce" in entry["result"]


def test_a_plan_kept_without_todo_runs_without_it(flux, kept_file, monkeypatch):
    """Runs with ToDo score 0, without it 1: the first candidate misses, then keeps the target without ToDo."""
    from tome_core.calibration import search

    real = search.latent_ssim
    monkeypatch.setattr(door, "MAX_RUNS", 3)  # the unpatched run, the candidate with ToDo and without
    calibrated(flux, **TODO)
    reduction = dit_attention.state_of(flux.transformer)
    monkeypatch.setattr(
        search, "latent_ssim", lambda latent, _: torch.full((latent.shape[0],), float(reduction.suspended))
    )
    counted(flux, "flux")
    (key,) = entries(kept_file)
    result = entries(kept_file)[key]["result"]
    assert result["interval"] is not None and result["reduce"] is False and result["runs"] == 3
    unreduced, calls = counted(flux, "flux")
    with_result(kept_file, key, reduce=True)
    reduced, reduced_calls = counted(flux, "flux")
    assert calls == reduced_calls and calls["span"] < calls["all"]  # the kept interval, with ToDo or without
    monkeypatch.setattr(search, "latent_ssim", real)
    calibrated(flux, **{**TODO, "downsample_factor": 1})  # no ToDo: another key, given the same plan
    counted(flux, "flux")
    (other,) = set(entries(kept_file)) - {key}
    with_result(kept_file, other, **{name: result[name] for name in ("interval", "last_full", "computed")})
    kept_plan, _ = counted(flux, "flux")
    assert (unreduced - kept_plan).abs().max() <= 1e-6
    assert (reduced - kept_plan).abs().max() > 1e-3  # with "reduce" True the kept plan runs ToDo
    calibrated(flux, **TODO)  # no plan kept: every step, without ToDo
    with_result(kept_file, key, interval=None, last_full=0, computed=STEPS, reduce=False)
    every_step, _ = counted(flux, "flux")
    tome_core.remove_patch(flux)
    assert (every_step - generate(flux, "flux")).abs().max() <= 1e-6
