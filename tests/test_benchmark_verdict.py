"""The benchmark's verdict rules on made-up figures: spreads, impossible orderings, a busy machine.

Pure functions of the tools (no model is built): the figures below are chosen so that each rule fires, or
does not, by a clear margin.
"""

from __future__ import annotations

import random

import pytest

from tools.bench import load as bench_load
from tools.bench import verdict as bench_verdict
from tools.common.measure import median_interval, spread_pct

LIMIT, BUSY = 5.0, 0.2


def row(name: str, group: str, speedup: float, spread: float | None, **extra) -> dict:
    low = speedup * (1 - (spread or 0) / 100)
    high = speedup * (1 + (spread or 0) / 100)
    record = {"row": name, "group": group, "host": "comfy", "speedup": speedup, "speedup_spread_pct": spread}
    return record | {"speedup_low": low, "speedup_high": high} | extra


def report(rows: list[dict], at_start: float = 0.02, during: float = 0.05) -> dict:
    def load(cores):
        return {"others_cores": cores, "steal_cores": 0.0, "cores": 2}

    return {
        "levels": [1],
        "resolutions": [{"resolution": "512", "rows": [row("unpatched", "unpatched", 1.0, 0.0), *rows]}],
        "machine_load": {"at_start": load(at_start), "during": load(during)},
    }


def quiet_rows() -> list[dict]:
    return [row("ours ToMe 0.5", "ours", 1.10, 2.0), row("ceiling", "ceiling", 1.25, 3.0)]


def test_a_quiet_stable_run_is_reliable_and_nothing_is_marked():
    made_up = report(quiet_rows())
    assert bench_verdict.judge(made_up, LIMIT, BUSY) == []
    assert not any("unreliable" in r for r in made_up["resolutions"][0]["rows"])


def test_the_ceiling_slower_than_unpatched_is_an_impossible_ordering():
    # The figures of a run disturbed by a neighbour: ceiling 0.54x, with a spread that still cannot reach 0.95x.
    made_up = report([row("ours ToMe 0.5", "ours", 1.02, 4.0), row("ceiling", "ceiling", 0.54, 4.0)])
    reasons = bench_verdict.judge(made_up, LIMIT, BUSY)
    assert len(reasons) == 1 and reasons[0].startswith(
        "impossible ordering: 512 px ceiling 0.54x slower than unpatched"
    )
    rows = {r["row"]: r for r in made_up["resolutions"][0]["rows"]}
    assert rows["ceiling"]["unreliable"] == ["ordering"]
    assert "unreliable" not in rows["unpatched"]


def test_a_row_faster_than_the_ceiling_that_bounds_it_is_flagged_beyond_the_noise_only():
    beyond = report([row("ours ToDo 2", "ours", 1.60, 3.0), row("ceiling", "ceiling", 1.30, 3.0)])
    reasons = bench_verdict.judge(beyond, LIMIT, BUSY)
    assert reasons == ["impossible ordering: 512 px ceiling 1.30x slower than ours ToDo 2 1.60x"]
    within = report([row("ours ToDo 2", "ours", 1.33, 3.0), row("ceiling", "ceiling", 1.30, 3.0)])
    assert bench_verdict.judge(within, LIMIT, BUSY) == []  # 1.30 +3% reaches 1.33 -3% minus the 5% margin


def test_rows_the_ceiling_does_not_bound_are_not_compared_with_it():
    # A row that also reduces the MLP, or reduces deeper levels, may legitimately beat the ceiling.
    rows = [
        row("ours block", "ours", 1.60, 3.0, settings={"scope": "block"}),
        row("tomesd mlp", "peer", 1.60, 3.0, settings={"ratio": 0.5, "merge_mlp": True}),
        row("ours levels 1-4", "ours", 1.60, 3.0, settings={"max_downsample": 4}),
        row("ceiling", "ceiling", 1.30, 3.0),
    ]
    assert bench_verdict.judge(report(rows), LIMIT, BUSY) == []
    assert bench_verdict.ceiling_bounds(row("tomesd 0.5", "peer", 1.1, 1.0, settings={"max_downsample": 1}), [1])
    assert not bench_verdict.ceiling_bounds(row("unpatched", "unpatched", 1.0, 0.0), [1])


def test_spreads_above_the_limit_and_single_pairs_are_reasons_and_marks():
    rows = [row("ours ToMe 0.5", "ours", 1.10, 12.0), row("ours ToDo 2", "ours", 1.2, None), *quiet_rows()[1:]]
    made_up = report(rows)
    reasons = bench_verdict.judge(made_up, LIMIT, BUSY)
    assert reasons == ["speed-up spread above ±5% at the end: 512 px ours ToMe 0.5 ±12%, 512 px ours ToDo 2 (1 pair)"]
    marked = [r["row"] for r in made_up["resolutions"][0]["rows"] if r.get("unreliable") == ["spread"]]
    assert marked == ["ours ToMe 0.5", "ours ToDo 2"]


@pytest.mark.parametrize(("at_start", "during", "expected"), [(0.9, 0.05, "at the start"), (0.02, 0.6, "during")])
def test_a_busy_machine_is_a_reason(at_start, during, expected):
    reasons = bench_verdict.judge(report(quiet_rows(), at_start, during), LIMIT, BUSY)
    assert len(reasons) == 1 and f"machine busy {expected}" in reasons[0] and "(limit 0.2 cores)" in reasons[0]


def test_others_cpu_use_does_not_count_this_process():
    # 2 cores for 1 s: 1.5 CPU-seconds busy, of which this process took 1.2: others took 0.3 cores.
    start = bench_load.Mark(wall=10.0, busy=100.0, total=400.0, steal=1.0, own=5.0)
    end = bench_load.Mark(wall=11.0, busy=101.5, total=402.0, steal=1.1, own=6.2)
    load = bench_load.between(start, end, cores=2)
    assert load.others_cores == pytest.approx(0.3) and load.steal_cores == pytest.approx(0.1)
    assert load.own_cores == pytest.approx(1.2) and load.busy(0.2) and not load.busy(0.5)
    # Own work alone is no load, whatever the load average says.
    alone = bench_load.Mark(wall=11.0, busy=102.0, total=402.0, steal=1.0, own=7.0)
    assert bench_load.between(start, alone, cores=2).others_cores == 0.0


def test_a_spread_is_the_range_for_few_values_then_narrows_as_values_accumulate():
    assert spread_pct([1.0]) is None
    assert spread_pct([1.0, 1.2]) == pytest.approx(100 * 0.1 / 1.1)
    generator = random.Random(0)
    values = [generator.gauss(1.0, 0.05) for _ in range(160)]
    assert median_interval(values[:5]) == (min(values[:5]), max(values[:5]))
    spreads = [spread_pct(values[:n]) for n in (10, 40, 160)]
    assert spreads[0] > spreads[1] > spreads[2] > 0
    assert spreads[-1] < spread_pct(values[:5])
