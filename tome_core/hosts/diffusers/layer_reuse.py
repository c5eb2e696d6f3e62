"""diffusers wiring of layer reuse (``reuse_interval``) on a ``UNet2DConditionModel``: its inner layers (all but
``conv_in``, the last up block's last resnet and what follows) get a ``SkippableLayer`` ``forward``. A pre-hook finds
the call's step in ``pipe.scheduler.timesteps``; a new schedule or a step that goes back starts a run.
docs/how-it-works.md, 'diffusers'."""

from __future__ import annotations

import inspect
import logging
import math
import sys
import weakref
from collections.abc import Callable

import torch

from ...reuse import (
    DEFAULT_EXTRAPOLATE,
    EXPONENTIAL,
    FULL,
    KARRAS,
    KARRAS_PART,
    Decision,
    IntervalSchedule,
    LayerReuse,
    LayerReuseRun,
    attach_forwards,
    decide,
    detach_forwards,
)
from ...reuse.samplers import BETA, noise_added

log = logging.getLogger("tome_patch")

_STATE = "_tome_patch_layer_reuse"  # on the UNet: the PipelineReuse object
_HOOKS = "_tome_patch_layer_reuse_hooks"  # on the UNet: the pre-hook's and the forward hook's handles
# The last up block's classes whose forward runs resnet i, then attention i, reading skip i from the end.
PAIRED_UP_BLOCKS = ("CrossAttnUpBlock2D", "UpBlock2D")


def inner_layers(unet) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of the layers that reuse skips, in call order; empty for a layout this split does not know."""
    downs = list(getattr(unet, "down_blocks", None) or ())
    ups = list(getattr(unet, "up_blocks", None) or ())
    if not downs or not ups or not any(c.__name__ in PAIRED_UP_BLOCKS for c in type(ups[-1]).__mro__):
        return []
    last = ups[-1]
    resnets = list(getattr(last, "resnets", None) or ())
    attentions = list(getattr(last, "attentions", None) or ())
    if len(resnets) < 2 or (attentions and len(attentions) != len(resnets)):
        return []
    layers = [(f"down_blocks.{i}", block) for i, block in enumerate(downs)]
    if getattr(unet, "mid_block", None) is not None:
        layers.append(("mid_block", unet.mid_block))
    layers += [(f"up_blocks.{i}", block) for i, block in enumerate(ups[:-1])]
    last_name = f"up_blocks.{len(ups) - 1}"
    for j in range(len(resnets) - 1):
        layers.append((f"{last_name}.resnets.{j}", resnets[j]))
        if attentions:
            layers.append((f"{last_name}.attentions.{j}", attentions[j]))
    return layers


class _Schedule:
    """The scheduler's ``timesteps`` as floats, read once per tensor (a new one per ``set_timesteps``)."""

    def __init__(self, timesteps: torch.Tensor):
        self.tensor = timesteps
        self.version = _version(timesteps)  # changes when the tensor is written in place
        self.values = [float(t) for t in timesteps.flatten().tolist()]

    def is_current(self, timesteps) -> bool:
        return timesteps is self.tensor and _version(timesteps) == self.version

    def step_of(self, timestep: float, step_index) -> int | None:
        """Index of the call's timestep, the scheduler's own step index where it agrees (Heun lists each twice)."""
        if isinstance(step_index, int) and 0 <= step_index < len(self.values):
            if _same(self.values[step_index], timestep):
                return step_index
        for i, value in enumerate(self.values):
            if _same(value, timestep):
                return i
        return None


def _version(tensor: torch.Tensor) -> int | None:
    """The tensor's version counter; None for a tensor made under ``torch.inference_mode`` (it has none)."""
    try:
        return tensor._version
    except RuntimeError:
        return None


def _same(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6)


