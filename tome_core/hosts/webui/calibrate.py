"""The WebUI family's door to ``reuse_plan`` "calibrated": the key at each job's first pass (the model's
weights by content as they are, the LoRAs and their strengths, sampler, schedule, steps, denoise, CFG, latent shape,
the target); a key without a kept plan runs its pass truly unpatched, no reuse and no ToDo or ToMe (the user's
picture, its denoised image per step recorded from the CFG callbacks for the report's chart), then ``p.sample``
runs again on the same seeds with the candidates, each with or without the token reduction as the search decides
(``schedule_for_pass``), and the result is kept for the next job, which runs its plan with the reduction or
without as it was kept; its picture is saved beside the kept file and, where asked, added to the job's gallery at
``postprocess``. The A1111 WebUI's ldm UNet is keyed by its modules and
the Lora extension's networks (``ldm_fingerprints``); lllyasviel's Forge's and Forge Neo's by the patcher in
``p.sd_model.forge_objects.unet``, its weights as loaded and its LoRA patches with their strengths
(``forge_fingerprints``). A UNet's candidates are forecasts (``schedule_for_pass``); a DiT's in Forge and Neo its
family's plan at other intervals (``dit_schedule_for_pass``, ``dit_fingerprints``: the family and its plan in the
key). Everything else is shared. docs/calibration.md, 'WebUI'."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import torch

from ...calibration import (
    Calibration,
    KeptCalibrations,
    calibration_key,
    key_id,
    plan_words,
    tensors_fingerprint,
)
from ...calibration.candidates import MIN_STEPS
from ...calibration.fingerprint import UnreadableModelError, patches_fingerprint
from ...calibration.store import FILE_ENV, SetAsideError
from ...reuse import decide, kept_plan
from ...version import __version__
from . import layer_reuse as webui_layer_reuse

ENV = FILE_ENV  # a calibrations file of the user's choosing, as in diffusers
DEFAULT_FILE = Path(__file__).resolve().parents[3] / "calibrations" / "calibrations.json"  # next to scripts/
KEY_CALIBRATED = "ToMe calibrated"  # the infotext's kept computed steps (not a control's value)
REPORTS = "reports"  # beside the kept file: each calibration's picture, ``<key>.png`` and ``latest.png``
LATEST = "latest.png"
_NOT_FORCED = object()
_BACKUPS = {"weight": "network_weights_backup", "bias": "network_bias_backup"}  # the Lora extension's names


def store() -> KeptCalibrations:
    return KeptCalibrations(os.environ.get(ENV) or DEFAULT_FILE)


class _UnetPending:
    """A UNet's pass that found no kept plan: its key, and its forecast candidates once the pass has run;
    ``reduction``: the token reduction its patch sets ("ToDo", "ToMe"; None: neither), which the search then
    decides (this pass, its reference, ran without it)."""

    dit = False
    latent_dims = (4,)

    def __init__(self, key: dict, base, target: float, reduction: str | None = None):
        self.key, self.base, self.target, self.reduction = key, base, target, reduction

    def search(self) -> tuple[Calibration | None, str]:
        """The calibration of the pass just run (``launch_sampling`` set its steps), or None and why there is none."""
        _, state = _opts()
        steps = int(getattr(state, "sampling_steps", 0) or 0)
        search = None
        if steps > 0:
            reduces = self.reduction is not None
            search = Calibration(self.base.for_run(steps), steps, self.target, reduces=reduces)
        if search is None or not search.candidates:
            return None, f"a run of {steps} steps forecasts nothing; every step runs, as under forecast v3"
        return search, ""


class _DitPending:
    """A DiT's pass that found no kept plan: its key, and its family's plan at other intervals as candidates, on
    the steps and noise levels its pass's owner (``dit_reuse.PassDitReuse``) saw."""

    dit = True
    latent_dims = (4, 5)  # a video DiT's latent has frames
    reduction = None  # a DiT in the WebUI runs no ToDo

    def __init__(self, key: dict, owner, target: float):
        self.key, self.owner, self.target = key, owner, target

    def search(self) -> tuple[Calibration | None, str]:
        """The calibration of the pass just run, or None and why there is none."""
        if self.owner.seen is None:
            return None, "no model call of this pass was a step of its schedule; nothing is kept"
        steps, sigmas = self.owner.seen
        search = Calibration.for_dit(self.owner.schedule, steps, sigmas, self.owner.full_below, target=self.target)
        if not search.candidates:
            return None, f"a run of {steps} steps reuses nothing; every step runs in full"
        return search, ""


