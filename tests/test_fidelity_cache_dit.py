"""cache-dit's fixed plans as a peer row (``tools/fidelity/dit_peers.cache_dit_plan``): which steps each policy
computes, as cache-dit's ``steps_mask`` builds them (CALIBRATIONS.md section 5 gives its 28-step masks)."""

from __future__ import annotations

import pytest

from tools.fidelity.dit_peers import CACHE_DIT_PLANS, cache_dit_plan


def runs(spaced: str) -> str:
    """A plan written as its runs of computed (1) and cached (0) steps, spaces between them."""
    return spaced.replace(" ", "")


def marks(policy: str, steps: int) -> str:
    return "".join("1" if computed else "0" for computed in cache_dit_plan(policy, steps))


def test_the_28_step_plans_are_cache_dits_masks():
    assert marks("slow", 28) == runs("11111111 0 111 00 111 00 11 00 1 000 1")
    assert marks("medium", 28) == runs("111111 0 11 000 11 000 11 000 11 000 1")
    assert marks("fast", 28) == runs("111111 0 1 000 1 0000 1 00000 1 0000 1")
    assert marks("ultra", 28) == runs("1111 00 1 00000 1 000000 1 0000000 1")
    assert [sum(cache_dit_plan(p, 28)) for p in CACHE_DIT_PLANS] == [18, 15, 11, 8]


@pytest.mark.parametrize("steps", [10, 12, 16, 20, 27, 29, 40, 50, 80])
@pytest.mark.parametrize("policy", list(CACHE_DIT_PLANS))
def test_every_length_starts_computed_and_ends_computed(policy, steps):
    plan = cache_dit_plan(policy, steps)
    assert len(plan) == steps
    assert plan[0] and plan[1] and plan[-1]  # every plan runs its first steps and its last in full
    assert 0 < sum(plan) < steps


def test_shorter_runs_cut_the_end_and_longer_ones_stretch_every_run():
    # 20 steps: the 28-step plan loses steps from its end, a cached one and a computed one in turn, so the fast
    # plan keeps its start and ends in one long cached stretch, the last step computed.
    assert marks("fast", 20) == runs("111111 0 1") + "0" * 11 + "1"
    # 50 steps: the computed start grows with the run (8 -> 22 on the slow plan), the share computed stays near
    # the 28-step plan's.
    slow = cache_dit_plan("slow", 50)
    assert slow[:22] == [True] * 22 and not slow[22]
    assert abs(sum(slow) / 50 - 18 / 28) < 0.15


def test_runs_shorter_than_its_plans_are_refused():
    with pytest.raises(ValueError, match="from 10 steps"):
        cache_dit_plan("fast", 8)
