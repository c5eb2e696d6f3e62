"""The benchmark's whole code path, end to end, on a tiny model: rows, pairs, verdict, table, JSON and chart.

It runs in a subprocess, because the benchmark configures ComfyUI (CPU, SDPA attention) before importing it,
which must not leak into the other tests. Nothing here looks at timings.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_benchmark(out: Path, *flags: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "tools.bench.speed", "--out", str(out), *flags]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_benchmark_smoke_on_a_tiny_model(tmp_path):
    flags = ("--model", "tiny", "--resolutions", "64,96x64", "--repeats", "1", "--steps", "1", "--engine-repeats", "1")
    done = run_benchmark(tmp_path, *flags, "--max-minutes", "0", "--chart", str(tmp_path / "copy.png"))
    assert done.returncode == 0, done.stderr[-3000:]

    report = json.loads((tmp_path / "benchmark-tiny.json").read_text())
    # One pair per row gives no spread: the run must say it cannot be trusted, first thing, and why.
    assert report["reliable"] is False
    assert any(reason.startswith("speed-up spread above ±5% at the end:") for reason in report["unreliable_reasons"])
    assert done.stdout.startswith("UNRELIABLE: ") and "(1 pair)" in done.stdout.splitlines()[0]
    assert report["measurement"]["speedup_clock"] == "wall" and set(report["measurement"]["clocks"]) == {"wall", "cpu"}
    assert report["measurement"]["rounds"] == {"64": 1, "96x64": 1}  # --max-minutes 0: the minimum only
    assert {"at_start", "during"} <= set(report["machine_load"])
    assert {"cpu", "device", "date"} <= set(report["machine"])
    assert report["versions"]["torch"] and report["versions"]["tomesd"] == "0.1.3"
    assert report["versions"]["comfyui"] == "0.3.75"
    assert [block["resolution"] for block in report["resolutions"]] == ["64", "96x64"]
    names = [row["row"] for row in report["resolutions"][0]["rows"]]
    for expected in (
        "unpatched",
        "ours ToMe 0.3",
        "ours ToMe 0.5",
        "ours ToDo 2",
        "ComfyUI TomePatchModel 0.5",
        "unpatched (ldm UNet)",
        "tomesd 0.5",
        "ToDo reference 2",
        "ceiling",
        "ours ToMe block 0.5 levels<=2",
        "ours ToMe 0.5 levels<=2",
        "tomesd 0.5 +crossattn+mlp levels<=2",
    ):
        assert expected in names
    for block in report["resolutions"]:
        for row in block["rows"]:
            assert row["median_s"] > 0 and row["speedup"] > 0 and row["cpu_median_s"] > 0
            assert row["deviation_unet"] >= 0
            if row["group"] == "unpatched":
                assert row["speedup"] == 1.0  # by definition; its time is that of all its pairs
                assert row["pairs"] == len(row["times_s"]) >= 1
            else:
                assert row["pairs"] == 1 and len(row["ratios_wall"]) == 1 and row["speedup_spread_pct"] is None
                assert row["speedup"] == row["ratios_wall"][0] and "spread" in row["unreliable"]
    by_name = {row["row"]: row for row in report["resolutions"][0]["rows"]}
    # The ldm UNet carries the very same weights: it computes what ComfyUI's UNet computes.
    assert by_name["unpatched"]["deviation_unet"] == 0.0
    assert by_name["ceiling"]["deviation_unet"] > 0  # the oracle really replaced attention
    assert set(report["sampling"]["deviation"]) >= {"unpatched", "ours ToMe 0.5", "tomesd 0.5"}
    assert report["engine"] and report["engine"][0]["plan_s"] > 0

    table = (tmp_path / "benchmark-tiny.md").read_text()
    assert "| 64 | ours ToMe 0.5 |" in table and "| 96x64 | ceiling |" in table
    assert "| 64 | ours ToMe 0.5 |" in done.stdout and "speed-up (CPU)" in done.stdout
    for chart in (tmp_path / "benchmark-tiny.png", tmp_path / "copy.png"):
        assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_forced_rows_reduce_even_tiny_grids(tmp_path):
    flags = ("--model", "tiny-xl", "--resolutions", "64", "--repeats", "1", "--steps", "0", "--engine-repeats", "0")
    done = run_benchmark(tmp_path, *flags, "--max-minutes", "0", "--force", "--only", "ours")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "benchmark-tiny-xl.json").read_text())
    assert report["levels"] == [2]  # SDXL layout: the finest level with attention
    rows = {row["row"]: row for row in report["resolutions"][0]["rows"]}
    assert set(rows) == {
        "unpatched",
        "ours ToMe 0.3 forced",
        "ours ToMe 0.5 forced",
        "ours ToDo 2 forced",
        "ours ToMe block 0.5 levels<=4 forced",  # SDXL layout: levels 2 and 4
        "ours ToMe 0.5 levels<=4 forced",
    }
    assert all(rows[name]["deviation_unet"] > 0 for name in rows if name != "unpatched")


def test_diffusers_host_rows(tmp_path):
    """``--host diffusers``: diffusers' own UNet2DConditionModel, rows unpatched, ours and tomesd on shared weights."""
    flags = ("--host", "diffusers", "--model", "tiny-xl", "--resolutions", "64", "--repeats", "1", "--steps", "1")
    done = run_benchmark(tmp_path, *flags, "--max-minutes", "0", "--force")  # the pairs asked for, no more
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "benchmark-diffusers-tiny-xl.json").read_text())
    assert report["config"]["host"] == "diffusers" and report["versions"]["diffusers"]
    assert report["levels"] == [2]
    rows = {row["row"]: row for row in report["resolutions"][0]["rows"]}
    assert set(rows) == {
        "unpatched",
        "ours ToMe 0.3 forced",
        "ours ToMe 0.5 forced",
        "ours ToDo 2 forced",
        "tomesd 0.5",
    }
    assert all(row["host"] == "diffusers" and row["median_s"] > 0 for row in rows.values())
    assert rows["unpatched"]["deviation_unet"] == 0.0
    assert all(rows[name]["deviation_unet"] > 0 for name in rows if name != "unpatched")
    assert set(report["sampling"]["deviation"]) == set(rows)
    assert "engine" not in report  # host-independent: measured on the ComfyUI path
    assert f"diffusers {report['versions']['diffusers']}" in (tmp_path / "benchmark-diffusers-tiny-xl.md").read_text()