class _StoppedError(Exception):
    """The Interrupt or Skip button, pressed while calibrating: the sampler returned early, nothing is kept."""


class JobCalibration:
    """One job's calibration state: the schedule a candidate run forces on its pass and whether it reduces tokens,
    the key a pass found no plan for, and the plan the job ran (for the infotext)."""

    def __init__(self, original_sample):
        self.original_sample = original_sample
        self.forced = _NOT_FORCED
        self.reducing = False  # whether a candidate's run (``forced``) runs ToDo or ToMe (``Calibration.reducing``)
        self.pending: _UnetPending | _DitPending | None = None  # the key a pass found no plan for
        self.picture = None  # the calibration's picture (a PIL image) where this job calibrated
        self.picture_words = ""  # what it shows, for an infotext


class _Recorder:
    """The unpatched run's denoised image (its first sample) at each step, from the WebUI's CFG
    callbacks (``cfg_denoiser`` names the step, ``cfg_after_cfg`` carries the denoised image after CFG); the first
    call of each step only (a second-order sampler calls twice)."""

    def __init__(self, p):
        self.p = p
        self.denoised: list[torch.Tensor] = []
        self.recording = False

    def on_cfg_denoiser(self, params) -> None:
        owner_p = getattr(getattr(params, "denoiser", None), "p", None)
        found = webui_layer_reuse.denoiser_step(params) if owner_p is None or owner_p is self.p else None
        self.recording = found is not None and found[0] == len(self.denoised)

    def on_cfg_after_cfg(self, params) -> None:
        x = getattr(params, "x", None)
        if self.recording and isinstance(x, torch.Tensor) and x.dim() >= 1:
            self.denoised.append(x[:1].detach().float().cpu())
        self.recording = False


_recorder: _Recorder | None = None  # the calibrating pass in progress (a WebUI process samples one pass at a time)


def _record(p) -> None:
    global _recorder
    _recorder = _Recorder(p)


def on_cfg_denoiser(params) -> None:
    """``script_callbacks.on_cfg_denoiser``: a denoiser call of the pass that calibrates starts."""
    if _recorder is not None:
        _recorder.on_cfg_denoiser(params)


def on_cfg_after_cfg(params) -> None:
    """``script_callbacks.on_cfg_after_cfg``: its denoised image."""
    if _recorder is not None:
        _recorder.on_cfg_after_cfg(params)


def install(p, job) -> None:
    """Run ``p.sample`` (called once per batch by ``process_images``) through ``sample`` for this job. Forge's and
    Neo's ``p.sample`` copy ``forge_objects`` from the patcher after the LoRAs and call
    ``process_before_every_sampling`` at each call: a candidate's run gets its forced schedule on a fresh clone."""
    original = getattr(p, "sample", None)
    if original is None or getattr(p, "sd_model", None) is None:
        return
    job.calibration = JobCalibration(original)

    def calibrated_sample(*args, **kwargs):
        return sample(p, job, args, kwargs)

    p.sample = calibrated_sample


def uninstall(p, job) -> None:
    calibration = getattr(job, "calibration", None)
    if calibration is not None and p.__dict__.get("sample") is not None:
        del p.__dict__["sample"]


def _unet_fingerprint(unet) -> str:
    """The UNet's tensors as they are; a layer the Lora extension has merged into is read from its backup, since
    the networks it merges are keyed apart (``_networks_fingerprint``) and it merges at the layer's first call."""
    modules = dict(unet.named_modules())
    named = []
    for name, tensor in unet.state_dict(keep_vars=True).items():
        owner_name, _, attribute = name.rpartition(".")
        owner = modules.get(owner_name)
        if owner is not None and attribute in _BACKUPS and getattr(owner, "network_current_names", ()):
            backup = getattr(owner, _BACKUPS[attribute], _NOT_FORCED)
            if backup is None and attribute == "bias":
                continue  # a bias the merge added
            if isinstance(backup, torch.Tensor):
                tensor = backup
        named.append((name, tensor))
    return tensors_fingerprint(named)


