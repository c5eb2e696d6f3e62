"""The workflow matrix in ComfyUI, by scheduler: each sampler with a plan, in txt2img on every scheduler ComfyUI lists
(the tiny random UNet), runs what the log names: the plan ``plans.decide`` gives its sampler and the schedule the
door reads from the sigmas, or every call with the line why. (Every combination's decision, and the other
workflows: test_workflow_matrix.py.)"""

from __future__ import annotations

import pytest
from hosts import comfy_host as host  # noqa: I001  (before any ComfyUI import: sys.path, CPU mode)
from test_workflow_matrix import (
    SCHEDULERS,
    assert_runs_what_the_log_names,
    inputs,
    model,
    no_progress_bar,
    node_classes,
)

# Euler's forecast and Heun's layer reuse on each scheduler (Karras sigmas: every step, shown once), DPM++ 2M on Karras
# sigmas and off them. DPM++ SDE reuses nothing (test_workflow_matrix.py shows it per workflow); ddim is Euler.
CASES = [
    *[("euler", scheduler) for scheduler in SCHEDULERS],
    *[("heun", scheduler) for scheduler in SCHEDULERS if scheduler != "karras"],
    ("dpmpp_2m", "karras"),
    ("dpmpp_2m", "normal"),
]
__all__ = ["inputs", "model", "no_progress_bar", "node_classes"]  # the fixtures, shared


@pytest.mark.parametrize(("sampler", "scheduler"), CASES, ids=[f"{s}-{c}" for s, c in CASES])
def test_each_scheduler_runs_what_the_log_names(node_classes, model, inputs, caplog, monkeypatch, sampler, scheduler):
    assert_runs_what_the_log_names(node_classes, model, inputs, caplog, monkeypatch, host.WORKFLOWS[0], sampler,
                                   scheduler)  # fmt: skip