class PipelineReuse(LayerReuse):
    """The owner of the UNet's ``SkippableLayer``s: follows the pipeline's runs (the DiT door subclasses it)."""

    SAMPLE = "sample"  # the keyword of the model's noisy input (also its first positional argument)
    DIT = False  # a DiT's door: its scheduler rules (``plans.DIT_PLAN``), no forecast
    TIMESTEP_SCALE = 1.0  # the pipeline passes the scheduler's timestep divided by this (Flux: 1000)
    HINT = " For the default's plan: pipe.scheduler = EulerDiscreteScheduler.from_config(pipe.scheduler.config)."

    def __init__(
        self,
        pipeline,
        schedule: IntervalSchedule,
        layers: list[tuple[str, torch.nn.Module]],
        allowed: Callable[[float], bool],
        extrapolate: float = DEFAULT_EXTRAPOLATE,
    ):
        super().__init__(schedule, len(layers), extrapolate)
        self._pipeline = weakref.ref(pipeline)  # held weakly, its scheduler looked up at each call (swaps follow)
        self.layer_modules = layers
        self.allowed = allowed
        self._timesteps: _Schedule | None = None
        self.run: LayerReuseRun | None = None
        self._first_step = 0
        self._last_step = -1
        self._call_in_step = 0  # calls at the same step with the same layout (cond, then uncond) keep apart
        self._calls_per_step = 1
        self._logged: LayerReuseRun | None = None
        self._refused: str | None = None  # the reason last said for running every step
        self._noise: str | None = None  # the option with which the run's scheduler adds noise ("eta 0.3")
        self._perturbed = False  # the run's pipeline adds perturbed-attention guidance (a UNet's: every step)
        self.suspended = False  # a calibration's unpatched run: every call runs in full, nothing recorded

    def _scheduler_timesteps(self, pipeline=None):
        pipeline = pipeline if pipeline is not None else self._pipeline()
        scheduler = getattr(pipeline, "scheduler", None)
        timesteps = getattr(scheduler, "timesteps", None)
        if not isinstance(timesteps, torch.Tensor) or timesteps.numel() == 0:
            return None, None
        return scheduler, timesteps

    def before_call(self, module, args, kwargs):
        self._current = None
        if self.suspended:
            return None
        sample = args[0] if args else kwargs.get(self.SAMPLE)
        timestep = args[1] if len(args) > 1 else kwargs.get("timestep")
        # The pipeline calling now, not only the one patched: a UNet shared by pipelines (``from_pipe``) follows
        # each one's scheduler and its call's eta.
        caller, eta = calling_pipeline(module)
        scheduler, timesteps = self._scheduler_timesteps(caller)
        if timesteps is None or timestep is None or not isinstance(sample, torch.Tensor):
            return None
        if self._timesteps is None or not self._timesteps.is_current(timesteps):
            self._timesteps = _Schedule(timesteps)
            self._new_run(None)
        t = float(torch.as_tensor(timestep).max()) * self.TIMESTEP_SCALE
        step = self._timesteps.step_of(t, getattr(scheduler, "_step_index", None))
        if step is None:  # not on the schedule (a call of the user's own): run in full, leave the run as it is
            return None
        starts = self.run is None or step < self._last_step
        if starts:
            self._noise = noise_added(scheduler_name(scheduler), {"eta": eta} if takes_eta(scheduler) else {})
            self._perturbed = not self.DIT and perturbed_attention(caller)
        decision = self.decision(scheduler, step if starts else self._first_step)
        if decision.runs == FULL:
            if self._refused != decision.why:
                self._refused = decision.why
                hint = "" if self.DIT else " For the default's plan: eta=0." if self._noise else self.HINT
                hint = "" if self._perturbed else hint
                log.warning("ToMe reuse across steps is off: %s; every step runs in full.%s", decision.why, hint)
            return None
        if starts:
            self._new_run(step, scheduler)
        self._call_in_step = self._call_in_step + 1 if step == self._last_step else 0
        self._calls_per_step = max(self._calls_per_step, self._call_in_step + 1)
        self._last_step = step
        # Pipelines that run the prompt and the negative prompt as two calls of one step (Wan, Flux's true CFG)
        # make them in the same order at every step: the call's place in its step tells them apart.
        key = (tuple(sample.shape), sample.dtype, self._call_in_step)
        position = _sigma_of(scheduler, step, t)
        allowed = self.allowed(t) and not self.must_run_in_full(module, kwargs)
        allowed = allowed and (position is None or position >= self.run.full_below)
        self.begin_call(self.run, step - self._first_step, key, allowed=allowed, position=position)
        return None

    def must_run_in_full(self, module, kwargs) -> bool:
        """Whether this call computes every layer whatever the schedule says (see the DiT door)."""
        return False

    def after_call(self, module, args, kwargs, output):
        """Also called when the UNet call raised (``always_call``): the next call starts clean."""
        if self.end_call() is None:
            return None
        # The run ends at its last step's last call; a cache left by a shorter last step is never read by another run.
        last_step = self._last_step >= len(self._timesteps.values) - 1
        if last_step and self._call_in_step + 1 >= self._calls_per_step:
            self._finish()
        return None

    def _new_run(self, first_step: int | None, scheduler=None) -> None:
        self._finish()
        self.run = None
        self._last_step = -1
        self._calls_per_step = 1
        if first_step is not None:
            self._first_step = first_step
            steps = len(self._timesteps.values) - first_step
            levels = [_sigma_of(scheduler, step, float(t)) for step, t in enumerate(self._timesteps.values)]
            levels = levels[first_step:] if None not in levels else None
            self.run = self.run_for(scheduler, steps, levels)

    def decision(self, scheduler, first_step: int = 0) -> Decision:
        """What a run from the scheduler's step ``first_step`` runs (later: part of its sigmas, e.g. img2img)."""
        interval = None if self.DIT else self.schedule.interval
        schedule = karras_or_none(scheduler)
        if schedule == KARRAS and first_step > 0:
            schedule = KARRAS_PART
        name = scheduler_name(scheduler)
        decision = decide(self.plan, name, schedule, interval, dit=self.DIT)
        if decision.runs == FULL:
            return decision
        if self._perturbed:
            return Decision(FULL, PERTURBED)
        if self._noise is None:
            return decision
        return Decision(FULL, f"{name} with {self._noise} adds noise at each step: no plan is measured there")

    def run_for(self, scheduler, steps: int, levels: list[float] | None) -> LayerReuseRun:
        decision = self.decision(scheduler, self._first_step)
        return self.new_run(steps, levels, (decision.fallback or decision).full_below)

    def _finish(self) -> None:
        run = self.run
        if run is None:
            return
        run.drop()
        if self._logged is not run:
            self._logged = run
            log.info("ToMe reuse across steps: %s", run.summary())

    def drop(self) -> None:
        self._finish()
        self.run = None
        self._timesteps = None
        self._current = None


