"""Engine unit tests: no host involved."""

from __future__ import annotations

import math

import pytest
import tomesd.merge
import torch
import torch.nn.functional as F

from tome_core import PatchSettings, Reducer, find_level, grid_at_level, matching, reduced_levels
from tome_core.downsample import NearestIndexCache, downsample_tokens, downsampled_size
from tome_core.patterns import PatternCache
from tome_core.schedule import NoiseRange

# fp32 merge sums the same tokens as tomesd in another order (index_add over tokens vs scatter_reduce over
# src): a mean of at most sx*sy + 1 values differs by a few ulp. 1e-6 relative to the inputs' scale (~1).
PARITY_ATOL = 1e-6


def _rows_sorted(x: torch.Tensor) -> torch.Tensor:
    """Rows of each batch element in a canonical order, to compare merged sets laid out differently."""
    keys = x[..., 0] + 1e-3 * x[..., 1]
    return x.gather(1, keys.argsort(dim=1).unsqueeze(-1).expand_as(x))


@pytest.mark.parametrize("h,w", [(8, 8), (15, 23), (7, 9), (16, 5), (32, 32)])
@pytest.mark.parametrize("ratio", [0.1, 0.3, 0.5, 0.75])
def test_tome_merge_and_unmerge_match_tomesd(h, w, ratio):
    generator = torch.Generator().manual_seed(h * 100 + w)
    x = torch.randn(2, h * w, 24, generator=generator)
    r = int(h * w * ratio)
    ref_merge, ref_unmerge = tomesd.merge.bipartite_soft_matching_random2d(x, w, h, 2, 2, r, no_rand=True)
    plan = matching.make_plan(x, PatternCache().get(h, w, 2, 2, None, x.device), r)

    ours_merged = matching.merge(plan, x)
    ref_merged = ref_merge(x)
    assert ours_merged.shape == ref_merged.shape
    torch.testing.assert_close(_rows_sorted(ours_merged), _rows_sorted(ref_merged), atol=PARITY_ATOL, rtol=0)
    # A per-token function between merge and unmerge (what attention on merged tokens looks like to unmerge).
    torch.testing.assert_close(
        matching.unmerge(plan, ours_merged.tanh()), ref_unmerge(ref_merged.tanh()), atol=PARITY_ATOL, rtol=0
    )


def test_merge_keeps_unmerged_tokens_bit_identical():
    x = torch.randn(3, 64, 8)
    plan = matching.make_plan(x, PatternCache().get(8, 8, 2, 2, None, x.device), 10)
    back = matching.unmerge(plan, matching.merge(plan, x))
    group = plan.inv_group_size[plan.slot].view(3, 64)
    alone = group == 1.0
    assert alone.sum() >= 3 * (64 - 2 * 10)  # 10 merged src and at most 10 dst receive them, per element
    assert torch.equal(back[alone], x[alone])


def test_levels_follow_the_unet_rounding():
    assert grid_at_level((15, 23), 2) == (8, 12)
    assert grid_at_level((15, 23), 4) == (4, 6)
    assert grid_at_level((15, 23), 8) == (2, 3)
    assert find_level((15, 23), 8 * 12) == (2, 8, 12)
    assert find_level((15, 23), 7 * 12) is None  # not a grid of this latent: the block is left alone
    assert find_level((128, 128), 16384) == (1, 128, 128)


def test_reduced_levels_auto_is_the_finest_with_attention():
    assert reduced_levels(0, (1, 2, 4, 8)) == {1}
    assert reduced_levels(0, (2, 4)) == {2}  # SDXL
    assert reduced_levels(2, (1, 2, 4, 8)) == {1, 2}
    assert reduced_levels(1, (2, 4)) == frozenset()
    assert reduced_levels(0, ()) == frozenset()


@pytest.mark.parametrize("h,w,factor", [(16, 16, 2), (15, 23, 2), (9, 7, 3), (64, 40, 4), (5, 5, 1.5)])
def test_nearest_exact_picks_what_interpolate_picks(h, w, factor):
    x = torch.randn(2, h * w, 6)
    ours = downsample_tokens(x, h, w, factor, "nearest-exact", NearestIndexCache())
    grid = x.view(2, h, w, 6).permute(0, 3, 1, 2)
    out_h, out_w = downsampled_size(h, w, factor)
    ref = F.interpolate(grid, size=(out_h, out_w), mode="nearest-exact").permute(0, 2, 3, 1).reshape(2, -1, 6)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("method", ["avg_pool", "bilinear"])
