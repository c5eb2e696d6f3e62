"""diffusers' door to ``reuse_plan`` "calibrated": the patched pipeline's class gets a ``__call__`` that, at the
run's first UNet call, keys the job (the UNet's weights by content with its adapters and their scalings, the
scheduler and its config, the run's noise levels, guidance, latent shape, strength, the patch's settings) and runs
the kept plan, or runs unpatched (the user's picture, without ToDo or ToMe either) and then calibrates on the
same noise, ToDo or ToMe part of what it decides where the patch sets them, and draws the calibration's picture
beside the kept file. A DiT pipeline's job (``DitJob``) is keyed the same way by its
transformer, with the patch's own plan, and calibrates that plan's interval (``Calibration.for_dit``).
docs/calibration.md, 'diffusers'."""

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

from ...calibration import (
    MAX_RUNS,
    Calibration,
    CalibrationResult,
    KeptCalibrations,
    calibration_key,
    key_id,
    plan_words,
)
from ...calibration.fingerprint import SAMPLE, UnreadableModelError, patches_fingerprint
from ...calibration.store import FILE_ENV, SetAsideError
from ...reuse import FORECAST, FULL, KARRAS, KARRAS_PART, Spacing, decide, kept_plan
from ...reuse.samplers import noise_added
from ...reuse.whole_step import denoised_of
from ...version import __version__
from . import dit_attention, dit_reuse, unet_patch
from .layer_reuse import (
    PERTURBED,
    _Schedule,
    _sigma_of,
    calling_pipeline,
    installed,
    karras_or_none,
    perturbed_attention,
    scheduler_name,
    takes_eta,
)
from .whole_step import WholeStepReuse, v_prediction

if TYPE_CHECKING:
    from PIL import Image

log = logging.getLogger("tome_patch")

ENVIRONMENT = FILE_ENV  # a file path that overrides the cache folder's file
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


def run_plan(scheduler, first: int) -> tuple[str, str | None]:
    """The scheduler's name and its sigmas' kind, as the plans name them (a Karras schedule entered past its first
    step is part of one)."""
    sigmas = karras_or_none(scheduler)
    return scheduler_name(scheduler), KARRAS_PART if sigmas == KARRAS and first > 0 else sigmas


def adds_noise(scheduler, name: str, eta) -> str | None:
    """Why a sampler that adds noise at each step cannot calibrate (None: it adds none)."""
    noise = noise_added(name, {"eta": eta} if takes_eta(scheduler) else {})
    return None if noise is None else f"{name} with {noise} adds noise at each step: no plan is measured there"


