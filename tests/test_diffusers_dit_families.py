"""``tome_core.apply_patch`` on the diffusers DiT families that get reuse across steps only (no ToDo yet): Flux.2,
Qwen-Image, Z-Image, HunyuanVideo 1.5, LTX-Video and LTX-2 (video and audio), assembled offline from the real
diffusers transformer classes with random weights and real schedulers (``hosts/diffusers_dit_host.py``,
``FAMILY_MAKERS``).

At 12 steps and ``reuse_interval`` 3 the DiT schedule (under 25 steps one step in two at most, the full steps
spaced by the noise) computes six of twelve steps in full and reuses the other six.
"""

from __future__ import annotations

import logging

import pytest
import torch
from hosts import diffusers_dit_host as D
from test_diffusers import module_snapshot
from test_diffusers_dit import counting_runs

import tome_core
from tome_core.hosts.diffusers import dit_attention, dit_reuse, patch
from tome_core.hosts.shared import dit_families
from tome_core.reuse import NoiseSpacedSchedule

KINDS = tuple(D.FAMILY_MAKERS)
# (transformer class, family (the registry's name, ``dit_families``), family in messages, transformer calls per step)
FAMILIES = {
    "flux2": ("Flux2Transformer2DModel", "Flux", "Flux.2", 1),  # guidance-distilled: one call
    "qwen-image": ("QwenImageTransformer2DModel", "Qwen-Image", "Qwen-Image", 2),  # true CFG: two calls
    "z-image": ("ZImageTransformer2DModel", "Lumina 2", "Z-Image", 1),  # CFG batched: one call on a list of two
    "hunyuanvideo-1.5": ("HunyuanVideo15Transformer3DModel", "HunyuanVideo", "HunyuanVideo 1.5", 2),  # its guider
    "ltx-video": ("LTXVideoTransformer3DModel", "LTX-Video", "LTX-Video", 1),  # CFG batched
    "ltx-2": ("LTX2VideoTransformer3DModel", "LTX-2", "LTX-2", 1),  # CFG batched; video and audio
}
AS_SET = {"downsample_factor": 1, "dit_settings": "as set"}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tensors here are tiny: PyTorch's intra-op threads cost more to wake than they save, and on a CPU shared
    with other work their spin-waits made a 12-step run 30 to 100 times slower (0.07 s against 2 to 10 s for
    Flux.2's, torch 2.14 on 2 cores). Every run of this module (the unpatched ones too) uses one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pipes():
    return {}


@pytest.fixture(scope="module")
def plains():
    """(kind, steps) -> the latents of the pipeline never patched."""
    return {}


def pipeline(pipes, kind):
    if kind not in pipes:
        pipes[kind] = D.FAMILY_MAKERS[kind]()
    pipe = pipes[kind]
    assert not patch.is_patched(pipe)
    return pipe


def plain_run(pipes, plains, kind, steps):
    if (kind, steps) not in plains:
        plains[kind, steps] = D.family_run(pipeline(pipes, kind), steps=steps)
    return plains[kind, steps]


def snapshot(pipe):
    return (
        *module_snapshot(pipe.transformer),
        [type(getattr(m, "processor", None)) for m in pipe.transformer.modules()],
    )


def patched_run(pipe, steps: int = 12, **settings) -> torch.Tensor:
    tome_core.apply_patch(pipe, **settings)
    try:
        return D.family_run(pipe, steps=steps)
    finally:
        tome_core.remove_patch(pipe)


@pytest.mark.parametrize("kind", KINDS)
def test_the_layouts_are_the_families(pipes, kind):
    name, family, label, _ = FAMILIES[kind]
    pipe = pipeline(pipes, kind)
    layout = dit_reuse.layout_of(pipe.transformer)
    assert type(pipe.transformer).__name__ == name
    assert (layout.name, layout.label, layout.todo) == (family, label, False)
    span = dit_reuse.span_of(pipe.transformer, layout)
    blocks = layout.blocks(pipe.transformer)
    assert len(span) == len(blocks) - 1 and span == blocks[1:]  # all but the first block


@pytest.mark.parametrize("kind", KINDS)
def test_reuse_skips_the_span_at_the_schedules_reusing_steps_and_removal_is_exact(pipes, plains, kind, monkeypatch):
    calls = FAMILIES[kind][3]
    plain = plain_run(pipes, plains, kind, 12)
    pipe = pipeline(pipes, kind)
    before = snapshot(pipe)  # after a run: the pipeline's cache_context adds diffusers' hook registry once
    runs = counting_runs(monkeypatch)
    assert tome_core.apply_patch(pipe, reuse_interval=3, **AS_SET) is pipe
    try:
        assert patch.is_patched(pipe)
        patched = D.family_run(pipe, steps=12)
    finally:
        assert tome_core.remove_patch(pipe) is pipe
    (run,) = runs
    assert (run.calls, run.reused_calls) == (12 * calls, 6 * calls)  # under 25 steps: one step in two
    assert not run.entries  # the cache is dropped after the last step
    assert patched.shape == plain.shape and torch.isfinite(patched).all()
    assert not torch.equal(patched, plain)
    assert not patch.is_patched(pipe)
    assert snapshot(pipe) == before  # classes, attributes, hooks and processors as they were
    assert torch.equal(D.family_run(pipe, steps=12), plain)  # bit-identical to never patched


# Each family's row in the measured table: a wrong family name would pick another row (or the default).
AUTO_INTERVAL = {"flux2": 3, "qwen-image": 6, "z-image": 3, "hunyuanvideo-1.5": 4, "ltx-video": 4, "ltx-2": 4}


@pytest.mark.parametrize("kind", KINDS)
def test_no_settings_run_the_familys_interval_and_no_todo(pipes, kind, monkeypatch, caplog):
    """``apply_patch(pipe)`` (``dit_settings`` auto): the family's schedule (``dit_families``; Z-Image every
    3, as Lumina 2 in ComfyUI, guarded by the family's published curve; Qwen-Image every 6, guarded by its first
    block's two guards), no ToDo. At 28 steps each of the intervals 3, 4 and 6 reuses other steps than half of it
    (every 2 at least; under 25 steps, one in two whatever the interval)."""
    _, family, label, calls = FAMILIES[kind]
    interval = AUTO_INTERVAL[kind]
    assert dict(dit_families.family(family).auto_intervals)[0] == interval
    pipe = pipeline(pipes, kind)
    processors = snapshot(pipe)[-1]
    runs = counting_runs(monkeypatch)
    with caplog.at_level(logging.INFO, logger="tome_patch"):
        tome_core.apply_patch(pipe)
    try:
        assert not dit_attention.installed(pipe.transformer) and snapshot(pipe)[-1] == processors
        schedule = dit_reuse.installed(pipe.transformer).schedule
        assert schedule == dit_families.auto_schedule(family) and schedule.interval(28) == interval
        assert f"{label} with dit_settings 'auto': reuse across steps every {interval}" in caplog.text
        out = D.family_run(pipe, steps=28)
    finally:
        tome_core.remove_patch(pipe)
    (run,) = runs
    levels = [float(sigma) for sigma in pipe.scheduler.sigmas[:28]]
    every_n = NoiseSpacedSchedule(interval).for_run(28, levels, run.full_below).full
    assert every_n != NoiseSpacedSchedule(max(interval // 2, 2)).for_run(28, levels, run.full_below).full
    record = dit_families.family(family)
    if record.line_guard is not None:  # Qwen-Image: every N, and the first block's guards each reusing call
        assert run.schedule.full == every_n
        assert (run.first_block_guard, run.line_guard) == (record.first_block_guard, record.line_guard)
        # Every call of the last step reuses where the plan says so: the run drops its cache after the step's last
        # call, not its first.
        scheduled = (28 - len(every_n)) * calls
        assert run.calls == 28 * calls and run.reused_calls == scheduled - run.guarded_calls
        assert not run.entries  # and it is dropped then
        assert torch.isfinite(out).all()
        return
    # On top of every N, the steps the real model's published curve needs in full (``dit_families``).
    curve = record.curve
    full = curve.guard(every_n, 28)
    assert run.schedule.full == full and every_n <= full
    assert max(curve.errors(full, 28)) <= curve.threshold
    assert (run.calls, run.reused_calls) == (28 * calls, (28 - len(full)) * calls)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("kind", KINDS)
def test_todo_asked_for_is_left_out_with_a_log_line(pipes, kind, caplog):
    """Named ToDo settings: reuse only, and the log says so; nothing of ToDo is installed."""
    label = FAMILIES[kind][2]
    pipe = pipeline(pipes, kind)
    processors = snapshot(pipe)[-1]
    with caplog.at_level(logging.INFO, logger="tome_patch"):
        tome_core.apply_patch(pipe, method="todo", downsample_factor=2, skip_when_slower=False)
    try:
        assert f"ToDo is not available for {label} yet; reuse only" in caplog.text
        assert dit_reuse.installed(pipe.transformer) is not None
        assert not dit_attention.installed(pipe.transformer) and snapshot(pipe)[-1] == processors
    finally:
        tome_core.remove_patch(pipe)
    assert not patch.is_patched(pipe)


@pytest.mark.parametrize("kind", KINDS)
def test_fewer_than_ten_steps_compute_what_the_unpatched_pipeline_does(pipes, plains, kind):
    """Distilled models (Z-Image Turbo, Flux.2 Klein, LTX-Video distilled) run under 10 steps: every step in full."""
    plain = plain_run(pipes, plains, kind, 6)
    assert torch.equal(patched_run(pipeline(pipes, kind), steps=6), plain)


def test_todo_is_not_installed_for_an_unknown_family(pipes):
    pipe = pipeline(pipes, "qwen-image")
    settings = tome_core.PatchSettings(downsample_factor=2, skip_when_slower=False)
    assert dit_attention.install(pipe.transformer, settings, lambda t: True, "Qwen-Image", 1000.0) is False
    assert not dit_attention.installed(pipe.transformer)


@pytest.mark.parametrize(
    ("name", "kwargs", "full"),
    [
        # Flux.2 Klein's first step writes its reference tokens' KV cache in every block; later steps read it.
        ("Flux2Transformer2DModel", {"kv_cache_mode": "extract"}, True),
        ("Flux2Transformer2DModel", {"kv_cache_mode": "cached"}, False),
        ("Flux2Transformer2DModel", {"kv_cache_mode": None}, False),
        ("QwenImageTransformer2DModel", {"controlnet_block_samples": [torch.zeros(1)]}, True),
        ("ZImageTransformer2DModel", {"controlnet_block_samples": {1: torch.zeros(1)}}, True),
        ("QwenImageTransformer2DModel", {"controlnet_block_samples": None}, False),
        # LTX-2's spatio-temporal guidance perturbs blocks; isolated modalities skip the audio-video attention.
        ("LTX2VideoTransformer3DModel", {"spatio_temporal_guidance_blocks": [3]}, True),
        ("LTX2VideoTransformer3DModel", {"isolate_modalities": True}, True),
        ("LTX2VideoTransformer3DModel", {"spatio_temporal_guidance_blocks": None, "isolate_modalities": False}, False),
    ],
)
def test_calls_that_must_run_every_block(name, kwargs, full):
    assert dit_reuse.LAYOUTS[name].in_full(kwargs) is full


def test_z_images_inputs_give_the_schedulers_timestep():
    """ZImagePipeline passes a list of latents and ``(1000 - t) / 1000`` (in the latents' float32)."""
    latents = [torch.zeros(4, 1, 8, 8), torch.zeros(4, 1, 8, 8)]
    for t in (999.0, 512.25, 58.3):
        given = (1000 - torch.tensor([t, t], dtype=torch.float32)) / 1000
        sample, timestep = dit_reuse._z_image_inputs((latents, given, None), {})
        assert sample.shape == (2, 4, 1, 8, 8) and sample.device.type == "meta"
        assert float(timestep.max()) * 1000 == pytest.approx(t, rel=1e-6)
    assert dit_reuse._z_image_inputs(([[torch.zeros(4, 1, 8, 8)]], given, None), {}) == (None, None)  # omni


def test_an_unsupported_pipeline_names_the_families():
    with pytest.raises(TypeError) as raised:
        tome_core.apply_patch(torch.nn.Linear(2, 2))
    for words in ("Flux2Transformer2DModel", "QwenImageTransformer2DModel", "ZImageTransformer2DModel"):
        assert words in str(raised.value)
    for words in ("HunyuanVideo15Transformer3DModel", "LTXVideoTransformer3DModel", "LTX2VideoTransformer3DModel"):
        assert words in str(raised.value)


def test_ltx2s_video_and_audio_are_both_predicted(pipes, plains):
    """LTX-2's blocks pass on video and audio tokens of two widths: at the reusing steps both come from the
    prediction (each differs from unpatched), and both stay closer to it than half the distance between two seeds'
    unpatched outputs (random weights move as noise does; a stream dropped or shifted would be as far as another
    seed's or further)."""
    plain = plain_run(pipes, plains, "ltx-2", 12)
    other_seed = D.family_run(pipeline(pipes, "ltx-2"), steps=12, seed=1)
    patched = patched_run(pipeline(pipes, "ltx-2"), reuse_interval=3, **AS_SET)
    video = 8 * 2 * 4 * 4  # channels x latent frames x h x w, then the audio latents
    for part in (slice(0, video), slice(video, None)):
        assert not torch.equal(patched[:, part], plain[:, part])
        apart = (other_seed[:, part] - plain[:, part]).abs().mean()
        assert (patched[:, part] - plain[:, part]).abs().mean() < 0.5 * apart
