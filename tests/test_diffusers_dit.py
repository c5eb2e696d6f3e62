"""``tome_core.apply_patch`` on diffusers' DiT pipelines (Flux, SD3 / SD3.5, Wan 2.1 and 2.2), assembled offline
from the real diffusers classes with random weights (``hosts/diffusers_dit_host.py``).

At 12 steps and the default ``reuse_interval`` 3 the DiT schedule (a run under 25 steps reuses one step in two at
most; the full steps spaced by the noise) computes six of twelve steps in full and reuses the other six.
"""

from __future__ import annotations

import logging

import pytest
import torch
from hosts import diffusers_dit_host as D
from test_diffusers import module_snapshot

import tome_core
from tome_core.hosts.diffusers import dit_attention, dit_reuse, patch
from tome_core.hosts.shared import dit_families
from tome_core.reuse import FullSteps, LayerReuse, LayerReuseRun, NoiseSpacedSchedule, StepCountSchedule

# The tiny grids are far below the break-even: reduce them anyway; and the settings as set (``dit_settings`` auto,
# the default, has tests of its own at the end).
FORCE = {"skip_when_slower": False, "dit_settings": "as set"}
KINDS = ("flux", "sd3", "wan", "wan2.2")
MAKERS = {
    "flux": D.flux_pipeline,
    "sd3": D.sd3_pipeline,
    "wan": D.wan_pipeline,
    "wan2.2": lambda: D.wan_pipeline(two_models=True),
}


@pytest.fixture(scope="module")
def pipes():
    return {}


def pipeline(pipes, kind):
    if kind not in pipes:
        pipes[kind] = MAKERS[kind]()
    pipe = pipes[kind]
    assert not patch.is_patched(pipe)
    return pipe


def transformers(pipe):
    return [t for t in (pipe.transformer, getattr(pipe, "transformer_2", None)) if t is not None]


def snapshot(pipe):
    return [
        (*module_snapshot(t), [type(getattr(m, "processor", None)) for m in t.modules()]) for t in transformers(pipe)
    ]


def counting_runs(monkeypatch) -> list:
    """Every LayerReuseRun made from now on, for its counts after the generation (a run drops its cache, not
    its counts)."""
    runs = []
    made = LayerReuseRun.__init__

    def record(self, *args, **kwargs):
        made(self, *args, **kwargs)
        runs.append(self)

    monkeypatch.setattr(LayerReuseRun, "__init__", record)
    return runs


def patched_run(pipe, steps: int = 12, **settings) -> torch.Tensor:
    """One generation with the patch on, removed afterwards whatever happens."""
    tome_core.apply_patch(pipe, **settings)
    try:
        return D.run(pipe, steps=steps)
    finally:
        tome_core.remove_patch(pipe)


@pytest.mark.parametrize("kind", KINDS)
def test_the_default_changes_the_picture_and_removal_is_exact(pipes, kind):
    pipe = pipeline(pipes, kind)
    plain = D.run(pipe)
    before = snapshot(pipe)  # after a run: the pipeline's cache_context adds diffusers' hook registry once
    assert tome_core.apply_patch(pipe, **FORCE) is pipe
    assert patch.is_patched(pipe)
    patched = D.run(pipe)
    assert patched.shape == plain.shape and torch.isfinite(patched).all()
    assert not torch.equal(patched, plain)
    assert tome_core.remove_patch(pipe) is pipe
    assert not patch.is_patched(pipe)
    assert snapshot(pipe) == before  # classes, attributes, hooks and processors as they were
    assert torch.equal(D.run(pipe), plain)  # bit-identical to never patched


@pytest.mark.parametrize("kind, calls_per_step, extrapolate", [("flux", 1, 1.0), ("sd3", 1, 0.5), ("wan", 2, 0.5)])
def test_reuse_skips_the_dit_schedules_steps(pipes, kind, calls_per_step, extrapolate, monkeypatch):
    pipe = pipeline(pipes, kind)
    runs = counting_runs(monkeypatch)
    patched_run(pipe, steps=12, downsample_factor=1, reuse_interval=3)
    (run,) = runs
    assert (run.calls, run.reused_calls) == (12 * calls_per_step, 6 * calls_per_step)  # under 25 steps: 1 in 2
    assert run.extrapolate == extrapolate  # the family's step along the line (``dit_families``)
    assert not run.entries  # the cache is dropped after the last step


