"""Smoke test of the fidelity benchmark on the committed reference models: the plumbing, and that the metrics
tell a correct patch from a broken one.

A few images and three sampling steps only: the full run is ``bash tools/bench.sh --fidelity``.
"""

from __future__ import annotations

import json

import pytest

from tools.fidelity import run as fidelity
from tools.fidelity.reference import models

pytestmark = pytest.mark.skipif(
    not (models.WEIGHTS / "ref-sd1.safetensors").exists(), reason="reference weights missing from the checkout"
)


@pytest.fixture(scope="module")
def smoke_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("fidelity")
    argv = ["--models", "ref-sd1", "--scales", "1", "--prompts", "4", "--seeds", "1", "--steps", "3"]
    argv += ["--broken", "--only", "ours ToMe 0.5,ours ToDo 2,broken", "--real", "64", "--grid", "4", "--out", str(out)]
    reports = fidelity.main(argv)
    return reports["ref-sd1"], out


def _row(report, name):
    return next(r for r in report["records"] if r["row"] == name)


def test_outputs_are_written(smoke_report):
    report, out = smoke_report
    for name in ("fidelity-ref-sd1.md", "fidelity-ref-sd1.json", "fidelity-ref-sd1.png", "fidelity-grid-ref-sd1.png"):
        assert (out / name).stat().st_size > 0, name
    saved = json.loads((out / "fidelity-ref-sd1.json").read_text())
    assert [r["row"] for r in saved["records"]] == [r["row"] for r in report["records"]]
    assert "| 32 | ours ToMe 0.5 |" in (out / "fidelity-ref-sd1.md").read_text()


def test_unpatched_row_is_its_own_reference(smoke_report):
    report, _ = smoke_report
    unpatched = _row(report, "unpatched")
    assert unpatched["identical_to_unpatched"] and unpatched["ssim"] == pytest.approx(1.0, abs=1e-6)
    assert unpatched["psnr"] is None


def test_patched_rows_change_the_picture_but_less_than_a_broken_patch(smoke_report):
    report, _ = smoke_report
    broken = _row(report, "broken (shifted tokens)")
    for name in ("ours ToMe 0.5", "ours ToDo 2"):
        row = _row(report, name)
        assert not row["identical_to_unpatched"], name  # the reduction really ran (skip_when_slower is off)
        # A one-token shift of every self-attention output wrecks the image; a correct reduction stays close.
        # 0.1 of SSIM is several times the spread between the correct rows seen in full runs.
        assert row["ssim"] > broken["ssim"] + 0.1, (name, row["ssim"], broken["ssim"])
        assert row["psnr"] > broken["psnr"], name
    assert "broken (shifted tokens)" not in sum(report["pareto_front"].values(), [])