@dataclass
class CalibrationReport:
    """What ``tome_core.calibrate`` did: the ``result`` kept in ``path`` under ``key_id`` and the unpatched run's
    ``output``; ``result`` None where the call could not calibrate (``why``: it ran as ``forecast v3``, a DiT as its
    family's plan). ``picture``:
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
    dit: bool = False  # a DiT pipeline's: its calls are ``DitJob``s
    reduces: bool = False  # the patch's settings reduce tokens (ToDo or ToMe): the search decides them too

    def say(self, why: str) -> None:
        """Log ``why`` a call cannot calibrate, once per reason: every call of the job would say it again."""
        if why not in self.said:
            self.said.add(why)
            runs = "its family's plan" if self.dit else "what forecast v3 runs for it"
            log.info("ToMe calibration: %s; running %s.", why, runs)


def _original_class(pipe) -> type:
    cls = type(pipe)
    return cls.__dict__[_PARENT] if _PARENT in cls.__dict__ else cls


def _calibrating_class(cls: type) -> type:
    """One subclass per pipeline class, of the same name (its saved config names the class as before)."""
    sub = _subclasses.get(cls)
    if sub is None:

        @functools.wraps(cls.__call__)
        def call(self, *args, **kwargs):
            return _job_class(self).call(self, args, kwargs).output

        members = {"__call__": call, _PARENT: cls, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
        sub = type(cls.__name__, (cls,), members)
        _subclasses[cls] = sub
    return sub


def _job_class(pipe) -> type[Job]:
    """The job that runs a call of ``pipe``: a DiT pipeline's calibrates its transformer's reuse."""
    calibrated = getattr(pipe, "__dict__", {}).get(_STATE)
    return DitJob if calibrated is not None and calibrated.dit else Job


def install(pipe, target: float, settings, dit: bool = False) -> None:
    """Calibrate ``pipe``'s calls from now on (its UNet, or with ``dit`` its transformer, already patched under a
    calibrating plan)."""
    others = {k: v for k, v in asdict(settings).items() if k not in ("reuse_plan", "calibration_target")}
    digest = hashlib.sha256(json.dumps(others, sort_keys=True, default=str).encode()).hexdigest()[:16]
    pipe.__dict__[_STATE] = Calibrated(target, digest, set(), dit, not settings.reduces_nothing)
    pipe.__class__ = _calibrating_class(_original_class(pipe))


def remove(pipe) -> None:
    getattr(pipe, "__dict__", {}).pop(_STATE, None)
    if _PARENT in type(pipe).__dict__:
        pipe.__class__ = _original_class(pipe)


def calibrate(pipe, args: tuple, kwargs: dict) -> CalibrationReport:
    """``tome_core.calibrate``: run the call unpatched and calibrate its job anew, whatever is kept for it."""
    job_class = _job_class(pipe)
    if _STATE not in pipe.__dict__ or job_class.owner_of(pipe) is None:
        raise ValueError(
            "tome_core.calibrate needs a pipeline patched with tome_core.apply_patch(pipe, reuse_plan='calibrated') "
            "whose UNet forecasts (reuse_interval above 1) or whose DiT reuses steps"
        )
    job = job_class.call(pipe, args, kwargs, force=True)
    why = job.why or (None if job.result is not None else f"the pipeline never called its {job_class.DENOISER}")
    return CalibrationReport(
        job.result, job.path, job.key_id, job.output, why, picture=job.picture, picture_path=job.picture_path
    )


def _owner(pipe):
    unet = getattr(pipe, "unet", None)
    return installed(getattr(unet, "_orig_mod", unet)) if unet is not None else None


def _transformer(pipe):
    """The pipeline's transformer, out of a torch.compile wrapper (None: it has none)."""
    transformer = getattr(pipe, "transformer", None)
    return getattr(transformer, "_orig_mod", transformer)