def test_other_downsample_methods_shape(method):
    x = torch.randn(2, 15 * 23, 6)
    out = downsample_tokens(x, 15, 23, 2, method, NearestIndexCache())
    assert out.shape == (2, 8 * 12, 6)
    if method == "avg_pool":
        assert torch.allclose(out[:, 0], x.view(2, 15, 23, 6)[:, :2, :2].mean(dim=(1, 2)), atol=1e-6)


def test_factor_one_returns_the_input_itself():
    x = torch.randn(1, 64, 4)
    assert downsample_tokens(x, 8, 8, 1.0, "nearest-exact", NearestIndexCache()) is x


def test_noise_range():
    full = NoiseRange(0.0, 1.0, lambda p: 1.0 - p)
    assert full.everywhere and full.contains(1e9) and full.contains(1e-9)
    empty = NoiseRange(0.4, 0.4, lambda p: 1.0 - p)
    assert empty.empty and not empty.contains(0.6) and not empty.contains(0.5)
    middle = NoiseRange(0.25, 0.75, lambda p: 1.0 - p)
    assert middle.contains(0.75) and middle.contains(0.5) and not middle.contains(0.25)
    assert not middle.contains(0.8)


def test_random_patterns_are_seeded_and_leave_the_global_rng_alone():
    state = torch.get_rng_state()
    a = PatternCache().get(16, 16, 2, 2, 1234, torch.device("cpu"))
    b = PatternCache().get(16, 16, 2, 2, 1234, torch.device("cpu"))
    c = PatternCache().get(16, 16, 2, 2, 99, torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a.dst_idx, b.dst_idx) and not torch.equal(a.dst_idx, c.dst_idx)
    assert a.n_dst == 64 and a.n_src == 192


def test_pattern_of_a_size_that_does_not_divide():
    pattern = PatternCache().get(5, 7, 2, 2, None, torch.device("cpu"))
    assert pattern.n_dst == 2 * 3
    assert sorted(torch.cat([pattern.src_idx, pattern.dst_idx]).tolist()) == list(range(35))


def test_reducer_skips_what_it_must():
    settings = PatchSettings(method="tome", ratio=0.5, skip_when_slower=False)
    reducer = Reducer(settings, (1, 2, 4))
    x = torch.randn(2, 15 * 23, 8)
    assert reducer.start_block(x, (15, 23)) is not None
    assert reducer.start_block(torch.randn(2, 8 * 12, 8), (15, 23)) is None  # level 2 not reduced by default
    assert reducer.start_block(torch.randn(2, 100, 8), (15, 23)) is None  # not a grid of this latent
    assert Reducer(settings.replace(ratio=0.0), (1, 2, 4)).does_nothing
    assert Reducer(PatchSettings(method="todo", downsample_factor=1.0), (1,)).does_nothing
    small = Reducer(PatchSettings(method="todo"), (1, 2, 4))  # skip_when_slower on: 15x23 is too small
    assert small.start_block(x, (15, 23)) is None


def test_reducer_todo_keeps_queries():
    reducer = Reducer(PatchSettings(method="todo", skip_when_slower=False), (1,))
    n = torch.randn(2, 16 * 16, 8)
    q, kv = reducer.start_block(n, (16, 16)).self_attn_inputs(n)
    assert q is n and kv.shape == (2, 64, 8)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"ratio": -0.1}, "ratio must be a number from 0.0 to 0.75"),
        ({"ratio": float("nan")}, "ratio"),
        ({"ratio": 0.6, "sx": 1, "sy": 2}, "ratio must be a number from 0 to 0.5 for a 1x2 stride"),
        ({"downsample_factor": 0}, "downsample_factor must be a number from 1.0 to 8.0"),
        ({"method": "fast"}, "method must be one of 'tome', 'todo'"),
        ({"start_percent": 0.8, "end_percent": 0.2}, "start_percent must not be above end_percent"),
        ({"ratio": "0.5"}, "ratio must be a number"),
        ({"max_downsample": 3}, "max_downsample must be one of"),
        ({"use_rand": "yes"}, "use_rand must be true or false"),
        ({"speed": 2}, "unknown setting(s) speed"),
        ({"sx": 1, "sy": 1}, "sx and sy must not both be 1"),
        ({"scope": "all"}, "scope must be one of 'self-attention', 'block', got 'all'"),
        ({"scope": None}, "scope must be one of 'self-attention', 'block', got None"),
    ],
)
def test_bad_settings_name_the_setting_and_range(values, message):
    with pytest.raises(ValueError) as err:
        PatchSettings.from_values(**values)
    assert message in str(err.value)


