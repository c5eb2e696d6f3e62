"""Can a run be trusted? The reasons it cannot, and the rows they concern.

A run is unreliable when
- the machine was busy at the start: other processes used more than the busy limit (0.2 cores by default) in
  the second before the model was built (``bench_load``: this process's own CPU time is not counted);
- the machine was busy during the timed pairs: same measure and limit, over all pairs; rows whose own pairs
  ran beside such load are marked;
- a row's speed-up still has a spread above the limit (5% by default) when the run ends (its time ran out
  before the row was stable), or has only one pair, so no spread at all;
- an ordering is impossible: the ceiling (self-attention made free at the reduced levels) is slower than the
  unpatched UNet, or slower than a row it bounds (a row that shrinks only self-attention, at those levels or
  fewer), by more than the noise: the top of the ceiling's interval is below the bottom of the other's by more
  than the spread limit. The limit is the margin because the ceiling's replace patch has a small cost of its
  own, visible where attention is cheap (tiny grids).
"""

from __future__ import annotations

from . import load as bench_load

# Settings under which a row reduces more than self-attention: the ceiling does not bound it.
_BEYOND_SELF_ATTENTION = {"merge_crossattn", "merge_mlp"}


def ceiling_bounds(record: dict, levels: list[int]) -> bool:
    """Whether the ceiling is a lower bound of this row's time: the row shrinks only self-attention, only at
    the ceiling's levels. Read from the row's ``settings`` (empty: this project's defaults, which qualify)."""
    if record["group"] not in ("ours", "peer"):
        return False
    settings = record.get("settings") or {}
    if settings.get("scope", "self-attention") != "self-attention":
        return False
    if any(settings.get(key) for key in _BEYOND_SELF_ATTENTION):
        return False
    deepest = settings.get("max_downsample")
    return deepest is None or not levels or deepest <= max(levels)


def _mark(record: dict, word: str) -> None:
    marks = record.setdefault("unreliable", [])
    if word not in marks:
        marks.append(word)


def _list(items: list[str], most: int = 4) -> str:
    shown = ", ".join(items[:most])
    return shown + (f" and {len(items) - most} more" if len(items) > most else "")


def judge(report: dict, spread_limit_pct: float, busy_limit_cores: float) -> list[str]:
    """The reasons the run is unreliable (empty: reliable); marks the rows concerned (``record["unreliable"]``)."""
    reasons = []
    load = report.get("machine_load", {})
    start = load.get("at_start") or {}
    limit = f"(limit {busy_limit_cores:g} cores)"
    if start.get("others_cores") is not None and start["others_cores"] > busy_limit_cores:
        reasons.append(f"machine busy at the start: {bench_load.describe(start)} in the second before the run {limit}")
    during = load.get("during") or {}
    if during.get("others_cores") is not None and during["others_cores"] > busy_limit_cores:
        reasons.append(f"machine busy during the timed pairs: {bench_load.describe(during)} on average {limit}")
        for block in report["resolutions"]:
            for record in block["rows"]:
                if (record.get("others_cores") or 0.0) > busy_limit_cores:
                    _mark(record, "busy")

    wide = []
    for block in report["resolutions"]:
        for record in block["rows"]:
            if record["group"] == "unpatched" or "speedup" not in record:
                continue
            spread = record.get("speedup_spread_pct")
            if spread is None or spread > spread_limit_pct:
                _mark(record, "spread")
                figure = "(1 pair)" if spread is None else f"±{spread:.0f}%"
                wide.append(f"{block['resolution']} px {record['row']} {figure}")
    if wide:
        reasons.append(f"speed-up spread above ±{spread_limit_pct:g}% at the end: {_list(wide)}")

    wrong = []
    margin = 1.0 - spread_limit_pct / 100.0
    for block in report["resolutions"]:
        ceiling = next((r for r in block["rows"] if r["group"] == "ceiling" and "speedup" in r), None)
        if ceiling is None:
            continue
        top = ceiling.get("speedup_high", ceiling["speedup"])
        where = f"{block['resolution']} px ceiling {ceiling['speedup']:.2f}x"
        if top < margin:
            wrong.append(f"{where} slower than unpatched")
            _mark(ceiling, "ordering")
        for record in block["rows"]:
            if "speedup" not in record or not ceiling_bounds(record, report.get("levels", [])):
                continue
            if top < record.get("speedup_low", record["speedup"]) * margin:
                wrong.append(f"{where} slower than {record['row']} {record['speedup']:.2f}x")
                _mark(ceiling, "ordering")
                _mark(record, "ordering")
    if wrong:
        reasons.append(f"impossible ordering: {_list(wrong)}")
    return reasons
