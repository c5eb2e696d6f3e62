"""diffusers' door to ``reuse_plan`` "calibrated": the patched pipeline's class gets a ``__call__`` that, at the
run's first UNet call, keys the job (the UNet's weights by content with its adapters and their scalings, the
scheduler and its config, the run's noise levels, guidance, latent shape, strength, the patch's settings) and runs
the kept plan, or runs unpatched (the user's picture) and then calibrates on the same noise, and draws the
calibration's picture beside the kept file. docs/calibration.md, 'diffusers'."""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import math
import os
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ...calibration import MAX_RUNS, Calibration, CalibrationResult, KeptCalibrations, calibration_key, key_id
from ...calibration.fingerprint import SAMPLE, UnreadableModelError, patches_fingerprint
from ...calibration.store import SetAsideError
from ...reuse import FORECAST, KARRAS, KARRAS_PART, Spacing, decide, kept_plan
from ...reuse.samplers import noise_added
from ...reuse.whole_step import denoised_of
from ...version import __version__
from .layer_reuse import _Schedule, _sigma_of, calling_pipeline, installed, karras_or_none, scheduler_name, takes_eta
from .whole_step import WholeStepReuse, v_prediction

if TYPE_CHECKING:
    from PIL import Image

log = logging.getLogger("tome_patch")

ENVIRONMENT = "TOME_PATCH_CALIBRATIONS"  # a file path that overrides the cache folder's file
FILE = os.path.join("tome_patch", "calibrations.json")
REPORTS, LATEST = "reports", "latest.png"  # the pictures' folder beside the kept file, and the last one's copy
_STATE = "_tome_patch_calibration"  # on the pipeline: its ``Calibrated``
_PARENT = "_tome_patch_calibration_parent"  # on our pipeline subclasses: the class they replace
_subclasses: dict[type, type] = {}


def store_path() -> Path:
    """``$TOME_PATCH_CALIBRATIONS``, else ``$XDG_CACHE_HOME/tome_patch/calibrations.json`` (``~/.cache``)."""
    path = os.environ.get(ENVIRONMENT)
    if path:
        return Path(path).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / FILE


def save_picture(picture: Image.Image, folder: Path, identity: str) -> Path:
    """``picture`` as ``folder/reports/<identity>.png`` and ``folder/reports/latest.png``, each written whole (a
    temporary file renamed over it); returns the first's path."""
    reports = folder / REPORTS
    reports.mkdir(parents=True, exist_ok=True)
    path = reports / f"{identity}.png"
    for target in (path, reports / LATEST):
        handle, temporary = tempfile.mkstemp(prefix=f".{target.stem}.", suffix=".png", dir=reports)
        try:
            with os.fdopen(handle, "wb") as file:
                picture.save(file, format="PNG")
            os.replace(temporary, target)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
    return path


@dataclass
class CalibrationReport:
    """What ``tome_core.calibrate`` did: the ``result`` kept in ``path`` under ``key_id`` and the unpatched run's
    ``output``; ``result`` None where the call could not calibrate (``why``: it ran as ``forecast v3``). ``picture``:
    the calibration's picture (a PIL image: the first sample's unpatched and calibrated latents, their difference
    amplified, the unpatched run's change per step with the computed steps in orange), saved as ``picture_path``
    (``reports/<key_id>.png`` beside the kept file; None where it could not be written); None where nothing
    calibrated."""

    result: CalibrationResult | None
    path: Path | None
    key_id: str | None
    output: object
    why: str | None = None
    picture: Image.Image | None = None
    picture_path: Path | None = None

    def words(self) -> str:
        if self.result is None:
            return f"not calibrated: {self.why}"
        where = f"; its picture: {self.picture_path}" if self.picture_path is not None else ""
        return f"{self.result.words()} ({self.result.runs} runs), kept in {self.path}{where}"


