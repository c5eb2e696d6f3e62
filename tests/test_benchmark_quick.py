"""The main command's quick run, end to end on a tiny UNet and a two-step picture: both parts run, the summary
names every row of both, and the side-by-side picture is written. Nothing here looks at timings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tools.bench import quick

ROOT = Path(__file__).resolve().parent.parent


def test_quick_run_answers_speed_and_picture(tmp_path):
    flags = ["--model", "tiny", "--resolution", "64", "--max-minutes", "0", "--steps", "2", "--out", str(tmp_path)]
    command = [sys.executable, "-m", "tools.bench", *flags]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = done.stdout[done.stdout.index("How much faster") :]
    for name in quick.SPEED_ROWS + quick.PICTURE_ROWS:
        assert name in summary
    assert "SSIM" in summary
    # The verdict line follows the speed part's own verdict (whichever it is: it depends on the machine's noise).
    reliable = json.loads((tmp_path / "benchmark-tiny.json").read_text())["reliable"]
    assert ("Speed figures reliable." in summary) is reliable
    assert ("Speed figures UNRELIABLE" in summary) is not reliable
    assert (tmp_path / "fidelity-grid-ref-sd1.png").stat().st_size > 0
