"""The MagCache peer row (``tools/fidelity/dit_peers.MagCache``): which calls it skips, from its calibrated ratios,
as MagCache decides (accumulated ratio since the last computed call, the sum of its distances from 1 under the
threshold, at most ``max_skips`` in a row, the first ``retention`` of the steps computed)."""

from __future__ import annotations

import pytest
import torch

from tools.fidelity.dit_peers import MagCache


def plan(ratios: list[float], threshold: float, steps: int | None = None) -> str:
    """The run's calls as F (computed) and . (skipped)."""
    cache = MagCache(keys=[], ratios=ratios, threshold=threshold)
    steps = steps or len(ratios)
    state = {"residual": None, "ratio": 1.0, "error": 0.0, "skips": 0, "steps": steps}
    shape = torch.Size([1, 4, 8])
    marks = ""
    for step in range(steps):
        state["step"] = step
        skip = cache._decide(state, shape)
        if not skip:
            state["residual"] = torch.zeros(shape)  # a computed call renews the residual
        marks += "." if skip else "F"
    return marks


def test_flat_ratios_skip_three_in_a_row_after_the_retained_start():
    # 10 steps: steps 0-1 (the first 20%) computed; then three skips, one computed call, and so on.
    assert plan([1.0] * 10, threshold=0.06) == "FF...F...F"


def test_a_fast_moving_step_is_computed():
    ratios = [1.0, 1.0, 1.1, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    # Step 2 moves by 10%: over the threshold at once, so it runs; the flat steps after it skip as before.
    assert plan(ratios, threshold=0.06) == "FFF...F..."
    # A looser threshold lets it be skipped, but the accumulated ratio stays 1.1 after it, so every skip adds 0.1:
    # the third call in a row (error 0.3) runs.
    assert plan(ratios, threshold=0.24) == "FF..F...F."


def test_errors_accumulate_over_skipped_steps():
    # A steady 3% drift: 0.03, then 0.03 + 0.0609 = 0.091 (over 0.06) at the second skip.
    assert plan([1.0] + [1.03] * 9, threshold=0.06) == "FF.F.F.F.F"


def test_ratios_are_read_at_the_same_share_of_a_longer_run():
    cache = MagCache(keys=[], ratios=[1.0, 1.2, 1.0], threshold=0.1)
    assert cache.ratio_at(1, 3) == 1.2
    assert cache.ratio_at(2, 5) == pytest.approx(1.2)  # the middle of five steps is the middle of three
    assert cache.ratio_at(1, 5) == pytest.approx(1.1)