def test_settings_accept_integer_choices_from_json():
    assert PatchSettings.from_values(max_downsample=2.0).max_downsample == 2
    assert PatchSettings.from_values(max_downsample="4").max_downsample == 4


def test_scope_block_is_tome_only_and_ignores_the_sub_layer_switches():
    n = torch.randn(2, 16 * 16, 8)
    block = PatchSettings(method="tome", scope="block", skip_when_slower=False, reuse_interval=1)  # no reuse
    assert block.merges_whole_block and not block.is_noop
    # The merge_* switches choose sub-layers for scope self-attention; scope block merges the whole block anyway.
    no_switches = block.replace(merge_attn=False, merge_crossattn=False, merge_mlp=False)
    assert not no_switches.is_noop and no_switches.replace(scope="self-attention").is_noop
    assert block.replace(ratio=0.0).is_noop
    reduction = Reducer(no_switches, (1,)).start_block(n, (16, 16))
    assert reduction.run_block(n, lambda tokens: tokens[:, :1].expand_as(tokens)).shape == n.shape
    # ToDo ignores the scope: keys and values of self-attention, nothing around the block.
    todo = PatchSettings(method="todo", scope="block", skip_when_slower=False)
    assert not todo.merges_whole_block and not Reducer(todo, (1,)).merges_whole_block
    todo_reduction = Reducer(todo, (1,)).start_block(n, (16, 16))
    q, kv = todo_reduction.self_attn_inputs(n)
    assert q is n and kv.shape == (2, 64, 8)
    assert todo_reduction.run_block(n, lambda tokens: tokens * 2).equal(n * 2)


def test_skip_when_slower_has_its_own_threshold_for_scope_block():
    from tome_core.cost import MIN_TOKENS

    reducer = Reducer(PatchSettings(method="tome", scope="block"), (1, 2, 4))
    side = math.isqrt(MIN_TOKENS["tome block"] - 1) + 1  # the smallest square grid at the threshold
    assert MIN_TOKENS["tome block"] < MIN_TOKENS["tome"]
    assert reducer.start_block(torch.randn(1, side * side, 8), (side, side)) is not None
    assert reducer.start_block(torch.randn(1, (side - 1) ** 2, 8), (side - 1, side - 1)) is None


def test_skip_when_slower_has_a_cuda_table_and_the_reducer_asks_with_its_input_device(monkeypatch):
    from tome_core import cost
    from tome_core import reducer as reducer_module

    for key in cost.MIN_TOKENS:
        assert cost.min_tokens(key, "cuda") == cost.MIN_TOKENS_CUDA[key] >= cost.MIN_TOKENS[key]
        assert cost.min_tokens(key, "mps") == cost.min_tokens(key, "cpu") == cost.MIN_TOKENS[key]
    todo = PatchSettings(method="todo")
    # Measured on an H200: 96 x 96 tokens still slower (0.96x), 128 x 128 faster (1.47x).
    assert not cost.worth_reducing(todo, 96 * 96, "cuda") and cost.worth_reducing(todo, 128 * 128, "cuda")
    assert cost.worth_reducing(todo, 64 * 64, "cpu") and cost.worth_reducing(todo, 64 * 64)
    assert cost.worth_reducing(todo.replace(skip_when_slower=False), 16, "cuda")
    # The reducer passes its input's device type (here the CPU's, answered with the CUDA table).
    asked = []

    def as_on_cuda(settings, n_tokens, device_type="cpu"):
        asked.append(device_type)
        return cost.worth_reducing(settings, n_tokens, "cuda")

    monkeypatch.setattr(reducer_module, "worth_reducing", as_on_cuda)
    reducer = Reducer(todo, (1,))
    assert reducer.start_block(torch.randn(1, 64 * 64, 8), (64, 64)) is None
    assert reducer.start_block(torch.randn(1, 128 * 128, 8), (128, 128)) is not None
    assert asked == ["cpu", "cpu"]
    # The whole call's answer agrees with the blocks': no level of a 64 x 64 latent pays, one of 128 x 128 does.
    assert not reducer.acts_on((64, 64), "cpu") and reducer.acts_on((128, 128), "cpu")
    assert not Reducer(todo.replace(downsample_factor=1.0), (1,)).acts_on((128, 128), "cpu")


def test_unipc_runs_in_full_below_half_noise_and_other_samplers_nowhere():
    from tome_core.reuse import FULL, decide

    def below(sampler):
        return decide(None, sampler, None, dit=True).full_below

    assert below("uni_pc") == below("UniPCMultistepScheduler") == 0.5
    assert below("euler") == below("FlowMatchEulerDiscreteScheduler") == 0.0
    assert decide(None, None, None, dit=True).runs == FULL