def _networks_fingerprint() -> str:
    """The networks the built-in Lora extension applies to this job (``networks.loaded_networks``): each one's file
    by its hash where the WebUI read one, and its strengths."""
    networks = sys.modules.get("networks")
    loaded = getattr(networks, "loaded_networks", None) or []
    described = []
    for net in loaded:
        on_disk = getattr(net, "network_on_disk", None)
        identity = getattr(on_disk, "sha256", None) or getattr(on_disk, "hash", None)
        if not identity:
            filename = getattr(on_disk, "filename", None)
            try:
                stat = os.stat(filename)
                identity = f"{filename}:{stat.st_size}:{stat.st_mtime_ns}"
            except (OSError, TypeError, ValueError):
                identity = str(filename)
        fields = ("name", "te_multiplier", "unet_multiplier", "dyn_dim")
        described.append([identity, *(repr(getattr(net, field, None)) for field in fields)])
    return patches_fingerprint({"networks": described})


def _opts():
    try:
        from modules import shared
    except ImportError:
        return None, None
    return getattr(shared, "opts", None), getattr(shared, "state", None)


def ldm_fingerprints(unet):
    """The A1111 WebUI's keying of ``unet`` (an ldm UNet): ``() -> (weights, patches, extra)``."""
    return lambda: (_unet_fingerprint(unet), _networks_fingerprint(), ["host:webui"])


_PREFIX = "diffusion_model."  # the patchers' weight keys are the model's, the UNet's under this name


def _forge_weights_backup(patcher) -> dict:
    """The weights a LoRA was merged into in place, as they were before: lllyasviel's Forge keeps them in the
    model's ``lora_loader.backup`` (key -> tensor; merged when the patcher is loaded for sampling, kept merged
    until other LoRAs are asked); Forge Neo's patcher, ComfyUI's ``ModelPatcher``, in ``backup`` (key -> a
    ``(weight, inplace_update)`` tuple, shared by its clones)."""
    saved = {}
    loader = getattr(patcher, "lora_loader", None) or getattr(getattr(patcher, "model", None), "lora_loader", None)
    for name, weight in (getattr(loader, "backup", None) or {}).items():
        saved[name] = weight
    for name, entry in (getattr(patcher, "backup", None) or {}).items():
        saved[name] = getattr(entry, "weight", entry)
    return saved


def _forge_unet_fingerprint(patcher) -> str:
    """Forge's UNet (``patcher.model.diffusion_model``) as loaded from its file: a weight merged in place is read
    from its backup, since the patches are keyed apart (``_forge_patches_fingerprint``)."""
    saved = _forge_weights_backup(patcher)
    named = []
    for name, tensor in patcher.model.diffusion_model.state_dict(keep_vars=True).items():
        backup = saved.get(_PREFIX + name)
        named.append((name, backup if isinstance(backup, torch.Tensor) else tensor))
    return tensors_fingerprint(named)


def _forge_patches_fingerprint(patcher) -> str:
    """The weight patches the job's LoRAs put in the patcher, by content and strength: lllyasviel's Forge's
    ``lora_patches`` (``(filename, strength_patch, strength_model, online_mode)`` -> key -> patch entries), Neo's
    ``patches`` (ComfyUI's: key -> ``(strength_patch, patch, strength_model, offset, function)`` entries)."""
    forge = [[repr(identifier), patches_fingerprint(patches)]
             for identifier, patches in (getattr(patcher, "lora_patches", None) or {}).items()]  # fmt: skip
    return patches_fingerprint({"lora_patches": forge, "patches": getattr(patcher, "patches", None) or {}})