def test_the_prompt_and_the_negative_prompt_are_predicted_apart(pipes, monkeypatch):
    """Wan runs them as two calls of one step with the same shapes: each has its own record."""
    pipe = pipeline(pipes, "wan")
    entries = []
    begin = LayerReuseRun.begin_call

    def spy(self, *args, **kwargs):
        reuse = begin(self, *args, **kwargs)
        entries.append(len(self.entries))
        return reuse

    monkeypatch.setattr(LayerReuseRun, "begin_call", spy)
    patched_run(pipe, steps=12, downsample_factor=1, reuse_interval=3)
    assert entries[:2] == [1, 2] and max(entries) == 2


def test_the_last_steps_second_call_reuses_and_the_cache_goes_after_it(pipes, monkeypatch):
    """Wan's prompt and negative prompt are two calls of each step. Where the plan reuses the last step, both of its
    calls reuse (the run is over after the step's last call, not its first), and the cache is dropped then."""
    pipe = pipeline(pipes, "wan")
    new_run = LayerReuse.new_run

    def last_step_reused(self, steps, *args, **kwargs):
        run = new_run(self, steps, *args, **kwargs)
        run.schedule = FullSteps(steps, frozenset(range(0, steps - 1, 2)))  # 0, 2, ..., 10 full; 11 reuses
        return run

    monkeypatch.setattr(LayerReuse, "new_run", last_step_reused)
    runs = counting_runs(monkeypatch)
    reused = []
    begin = LayerReuseRun.begin_call

    def spy(self, step, *args, **kwargs):
        reuse = begin(self, step, *args, **kwargs)
        reused.append((step, reuse))
        return reuse

    monkeypatch.setattr(LayerReuseRun, "begin_call", spy)
    patched_run(pipe, steps=12, downsample_factor=1, reuse_interval=3)
    (run,) = runs
    assert reused[-2:] == [(11, True), (11, True)]
    assert (run.calls, run.reused_calls) == (24, 12)
    assert not run.entries


def test_fewer_than_ten_steps_reuse_nothing(pipes):
    """Distilled models and Lightning LoRAs: the default then computes exactly what reuse_interval 1 does."""
    pipe = pipeline(pipes, "flux")
    tome_core.apply_patch(pipe, **FORCE)
    default = D.run(pipe, steps=8)
    tome_core.apply_patch(pipe, reuse_interval=1, **FORCE)
    todo_alone = D.run(pipe, steps=8)
    tome_core.remove_patch(pipe)
    assert torch.equal(default, todo_alone)


def test_wan_2_2s_two_transformers_each_reuse_within_their_part(pipes, monkeypatch):
    pipe = pipeline(pipes, "wan2.2")
    runs = counting_runs(monkeypatch)
    # The second transformer takes the steps under timestep 500: with the scheduler's shift 3, a quarter of them
    # (12 of 48), enough for it to reuse (a part of under 10 steps would not).
    patched_run(pipe, steps=48, downsample_factor=1, reuse_interval=2)
    assert len(runs) == 2  # one run per transformer, each from its own first call
    assert sorted(run.calls for run in runs) == [24, 72]  # two calls per step (the prompt, the negative one)
    assert all(run.reused_calls > 0 for run in runs)


def test_an_interrupted_generation_leaves_nothing_for_the_next(pipes):
    pipe = pipeline(pipes, "flux")
    tome_core.apply_patch(pipe, downsample_factor=1, reuse_interval=2)
    try:
        first = D.run(pipe, steps=12)

        def stop(pipe, step, timestep, kwargs):
            if step == 5:
                raise KeyboardInterrupt
            return kwargs

        with pytest.raises(KeyboardInterrupt):
            D.run(pipe, steps=12, callback_on_step_end=stop)
        again = D.run(pipe, steps=12)
        other = D.run(pipe, steps=14, px=48)  # another size and step count: a fresh run
        assert torch.isfinite(other).all()
        assert torch.equal(D.run(pipe, steps=12), first)
    finally:
        tome_core.remove_patch(pipe)
    assert torch.equal(again, first)


