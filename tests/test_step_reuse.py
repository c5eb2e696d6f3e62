"""Scope reuse (reuse across steps, token by token) in a real ComfyUI 0.3.75 with small random-weight UNets.

The cache belongs to one sampling run: made when the run starts, dropped when it ends and whenever the shape,
the batch layout or the step order changes; a block computed in part gives its computed tokens exactly as the
whole block would.
"""

from __future__ import annotations

import sys

import pytest
import torch
from hosts import comfy_host as host  # noqa: I001  (before any ComfyUI import: sys.path, CPU mode)

HW = (15, 23)
REUSE = {"method": "tome", "scope": "reuse", "ratio": 0.5, "skip_when_slower": False, "max_downsample": "4"}
STEPS = 6  # full steps 0, 1, 4, 5; reduced 2, 3 (ReuseSchedule defaults)


@pytest.fixture(scope="module")
def node_classes():
    return host.load_our_package()


@pytest.fixture(scope="module")
def models():
    return {family: host.tiny_model(family) for family in ("sd15", "sdxl")}


_references: dict = {}


def reference_of(model, family="sd15"):
    """The unpatched sampling result (the same for every test: computed once)."""
    key = (id(model), family)
    if key not in _references:
        _references[key] = run(model, family)
    return _references[key]


def patch(node_classes, model, **values):
    return host.patch_with_node(node_classes, model, **{**REUSE, **values})


def run(model, family="sd15", **kwargs):
    return host.sample(model, family, **{"latent_hw": HW, "steps": STEPS, "batch": 2, **kwargs})


def hooks_of(patched):
    return patched.model_options["transformer_options"]["tome_patch_owner"]


def engine_of(hooks):
    """The engine modules as ComfyUI loaded them (submodules of the custom node package)."""
    adapter = sys.modules[type(hooks).__module__]
    return adapter, sys.modules[type(hooks).__module__.replace("hosts.comfyui.step_reuse", "step_cache")]


def blocks_of(model):
    return [m for _, m in model.model.diffusion_model.named_modules() if type(m).__name__ == "BasicTransformerBlock"]


def test_reuse_is_a_scope_and_changes_the_picture_within_reason(node_classes, models):
    model = models["sd15"]
    reference = reference_of(model)
    patched = patch(node_classes, model)
    out = run(patched)
    assert out.shape == reference.shape and torch.isfinite(out).all()
    assert not torch.equal(out, reference)
    assert (out - reference).abs().mean() < 0.2 * reference.abs().mean()
    last = hooks_of(patched).last_run
    assert last.calls == STEPS and last.full_calls == 4
    assert 0 < last.tokens_computed < last.tokens_total


def test_the_cache_is_dropped_when_the_run_ends_and_nothing_stays_on_the_model(node_classes, models):
    model = models["sd15"]
    reference = reference_of(model)
    patched = patch(node_classes, model)
    run(patched)
    hooks = hooks_of(patched)
    adapter, _ = engine_of(hooks)
    assert hooks.last_run.entries == {}
    for key in (adapter.RUN_KEY, adapter.CALL_KEY, adapter.KEYS_VALUES_KEY):
        assert key not in patched.model_options["transformer_options"]
    assert torch.equal(run(model), reference)  # loading the input model ejects our block forwards
    assert not any("forward" in block.__dict__ for block in blocks_of(model))
    off = host.patch_with_node(node_classes, patched, method="tome", ratio=0.0)
    assert not off.injections and "tome_patch_owner" not in off.model_options["transformer_options"]
    assert not off.wrappers.get("outer_sample") and not off.wrappers.get("apply_model")


@pytest.mark.parametrize("family", ["sd15", "sdxl"])
def test_ratio_zero_and_all_steps_full_are_bit_identical(node_classes, models, family):
    model = models[family]
    reference = reference_of(model, family)
    off = patch(node_classes, model, ratio=0.0)
    assert not off.injections and not off.wrappers
    assert torch.equal(run(off, family), reference)
    # Every step full: the block path runs every block on all tokens, and must compute exactly the unpatched UNet.
    every = patch(node_classes, model)
    adapter, engine = engine_of(hooks_of(every))
    hooks_of(every).schedule = engine.ReuseSchedule(reuse=0.5, full_every=1)
    assert torch.equal(run(every, family), reference)
    assert hooks_of(every).last_run.tokens_computed == hooks_of(every).last_run.tokens_total


def test_runs_back_to_back_with_other_sizes_and_step_counts_share_nothing(node_classes, models):
    model = models["sdxl"]
    patched = patch(node_classes, model)
    run(patched, "sdxl", latent_hw=(16, 16), steps=6, batch=1)
    after_other_runs = run(patched, "sdxl", steps=10)
    fresh = run(patch(node_classes, model), "sdxl", steps=10)
    assert torch.equal(after_other_runs, fresh)