def forge_fingerprints(patcher, v_prediction):
    """lllyasviel's Forge's and Forge Neo's keying of ``patcher`` (``p.sd_model.forge_objects.unet`` as the job
    made it, LoRAs applied): its weights, its LoRA patches, and by name the other patches extensions set on it."""
    options = getattr(patcher, "model_options", None) or {}
    transformer = options.get("transformer_options", {})
    others = [f"patch:{name}" for name in transformer.get("patches", {})]
    others += [f"replace:{name}" for name in transformer.get("patches_replace", {})]
    others += [f"object:{name}" for name in getattr(patcher, "object_patches", None) or {}]
    others += [f"option:{name}" for name in options if name != "transformer_options"]
    host = ["host:forge", f"v_prediction:{v_prediction}", *others]
    return lambda: (_forge_unet_fingerprint(patcher), _forge_patches_fingerprint(patcher), host)


def job_key(p, fingerprints, settings, sampler, schedule, latent) -> dict:
    """The key of this pass; ``fingerprints()``: the model's weights, its patches and the host's own fields."""
    opts, _ = _opts()
    img2img = hasattr(p, "init_images")
    model, patches, host = fingerprints()
    extra = [
        *host,
        f"schedule:{schedule}",
        f"denoise:{getattr(p, 'denoising_strength', 1.0) if img2img else 1.0}",
        f"settings:{sorted((k, v) for k, v in dataclasses.asdict(settings).items() if k != 'seed')}",
        f"parameterization:{getattr(p.sd_model, 'parameterization', None)}",
    ]
    for option in ("always_discard_next_to_last_sigma", "sd_noise_schedule", "img2img_fix_steps"):
        if hasattr(opts, option):
            extra.append(f"{option}:{getattr(opts, option)}")
    shape = latent.shape[1:] if isinstance(latent, torch.Tensor) else ()
    return calibration_key(
        model=model,
        patches=patches,
        sampler=sampler,
        sigmas=[],
        steps=p.steps,
        cfg=getattr(p, "cfg_scale", None),
        shape=shape,
        version=__version__,
        extra=extra,
    )


HIGHRES = "highres fix is on"


def _highres_or_refiner(p) -> str | None:
    """Why this pass does not calibrate (``HIGHRES``: a highres job's pass, which may still use a kept plan)."""
    refiner = getattr(p, "refiner_checkpoint", None)
    if getattr(p, "refiner_checkpoint_info", None) is not None or refiner not in (None, "", "None"):
        return "a refiner is set (it loads other weights mid-pass)"
    if getattr(p, "enable_hr", False) or getattr(p, "is_hr_pass", False):
        return HIGHRES
    return None


def _forced(job):
    """The schedule a candidate's run forces on its pass, or ``_NOT_FORCED`` outside a calibration's runs."""
    calibration = getattr(job, "calibration", None)
    return _NOT_FORCED if calibration is None else calibration.forced


def _key_and_kept(p, job, settings, fingerprints, latent, fallback: str):
    """(key, its kept result or None) of this pass; None where this job does not calibrate (one line says why,
    ``fallback`` naming what it runs instead). A kept result is announced and goes into the infotext."""
    why = _highres_or_refiner(p)
    if why is None and getattr(job, "calibration", None) is None:
        why = "this job's processing has no sample() to run again"
    if why == HIGHRES:  # the first pass is the job without highres fix: it runs a plan kept for that job
        job.warn_once(f"reuse_plan 'calibrated' with highres fix: the first pass runs the plan kept for the same job "
                      f"without highres fix (where none is kept yet, {fallback}: a calibration would run both passes "
                      f"and the upscale again for every candidate), the highres pass {fallback}.")  # fmt: skip
        if getattr(p, "is_hr_pass", False):
            return None
    elif why is not None:
        job.warn_once(f"reuse_plan 'calibrated' runs {fallback} for this job: {why}.")
        return None
    sampler, schedule = webui_layer_reuse.sampler_and_schedule(p)
    kept_calibrations = store()
    try:
        key = job_key(p, fingerprints, settings, sampler, schedule, latent)
        kept = kept_calibrations.get(key_id(key))
    except UnreadableModelError as err:
        job.warn_once(f"reuse_plan 'calibrated': this model cannot be keyed by its content ({err}); running "
                      f"{fallback}.")  # fmt: skip
        return None
    except SetAsideError:
        return None
    if kept is None and why == HIGHRES:
        return None
    if kept is not None:
        p.extra_generation_params.update(infotext(kept, reduction=reduction_name(settings)))
        job.warn_once(f"calibration: the plan kept for this job in {kept_calibrations.path}: {kept.words()}.")
    return key, kept