def test_flux_keys_and_values_of_the_image_are_downsampled(pipes, monkeypatch):
    """64 px: 16 image tokens (4 x 4) after 8 text tokens; ToDo 2 keeps 4 image keys, every query stays."""
    import diffusers.models.attention_dispatch as dispatch

    pipe = pipeline(pipes, "flux")
    shapes = []
    real = dispatch.dispatch_attention_fn

    def spy(q, k, v, *args, **kwargs):
        shapes.append((q.shape[1], k.shape[1], kwargs.get("attn_mask") is not None))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(dispatch, "dispatch_attention_fn", spy)
    tome_core.apply_patch(pipe, downsample_factor=2, reuse_interval=1, **FORCE)
    try:
        D.run(pipe, steps=2)
    finally:
        tome_core.remove_patch(pipe)
    assert shapes and set(shapes) == {(24, 12, True)}  # 2 double + 3 single blocks x 2 steps, all reduced


def test_flux_processor_computes_what_diffusers_does_where_nothing_is_reduced(pipes):
    """Below Flux's break-even (4096 image tokens) skip_when_slower keeps every key: the project's processor
    then runs its own projections, norms, rotary embedding and attention, bit-identical to diffusers'."""
    pipe = pipeline(pipes, "flux")
    plain = D.run(pipe)
    tome_core.apply_patch(pipe, downsample_factor=2, reuse_interval=1)
    try:
        processors = [m.processor for m in pipe.transformer.modules() if hasattr(m, "processor")]
        assert processors and all(isinstance(p, dit_attention.TodoFluxProcessor) for p in processors)
        assert torch.equal(D.run(pipe), plain)
    finally:
        tome_core.remove_patch(pipe)


def test_flux_image_tokens_come_from_the_ids():
    def ids(rows, cols, kind=0):
        r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
        return torch.stack([torch.full_like(r, kind), r, c], -1).reshape(-1, 3).float()

    assert dit_attention.flux_image_tokens(ids(4, 6)).grid == (1, 4, 6)
    kontext = dit_attention.flux_image_tokens(torch.cat([ids(4, 6), ids(3, 3, kind=1)]))
    assert (kontext.grid, kontext.after) == ((1, 4, 6), 9)  # the reference image's tokens stay whole
    assert dit_attention.flux_image_tokens(ids(4, 6).flip(0)) is None  # not raster order: left alone
    assert dit_attention.flux_image_tokens(ids(4, 6, kind=1)) is None  # no image tokens


def test_tome_and_reuse_on_a_bare_transformer_are_refused_unchanged(pipes):
    pipe = pipeline(pipes, "flux")
    before = snapshot(pipe)
    with pytest.raises(ValueError, match="method 'tome' is not available for Flux"):
        tome_core.apply_patch(pipe, method="tome", ratio=0.5)
    with pytest.raises(ValueError, match="reuse_interval above 1 needs the pipeline"):
        tome_core.apply_patch(pipe.transformer, reuse_interval=3)
    with pytest.raises(ValueError, match="reuse_interval"):
        tome_core.apply_patch(pipe, reuse_interval=0)
    assert snapshot(pipe) == before and not patch.is_patched(pipe)


def test_a_bare_transformer_gets_todo_and_leaves_the_default_reuse_out(pipes, caplog):
    pipe = pipeline(pipes, "flux")
    plain = D.run(pipe)
    with caplog.at_level(logging.INFO, logger="tome_patch"):
        tome_core.apply_patch(pipe.transformer, **FORCE)
    try:
        assert "reuse across steps (the default reuse_interval 3) is left out" in caplog.text
        assert dit_reuse.installed(pipe.transformer) is None and dit_attention.installed(pipe.transformer)
        assert not torch.equal(D.run(pipe), plain)
    finally:
        tome_core.remove_patch(pipe.transformer)
    assert torch.equal(D.run(pipe), plain)


def test_diffusers_own_cache_makes_reuse_stand_down(pipes, caplog, monkeypatch):
    """First Block Cache on the transformer: ours computes every block (with a warning), theirs still skips."""
    from diffusers import FirstBlockCacheConfig

    # A pipeline that never ran: diffusers 0.39 keeps the list of a transformer's hook registries from its first
    # cache_context, so a cache enabled after a run would get no context (their issue, not this patch's).
    pipe = D.flux_pipeline()
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.2))
    try:
        cache_alone = D.run(pipe, steps=12)
        runs = counting_runs(monkeypatch)
        with caplog.at_level(logging.INFO, logger="tome_patch"):
            tome_core.apply_patch(pipe, downsample_factor=1, reuse_interval=3)
            both = D.run(pipe, steps=12)
        tome_core.remove_patch(pipe)
    finally:
        pipe.transformer.disable_cache()
    assert "diffusers' own cache is enabled" in caplog.text
    assert runs and all(run.reused_calls == 0 for run in runs)
    assert torch.equal(both, cache_alone)