def weights_fingerprint(unet) -> str:
    """The UNet's (or transformer's) tensors (LoRA/PEFT adapters' included) by name, shape, dtype and a strided
    sample of values, read in one transfer per device and dtype: every call reads them (a fused LoRA changes weights
    in place)."""
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

    DENOISER = "UNet"  # in the log lines: the model the job keys and patches
    FALLBACK = "forecast v3"  # what a call that cannot calibrate runs

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
        self.reduction = None  # the model's token reduction state (``reduction_of``; None: it reduces nothing)

    @staticmethod
    def owner_of(pipe):
        """The reuse this job calibrates: the UNet's forecasting owner (None: it has none)."""
        owner = _owner(pipe)
        return owner if isinstance(owner, WholeStepReuse) else None

    @staticmethod
    def denoiser_of(pipe):
        """The model the job keys and probes, out of a torch.compile wrapper."""
        return getattr(pipe.unet, "_orig_mod", pipe.unet)

    @staticmethod
    def reduction_of(denoiser):
        """The UNet's ToDo/ToMe state, which a run of the job may switch off (None: the patch reduces nothing)."""
        return unet_patch.reduction_of(denoiser)

    @classmethod
    def call(cls, pipe, args: tuple, kwargs: dict, force: bool = False) -> Job:
        """Run the call: with the kept plan, else unpatched and then the calibration (``run``)."""
        job = cls(pipe, force)
        original = _original_class(pipe).__call__
        calibrated, owner = pipe.__dict__.get(_STATE), cls.owner_of(pipe)
        arguments = None
        if calibrated is None or owner is None:
            job.why = "the pipeline is not patched to calibrate"
        else:
            arguments = job._arguments(original, args, kwargs)
            if arguments is None:
                calibrated.say(job.why)
        if arguments is None:
            job.output = original(pipe, *args, **kwargs)
            return job
        job.calibrated, job.owner, job.arguments = calibrated, owner, arguments
        job.denoiser = cls.denoiser_of(pipe)
        job.reduction = cls.reduction_of(job.denoiser)
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
        """The user's run (probed at its first model call), then the calibration where the probe started one."""
        held = self._hold()
        generators = self._generators()
        states = [g.get_state() for g in generators]
        probe = self.denoiser.register_forward_pre_hook(
            torch.compiler.disable(self.probe), with_kwargs=True, prepend=True
        )
        try:
            self.output, user_latents = self._run(original, self.arguments, states, generators, False)
        finally:
            probe.remove()
            self._unobserve()
            self._release(held)
        if self.calibration is None:
            return
        after = [g.get_state() for g in generators]
        second, second_generators, second_states = None, [], []
        if user_latents.shape[0] < 2:
            second = self._second(generators)
            second_generators = self._generators_of(second)
            second_states = [g.get_state() for g in second_generators]

        def sample(schedule):
            self._use(schedule, held)
            if schedule is None:
                parts = [user_latents]
            else:
                parts = [self._run(original, self.arguments, states, generators, True)[1]]
            if second is not None:
                parts.append(self._run(original, second, second_states, second_generators, True)[1])
            return torch.cat(parts)

        try:
            self.result = self.calibration.run(sample, observed=self._observed, counted=self._counted)
        finally:
            self._release(held)
            for generator, state in zip(generators, after, strict=True):
                generator.set_state(state)
        seeds = user_latents.shape[0] + (second is not None)
        record = {"metric": "latent SSIM, worst sample", "seeds": seeds, "host": "diffusers",
                  "date": time.strftime("%Y-%m-%d %H:%M:%S")}  # fmt: skip
        KeptCalibrations(self.path).put(self.key_id, self.key, self.result, record)
        self.picture, self.picture_path = self._draw()
        log.info("ToMe calibration: kept in %s: %s (%d runs); its picture: %s.", self.path, self.result.words(),
                 self.result.runs, self.picture_path or "not saved")  # fmt: skip

    # --- the owner's state: what each run of the job computes ---

    def _hold(self):
        """The owner's state before the job, for ``_release``: the UNet's plan."""
        return self.owner.plan

    def _release(self, held) -> None:
        """The owner as it was before the job, whatever happened in it."""
        self.owner.plan, self.owner.suspended = held, False
        self._reducing(True)

    def _reduces(self) -> bool:
        """Whether the search decides ToDo/ToMe: the settings reduce and the model has the reduction (a DiT's
        family settings or a family without ToDo leave it out)."""
        return self.calibrated.reduces and self.reduction is not None

    def _reduces_in(self, schedule) -> bool:
        """Whether the next run of the search reduces tokens: never the unpatched one (None), a candidate's as the
        search says (``Calibration.reducing``), or as set where the search does not decide them."""
        return schedule is not None and (self.calibration.reducing or not self.calibration.reduces)

    def _reducing(self, on: bool) -> None:
        """ToDo/ToMe on or off for the next run (off: the unpatched run, or a plan kept without them)."""
        if self.reduction is not None:
            self.reduction.suspended = not on

    def _use(self, schedule, held) -> None:
        """The owner set for the next run: unpatched (None) or forecast on a candidate's ``schedule``, with ToDo/ToMe
        where the search runs them (``Calibration.reducing``)."""
        self.owner.suspended = schedule is None
        self._reducing(self._reduces_in(schedule))
        if schedule is not None:
            sampler, schedule_name = self.run_plan
            spacing = Spacing(schedule.full_start, schedule.full_end, every=schedule.interval)
            self.owner.plan = kept_plan(held, sampler, schedule_name, spacing)

    def _use_kept(self, kept: CalibrationResult) -> None:
        """The owner set for the user's run on the plan ``kept`` for its job, with ToDo/ToMe where it keeps them."""
        self._reducing(kept.reduce)
        if kept.spacing is None:
            self.owner.suspended = True
        else:
            self.owner.plan = kept_plan(self.owner.plan, *self.run_plan, kept.spacing)

    def _counted(self) -> int | None:
        """The steps the last candidate computed (None: as planned: a forecast adds none)."""
        return None

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

    def _denoising(self, scheduler):
        """``(arguments, output, sample, level) -> denoised`` of one step, from the guided model output the step is
        handed and the scheduler's unit-variance input (``scale_model_input``) at the step's noise level, as the
        forecast reads a UNet call's: every scheduler the calibration runs on has it, ``pred_original_sample`` or
        not (DPM++ 2M)."""
        predicts_v = bool(v_prediction(scheduler))

        def denoised(arguments: dict, output: torch.Tensor, sample: torch.Tensor, level: float) -> torch.Tensor:
            x = scheduler.scale_model_input(sample, arguments.get("timestep")).float()
            return denoised_of(output.float(), x, level, predicts_v)

        return denoised

    def _observe(self, scheduler) -> None:
        """Wrap ``scheduler.step`` (on the instance, for the unpatched run only: ``_unobserve`` undoes it) to keep
        the first sample's denoised image at each step (``_denoising``; nothing where it has none)."""
        denoising = self._denoising(scheduler)
        if denoising is None:
            return
        original, saved = scheduler.step, scheduler.__dict__.get("step")
        signature, levels, sink, calls = inspect.signature(original), self.levels, self.denoised, [0]

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
                sink.append(denoising(arguments, output[:1], sample[:1], levels[call]).cpu())
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

    # --- the first model call: the key, then the kept plan, the unpatched run or what runs without a calibration ---

    def _inputs(self, args: tuple, kwargs: dict) -> tuple[object, float | None]:
        """(the model call's noisy input, its timestep on the scheduler's scale; None where it has none)."""
        sample = args[0] if args else kwargs.get("sample")
        timestep = args[1] if len(args) > 1 else kwargs.get("timestep")
        return sample, None if timestep is None else float(torch.as_tensor(timestep).max())

    def probe(self, module, args, kwargs):
        """At the run's first model call: key the job, then set the owner for the kept plan or the unpatched run."""
        if self.probed:
            return None
        self.probed = True
        caller, eta = calling_pipeline(module)
        sample, timestep = self._inputs(args, kwargs)
        scheduler = getattr(caller, "scheduler", None)
        timesteps = getattr(scheduler, "timesteps", None)
        if caller is not self.pipe or not isinstance(sample, torch.Tensor) or not isinstance(timesteps, torch.Tensor):
            return self._cannot(f"the {self.DENOISER} was called outside the pipeline's own steps")
        schedule = _Schedule(timesteps)
        first = None if timestep is None else schedule.step_of(timestep, getattr(scheduler, "_step_index", None))
        if first is None:
            return self._cannot(f"the {self.DENOISER}'s first call is not on the scheduler's timesteps")
        why = self._why_not(scheduler, schedule, first, eta, sample)
        if why is not None:
            return self._cannot(why)
        try:
            self.key = self._key(scheduler, schedule, first, sample, kwargs)
            self.key_id, self.path = key_id(self.key), store_path()
            kept = None if self.force else KeptCalibrations(self.path).get(self.key_id)
        except UnreadableModelError as err:
            log.warning("ToMe calibration: this %s cannot be keyed by its content (%s); running %s.", self.DENOISER,
                        err, self.FALLBACK)  # fmt: skip
            return self._cannot(f"the {self.DENOISER} cannot be keyed by its content ({err})", said=True)
        except SetAsideError as err:
            return self._cannot(f"the calibrations' file was set aside ({err})", said=True)
        if kept is not None:
            log.info("ToMe calibration: the plan kept for this job in %s: %s.", self.path, kept.words())
            self._use_kept(kept)
            self.calibration = None
            return None
        self.calibration.start_from(KeptCalibrations(self.path).nearest(self.key, self.calibration.steps))
        self._use(None, None)
        self._observe(scheduler)
        log.info("ToMe calibration: a new job for this %s; up to %d runs (the first unpatched: this call's "
                 "picture); the result is kept in %s.", self.DENOISER, self.calibration.max_runs,
                 self.path)  # fmt: skip
        return None

    def _cannot(self, why: str, said: bool = False) -> None:
        self.calibration, self.why = None, why
        if not said:
            self.calibrated.say(why)
        return None

    def _why_not(self, scheduler, schedule, first: int, eta, sample: torch.Tensor) -> str | None:
        """Why this run cannot calibrate (None: it can); sets the calibration and the run's plan names."""
        name, sigmas = run_plan(scheduler, first)
        decision = decide(self.owner.plan, name, sigmas, self.owner.schedule.interval)
        if decision.runs != FORECAST:
            return f"{decision.why}: no forecast to calibrate"
        if perturbed_attention(self.pipe):
            return f"{PERTURBED}: no forecast to calibrate"
        if (noise := adds_noise(scheduler, name, eta)) is not None:
            return noise
        if v_prediction(scheduler) is None:
            return f"{name} predicts {getattr(scheduler.config, 'prediction_type', None)!r}: no forecast"
        levels = self._levels(scheduler, schedule, first)
        if levels is None or not all(math.isfinite(level) and level > 0 for level in levels):
            return f"{name}'s noise levels are not all known: no forecast"
        steps = len(levels)
        calibration = Calibration(
            decision.schedule.for_run(steps), steps, self.calibrated.target, MAX_RUNS, reduces=self._reduces()
        )
        if not calibration.candidates:
            return f"a run of {steps} steps (under 10 forecasts nothing)"
        self.calibration, self.run_plan, self.levels = calibration, (name, sigmas), levels
        return None

    @staticmethod
    def _levels(scheduler, schedule, first: int) -> list[float] | None:
        levels = [_sigma_of(scheduler, step, t) for step, t in enumerate(schedule.values)][first:]
        return None if None in levels else levels

    KEYED_ARGUMENTS = ("strength", "denoising_start", "denoising_end", "guidance_rescale")  # in the key where set

    def _extra(self, scheduler, first: int, attention) -> list[str]:
        """The key's words beside the model and the run: the pipeline, scheduler, settings, target and call."""
        config = {k: v for k, v in dict(scheduler.config).items() if not k.startswith("_")}
        extra = [
            f"pipeline:{_original_class(self.pipe).__name__}",
            f"scheduler:{type(scheduler).__name__}:{_digest(config)}",
            f"settings:{self.calibrated.settings}",
            f"target:{self.calibrated.target}",
            f"first step:{first}",
        ]
        for name in self.KEYED_ARGUMENTS:
            if self._default(name) is not None:
                extra.append(f"{name}:{self._default(name)}")
        if isinstance(attention, dict) and attention.get("scale") is not None:
            extra.append(f"lora scale:{float(attention['scale'])}")
        return extra

    def _key(self, scheduler, schedule, first: int, sample: torch.Tensor, kwargs: dict) -> dict:
        """The job's key (``calibration_key``): the UNet by its content and the call's run."""
        guidance = getattr(self.pipe, "_guidance_scale", None)
        return calibration_key(
            model=weights_fingerprint(self.denoiser),
            patches=adapters_fingerprint(self.denoiser),
            sampler=scheduler_name(scheduler),
            sigmas=self._levels(scheduler, schedule, first),
            cfg=guidance if guidance is not None else self._default("guidance_scale"),
            shape=sample.shape[1:],
            version=__version__,
            extra=self._extra(scheduler, first, kwargs.get("cross_attention_kwargs") or {}),
        )