def reduction_name(settings) -> str:
    """The name of the token reduction ``settings`` set, so that an infotext names the one the job asked for."""
    return "ToMe" if settings.method == "tome" else "ToDo"


def schedule_for_pass(p, job, settings, decision, fingerprints, latent, reduces: bool = False):
    """(the forecast schedule of a pass under "calibrated", None: every step in full; whether the pass runs its
    ToDo or ToMe): a candidate run's schedule, reducing as the search asks (``Calibration.reducing``); the kept
    plan's, reducing as it was kept (``CalibrationResult.reduce``); or every step without them while the key has
    no plan yet (the pass runs truly unpatched, the search's reference, and ``sample`` then calibrates).
    ``reduces``: whether the pass's patch reduces tokens at all (where not, the second value is False).
    ``fingerprints``: the host's keying of the model (``ldm_fingerprints``, ``forge_fingerprints``)."""
    forced = _forced(job)
    if forced is not _NOT_FORCED:
        return forced, reduces and job.calibration.reducing
    steps = getattr(p, "steps", None)
    steps = len(steps) if isinstance(steps, tuple | list) else steps  # a list of timesteps counts as its length
    if isinstance(steps, int) and 0 < steps < MIN_STEPS:  # nothing could be kept: forecast v3, the reduction as set
        job.warn_once(f"reuse_plan 'calibrated': a run of {steps} steps forecasts nothing; it runs as forecast v3.")
        return decision.schedule, reduces
    found = _key_and_kept(p, job, settings, fingerprints, latent, "forecast v3")
    if found is None:
        return decision.schedule, reduces
    key, kept = found
    if kept is None:
        reduction = reduction_name(settings) if reduces else None
        job.calibration.pending = _UnetPending(key, decision.schedule, settings.calibration_target, reduction)
        _record(p)  # this pass is the calibration's unpatched run: its chart
        return None, False
    reduce = reduces and kept.reduce
    if kept.spacing is None:
        return None, reduce
    sampler, schedule = webui_layer_reuse.sampler_and_schedule(p)
    plan = kept_plan(settings.reuse_plan, sampler, schedule, kept.spacing)
    return decide(plan, sampler, schedule, settings.reuse_interval).schedule, reduce


def dit_fingerprints(patcher, owner):
    """Forge's and Neo's keying of a DiT: its patcher as a UNet's (``forge_fingerprints``: the job's patcher, LoRAs
    in, ours not) with the family and its plan (``owner``: the pass's ``dit_reuse.PassDitReuse``)."""
    fingerprints = forge_fingerprints(patcher, None)

    def read():
        """The patcher's fingerprints, read when the key is made (after the job's LoRAs are in)."""
        model, patches, host = fingerprints()
        return model, patches, [*host, f"dit:{owner.family}", f"plan:{plan_words(owner.schedule)}"]

    return read


def dit_schedule_for_pass(p, job, settings, owner, fingerprints, latent):
    """The plan a DiT's pass follows under "calibrated" (``owner.follow``; None: every block, while the key has no
    plan yet or where the kept plan is every step): a candidate run's, the family's plan at the kept interval, or
    the family's own where the job does not calibrate. ``owner``: the pass's ``dit_reuse.PassDitReuse``."""
    forced = _forced(job)
    if forced is not _NOT_FORCED:
        return forced
    found = _key_and_kept(p, job, settings, fingerprints, latent, "the family's plan")
    if found is None:
        return owner.schedule
    key, kept = found
    if kept is None:
        job.calibration.pending = _DitPending(key, owner, settings.calibration_target)
        _record(p)  # this pass is the calibration's unpatched run: its chart
        return None
    return kept.dit_schedule(owner.schedule)


def _stopped() -> bool:
    _, state = _opts()
    return any(getattr(state, flag, False) for flag in ("interrupted", "skipped", "stopping_generation"))