@pytest.mark.parametrize(
    "kind, expected",
    [
        # SD3: 16 image tokens (4 x 4 patches) before 8 text tokens in joint attention (2 x 2 image keys kept,
        # with the mask that gives them their share), the image alone in SD3.5's extra self-attention (no mask).
        ("sd3", {(24, 12, True), (16, 4, False)}),
        # Wan: 2 latent frames of 4 x 4 patches in self-attention (ToDo 2 keeps 2 x 2 per frame); the
        # cross-attention to the 8 text tokens is diffusers' own (not seen here).
        ("wan", {(32, 8, False)}),
    ],
)
def test_sd3_and_wan_keys_and_values_of_the_image_are_downsampled(pipes, kind, expected, monkeypatch):
    import diffusers.models.attention_dispatch as dispatch

    pipe = pipeline(pipes, kind)
    shapes = set()
    sdpa, dispatched = torch.nn.functional.scaled_dot_product_attention, dispatch.dispatch_attention_fn

    def spy_sdpa(q, k, v, *args, **kwargs):  # SD3's processor: (batch, heads, tokens, head_dim)
        shapes.add((q.shape[2], k.shape[2], kwargs.get("attn_mask") is not None))
        return sdpa(q, k, v, *args, **kwargs)

    def spy_dispatch(q, k, v, *args, **kwargs):  # Wan's: (batch, tokens, heads, head_dim)
        if q.shape[1] == k.shape[1] * 4:  # ours (the text cross-attention goes through diffusers' processor)
            shapes.add((q.shape[1], k.shape[1], kwargs.get("attn_mask") is not None))
        return dispatched(q, k, v, *args, **kwargs)

    if kind == "sd3":  # its processor calls PyTorch's attention itself
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy_sdpa)
    else:
        monkeypatch.setattr(dispatch, "dispatch_attention_fn", spy_dispatch)
    tome_core.apply_patch(pipe, downsample_factor=2, reuse_interval=1, **FORCE)
    try:
        D.run(pipe, steps=2)
    finally:
        tome_core.remove_patch(pipe)
    assert shapes == expected


@pytest.mark.parametrize("kind", ["sd3", "wan"])
def test_sd3_and_wan_processors_compute_what_diffusers_does_where_nothing_is_reduced(pipes, kind):
    """Below the ToDo threshold (1024 image tokens) skip_when_slower keeps every key: the project's processors run
    their own path, bit-identical to diffusers' processors."""
    pipe = pipeline(pipes, kind)
    plain = D.run(pipe)
    tome_core.apply_patch(pipe, downsample_factor=2, reuse_interval=1)
    try:
        held = [
            m.processor
            for m in pipe.transformer.modules()
            if isinstance(getattr(m, "processor", None), dit_attention._HeldProcessor)
        ]
        assert held
        assert torch.equal(D.run(pipe), plain)
    finally:
        tome_core.remove_patch(pipe)


def test_wans_default_unipc_scheduler_reuses_on_dits_only(pipes, caplog, monkeypatch):
    """Measured to keep the picture on the DiT reference (docs/dit.md), not on UNets: Wan reuses with it, an SD
    pipeline runs every step in full."""
    from diffusers import UniPCMultistepScheduler
    from hosts import diffusers_host as H

    pipe = D.wan_pipeline()
    pipe.scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    runs = counting_runs(monkeypatch)
    patched_run(pipe, steps=12, downsample_factor=1, reuse_interval=3)
    # 5 steps (one in two of the 10 above noise 0.5, under 25 steps) x the prompt and the negative prompt
    assert [run.reused_calls for run in runs] == [10]

    sd = H.make_pipeline("txt2img")
    sd.scheduler = UniPCMultistepScheduler.from_config(sd.scheduler.config)
    with caplog.at_level(logging.INFO, logger="tome_patch"):
        tome_core.apply_patch(sd, reuse_interval=3)
        H.run(sd, "txt2img", steps=10)
    tome_core.remove_patch(sd)
    assert "reuse across steps is off: sampler UniPCMultistepScheduler" in caplog.text


