"""The line's diagnosis (``tools/fidelity/line_diagnosis``): the recording does not change the unpatched run, the
run's own line is the whole-step forecast, and the unpatched run's outputs replace the anchor, the slope or the
whole line where asked."""

from __future__ import annotations

import torch
from hosts import comfy_host as host  # noqa: I001  (before any ComfyUI import: sys.path, CPU mode)

from tools.fidelity.line_diagnosis import DiagnosedLine, Line, Recorder, hooked
from tools.fidelity.spectrum import SpectrumSettings, spectrum_patch

COMPUTED = (0, 1, 2, 4, 6, 8, 10, 11)  # of 12 steps


def test_the_recording_is_the_unpatched_run_and_the_own_line_is_the_whole_step_forecast():
    model = host.tiny_model("sd15")
    recorded = Recorder()
    assert torch.equal(host.sample(hooked(recorded)(model), steps=12), host.sample(model, steps=12))
    assert len(recorded.outputs) == 12
    own = host.sample(hooked(DiagnosedLine(COMPUTED, Line(), recorded))(model), steps=12)
    lab = host.sample(
        spectrum_patch(SpectrumSettings(at=COMPUTED, blend=0.0, reach=0.75, by_sigma=True))(model), steps=12
    )
    # The same line written as anchor plus slope times the distance: equal to float32 rounding.
    assert torch.allclose(own, lab, rtol=1e-4, atol=1e-4) and not torch.equal(own, host.sample(model, steps=12))


def _skipped_step(line: Line) -> torch.Tensor:
    """At noise level 3 (step 3 of 0-5; computed: 0, 1, 2, 5), with the run's own outputs 1 and 2 at noise levels
    8 and 4 and the unpatched run's 1.5 and 2.5 there, 4.5 at noise level 1."""
    sigmas = [10.0, 8.0, 4.0, 3.0, 2.0, 1.0, 0.0]
    recorded = Recorder()
    recorded.outputs = {8.0: [torch.tensor([1.5])], 4.0: [torch.tensor([2.5])], 1.0: [torch.tensor([4.5])]}
    hook = DiagnosedLine((0, 1, 2, 5), line, recorded)
    hook.kept = [(8.0, [torch.tensor([1.0])]), (4.0, [torch.tensor([2.0])])]
    hook.slope, hook.last_sigma = hook._slope(4.0, hook.kept[1][1], hook.kept[0]), 4.0
    options = {"transformer_options": {"sample_sigmas": torch.tensor(sigmas)}}
    return hook({"sigma": torch.tensor([3.0]), "model_options": options, "conds": [None], "input": None})[0]


def test_the_anchor_the_slope_or_the_line_come_from_the_unpatched_run_where_asked():
    own_slope, unpatched_slope = (2.0 - 1.0) / (4.0 - 8.0), (2.5 - 1.5) / (4.0 - 8.0)
    assert torch.allclose(_skipped_step(Line(reach=1.0)), torch.tensor([2.0 - own_slope]))
    assert torch.allclose(_skipped_step(Line(reach=1.0, slope="unpatched")), torch.tensor([2.0 - unpatched_slope]))
    assert torch.allclose(_skipped_step(Line(reach=1.0, anchor="unpatched")), torch.tensor([2.5 - own_slope]))
    # Between the unpatched run's outputs at noise levels 4 and 1 (2.5 and 4.5): a third of the way at 3.
    assert torch.allclose(_skipped_step(Line(anchor="interpolated")), torch.tensor([2.5 + 2.0 / 3.0]))


def test_a_trend_below_1_mixes_the_newest_slope_with_the_one_before():
    hook = DiagnosedLine((0, 1), Line(trend=0.25), Recorder())
    hook.slope = [torch.tensor([4.0])]
    newest = hook._slope(2.0, [torch.tensor([3.0])], (4.0, [torch.tensor([5.0])]))  # (3 - 5) / (2 - 4) = 1
    assert torch.allclose(newest[0], torch.tensor([0.25 * 1.0 + 0.75 * 4.0]))
