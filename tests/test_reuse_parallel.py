"""The engine's vote (``LayerReuseRun`` with an ``Agreement``) against a stand-in for one other process: what it
says is added to this process's evidence, as the all-reduce does."""

from __future__ import annotations

import logging

import torch

from tome_core.reuse import LayerReuseRun, NoiseSpacedSchedule

STEPS = 12
FULL = NoiseSpacedSchedule(3).for_run(STEPS).full


class OtherProcess:
    """The group's totals: this process's evidence plus ``theirs(call)`` (full, down, four guard sums)."""

    def __init__(self, theirs):
        self.theirs = theirs
        self.votes = []

    def totals(self, evidence: torch.Tensor) -> list[float]:
        mine = evidence.tolist()
        self.votes.append(mine)
        return [a + b for a, b in zip(mine, self.theirs(len(self.votes) - 1), strict=True)]


def sampled(other, run=None, streams=lambda step: {"img": torch.full((1, 4, 8), 1.0 + 0.01 * step)}, last=None):
    """Every step of a run through ``span_block`` (one block: first and last); the steps that reused."""
    run = run or LayerReuseRun(NoiseSpacedSchedule(3).for_run(STEPS), STEPS, 1)
    run.agreement = other
    reused = []
    for step in range(STEPS):
        run.begin_call(step, "layout", position=1.0 - step / STEPS)
        given = streams(step)
        out = {"img": given["img"] + 1.0} if isinstance(given["img"], torch.Tensor) else given
        run.span_block(True, True, given, lambda o=out: o, (last or (lambda o: o)))
        reused.append(step) if run.reused_calls > len(reused) else None
        run.end_call()
    return run, reused


def test_every_call_is_voted_on_and_one_process_that_cannot_reuse_makes_all_full():
    agreeing = OtherProcess(lambda call: [0.0] * 6)
    run, reused = sampled(agreeing)
    assert reused == [step for step in range(STEPS) if step not in FULL] and len(agreeing.votes) == STEPS
    refusing = OtherProcess(lambda call: [1.0 if call == 2 else 0.0, 0, 0, 0, 0, 0])
    run, reused_now = sampled(refusing)
    assert 2 in reused and reused_now == [step for step in reused if step != 2]


def test_one_process_that_stands_down_makes_the_group_stand_down_and_the_votes_end(caplog):
    other = OtherProcess(lambda call: [0.0, 1.0 if call >= 5 else 0.0, 0, 0, 0, 0])
    with caplog.at_level(logging.WARNING, logger="tome_patch"):
        run, reused = sampled(other)
    assert run.stood_down is not None and "another process" in run.stood_down
    assert len(other.votes) == 6 and reused == [1, 2, 3]
    assert caplog.text.count("stands down for this run") == 1


def test_a_process_that_stood_down_alone_keeps_voting_until_the_group_does():
    """A stream it cannot join in a block's output (its last block) is told to the others at the next call."""
    joined = OtherProcess(lambda call: [0.0] * 6)
    bad = lambda out: {"img": {"video": out["img"]}}  # noqa: E731
    run, reused = sampled(joined, last=lambda out: bad(out) if len(joined.votes) == 5 else out)  # step 4: full
    assert 4 in FULL and reused == [1, 2, 3]
    assert len(joined.votes) == 6 and joined.votes[5][1] == 1.0  # the next call votes its stand-down, the last vote


def test_the_guards_decide_on_the_groups_sums_not_on_one_process():
    """This process's 32 values move 10% at each reusing step (past a 7% guard); the other's 32 do not: 5% together."""
    scheduled = [step for step in range(STEPS) if step not in FULL]

    def guarded(other):
        run = LayerReuseRun(NoiseSpacedSchedule(3).for_run(STEPS), STEPS, 1, first_block_guard=0.07)
        return sampled(other, run, streams=lambda step: {"img": torch.full((1, 4, 8), 1.0 if step in FULL else 1.1)})

    alone, _ = guarded(None)
    together, reused = guarded(OtherProcess(lambda call: [0.0, 0.0, 0.0, 32.0, 0.0, 32.0]))
    assert alone.guarded_calls > 0 and together.guarded_calls == 0 and reused == scheduled
    moved_too, _ = guarded(OtherProcess(lambda call: [0.0, 0.0, 3.2, 32.0, 3.2, 32.0]))
    assert moved_too.guarded_calls == alone.guarded_calls