def test_unipc_runs_the_low_noise_steps_in_full(pipes, monkeypatch):
    """UniPC's corrector multiplies a predicted output's error at low noise (docs/dit.md): with Wan's flow shift 3
    over 30 steps, the steps below noise 0.5 run in full, on top of one in two of the others."""
    from diffusers import UniPCMultistepScheduler

    from tome_core.reuse import FULL_BELOW_NOISE_WITH_A_CORRECTOR

    pipe = D.wan_pipeline()
    pipe.scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    runs = counting_runs(monkeypatch)
    patched_run(pipe, steps=30, downsample_factor=1, reuse_interval=2)
    sigmas = [float(s) for s in pipe.scheduler.sigmas[:30]]
    low = [step for step in range(30) if sigmas[step] < FULL_BELOW_NOISE_WITH_A_CORRECTOR]
    assert 2 < len(low) < 15
    assert [run.reused_calls for run in runs] == [2 * ((30 - len(low)) // 2)]  # prompt and negative prompt
    assert {0, *low} <= runs[0].schedule.full  # the first step and every low-noise one


def _flux_lora(transformer, rank: int = 2, seed: int = 3) -> dict:
    """A LoRA in diffusers' format on every attention projection of the Flux transformer (seeded, non-zero B)."""
    generator = torch.Generator().manual_seed(seed)
    lora = {}
    for name, module in transformer.named_modules():
        if name.endswith(("attn.to_q", "attn.to_k", "attn.to_v")):
            lora[f"transformer.{name}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=generator)
            lora[f"transformer.{name}.lora_B.weight"] = 0.1 * torch.randn(
                module.out_features, rank, generator=generator
            )
    return lora


def test_a_lora_loaded_with_load_lora_weights_applies_under_the_patch(monkeypatch):
    """peft's LoRA layers wrap the projections that our processors and forwards call: the LoRA changes the
    picture under the patch as it does without it, and unloading it gives the patch's own picture back."""
    pipe = D.flux_pipeline()
    tome_core.apply_patch(pipe, reuse_interval=3, **FORCE)
    try:
        patched = D.run(pipe)
        pipe.load_lora_weights(_flux_lora(pipe.transformer), adapter_name="test")
        with_lora = D.run(pipe)
        assert not torch.equal(with_lora, patched)  # the LoRA is applied through our processors
        pipe.unload_lora_weights()
        assert torch.equal(D.run(pipe), patched)
    finally:
        tome_core.remove_patch(pipe)


@pytest.mark.parametrize("order", ["compile, then patch", "patch, then compile"])
def test_torch_compile_of_the_transformer_gives_the_patchs_picture(order):
    """torch.compile (eager backend: the graph capture without code generation) of the transformer, before or
    after patching: the same latents as the patched transformer uncompiled, and reuse still skips its steps."""
    pipe = D.flux_pipeline()
    tome_core.apply_patch(pipe, reuse_interval=3, **FORCE)
    expected = D.run(pipe)
    tome_core.remove_patch(pipe)
    original = pipe.transformer
    if order == "compile, then patch":
        pipe.transformer = torch.compile(original, backend="eager")
        tome_core.apply_patch(pipe, reuse_interval=3, **FORCE)
    else:
        tome_core.apply_patch(pipe, reuse_interval=3, **FORCE)
        pipe.transformer = torch.compile(original, backend="eager")
    try:
        compiled = D.run(pipe)
        assert dit_reuse.installed(original).run.reused_calls == 6
    finally:
        tome_core.remove_patch(pipe)
        torch._dynamo.reset()
    # The eager backend runs the same operations in the same order: equal up to no rounding at all here.
    assert torch.equal(compiled, expected)


def test_kontexts_reference_tokens_stay_whole_and_removal_is_exact(monkeypatch):
    """FluxKontextPipeline: the reference image's tokens (after the image's) keep every key; ToDo 2 keeps a
    quarter of the 16 image keys; reuse carries the reference tokens through the span like the others."""
    import diffusers.models.attention_dispatch as dispatch

    pipe = D.kontext_pipeline()
    plain = D.kontext_run(pipe)
    keys = set()
    real = dispatch.dispatch_attention_fn

    def spy(q, k, v, *args, **kwargs):
        keys.add((q.shape[1], k.shape[1]))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(dispatch, "dispatch_attention_fn", spy)
    runs = counting_runs(monkeypatch)
    tome_core.apply_patch(pipe, **FORCE)
    patched = D.kontext_run(pipe)
    tome_core.remove_patch(pipe)
    assert keys == {(8 + 16 + 9, 8 + 4 + 9)}  # text, image (reduced), reference (whole)
    assert runs[0].reused_calls == 6 and not torch.equal(patched, plain)
    assert torch.equal(D.kontext_run(pipe), plain)


def test_model_cpu_offload_keeps_the_patchs_picture(monkeypatch):
    """accelerate's offload hooks on the transformer (enable_model_cpu_offload; the CPU as the execution device
    here): the same latents as the patched pipeline without them, reuse skipping the same steps."""
    pipe = D.flux_pipeline()
    tome_core.apply_patch(pipe, **FORCE)
    expected = D.run(pipe)
    tome_core.remove_patch(pipe)
    pipe.enable_model_cpu_offload(device="cpu")
    runs = counting_runs(monkeypatch)
    tome_core.apply_patch(pipe, **FORCE)
    try:
        assert torch.equal(D.run(pipe), expected)
    finally:
        tome_core.remove_patch(pipe)
    assert runs[0].reused_calls == 6


def test_wan_runs_every_6_with_its_first_block_guards(pipes, monkeypatch):
    """Wan's default in diffusers (``dit_families``): every 6 spaced by the noise, no curve, and the run carries
    the first block's two guards, which decide the rest while it goes; every call counted."""
    pipe = pipeline(pipes, "wan")
    runs = counting_runs(monkeypatch)
    out = patched_run(pipe, steps=30)
    record = dit_families.family("Wan")
    (run,) = runs
    assert torch.isfinite(out).all() and record.auto_schedule().curve is None
    assert (run.first_block_guard, run.line_guard) == (record.first_block_guard, record.line_guard) == (0.15, 0.1)
    levels = [float(sigma) for sigma in pipe.scheduler.sigmas[:30]]
    every_6 = NoiseSpacedSchedule(6).for_run(30, levels, run.full_below).full
    assert run.schedule.full == every_6
    calls = run.calls // 30
    assert run.calls == 30 * calls and run.reused_calls == (30 - len(every_6)) * calls - run.guarded_calls


@pytest.mark.parametrize(("kind", "steps", "interval"), (("flux", 28, 3),))
def test_no_settings_run_the_familys_measured_reuse_without_todo(pipes, kind, steps, interval, monkeypatch):
    """``apply_patch(pipe)`` (``dit_settings`` auto): reuse at the family's measured interval for the step count
    (``dit_families``) and no ToDo; without the curve guard, bit for bit what naming that setting computes, and
    with it (the default) more steps in full where the real model moves fast (Flux's first steps)."""
    pipe = pipeline(pipes, kind)
    runs = counting_runs(monkeypatch)
    auto = patched_run(pipe, steps=steps)
    by_hand = patched_run(pipe, steps=steps, downsample_factor=1, reuse_interval=interval, dit_settings="as set")
    assert torch.isfinite(auto).all()
    record = dit_families.family(kind.capitalize())
    guarded, every_n = runs[0].schedule.full, runs[-1].schedule.full
    assert guarded == record.curve.guard(every_n, steps)
    # Flux's first steps move fast: several more in full; Wan's curve is flat: a step more at most.
    assert every_n < guarded and len(guarded - every_n) >= (2 if kind == "flux" else 1)
    assert kind == "flux" or len(guarded - every_n) == 1
    assert not torch.equal(auto, by_hand)
    unguarded = StepCountSchedule(record.auto_intervals)
    monkeypatch.setattr(dit_families, "auto_schedule", lambda name: unguarded)
    assert torch.equal(patched_run(pipe, steps=steps), by_hand)
    other = patched_run(pipe, steps=steps, downsample_factor=1, reuse_interval=interval + 1, dit_settings="as set")
    assert not torch.equal(by_hand, other)


def test_auto_keeps_what_the_user_names(pipes, monkeypatch):
    """Under auto a named setting is used as set: ToDo where ``downsample_factor`` is named, the named interval."""
    pipe = pipeline(pipes, "flux")
    named = patched_run(pipe, steps=12, downsample_factor=2, reuse_interval=2, skip_when_slower=False)
    by_hand = patched_run(pipe, steps=12, downsample_factor=2, reuse_interval=2, **FORCE)
    assert torch.equal(named, by_hand)
    tome_core.apply_patch(pipe.transformer)  # no pipeline: no reuse, and no ToDo unless named
    try:
        assert not patch.is_patched(pipe)
    finally:
        tome_core.remove_patch(pipe)
