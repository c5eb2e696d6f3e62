"""The DiT reuse timing (``tools/bench/dit/reuse.py``) on a tiny Flux: it drives real reusing and full calls
through the project's own code and converts them over whole runs. Nothing here looks at timings."""

from __future__ import annotations

from tools.bench.dit import reuse as dit_reuse


def test_reusing_and_full_calls_are_timed_and_converted(tmp_path):
    result = dit_reuse.main(["--models", "tiny-flux", "--rounds", "1", "--out", str(tmp_path)])
    record = result["models"]["tiny-flux"]
    assert len(record["full_cpu_s"]) == len(record["reusing_cpu_s"]) == 1  # measure() checked it reused once
    assert record["runs"]["28 steps, every 3"]["full_steps"] == 10  # the DiT schedule: ceil(28 / 3)
    assert record["runs"]["28 steps, every 6"]["full_steps"] == 5
    assert record["depth"] == 57
    # The tiny model's timings are noise: only that a speed-up is given exactly when the span cost something.
    assert (record["runs"]["28 steps, every 6"]["speedup"] is not None) == record["measured"]
    assert (tmp_path / "dit-reuse.json").is_file()
