"""``reuse_plan`` "calibrated": the first job with a model, sampler, schedule, step count and size runs unpatched,
then candidate forecasts on the same noise, and keeps the fewest computed steps whose picture stays at the target;
later jobs with the same key run the kept plan. One module per idea: ``metric`` (the picture's score), ``candidates``
(what is tried), ``search`` (the bounded search), ``fingerprint`` (the key, by the model's content), ``store`` (the kept
plans' file). Method: docs/calibration.md."""

from .candidates import Candidate, candidates, dit_candidates, plan_words, with_interval
from .fingerprint import calibration_key, key_id, tensors_fingerprint
from .metric import latent_ssim
from .report import draw_report, step_changes
from .search import DEFAULT_TARGET, MAX_RUNS, Calibration, CalibrationResult, check_target
from .store import KeptCalibrations

__all__ = [
    "DEFAULT_TARGET",
    "MAX_RUNS",
    "Calibration",
    "CalibrationResult",
    "Candidate",
    "KeptCalibrations",
    "calibration_key",
    "candidates",
    "dit_candidates",
    "draw_report",
    "check_target",
    "key_id",
    "latent_ssim",
    "plan_words",
    "step_changes",
    "tensors_fingerprint",
    "with_interval",
]
