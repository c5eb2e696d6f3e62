"""Reuse across steps under diffusers' context parallelism: two gloo processes on the CPU (``hosts/parallel_dits.py``).
They must decide as one process, call by call, and compute its latents up to float32 summed in another order: at most
1.2e-6 measured, where one call decided otherwise moves them by 0.15 (Wan, 20 steps); the tolerance 1e-5 lies between.
"""

from __future__ import annotations

import pytest
import torch
from hosts import parallel_dits as P

REUSE = {"dit_settings": "as set", "reuse_interval": 3}
TODO = {**REUSE, "downsample_factor": 2, "skip_when_slower": False}
_REUSE = {"settings": REUSE}
SCENARIOS = [
    ("wan", {"scenario": "patched", **_REUSE}),
    (
        "qwen-image, patched first",
        {"scenario": "patched", "family": "qwen-image", "order": "before", "settings": REUSE},
    ),
    ("flux, its default", {"scenario": "patched", "family": "flux"}),
    ("wan, ring", {"scenario": "patched", "mode": "ring", **_REUSE}),
    ("guard", {}),
    ("todo", {"scenario": "patched", "settings": TODO, "alone": False}),
    ("todo, patched first", {"scenario": "patched", "order": "before", "settings": TODO, "alone": False}),
    ("failing", {}),  # last: it breaks the group
]
PATCHED = [name for name, options in SCENARIOS if options.get("scenario") == "patched"]
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return P.spawn(2, SCENARIOS, tmp_path_factory.mktemp("parallel"))


def test_every_process_ran_every_scenario(ranks):
    for rank in ranks:
        assert "error" not in rank, rank.get("error")
        assert rank["several_processes"]
        assert all(name in rank for name, _ in SCENARIOS)


@pytest.mark.parametrize("name", [n for n in PATCHED if not n.startswith("todo")])
def test_the_parallel_run_decides_and_computes_as_one_process(ranks, name):
    first, second = (rank[name] for rank in ranks)
    single = first["single"]
    assert first["decisions"] == second["decisions"] == single["decisions"]
    assert 0 < first["computed"] < len(first["decisions"])  # it reused
    assert torch.equal(first["patched"], second["patched"])
    torch.testing.assert_close(first["patched"], single["patched"], **TOLERANCE)


@pytest.mark.parametrize("name", PATCHED)
def test_each_process_keeps_its_shard_and_removal_restores_it(ranks, name):
    single = ranks[0][name].get("single") or ranks[0]["wan"]["single"]  # ToDo's runs: Wan's, without ToDo
    ((tokens, width),) = {shape[1:] for shape in single["recorded"]}
    for rank in ranks:
        assert rank[name]["recorded"] == [(1, tokens // 2, width)]
        assert rank[name]["leftovers"] == []
        if "plain" in rank[name]:
            assert torch.equal(rank[name]["removed"], rank[name]["plain"])


def test_a_guard_that_one_shard_alone_would_fire_is_decided_together(ranks):
    first, second = (rank["guard"] for rank in ranks)
    (mine, yours), whole, threshold = first["ratios"], first["whole"], first["threshold"]
    assert mine > threshold > whole > yours
    assert first["decisions"] == second["decisions"] == first["single"]["decisions"]
    assert first["guarded"] == second["guarded"] == first["single"]["guarded"] > 0
    torch.testing.assert_close(first["patched"], first["single"]["patched"], **TOLERANCE)


def test_todo_is_left_out_under_parallelism_with_one_log_line(ranks):
    for rank in ranks:
        for name in ("todo", "todo, patched first"):
            assert torch.equal(rank[name]["patched"], rank["wan"]["patched"])
            assert sum("ToDo is left out under context parallelism" in line for line in rank[name]["log"]) == 1
    assert any("under context parallelism: 2 processes" in line for line in ranks[0]["wan"]["log"])


def test_a_failing_process_leaves_none_waiting(ranks):
    """Rank 1 raises in its first block; rank 0, waiting in the span's vote, gets an error naming why."""
    waiting, failing = (rank["failing"] for rank in ranks)
    assert failing["ended"] == "RuntimeError: a failure of rank 1's own"
    assert waiting["ended"].startswith("RuntimeError: ToMe reuse across steps: process 0 of 2")
    assert waiting["waited"] < P.GROUP_TIMEOUT_S + 10