DENOISERS = ("unet", "transformer", "transformer_2")  # a pipeline's attributes that hold its denoiser


# As ComfyUI's PAG node (a post-CFG function) runs a UNet's steps in full: docs/step-reuse.md, 'The workflows
# around the sampler'.
PERTURBED = (
    "perturbed-attention guidance (pag_scale above 0) adds a perturbed call at each step: no plan is measured with it"
)


def perturbed_attention(pipeline) -> bool:
    """Whether ``pipeline`` (a PAG pipeline's ``PAGMixin``) runs perturbed-attention guidance in this call."""
    return bool(getattr(pipeline, "do_perturbed_attention_guidance", False))


def calling_pipeline(module) -> tuple[object | None, object]:
    """(the pipeline whose ``__call__`` is running ``module``, that call's ``eta``), found in the call stack;
    (None, None) where no pipeline runs it (a loop of the user's own)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "__call__":
            local = frame.f_locals
            owner = local.get("self")
            if hasattr(owner, "scheduler") and any(
                getattr(getattr(owner, name, None), "_orig_mod", getattr(owner, name, None)) is module
                for name in DENOISERS
            ):
                return owner, local.get("eta")
        frame = frame.f_back
    return None, None


_TAKES_ETA: dict[type, bool] = {}


def takes_eta(scheduler) -> bool:
    """Whether the pipelines hand ``scheduler.step`` their ``eta`` (diffusers' ``prepare_extra_step_kwargs``)."""
    kind = type(scheduler)
    if kind not in _TAKES_ETA:
        try:
            _TAKES_ETA[kind] = "eta" in inspect.signature(scheduler.step).parameters
        except (TypeError, ValueError, AttributeError):
            _TAKES_ETA[kind] = False
    return _TAKES_ETA[kind]


def scheduler_name(scheduler) -> str:
    """The scheduler's class name; a ``DPMSolverMultistepScheduler`` counts as DPM++ 2M only at its defaults."""
    name = type(scheduler).__name__
    config = getattr(scheduler, "config", None)
    if name == "DPMSolverMultistepScheduler":
        algorithm, order = getattr(config, "algorithm_type", None), getattr(config, "solver_order", None)
        if algorithm != "dpmsolver++" or order != 2:
            return f"{name} ({algorithm}, order {order})"
    return name


def karras_or_none(scheduler) -> str | None:
    """The scheduler's sigmas where its config names them (``use_karras_sigmas``, ``use_exponential_sigmas``)."""
    config = getattr(scheduler, "config", None)
    if getattr(config, "use_karras_sigmas", False):
        return KARRAS
    if getattr(config, "use_beta_sigmas", False):
        return BETA
    return EXPONENTIAL if getattr(config, "use_exponential_sigmas", False) else None


def _sigma_of(scheduler, step: int, timestep: float) -> float | None:
    """The noise level of a call: the scheduler's sigma of the step, or its timestep's (DDIM-like); None: unknown."""
    sigmas = getattr(scheduler, "sigmas", None)
    timesteps = getattr(scheduler, "timesteps", None)
    if isinstance(sigmas, torch.Tensor) and isinstance(timesteps, torch.Tensor) and len(sigmas) > len(timesteps) - 1:
        if step < len(sigmas):
            return float(sigmas[step])
    alphas = getattr(scheduler, "alphas_cumprod", None)
    if isinstance(alphas, torch.Tensor) and 0 <= round(timestep) < len(alphas):
        alpha = float(alphas[round(timestep)])
        return ((1.0 - alpha) / alpha) ** 0.5 if alpha > 0 else None
    return None


def install(
    unet, pipeline, settings, allowed: Callable[[float], bool], schedule, owner_class: type = PipelineReuse
) -> bool:
    """Give ``unet`` layer reuse on ``schedule``, following ``pipeline``'s scheduler; False for an unknown layout."""
    layers = inner_layers(unet)
    if not layers:
        return False
    owner = owner_class(pipeline, schedule, layers, allowed)
    owner.plan = settings.reuse_plan
    attach_forwards(owner, [layer for _, layer in layers])
    unet.__dict__[_STATE] = owner
    unet.__dict__[_HOOKS] = (
        unet.register_forward_pre_hook(_disabled(owner.before_call), with_kwargs=True),
        unet.register_forward_hook(_disabled(owner.after_call), with_kwargs=True, always_call=True),
    )
    return True


def _disabled(hook):
    """Kept out of torch.compile's graph: the hooks read the host's scheduler and keep Python state."""
    return torch.compiler.disable(hook)


def installed(unet) -> PipelineReuse | None:
    return unet.__dict__.get(_STATE)


def remove(unet) -> None:
    """Remove everything ``install`` put on ``unet``; a no-op where nothing is."""
    owner = unet.__dict__.pop(_STATE, None)  # our layers' forwards are removed even without it (a copied UNet)
    for handle in unet.__dict__.pop(_HOOKS, ()):
        handle.remove()
    detach_forwards(unet.modules(), lambda other: isinstance(other, PipelineReuse))
    if owner is not None:
        owner.drop()
