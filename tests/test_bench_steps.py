"""The whole-run step benchmark (``tools.bench.unet.steps``) on a tiny UNet: its conversion and the peers' rows.

In a subprocess, as the other benchmark tests: the benchmark configures ComfyUI before importing it. Nothing here
looks at timings, only at how the rows are counted and converted.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_steps(*flags: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "tools.bench.unet.steps", *flags]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)


def fidelity_json(tmp_path):
    """A fidelity result with the rows the benchmark converts (step caches) and one it must leave out."""
    records = [
        {"row": "unpatched", "work": {"call_share": 1.0}},
        {"row": "EasyCache 0.2", "work": {"call_share": 0.6}},
        {"row": "ours ToDo 2 + EasyCache 0.2", "work": {"call_share": 0.64}},
        {"row": "ours reuse every 3 + EasyCache 0.2", "work": {"call_share": 0.44}},
    ]
    path = tmp_path / "fidelity.json"
    path.write_text(json.dumps({"model": "ref-sd1", "settings": {"steps": 25}, "records": records}))
    return path


def test_converts_the_schedule_and_the_peers(tmp_path):
    flags = ["--model", "tiny", "--resolution", "64", "--steps", "12", "--threads", "1", "--cpu-time"]
    flags += ["--only", "ToDo 2", "--convert", "25", "--peers", str(fidelity_json(tmp_path)), "--out", str(tmp_path)]
    done = run_steps(*flags)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "steps-tiny-64.json").read_text())
    rows, peers = result["rows"], result["peers"]
    assert set(rows) == {"unpatched", "ToDo 2", "ToDo 2 + reuse every 2", "ToDo 2 + reuse every 3"}
    # The run's own count of reusing calls follows the fixed schedule: 12 steps, 3 full at the start, 4 at the end,
    # one in two between them (a short run).
    assert rows["ToDo 2 + reuse every 3"]["converted"]["12"]["full_steps"] == 9
    assert rows["ToDo 2 + reuse every 3"]["reusing_calls"] == 12 - 9
    # From 25 steps the tiny SD1.5-layout UNet's family plan: 12 full steps of 25.
    assert rows["ToDo 2 + reuse every 3"]["converted"]["25"]["full_steps"] == 12
    assert rows["ToDo 2"]["reusing_calls"] == 0
    # Peers: a computed call costs a step of the row it follows, a skipped one nothing; reuse under a cache is left out.
    assert set(peers) == {"EasyCache 0.2", "ours ToDo 2 + EasyCache 0.2"}
    base = rows["unpatched"]["full_call_s"]
    assert peers["EasyCache 0.2"]["speedup"] == pytest.approx(1 / 0.6)
    assert peers["ours ToDo 2 + EasyCache 0.2"]["speedup"] == pytest.approx(
        base / (0.64 * rows["ToDo 2"]["full_call_s"])
    )
    assert "EasyCache 0.2 | 0.60 | 1.67x at 25 steps" in (tmp_path / "steps-tiny-64.md").read_text()


def test_peers_need_the_row_they_follow(tmp_path):
    flags = ["--model", "tiny", "--resolution", "64", "--steps", "4", "--threads", "1", "--only", "reuse every 2"]
    flags += ["--peers", str(fidelity_json(tmp_path)), "--out", str(tmp_path)]
    done = run_steps(*flags)
    assert done.returncode != 0
    assert "needs the row 'ToDo 2'" in done.stderr
