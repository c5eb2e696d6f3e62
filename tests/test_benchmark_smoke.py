"""The benchmark's whole code path, end to end, on a tiny model: rows, table, JSON and chart are produced.

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
    command = [sys.executable, "-m", "tools.benchmark", "--out", str(out), *flags]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_benchmark_smoke_on_a_tiny_model(tmp_path):
    flags = ("--model", "tiny", "--resolutions", "64,96x64", "--repeats", "1", "--steps", "1", "--engine-repeats", "1")
    done = run_benchmark(tmp_path, *flags, "--chart", str(tmp_path / "copy.png"))
    assert done.returncode == 0, done.stderr[-3000:]

    report = json.loads((tmp_path / "benchmark-tiny.json").read_text())
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
    ):
        assert expected in names
    for block in report["resolutions"]:
        for row in block["rows"]:
            assert row["median_s"] > 0 and row["speedup"] > 0
            assert row["deviation_unet"] >= 0
    by_name = {row["row"]: row for row in report["resolutions"][0]["rows"]}
    # The ldm UNet carries the very same weights: it computes what ComfyUI's UNet computes.
    assert by_name["unpatched"]["deviation_unet"] == 0.0
    assert by_name["ceiling"]["deviation_unet"] > 0  # the oracle really replaced attention
    assert set(report["sampling"]["deviation"]) >= {"unpatched", "ours ToMe 0.5", "tomesd 0.5"}
    assert report["engine"] and report["engine"][0]["plan_s"] > 0

    table = (tmp_path / "benchmark-tiny.md").read_text()
    assert "| 64 | ours ToMe 0.5 |" in table and "| 96x64 | ceiling |" in table
    assert "| 64 | ours ToMe 0.5 |" in done.stdout
    for chart in (tmp_path / "benchmark-tiny.png", tmp_path / "copy.png"):
        assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_forced_rows_reduce_even_tiny_grids(tmp_path):
    flags = ("--model", "tiny-xl", "--resolutions", "64", "--repeats", "1", "--steps", "0", "--engine-repeats", "0")
    done = run_benchmark(tmp_path, *flags, "--force", "--only", "ours")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "benchmark-tiny-xl.json").read_text())
    assert report["levels"] == [2]  # SDXL layout: the finest level with attention
    rows = {row["row"]: row for row in report["resolutions"][0]["rows"]}
    assert set(rows) == {"unpatched", "ours ToMe 0.3 forced", "ours ToMe 0.5 forced", "ours ToDo 2 forced"}
    assert all(rows[name]["deviation_unet"] > 0 for name in rows if name != "unpatched")
