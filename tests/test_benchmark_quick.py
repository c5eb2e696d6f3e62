"""The main command's quick run, end to end on a tiny UNet and a short picture run: every part runs, the summary
has a line per row with a speed and an SSIM, the whole-run conversion follows the calls each row computed, and the
side-by-side picture is written. Nothing here looks at timings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools.bench import quick

ROOT = Path(__file__).resolve().parent.parent


def test_quick_run_answers_speed_and_picture(tmp_path):
    flags = ["--model", "tiny", "--resolution", "64", "--max-minutes", "0", "--steps", "12", "--prompts", "2"]
    flags += ["--out", str(tmp_path)]  # two prompts (FD needs two): the picture part's plumbing, not its figures
    command = [sys.executable, "-m", "tools.bench", *flags]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = done.stdout[done.stdout.index("How much faster") :]
    for label in quick.LABELS.values():
        assert any(line.strip().startswith(label) and line.rstrip().endswith(")") for line in summary.splitlines())
    run = json.loads((tmp_path / "quick.json").read_text())
    assert set(run["rows"]) == set(quick.LABELS)
    # Unpatched against its own picture: SSIM is 1 up to float32 rounding in the library's means and variances.
    assert run["rows"]["unpatched"]["ssim"] == pytest.approx(1.0, abs=1e-6)
    assert run["rows"]["unpatched"]["speedup"] == 1.0
    default = run["rows"][quick.DEFAULT_ROW]
    # 12 Euler steps under "forecast": the first 2, every second after them, the last 3 reach the UNet.
    assert (default["full_steps"], default["calls"]) == (8, pytest.approx(8 / 12))
    todo = run["rows"][quick.TODO_ROW]["speedup"]
    assert abs(default["speedup"] - todo * 12 / 8) < 1e-9
    for peer in (quick.EASYCACHE_ROW, quick.SPECTRUM_ROW):
        assert abs(run["rows"][peer]["speedup"] - 1 / run["rows"][peer]["calls"]) < 1e-9
    assert run["rows"][quick.SPECTRUM_ROW]["calls"] == pytest.approx(10 / 12)  # Neo's plan: 10 of 12
    # The verdict line follows the speed part's own verdict (whichever it is: it depends on the machine's noise).
    reliable = json.loads((tmp_path / "benchmark-tiny.json").read_text())["reliable"]
    assert ("Speed figures reliable." in summary) is reliable
    assert ("Speed figures UNRELIABLE" in summary) is not reliable
    assert (tmp_path / "fidelity-grid-ref-sd1.png").stat().st_size > 0
