"""ComfyUI's door to ``reuse_plan`` "calibrated": the key from the guider (the model's weights by content, its
weight patches, sampler, noise levels, CFG, latent shape), the kept plan from the user directory, and a job that
calibrates by running the sampler again on the same noise. docs/calibration.md."""

from __future__ import annotations

import logging
import os
import weakref

import torch

from ...calibration import (
    Calibration,
    KeptCalibrations,
    calibration_key,
    key_id,
    plan_words,
    tensors_fingerprint,
)
from ...calibration.fingerprint import UnreadableModelError, patches_fingerprint
from ...calibration.store import SetAsideError
from ...reuse import decide, kept_plan
from ...reuse.agreement import several_processes
from ...schedule import call_sigmas
from ...version import __version__
from ..shared.model_patcher import REDUCTION_OFF_KEY
from .sampling_run import run_options

log = logging.getLogger("tome_patch")
FILE = os.path.join("tome_patch", "calibrations.json")
LATEST = "latest.png"
_WEIGHTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a model's fingerprint, read once


def store() -> KeptCalibrations:
    import folder_paths  # ComfyUI's; lazy: the engine is imported outside ComfyUI too

    return KeptCalibrations(os.path.join(folder_paths.get_user_directory(), FILE))


def _model_fingerprint(patcher) -> str:
    """The weights as loaded from the file: a weight ComfyUI patched in place is read from its backup."""
    model = patcher.model
    if model not in _WEIGHTS:
        backup = getattr(patcher, "backup", {}) or {}
        named = ((name, backup[name].weight if name in backup else value) for name, value in
                 model.state_dict(keep_vars=True).items())  # fmt: skip
        _WEIGHTS[model] = tensors_fingerprint(named)
    return _WEIGHTS[model]


def job_key(guider, sampler: str | None, sigmas: torch.Tensor, noise: torch.Tensor, target: float, plan: str = "",
            settings: tuple[str, ...] = ()) -> dict:  # fmt: skip
    patcher = guider.model_patcher
    options = guider.model_options.get("transformer_options", {})
    others = [f"patch:{name}" for name in options.get("patches", {})]
    others += [f"replace:{name}" for name in options.get("patches_replace", {})]
    others += [f"object:{name}" for name in getattr(patcher, "object_patches", {})]
    # A ControlNet or a process group changes what a step skips: a plan kept with one is not kept without it.
    others += [f"control:{name}" for name in controls_of(guider)]
    # So does a guidance function (PAG's post-CFG call of the model, a CFG rescale): keyed by its function's name.
    others += [f"{kind}:{function_name(f)}" for kind in GUIDANCE for f in guidance_functions(guider, kind)]
    others += ["several processes"] if several_processes() else []
    return calibration_key(
        model=_model_fingerprint(patcher),
        patches=patches_fingerprint(getattr(patcher, "patches", {})),
        sampler=sampler,
        sigmas=sigmas.flatten().tolist(),
        cfg=getattr(guider, "cfg", None),
        shape=noise.shape[1:],
        version=__version__,
        extra=[*others, f"target:{target}", *([f"plan:{plan}"] if plan else []), *settings],
    )


GUIDANCE = ("sampler_cfg_function", "sampler_pre_cfg_function", "sampler_post_cfg_function")


def guidance_functions(guider, kind: str) -> list:
    """The job's functions of ``kind``: a list in ComfyUI's model options, one function for the CFG function."""
    found = guider.model_options.get(kind)
    return [] if found is None else list(found) if isinstance(found, list | tuple) else [found]


def function_name(function) -> str:
    return getattr(function, "__qualname__", type(function).__name__)


def controls_of(guider) -> list[str]:
    """The kinds of ControlNet (or adapter) the job's conditioning carries."""
    conds = getattr(guider, "conds", None) or {}
    found = {type(cond["control"]).__name__ for entries in conds.values() for cond in entries
             if isinstance(cond, dict) and cond.get("control") is not None}  # fmt: skip
    return sorted(found)


def _fresh_conds(saved: dict) -> dict:
    return {kind: [cond.copy() for cond in conds] for kind, conds in saved.items()}


def sample_calibrated(hooks, executor, args, kwargs, sampler: str | None, schedule: str | None, run_with) -> object:
    """One job under "calibrated": the kept plan where there is one; else calibrate (the user gets the unpatched
    picture) and keep the result; ``run_with(schedule or None)`` runs the job forecast on ``schedule``."""
    guider = executor.class_obj
    noise, raw_sigmas = args[0], args[3]
    try:
        key = job_key(guider, sampler, raw_sigmas, noise, hooks.target, settings=hooks.settings_words)
        kept_calibrations = store()
        kept = kept_calibrations.get(key_id(key))
    except UnreadableModelError as err:
        log.warning("ToMe calibration: this model cannot be keyed by its content (%s); running forecast v3.", err)
        return run_with(decide("forecast v3", sampler, schedule, hooks.schedule.interval).schedule)
    except SetAsideError:
        return run_with(decide("forecast v3", sampler, schedule, hooks.schedule.interval).schedule)
    if kept is not None:
        log.info("ToMe calibration: the plan kept for this job in %s: %s.", kept_calibrations.path, kept.words())
        plan = kept_plan(hooks.plan, sampler, schedule, kept.spacing)
        decision = decide(plan, sampler, schedule, hooks.schedule.interval)
        return run_with(decision.schedule if kept.spacing is not None else None, reduce=kept.reduce)
    steps = len(call_sigmas(raw_sigmas))
    base = decide(hooks.plan, sampler, schedule, hooks.schedule.interval).schedule
    calibration = Calibration(base.for_run(steps), steps, hooks.target, reduces=hooks.reduces)
    if not calibration.candidates:
        return run_with(base)
    calibration.start_from(kept_calibrations.nearest(key, steps))
    return _calibrate(hooks, executor, args, kwargs, calibration, kept_calibrations, key, run_with)