def test_cond_and_uncond_batched_or_apart_give_the_same_picture(node_classes, models, monkeypatch):
    model = models["sd15"]
    patched = patch(node_classes, model)
    batched = run(patched)
    assert hooks_of(patched).last_run.calls == STEPS
    # ComfyUI batches cond and uncond when the memory it estimates fits; an estimate too large splits them.
    monkeypatch.setattr(patched.model, "memory_required", lambda *args, **kwargs: float("inf"))
    apart = run(patched)
    hooks = hooks_of(patched)
    assert hooks.last_run.calls == 2 * STEPS  # cond and uncond ran as separate model calls
    # Not bit-identical: batched and single matrix products round differently, which can swap a token of nearly
    # equal change in or out of the computed set. The same picture: far below what the reuse itself changes.
    change = (batched - reference_of(model)).abs().mean()
    assert (apart - batched).abs().mean() < change / 100 and (apart - batched).abs().max() < 1e-2


def test_shape_change_step_order_and_off_schedule_compute_in_full():
    from tome_core.step_cache import ReuseRun, ReuseSchedule

    schedule = ReuseSchedule(reuse=0.5, full_start=0.0, full_end=0, full_every=100)  # step 0 full, then reduced
    run = ReuseRun(schedule, torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0]))
    computed = []

    def body(x):
        computed.append(x.shape[1])
        return x * 2

    def with_keys_values(tokens, compute):
        return compute()

    x = torch.randn(2, 16, 4)
    assert run.begin_call(4.0).full
    assert torch.equal(run.run_block("b", run.begin_call(4.0), x, body, with_keys_values), x * 2)
    plan = run.begin_call(3.0)
    assert not plan.full
    run.run_block("b", plan, x, body, with_keys_values)
    assert computed == [16, 8]  # reduced: half the tokens
    wider = torch.randn(2, 20, 4)
    assert torch.equal(run.run_block("b", plan, wider, body, with_keys_values), wider * 2)  # another shape
    assert computed[-1] == 20
    fresh = torch.randn(2, 16, 4)
    assert torch.equal(run.run_block("new", plan, fresh, body, with_keys_values), fresh * 2)  # nothing cached
    assert run.entries
    assert run.begin_call(4.0) is not None and run.entries == {}  # the steps went backwards: dropped
    run.run_block("b", run.begin_call(3.0), x, body, with_keys_values)
    assert computed[-1] == 16 and run.entries
    assert run.begin_call(2.5) is None and run.entries == {}  # a sigma off the schedule: dropped, in full


@pytest.mark.parametrize("family", ["sd15", "sdxl"])
def test_computed_tokens_are_exactly_those_of_the_whole_block(node_classes, models, family):
    model = models[family]
    patched = patch(node_classes, model)
    hooks = hooks_of(patched)
    adapter, engine = engine_of(hooks)
    block = blocks_of(model)[0]
    torch.manual_seed(0)
    n = HW[0] * HW[1]
    x1 = torch.randn(2, n, block.norm1.normalized_shape[0])
    x2 = x1 + 0.3 * torch.randn_like(x1) * (torch.arange(n) % 3 == 0).float()[None, :, None]
    context = torch.randn(2, 7, 64)
    run = engine.ReuseRun(engine.ReuseSchedule(reuse=0.5, full_start=0.5, full_end=0), torch.tensor([2.0, 1.0, 0]))
    options = {"patches": {"attn1_patch": [hooks.attn1_patch]}, "tome_patch_owner": hooks, adapter.RUN_KEY: run}
    options.update(original_shape=[2, 4, *HW], uuids=["c", "u"])
    forward = __import__(adapter.model_patcher.__name__, fromlist=["BlockForward"]).BlockForward(hooks, block)

    def call(x, sigma):
        options[adapter.CALL_KEY] = run.begin_call(sigma)
        with torch.no_grad():
            return forward(x, context=context, transformer_options=dict(options))

    with torch.no_grad():
        whole1 = type(block).forward(block, x1, context=context)
        whole2 = type(block).forward(block, x2, context=context)
    assert torch.equal(call(x1, 2.0), whole1)  # a full step
    out2 = call(x2, 1.0)  # a reduced step: half the tokens computed
    computed = torch.isclose(out2, whole2, atol=1e-5, rtol=1e-4).all(dim=-1)
    reused = torch.isclose(out2, x2 + (whole1 - x1), atol=1e-5, rtol=1e-4).all(dim=-1)
    assert (computed | reused).all()
    assert (computed.sum(dim=1) >= n - int(n * 0.5)).all()
    # The changed tokens (every third) are among those computed.
    assert computed[:, torch.arange(n) % 3 == 0].all()


def test_composes_with_easycache(node_classes, models):
    from comfy_extras.nodes_easycache import EasyCacheNode

    model = models["sd15"]
    ours = patch(node_classes, model)
    both = EasyCacheNode.execute(ours, reuse_threshold=0.2, start_percent=0.15, end_percent=0.95, verbose=False)
    out = run(both.result[0], steps=10)
    assert torch.isfinite(out).all() and hooks_of(ours).last_run.calls > 0
    assert "easycache" not in ours.model_options["transformer_options"]


def test_hosts_without_the_scope_do_not_offer_it_and_refuse_it_clearly():
    import tome_core
    from tome_core.hosts.webui import args as webui_args

    assert "reuse" not in webui_args.ARGS[webui_args.ARG_NAMES.index("scope")].choices
    with pytest.raises(ValueError, match="scope 'reuse' is available in ComfyUI only"):
        tome_core.apply_patch(torch.nn.Linear(1, 1), method="tome", scope="reuse")