# --- a DiT pipeline's job: its family's plan at the kept interval, or a calibration over the intervals ---

NEGATIVE_PROMPTS = ("negative_prompt", "negative_prompt_embeds")  # given: true CFG runs (Flux, Qwen-Image)


def flow_matching(scheduler) -> bool:
    """Whether the scheduler's model output is a flow's velocity, the denoised image ``sample - level * output``."""
    config = getattr(scheduler, "config", None)
    if type(scheduler).__name__.startswith("FlowMatch"):
        return True
    return getattr(config, "prediction_type", None) == "flow_prediction" or bool(getattr(config, "use_flow_sigmas", 0))


def token_grid(tokens: int, ratio: float) -> tuple[int, int]:
    """(rows, columns) of ``tokens`` image tokens whose grid is nearest ``ratio`` (height over width)."""
    pairs = [(rows, tokens // rows) for rows in range(1, tokens + 1) if tokens % rows == 0]
    return min(pairs, key=lambda pair: abs(math.log(pair[0] / pair[1] / ratio)))


class DitJob(Job):
    """One call of a DiT pipeline under "calibrated": the transformer's reuse (``DitReuse``) runs its family's plan
    at the kept interval, or the job runs unpatched and then that plan at other intervals (``Calibration.for_dit``)
    on the same noise, each candidate's computed steps read from its runs (a guard adds some)."""

    DENOISER = "transformer"
    FALLBACK = "its family's plan"
    KEYED_ARGUMENTS = (*Job.KEYED_ARGUMENTS, "true_cfg_scale", "guidance_scale_2")

    def __init__(self, pipe, force: bool = False):
        super().__init__(pipe, force)
        self.runs: list = []  # the reuse runs of the sample being made (one per seed), for their computed steps

    @staticmethod
    def owner_of(pipe):
        """The transformer's ``DitReuse`` (None: it reuses no step)."""
        transformer = _transformer(pipe)
        return None if transformer is None else dit_reuse.installed(transformer)

    @staticmethod
    def denoiser_of(pipe):
        """The pipeline's transformer, the model the job keys and probes."""
        return _transformer(pipe)

    @staticmethod
    def reduction_of(denoiser):
        """The transformer's ToDo state, which a run of the job may switch off (None: no ToDo here)."""
        return dit_attention.state_of(denoiser)

    def _inputs(self, args: tuple, kwargs: dict) -> tuple[object, float | None]:
        """The transformer call's noisy input and timestep, read as its reuse reads them (``DitLayout``)."""
        owner = self.owner
        if owner.layout.inputs is not None:
            sample, timestep = owner.layout.inputs(args, kwargs)
        else:
            sample = args[0] if args else kwargs.get(owner.SAMPLE)
            timestep = args[1] if len(args) > 1 else kwargs.get("timestep")
        if timestep is None:
            return sample, None
        return sample, float(torch.as_tensor(timestep).max()) * owner.TIMESTEP_SCALE

    def _hold(self):
        """Nothing to keep: the owner's own schedule stays, a calibration's is set beside it."""
        return None

    def _release(self, held) -> None:
        """The owner on its family's plan again, whatever happened in the job."""
        self.owner.calibration_schedule, self.owner.suspended = None, False
        self._reducing(True)

    def _use(self, schedule, held) -> None:
        """The owner set for the next run: unpatched (None) or on a candidate's ``schedule``, with ToDo where the
        search runs it (``Calibration.reducing``)."""
        self.owner.suspended = schedule is None
        self.owner.calibration_schedule = schedule
        self._reducing(self._reduces_in(schedule))
        self.runs.clear()

    def _use_kept(self, kept: CalibrationResult) -> None:
        """The owner on the family's plan at the kept interval, or every step in full where none was kept; ToDo
        where the kept plan keeps it."""
        self._reducing(kept.reduce)
        if kept.interval is None:
            self.owner.suspended = True
        else:
            self.owner.calibration_schedule = kept.dit_schedule(self.owner.schedule)

    def _counted(self) -> int | None:
        """The steps the last candidate computed on its costliest seed: a guard may add steps to a plan."""
        steps = self.calibration.steps
        counts = [round(steps * (1 - run.reused_calls / run.calls)) for run in self.runs if run.calls]
        return max(counts) if counts else None

    def _run(self, original, arguments: dict, states: list, generators: list, latent_only: bool):
        """``Job._run``, keeping the reuse run it made and its final latent as an image (``_as_image``)."""
        before = self.owner.run
        output, latents = super()._run(original, arguments, states, generators, latent_only)
        if self.owner.run is not None and self.owner.run is not before:
            self.runs.append(self.owner.run)
        return output, self._as_image(latents)

    def _as_image(self, latents: torch.Tensor) -> torch.Tensor:
        """A packed latent (batch, tokens, channels: Flux, Qwen-Image) as (batch, channels, rows, columns), the
        grid at the call's aspect ratio, so that the score's windows see neighbours; others as they are."""
        if latents.dim() != 3:
            return latents
        batch, tokens, channels = latents.shape
        rows, columns = token_grid(tokens, self._aspect_ratio())
        return latents.transpose(1, 2).reshape(batch, channels, rows, columns)

    def _aspect_ratio(self) -> float:
        """The call's height over its width, a size left out at the pipeline's default (square where unknown)."""
        size = getattr(self.pipe, "default_sample_size", None)
        scale = getattr(self.pipe, "vae_scale_factor", None)
        default = size * scale if isinstance(size, int) and isinstance(scale, int) else None
        height, width = self._default("height") or default, self._default("width") or default
        return height / width if height and width else 1.0

    def _denoising(self, scheduler):
        """A flow's denoised image ``sample - level * output`` (None: the scheduler is no flow's, no chart)."""
        if not flow_matching(scheduler):
            return None

        def denoised(arguments: dict, output: torch.Tensor, sample: torch.Tensor, level: float) -> torch.Tensor:
            return sample.float() - level * output.float()

        return denoised

    def _why_not(self, scheduler, schedule, first: int, eta, sample: torch.Tensor) -> str | None:
        """Why this run cannot calibrate (None: it can); sets the calibration over the family plan's intervals."""
        name, sigmas = run_plan(scheduler, first)
        decision = decide(self.owner.plan, name, sigmas, None, dit=True)
        if decision.runs == FULL:
            return f"{decision.why}: it reuses no step to calibrate"
        if (noise := adds_noise(scheduler, name, eta)) is not None:
            return noise
        if sample.dim() == 3 and "num_frames" in self.parameters:
            return "its video latents are packed as tokens: no picture to score a plan by"
        levels = self._levels(scheduler, schedule, first)
        if levels is None or not all(math.isfinite(level) for level in levels):
            return f"{name}'s noise levels are not all known"
        steps, full_below = len(levels), (decision.fallback or decision).full_below
        calibration = Calibration.for_dit(
            self.owner.schedule,
            steps,
            levels,
            full_below,
            target=self.calibrated.target,
            max_runs=MAX_RUNS,
            reduces=self._reduces(),
        )
        if not calibration.candidates:
            return f"a run of {steps} steps (under 10 reuses nothing)"
        self.calibration, self.levels = calibration, levels
        return None

    def _key(self, scheduler, schedule, first: int, sample: torch.Tensor, kwargs: dict) -> dict:
        """The job's key: the transformer by its content, the call's run and the patch's own plan."""
        guidance = getattr(self.pipe, "_guidance_scale", None)
        attention = kwargs.get("joint_attention_kwargs") or kwargs.get("attention_kwargs") or {}
        extra = [*self._extra(scheduler, first, attention), f"plan:{plan_words(self.owner.schedule)}"]
        if any(self._default(name) is not None for name in NEGATIVE_PROMPTS):
            extra.append("negative prompt")
        return calibration_key(
            model=weights_fingerprint(self.denoiser),
            patches=adapters_fingerprint(self.denoiser),
            sampler=scheduler_name(scheduler),
            sigmas=self.levels,
            cfg=guidance if guidance is not None else self._default("guidance_scale"),
            shape=sample.shape[1:],
            version=__version__,
            extra=extra,
        )