@dataclass
class Calibrated:
    """The pipeline's calibration settings and the reasons already said (one log line each)."""

    target: float
    settings: str  # the patch's other settings: another ToDo factor is another key
    said: set

    def say(self, why: str) -> None:
        if why not in self.said:
            self.said.add(why)
            log.info("ToMe calibration: %s; running what forecast v3 runs for it.", why)


def _original_class(pipe) -> type:
    cls = type(pipe)
    return cls.__dict__[_PARENT] if _PARENT in cls.__dict__ else cls


def _calibrating_class(cls: type) -> type:
    """One subclass per pipeline class, of the same name (its saved config names the class as before)."""
    sub = _subclasses.get(cls)
    if sub is None:

        @functools.wraps(cls.__call__)
        def call(self, *args, **kwargs):
            return Job.call(self, args, kwargs).output

        members = {"__call__": call, _PARENT: cls, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
        sub = type(cls.__name__, (cls,), members)
        _subclasses[cls] = sub
    return sub


def install(pipe, target: float, settings) -> None:
    """Calibrate ``pipe``'s calls from now on (its UNet already patched under a calibrating plan)."""
    others = {k: v for k, v in asdict(settings).items() if k not in ("reuse_plan", "calibration_target")}
    digest = hashlib.sha256(json.dumps(others, sort_keys=True, default=str).encode()).hexdigest()[:16]
    pipe.__dict__[_STATE] = Calibrated(target, digest, set())
    pipe.__class__ = _calibrating_class(_original_class(pipe))


def remove(pipe) -> None:
    getattr(pipe, "__dict__", {}).pop(_STATE, None)
    if _PARENT in type(pipe).__dict__:
        pipe.__class__ = _original_class(pipe)


def calibrate(pipe, args: tuple, kwargs: dict) -> CalibrationReport:
    if _STATE not in pipe.__dict__ or not isinstance(_owner(pipe), WholeStepReuse):
        raise ValueError(
            "tome_core.calibrate needs a pipeline patched with tome_core.apply_patch(pipe, reuse_plan='calibrated') "
            "whose UNet forecasts (reuse_interval above 1)"
        )
    job = Job.call(pipe, args, kwargs, force=True)
    why = job.why or (None if job.result is not None else "the pipeline never called its UNet")
    return CalibrationReport(
        job.result, job.path, job.key_id, job.output, why, picture=job.picture, picture_path=job.picture_path
    )


def _owner(pipe):
    unet = getattr(pipe, "unet", None)
    return installed(getattr(unet, "_orig_mod", unet)) if unet is not None else None


def weights_fingerprint(unet) -> str:
    """The UNet's tensors (LoRA/PEFT adapters' included) by name, shape, dtype and a strided sample of values, read
    in one transfer per device and dtype: every call reads them (a fused LoRA changes weights in place)."""
    digest, groups = hashlib.sha256(), {}
    try:
        for name, tensor in sorted(unet.state_dict(keep_vars=True).items()):
            tensor, name = tensor.detach(), name.replace(".base_layer.", ".")  # a PEFT wrapper computes as its base
            digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
            flat = tensor.reshape(-1)
            stride = max(flat.numel() // SAMPLE, 1)
            groups.setdefault((str(tensor.device), str(tensor.dtype)), []).append(flat[::stride][:SAMPLE])
        for group in sorted(groups):
            digest.update(torch.cat(groups[group]).to("cpu", torch.float32).numpy().tobytes())
    except (RuntimeError, TypeError, NotImplementedError) as err:
        raise UnreadableModelError(str(err)) from err
    return digest.hexdigest()[:32]


def adapters_fingerprint(unet) -> str:
    """The PEFT adapters on the UNet's layers: which are active, their scalings, disabled or merged."""
    found = {}
    for name, module in unet.named_modules():
        scaling = getattr(module, "scaling", None)
        if isinstance(scaling, dict) and scaling and hasattr(module, "active_adapters"):
            found[name] = {
                "active": list(module.active_adapters),
                "scaling": {str(k): float(v) for k, v in scaling.items()},
                "disabled": bool(getattr(module, "disable_adapters", False)),
                "merged": list(getattr(module, "merged_adapters", ())),
            }
    return patches_fingerprint(found)


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


class Job:
    """One pipeline call under "calibrated": ``call`` runs it and, where it has no kept plan, calibrates."""

    def __init__(self, pipe, force: bool = False):
        self.pipe, self.force = pipe, force
        self.output = self.result = self.path = self.key_id = self.key = self.why = None
        self.calibration: Calibration | None = None
        self.run_plan = None  # (sampler, schedule) names of the run, for a candidate's plan
        self.probed = False
        self.latents: list[torch.Tensor] = []
        self.levels: list[float] | None = None  # the run's noise levels per step, from its first
        self.denoised: list[torch.Tensor] = []  # the unpatched run's denoised image per step, its first sample
        self.restore_step = None  # undoes ``_observe``
        self.picture = self.picture_path = None

    @classmethod
    def call(cls, pipe, args: tuple, kwargs: dict, force: bool = False) -> Job:
        job = cls(pipe, force)
        original = _original_class(pipe).__call__
        calibrated, owner = pipe.__dict__.get(_STATE), _owner(pipe)
        arguments = None
        if calibrated is None or not isinstance(owner, WholeStepReuse):
            job.why = "the pipeline is not patched to calibrate"
        else:
            arguments = job._arguments(original, args, kwargs)
            if arguments is None:
                calibrated.say(job.why)
        if arguments is None:
            job.output = original(pipe, *args, **kwargs)
            return job
        job.calibrated, job.owner, job.arguments = calibrated, owner, arguments
        job.unet = getattr(pipe.unet, "_orig_mod", pipe.unet)
        with torch.no_grad():
            job.run(original)
        return job

    def _arguments(self, original, args: tuple, kwargs: dict) -> dict | None:
        """The call's arguments by name (None, with ``why``, where they cannot be read or rerun)."""
        signature = inspect.signature(original)
        self.parameters = signature.parameters
        if "callback_on_step_end" not in self.parameters:
            self.why = f"{type(self.pipe).__name__} takes no callback_on_step_end to read the final latents by"
            return None
        try:
            bound = signature.bind(self.pipe, *args, **kwargs)
        except TypeError:
            self.why = "the call's arguments do not fit the pipeline's"
            return None  # the pipeline's own call raises the user's error
        arguments = dict(bound.arguments)
        arguments.pop(next(iter(self.parameters)))  # self
        for name, parameter in self.parameters.items():
            if parameter.kind is parameter.VAR_POSITIONAL and arguments.get(name):
                self.why = "the call passes extra positional arguments"
                return None
            if parameter.kind in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL):
                extra = arguments.pop(name, {})
                arguments.update(extra if isinstance(extra, dict) else {})
        return arguments

    def _default(self, name: str):
        if name in self.arguments:
            return self.arguments[name]
        parameter = self.parameters.get(name)
        return None if parameter is None or parameter.default is parameter.empty else parameter.default

    # --- the generators: the same noise at every run ---

    def _generators(self) -> list[torch.Generator]:
        generator = self.arguments.get("generator")
        if generator is None:  # no generator: one from a random seed, so every run draws the same noise
            try:
                generator = torch.Generator(device=self.pipe._execution_device)
            except (RuntimeError, AttributeError):
                generator = torch.Generator()
            generator.manual_seed(random.randrange(2**63))
            self.arguments["generator"] = generator
        return list(generator) if isinstance(generator, list) else [generator]

    def _second(self, generators: list[torch.Generator]) -> dict:
        """The call with a second seed (a plan kept from one picture transfers only in part)."""
        seeds = [torch.Generator(device=g.device).manual_seed(g.initial_seed() + 1) for g in generators]
        second = dict(self.arguments)
        second["generator"] = seeds if isinstance(self.arguments["generator"], list) else seeds[0]
        latents = self.arguments.get("latents")
        if isinstance(latents, torch.Tensor):
            noise = torch.Generator().manual_seed(generators[0].initial_seed() + 1)
            second["latents"] = torch.randn(latents.shape, generator=noise).to(latents)
        return second

    # --- one run ---

    def _capturing(self, arguments: dict) -> dict:
        """``arguments`` whose step-end callback (the user's, composed) keeps the latents after each step."""
        user = arguments.get("callback_on_step_end")
        inputs = list(arguments.get("callback_on_step_end_tensor_inputs") or ["latents"])
        if hasattr(user, "tensor_inputs"):  # diffusers' PipelineCallback objects name their own
            inputs = list(user.tensor_inputs)
        if "latents" not in inputs:
            inputs.append("latents")
        sink = self.latents

        def callback(pipe, step, timestep, tensors):
            out = user(pipe, step, timestep, tensors) if user is not None else {}
            latents = (out or {}).get("latents", tensors["latents"])
            sink[:] = [latents.detach().clone()]
            return out if out is not None else {}

        return {**arguments, "callback_on_step_end": callback, "callback_on_step_end_tensor_inputs": inputs}

    def _run(self, original, arguments: dict, states: list, generators: list, latent_only: bool):
        for generator, state in zip(generators, states, strict=True):
            generator.set_state(state)
        arguments = self._capturing(arguments)
        if latent_only:
            arguments["output_type"] = "latent"
        self.latents.clear()
        output = original(self.pipe, **arguments)
        if not self.latents:
            raise RuntimeError("the pipeline ran no step: no final latent to calibrate on")
        return output, self.latents[0]

    def run(self, original) -> None:
        owner, plan = self.owner, self.owner.plan
        generators = self._generators()
        states = [g.get_state() for g in generators]
        probe = self.unet.register_forward_pre_hook(torch.compiler.disable(self.probe), with_kwargs=True, prepend=True)
        try:
            self.output, user_latents = self._run(original, self.arguments, states, generators, False)
        finally:
            probe.remove()
            self._unobserve()
            owner.plan, owner.suspended = plan, False
        if self.calibration is None:
            return
        after = [g.get_state() for g in generators]
        second, second_generators, second_states = None, [], []
        if user_latents.shape[0] < 2:
            second = self._second(generators)
            second_generators = self._generators_of(second)
            second_states = [g.get_state() for g in second_generators]

        def sample(schedule):
            owner.suspended = schedule is None
            if schedule is None:
                parts = [user_latents]
            else:
                sampler, schedule_name = self.run_plan
                spacing = Spacing(schedule.full_start, schedule.full_end, every=schedule.interval)
                owner.plan = kept_plan(plan, sampler, schedule_name, spacing)
                parts = [self._run(original, self.arguments, states, generators, True)[1]]
            if second is not None:
                parts.append(self._run(original, second, second_states, second_generators, True)[1])
            return torch.cat(parts)

        try:
            self.result = self.calibration.run(sample, observed=self._observed)
        finally:
            owner.plan, owner.suspended = plan, False
            for generator, state in zip(generators, after, strict=True):
                generator.set_state(state)
        seeds = user_latents.shape[0] + (second is not None)
        record = {"metric": "latent SSIM, worst sample", "seeds": seeds, "host": "diffusers",
                  "date": time.strftime("%Y-%m-%d %H:%M:%S")}  # fmt: skip
        KeptCalibrations(self.path).put(self.key_id, self.key, self.result, record)
        self.picture, self.picture_path = self._draw()
        log.info("ToMe calibration: kept in %s: %s (%d runs); its picture: %s.", self.path, self.result.words(),
                 self.result.runs, self.picture_path or "not saved")  # fmt: skip

    def _draw(self) -> tuple[Image.Image, Path | None]:
        """The calibration's picture, and where it was saved (None: it could not be, with one warning)."""
        from PIL import Image

        image = self.calibration.picture(self.result)
        picture = Image.fromarray((image.clamp(0, 1) * 255).round().to(torch.uint8).numpy())
        try:
            return picture, save_picture(picture, self.path.parent, self.key_id)
        except OSError as err:
            log.warning("ToMe calibration: its picture could not be saved in %s (%s).", self.path.parent / REPORTS,
                        err)  # fmt: skip
            return picture, None

    # --- the unpatched run's denoised image per step: the picture's chart, and the candidates' placement ---

    def _observe(self, scheduler) -> None:
        """Wrap ``scheduler.step`` (on the instance, for the unpatched run only: ``_unobserve`` undoes it) to keep
        the first sample's denoised image at each step, from the guided model output the step is handed and the
        scheduler's unit-variance input (``scale_model_input``) at the step's noise level, as the forecast reads a
        UNet call's: every scheduler the calibration runs on has it, ``pred_original_sample`` or not (DPM++ 2M)."""
        original, saved = scheduler.step, scheduler.__dict__.get("step")
        signature, levels, sink = inspect.signature(original), self.levels, self.denoised
        predicts_v, calls = bool(v_prediction(scheduler)), [0]

        @functools.wraps(original)  # the pipelines read the step's parameters (eta, generator) by its signature
        def step(*args, **kwargs):
            call, calls[0] = calls[0], calls[0] + 1
            try:
                arguments = signature.bind(*args, **kwargs).arguments
            except TypeError:
                arguments = {}
            output, sample = arguments.get("model_output"), arguments.get("sample")
            if (call == len(sink) < len(levels) and isinstance(output, torch.Tensor)
                    and isinstance(sample, torch.Tensor) and output.shape[1:] == sample.shape[1:]):  # fmt: skip
                x = scheduler.scale_model_input(sample[:1], arguments.get("timestep")).float()
                sink.append(denoised_of(output[:1].float(), x, levels[call], predicts_v).cpu())
            return original(*args, **kwargs)

        scheduler.__dict__["step"] = step

        def restore():
            if saved is None:
                scheduler.__dict__.pop("step", None)
            else:
                scheduler.__dict__["step"] = saved

        self.restore_step = restore

    def _unobserve(self) -> None:
        restore, self.restore_step = self.restore_step, None
        if restore is not None:
            restore()

    def _observed(self) -> list[torch.Tensor]:
        return self.denoised

    @staticmethod
    def _generators_of(arguments: dict) -> list[torch.Generator]:
        generator = arguments["generator"]
        return list(generator) if isinstance(generator, list) else [generator]

    # --- the first UNet call: the key, then the kept plan, the unpatched run or forecast v3 ---

    def probe(self, module, args, kwargs):
        if self.probed:
            return None
        self.probed = True
        caller, eta = calling_pipeline(module)
        sample = args[0] if args else kwargs.get("sample")
        timestep = args[1] if len(args) > 1 else kwargs.get("timestep")
        scheduler = getattr(caller, "scheduler", None)
        timesteps = getattr(scheduler, "timesteps", None)
        if caller is not self.pipe or not isinstance(sample, torch.Tensor) or not isinstance(timesteps, torch.Tensor):
            return self._cannot("the UNet was called outside the pipeline's own steps")
        schedule = _Schedule(timesteps)
        first = schedule.step_of(float(torch.as_tensor(timestep).max()), getattr(scheduler, "_step_index", None))
        if first is None:
            return self._cannot("the UNet's first call is not on the scheduler's timesteps")
        why = self._why_not(scheduler, schedule, first, eta)
        if why is not None:
            return self._cannot(why)
        try:
            self.key = self._key(scheduler, schedule, first, sample, kwargs)
            self.key_id, self.path = key_id(self.key), store_path()
            kept = None if self.force else KeptCalibrations(self.path).get(self.key_id)
        except UnreadableModelError as err:
            log.warning("ToMe calibration: this UNet cannot be keyed by its content (%s); running forecast v3.", err)
            return self._cannot(f"the UNet cannot be keyed by its content ({err})", said=True)
        except SetAsideError as err:
            return self._cannot(f"the calibrations' file was set aside ({err})", said=True)
        if kept is not None:
            log.info("ToMe calibration: the plan kept for this job in %s: %s.", self.path, kept.words())
            if kept.spacing is None:
                self.owner.suspended = True
            else:
                self.owner.plan = kept_plan(self.owner.plan, *self.run_plan, kept.spacing)
            self.calibration = None
            return None
        self.calibration.start_from(KeptCalibrations(self.path).nearest(self.key, self.calibration.steps))
        self.owner.suspended = True
        self._observe(scheduler)
        log.info("ToMe calibration: a new job for this UNet; up to %d runs (the first unpatched: this call's "
                 "picture); the result is kept in %s.", self.calibration.max_runs, self.path)  # fmt: skip
        return None

    def _cannot(self, why: str, said: bool = False) -> None:
        self.calibration, self.why = None, why
        if not said:
            self.calibrated.say(why)
        return None

    def _why_not(self, scheduler, schedule, first: int, eta) -> str | None:
        """Why this run cannot calibrate (None: it can); sets the calibration and the run's plan names."""
        name = scheduler_name(scheduler)
        sigmas = karras_or_none(scheduler)
        if sigmas == KARRAS and first > 0:
            sigmas = KARRAS_PART
        decision = decide(self.owner.plan, name, sigmas, self.owner.schedule.interval)
        if decision.runs != FORECAST:
            return f"{decision.why}: no forecast to calibrate"
        noise = noise_added(name, {"eta": eta} if takes_eta(scheduler) else {})
        if noise is not None:
            return f"{name} with {noise} adds noise at each step: no plan is measured there"
        if v_prediction(scheduler) is None:
            return f"{name} predicts {getattr(scheduler.config, 'prediction_type', None)!r}: no forecast"
        levels = self._levels(scheduler, schedule, first)
        if levels is None or not all(math.isfinite(level) and level > 0 for level in levels):
            return f"{name}'s noise levels are not all known: no forecast"
        steps = len(levels)
        calibration = Calibration(decision.schedule.for_run(steps), steps, self.calibrated.target, MAX_RUNS)
        if not calibration.candidates:
            return f"a run of {steps} steps (under 10 forecasts nothing)"
        self.calibration, self.run_plan, self.levels = calibration, (name, sigmas), levels
        return None

    @staticmethod
    def _levels(scheduler, schedule, first: int) -> list[float] | None:
        levels = [_sigma_of(scheduler, step, t) for step, t in enumerate(schedule.values)][first:]
        return None if None in levels else levels

    def _key(self, scheduler, schedule, first: int, sample: torch.Tensor, kwargs: dict) -> dict:
        config = {k: v for k, v in dict(scheduler.config).items() if not k.startswith("_")}
        attention = kwargs.get("cross_attention_kwargs") or {}
        guidance = getattr(self.pipe, "_guidance_scale", None)
        extra = [
            f"pipeline:{_original_class(self.pipe).__name__}",
            f"scheduler:{type(scheduler).__name__}:{_digest(config)}",
            f"settings:{self.calibrated.settings}",
            f"target:{self.calibrated.target}",
            f"first step:{first}",
        ]
        for name in ("strength", "denoising_start", "denoising_end", "guidance_rescale"):
            if self._default(name) is not None:
                extra.append(f"{name}:{self._default(name)}")
        if attention.get("scale") is not None:
            extra.append(f"lora scale:{float(attention['scale'])}")
        return calibration_key(
            model=weights_fingerprint(self.unet),
            patches=adapters_fingerprint(self.unet),
            sampler=scheduler_name(scheduler),
            sigmas=self._levels(scheduler, schedule, first),
            cfg=guidance if guidance is not None else self._default("guidance_scale"),
            shape=sample.shape[1:],
            version=__version__,
            extra=extra,
        )