def _with_seeds(args: tuple, kwargs: dict, seeds: list) -> tuple[tuple, dict]:
    """``p.sample``'s arguments with other seeds (read by WebUIs before v1.6, which had no ``p.rng``)."""
    if "seeds" in kwargs:
        return args, {**kwargs, "seeds": seeds}
    if len(args) > 2:
        return (*args[:2], seeds, *args[3:]), kwargs
    return args, kwargs


def _noise_for(rng, seeds):
    """A new ``ImageRNG`` like ``rng`` for ``seeds``: ``p.sample`` draws its noise from ``p.rng``, once."""
    return type(rng)(rng.shape, seeds, subseeds=rng.subseeds, subseed_strength=rng.subseed_strength,
                     seed_resize_from_h=rng.seed_resize_from_h, seed_resize_from_w=rng.seed_resize_from_w)  # fmt: skip


def sample(p, job, args, kwargs):
    """``p.sample`` under "calibrated": the job's own run, then, where its first pass found no kept plan, the
    calibration on the same seeds; returns the job's own (unpatched) latent."""
    global _recorder
    calibration = job.calibration
    calibration.pending = None
    rng = getattr(p, "rng", None)
    try:
        out = calibration.original_sample(*args, **kwargs)
    finally:
        recorder, _recorder = _recorder, None
    pending, calibration.pending = calibration.pending, None
    if pending is None:
        return out
    try:
        _calibrate(p, job, args, kwargs, out, pending, rng, recorder)
    except _StoppedError:
        job.say("calibration: stopped (Interrupt or Skip); nothing is kept, the next job calibrates again.")
    except Exception as err:  # the user's picture is made: a failed candidate run costs only the calibration
        job.say(f"calibration: failed ({err!r}); nothing is kept.")
    finally:
        calibration.forced, calibration.reducing = _NOT_FORCED, False
        if rng is not None:
            p.rng = rng
    return out


def _calibrate(p, job, args, kwargs, out, pending, rng, recorder: _Recorder | None = None) -> None:
    """The calibration after the job's own unpatched pass: each candidate's ``p.sample`` on the job's seeds (and
    the next seeds where the batch is one); the result kept, in the infotext and in its picture."""
    calibration = job.calibration
    key = pending.key
    if _stopped():
        raise _StoppedError
    latent = isinstance(out, torch.Tensor) and out.dim() in pending.latent_dims
    if not latent or getattr(out, "already_decoded", False):
        job.say("calibration: this job's sampler returns no latent to compare; nothing is kept.")
        return
    search, why = pending.search()
    if search is None:
        job.say(f"calibration: {why}.")
        return
    steps = search.steps
    search.start_from(store().nearest(key, steps))
    seeds = [int(seed) for seed in (getattr(p, "seeds", None) or [getattr(p, "seed", 0)])]
    # A plan kept from one picture transfers only in part (docs/calibration.md): a second seed where the batch has one.
    second = [seed + 1 for seed in seeds] if out.shape[0] < 2 else None
    if rng is None and second is not None:
        job.say("calibration: this WebUI draws no noise per job (no p.rng); calibrating on the job's seeds alone.")
        second = None
    job.say(f"calibration: a new job for this model; up to {search.max_runs} runs (the first unpatched, the job's "
            f"picture){', each on two seeds' if second else ''}.")  # fmt: skip

    passes = []  # the reuse runs of the candidate's passes (a DiT's guards may compute more steps than planned)

    def run(schedule, run_seeds):
        calibration.forced, calibration.reducing = schedule, search.reducing
        if rng is not None:
            p.rng = _noise_for(rng, run_seeds)
        run_args, run_kwargs = _with_seeds(args, kwargs, run_seeds)
        try:
            latent = calibration.original_sample(*run_args, **run_kwargs)
        finally:
            ended = webui_layer_reuse.end_pass()  # a candidate's run is the calibration's, not the job's: no line
            if ended is not None:
                passes.append(ended)
        if _stopped():
            raise _StoppedError
        return latent

    def candidate(schedule):
        passes.clear()
        first = out if schedule is None else run(schedule, seeds)
        return first if second is None else torch.cat([first, run(schedule, second)])

    def counted() -> int | None:
        """The steps the last candidate computed on its worst seed (None: as planned)."""
        counts = [round(steps * (1 - ended.reused_calls / ended.calls)) for ended in passes if ended.calls]
        return max(counts) if counts else None

    # The chart's change per step (without the callbacks' record, or with another count of steps, it shows zeros).
    observed = None if recorder is None else (lambda: recorder.denoised)
    result = search.run(candidate, observed=observed, counted=counted if pending.dit else None)
    kept_calibrations = store()
    identity = key_id(key)
    kept_calibrations.put(identity, key, result, {"metric": "latent SSIM, worst sample", "seeds": 2})
    p.extra_generation_params.update(infotext(result, calibrating=True, reduction=pending.reduction))
    job.say(f"calibration: kept in {kept_calibrations.path}: {result.words()} ({result.runs} runs).")
    calibration.picture_words = f"ToMe Patch calibration: {result.words()}"
    try:  # the plan is kept: a picture that cannot be made or saved costs only the picture
        calibration.picture = as_image(search.picture(result))
        path = save_picture(calibration.picture, kept_calibrations.path.parent, identity)
    except Exception as err:
        job.say(f"calibration: its picture could not be made or saved ({err!r}).")
        return
    calibration.picture_words += f"; its picture: {path}"
    job.say(f"calibration: its picture: {path}.")