def sample_calibrated_dit(hooks, executor, args, kwargs, sampler: str | None, sigmas, full_below: float, run_with
                          ) -> object:  # fmt: skip
    """A DiT's job under "calibrated": its family's plan at the kept interval where one is kept; else calibrate over
    the intervals (``Calibration.for_dit``); ``run_with(schedule or None)`` runs the job on ``schedule``."""
    guider = executor.class_obj
    noise, raw_sigmas = args[0], args[3]
    base = hooks.schedule
    try:
        key = job_key(guider, sampler, raw_sigmas, noise, hooks.target, plan_words(base), hooks.settings_words)
        kept_calibrations = store()
        kept = kept_calibrations.get(key_id(key))
    except UnreadableModelError as err:
        log.warning("ToMe calibration: this model cannot be keyed by its content (%s); running its family's plan.",
                    err)  # fmt: skip
        return run_with(base)
    except SetAsideError:
        return run_with(base)
    if kept is not None:
        log.info("ToMe calibration: the plan kept for this job in %s: %s.", kept_calibrations.path, kept.words())
        return run_with(kept.dit_schedule(base), reduce=kept.reduce)
    steps = len(sigmas)
    calibration = Calibration.for_dit(base, steps, sigmas, full_below, target=hooks.target, reduces=hooks.reduces)
    if not calibration.candidates:
        return run_with(base)
    calibration.start_from(kept_calibrations.nearest(key, steps))

    def counted() -> int | None:  # the steps the last run computed: a guard may have added some
        run = hooks.last_run
        return None if run is None or not run.calls else round(steps * (1 - run.reused_calls / run.calls))

    return _calibrate(hooks, executor, args, kwargs, calibration, kept_calibrations, key, run_with, counted)


def _calibrate(hooks, executor, args, kwargs, calibration, kept_calibrations, key, run_with, counted=None) -> object:
    guider = executor.class_obj
    args = list(args)
    noise, latent = args[0], args[1]
    batch = noise.shape[0]
    if batch < 2 and len(kwargs.get("latent_shapes") or [None]) <= 1:
        # A second seed: a plan kept from one picture transfers only in part (docs/calibration.md).
        seed = args[7] if len(args) > 7 and args[7] is not None else 0
        generator = torch.Generator().manual_seed(int(seed) + 1)
        second = torch.randn(noise.shape, generator=generator).to(noise)
        args[0] = torch.cat([noise, second])
        args[1] = torch.cat([latent, latent])
        if len(args) > 4 and isinstance(args[4], torch.Tensor) and args[4].shape[0] == batch:
            args[4] = torch.cat([args[4], args[4]])
        if kwargs.get("latent_shapes"):
            kwargs = {**kwargs, "latent_shapes": [args[1].shape]}
    saved = _fresh_conds(guider.conds)
    log.info("ToMe calibration: a new job for this model; up to %d runs (the first unpatched, the job's picture).",
             calibration.max_runs)  # fmt: skip
    denoised, callback = [], args[5] if len(args) > 5 else None
    args += [None] * (6 - len(args))

    def recording(step, x0, x, total_steps):  # the unpatched run's denoised image per step (the picture's chart)
        denoised.append(x0[:1].detach().float().cpu())
        return callback(step, x0, x, total_steps) if callback is not None else None

    def sample(schedule):  # the unpatched run reduces no tokens either; a candidate's as the search says
        guider.conds = _fresh_conds(saved)
        if schedule is None:
            with run_options(guider, {REDUCTION_OFF_KEY: True}):
                return executor(*args[:5], recording, *args[6:], **kwargs)
        return run_with(schedule, args, kwargs, reduce=calibration.reducing)

    result = calibration.run(sample, observed=lambda: denoised, counted=counted)
    identity = key_id(key)
    kept_calibrations.put(identity, key, result, {"metric": "latent SSIM, worst sample", "seeds": 2})
    picture = save_picture(calibration.picture(result), kept_calibrations.path.parent, identity)
    log.info("ToMe calibration: kept in %s: %s (%d runs); its picture: %s.", kept_calibrations.path, result.words(),
             result.runs, picture)  # fmt: skip
    return calibration.reference[:batch]


def reports_folder(folder) -> str:
    return os.path.join(folder, "reports")


def save_picture(image: torch.Tensor, folder, identity: str) -> str:
    """``image`` (height, width, 3 in [0, 1]) as ``reports/<key>.png`` and ``reports/latest.png``."""
    from PIL import Image

    os.makedirs(reports_folder(folder), exist_ok=True)
    picture = Image.fromarray((image.clamp(0, 1) * 255).round().to(torch.uint8).numpy())
    path = os.path.join(reports_folder(folder), f"{identity}.png")
    picture.save(path)
    picture.save(os.path.join(reports_folder(folder), LATEST))
    return path


def latest_picture() -> torch.Tensor | None:
    """The last calibration's picture as ComfyUI's IMAGE (1, height, width, 3), or None where there is none."""
    from PIL import Image

    path = os.path.join(reports_folder(store().path.parent), LATEST)
    if not os.path.exists(path):
        return None
    with Image.open(path) as picture:
        pixels = torch.frombuffer(bytearray(picture.convert("RGB").tobytes()), dtype=torch.uint8)
        return (pixels.view(picture.height, picture.width, 3).float() / 255)[None]
