"""A/B pairs: every row timed right next to its own unpatched row, repeated until stable or out of time.

A machine's speed drifts (turbo, heat, a neighbour starting, a virtual machine's steal), often by more than the
effect measured. Two calls made one right after the other see nearly the same machine, so each row is timed in
pairs with its own baseline (tomesd's with the ldm UNet, every other row's with ComfyUI's UNet), and its
speed-up is the median of the pairs' ratios, not the ratio of two medians taken minutes apart. Within a round
the pairs are rotated and the order inside a pair alternates, so neither the first place nor the second gains.

Every row first gets ``min_repeats`` pairs at every size; then, while a row's speed-up still has a spread above
the limit (``bench_measure.spread_pct``), only such rows get more pairs, for as long as the next round fits in
the time left. Each pair also records what other processes took of the CPU meanwhile (``bench_load``).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tqdm import tqdm

from tools.common.measure import clocked, spread_pct

from . import load as bench_load


@dataclass
class Series:
    """Everything timed for one row at one size."""

    wall_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)
    ratio_wall: list[float] = field(default_factory=list)  # baseline time / row time, one per pair
    ratio_cpu: list[float] = field(default_factory=list)
    busy: list[tuple[float, float]] = field(default_factory=list)  # (seconds, cores others used) per pair

    def others_cores(self) -> float | None:
        seconds = sum(s for s, _ in self.busy)
        return sum(s * c for s, c in self.busy) / seconds if seconds > 0 else None


@dataclass
class Block:
    """The rows and inputs of one size, with their warm-up times (the first cost estimate)."""

    label: str
    rows: list
    inputs: dict
    warm_s: dict[str, float]
    series: dict[str, Series] = field(default_factory=dict)
    rounds: int = 0

    def __post_init__(self):
        self.series = {row.name: Series() for row in self.rows}
        self.base = {row.host: row for row in self.rows if row.group == "unpatched"}
        self.paired = [row for row in self.rows if row.group != "unpatched" and row.host in self.base]

    def cost(self, row) -> float:
        """Expected seconds of one call: the median so far, else the warm-up (an overestimate: first call)."""
        done = self.series[row.name].wall_s
        return statistics.median(done) if done else self.warm_s.get(row.name, 1.0)

    def pair_cost(self, row) -> float:
        return self.cost(row) + self.cost(self.base[row.host])

    def unstable(self, limit_pct: float) -> list:
        """Rows whose speed-up spread is above the limit (or unknown: fewer than two pairs)."""
        out = []
        for row in self.paired:
            spread = spread_pct(self.series[row.name].ratio_wall)
            if spread is None or spread > limit_pct:
                out.append(row)
        return out


def _round(block: Block, rows: list, planned: dict[str, float], call: Callable, device, bar, log) -> None:
    """One pair per row. The bar counts expected seconds, each pair by the estimate it had when its round was
    added to the bar's total, so the bar ends at its total; tqdm's average rate (expected seconds done per
    second) then corrects the time left when the machine is slower than the estimates."""
    shift = block.rounds % len(rows) if rows else 0
    for row in rows[shift:] + rows[:shift]:
        base = block.base[row.host]
        # Alternate per row, from one of its pairs to the next: baseline first, then the row first.
        order = (base, row) if len(block.series[row.name].ratio_wall) % 2 == 0 else (row, base)
        start = bench_load.Mark.now()
        measured = {}
        for one in order:
            wall, cpu, _ = clocked(lambda one=one: call(one, block.inputs), device)
            measured[one.name] = (wall, cpu)
        load = bench_load.between(start, bench_load.Mark.now())
        for one in order:
            series = block.series[one.name]
            series.wall_s.append(measured[one.name][0])
            series.cpu_s.append(measured[one.name][1])
            if load.others_cores is not None:
                series.busy.append((load.seconds, load.others_cores))
        (base_wall, base_cpu), (wall, cpu) = measured[base.name], measured[row.name]
        block.series[row.name].ratio_wall.append(base_wall / wall)
        if cpu > 0:
            block.series[row.name].ratio_cpu.append(base_cpu / cpu)
        bar.update(min(planned[row.name], max(0.0, bar.total - bar.n)))  # no rounding error past the total
    block.rounds += 1
    figures = []
    for row in rows:
        ratios = block.series[row.name].ratio_wall
        spread = spread_pct(ratios)
        figures.append(f"{row.name} {statistics.median(ratios):.2f}x" + ("" if spread is None else f" ±{spread:.0f}%"))
    log(f"  {block.label} px, round {block.rounds}: " + ", ".join(figures))


def run(
    blocks: list[Block],
    call: Callable,
    device,
    *,
    min_repeats: int,
    spread_limit_pct: float,
    deadline: float,
) -> dict:
    """Minimum rounds at every size, then extra rounds of the unstable rows while they fit before ``deadline``
    (a ``time.perf_counter`` value). Returns how the timing went: rounds, seconds, why it stopped, the load."""
    started, start_mark = time.perf_counter(), bench_load.Mark.now()
    first = {block.label: {row.name: block.pair_cost(row) for row in block.paired} for block in blocks}
    bar = tqdm(
        total=sum(sum(costs.values()) for costs in first.values()) * min_repeats,
        desc="timed pairs",
        file=sys.stderr,
        mininterval=2.0,
        smoothing=0.0,  # the average rate over the whole run: pairs of different sizes take very different times
        bar_format="{desc}: {percentage:3.0f}%|{bar:20}| {elapsed} elapsed, about {remaining} left{postfix}",
    )

    def say(message: str) -> None:  # a log line above the bar, which stays at the bottom
        bar.write(message, file=sys.stderr)

    try:
        for _ in range(min_repeats):
            for block in blocks:
                if block.paired:
                    bar.set_postfix_str(f"{block.label} px round {block.rounds + 1}")
                    _round(block, block.paired, first[block.label], call, device, bar, say)
        stopped = "stable"
        while True:
            todo = [(block, block.unstable(spread_limit_pct)) for block in blocks]
            todo = [(block, rows) for block, rows in todo if rows]
            if not todo:
                break
            ran = False
            for block, rows in todo:
                costs = {row.name: block.pair_cost(row) for row in rows}
                left = deadline - time.perf_counter()
                if sum(costs.values()) > left:
                    continue
                bar.total += sum(costs.values())
                rows_text = f"{len(rows)} row{'s' if len(rows) > 1 else ''}"
                bar.set_postfix_str(
                    f"{block.label} px: {rows_text} above ±{spread_limit_pct:g}%, {left / 60:.0f} min of budget left"
                )
                _round(block, rows, costs, call, device, bar, say)
                ran = True
            if not ran:
                stopped = "time limit"
                break
    finally:
        bar.close()
    return {
        "seconds": round(time.perf_counter() - started, 1),
        "rounds": {block.label: block.rounds for block in blocks},
        "stopped": stopped,
        "load": bench_load.between(start_mark, bench_load.Mark.now()),
    }