def as_image(image: torch.Tensor):
    """The engine's picture (height, width, 3 floats in [0, 1]) as a PIL image, as the WebUI's gallery takes it."""
    from PIL import Image

    return Image.fromarray((image.detach().float().cpu().clamp(0, 1) * 255).round().to(torch.uint8).numpy())


def save_picture(picture, folder, identity: str) -> Path:
    """``picture`` as ``reports/<key>.png`` (and ``reports/latest.png``) in ``folder``; returns the first."""
    reports = Path(folder) / REPORTS
    reports.mkdir(parents=True, exist_ok=True)
    path = reports / f"{identity}.png"
    picture.save(path)
    picture.save(reports / LATEST)
    return path


def show_picture(job, processed) -> bool:
    """At ``postprocess``: the calibration's picture of this job, where it calibrated and the box is ticked, after
    the gallery's images. WebUI v1.8+ shows ``processed.extra_images`` after the images (not saved with them, no
    infotext of their own); an older one gets it in ``processed.images`` with an infotext, as extensions did there."""
    calibration = getattr(job, "calibration", None)
    picture = getattr(calibration, "picture", None)
    args = getattr(job, "args", None)
    if picture is None or args is None or not args.calibration_picture or processed is None:
        return False
    calibration.picture = None  # once
    extra = getattr(processed, "extra_images", None)
    if isinstance(extra, (list, tuple)):
        processed.extra_images = [*extra, picture]  # a new list: never one another job may share
        return True
    images, infotexts = getattr(processed, "images", None), getattr(processed, "infotexts", None)
    if not isinstance(images, list):
        return False
    images.append(picture)
    if isinstance(infotexts, list):
        infotexts.append(calibration.picture_words)
    return True


def infotext(result, calibrating: bool = False, reduction: str | None = None) -> dict:
    """The kept plan's computed steps (a DiT's: and its interval), and where the patch sets a token reduction
    (``reduction``: "ToDo", "ToMe") but the plan was kept without it, that it runs without; a job that calibrated
    says its own picture ran every step (and without the reduction, the search's unpatched reference)."""
    computed = "every step" if not result.kept else f"{result.computed} of {result.steps} steps"
    if result.kept and result.interval is not None:
        last = f", the last {result.last_full} in full" if result.last_full else ""
        computed += f" (one in {result.interval}{last})"
    without = reduction is not None and not result.reduce
    if without:
        computed += f", without {reduction}"
    if not calibrating:
        return {KEY_CALIBRATED: computed}
    unreduced = "" if reduction is None else f", without {reduction}"
    return {KEY_CALIBRATED: f"{computed}{',' if without else ''} kept; this picture every step{unreduced}"}
