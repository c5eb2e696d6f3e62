"""diffusers wiring of layer reuse (setting ``reuse_interval``; the engine is ``tome_core.reuse``).

Which layers: the split of ComfyUI's ldm UNet with one outer block on each side (``unet_layout.inner_layers``).
``UNet2DConditionModel.forward`` runs ``conv_in``, every down block, the mid block, every up block, then
``conv_norm_out``/``conv_out``; the last up block pairs its resnets with its attentions (CrossAttnUpBlock2D) or
has resnets only (UpBlock2D), its last resnet reading ``conv_in``'s output through the skip connection. Kept,
run at every step: ``conv_in``, that last resnet (and its attention) and what follows it. Inner: the down blocks,
the mid block and the up blocks before the last one, each whole (the UNet calls each as a module), then the last
up block's earlier resnets and attentions, one by one; the last of them is the boundary. Skip tensors of inner
layers feed only inner layers, so their stand-in zeros are never seen by a kept layer; ControlNet's residuals are
added to the down blocks' skip tensors and to the mid block's output: to zeros (of the recorded shapes) at a
reusing step, where nothing kept reads them, except the residual on ``conv_in``'s output, which still counts.

Which step: diffusers has no sampling-run hook, so a run is found from the pipeline's scheduler. Pipelines call
``scheduler.set_timesteps`` (a new ``timesteps`` tensor) before their loop and give the UNet one of those
timesteps per call. A forward pre-hook on the UNet finds the call's step in ``pipe.scheduler.timesteps``; a new
schedule, or a step that goes back, starts a new run, whose first step is the first one called (image-to-image
starts part way); the run's cache is dropped after its last step. A call whose step is not on the schedule runs
in full. A bare UNet has no scheduler to follow: ``apply_patch`` refuses reuse_interval > 1 there.

Every inner layer gets an instance attribute ``forward`` (a ``SkippableLayer``); removal deletes them and the
hooks, so the UNet then computes bit-identically to one never patched.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable

import torch

from ...reuse import (
    DEFAULT_EXTRAPOLATE,
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

log = logging.getLogger("tome_patch")

_STATE = "_tome_patch_layer_reuse"  # on the UNet: the PipelineReuse object
_HOOKS = "_tome_patch_layer_reuse_hooks"  # on the UNet: the pre-hook's and the forward hook's handles
# The last up block's classes whose forward runs resnet i, then attention i, reading skip i from the end.
PAIRED_UP_BLOCKS = ("CrossAttnUpBlock2D", "UpBlock2D")


def inner_layers(unet) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of the layers that reuse skips, in the order a UNet call runs them; empty for a layout
    this split does not know (see the module docstring)."""
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
        """Index of the call's timestep; the scheduler's own step index where it agrees (second-order schedulers
        such as Heun list each timestep twice), else the first equal value."""
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
    """The owner of the UNet's ``SkippableLayer``s: follows the pipeline's runs and holds the current one.

    The DiT door (``dit_reuse``) subclasses it: the names of the model's input, the scale of its timestep and the
    calls that must run every layer are what differ."""

    SAMPLE = "sample"  # the keyword of the model's noisy input (also its first positional argument)
    DIT = False  # a DiT's door: its scheduler rules (``plans.DIT_PLAN``), no forecast
    TIMESTEP_SCALE = 1.0  # the pipeline passes the scheduler's timestep divided by this (Flux: 1000)
    # How a UNet pipeline whose scheduler has no plan (SD1.5 ships PNDM) gets the default's speed.
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
        self.run: LayerReuseRun | None = None  # the run in progress (kept after its end for its counts)
        self._first_step = 0  # the run's first step in the scheduler's timesteps
        self._last_step = -1
        self._call_in_step = 0  # calls at the same step with the same layout (cond, then uncond) keep apart
        self._calls_per_step = 1  # the most calls one step of this run has made (the last step's end is its last)
        self._logged: LayerReuseRun | None = None  # the run whose summary was logged (once per run)
        self._refused: type | None = None  # the scheduler class last refused (logged once)

    def _scheduler_timesteps(self):
        pipeline = self._pipeline()
        scheduler = getattr(pipeline, "scheduler", None)
        timesteps = getattr(scheduler, "timesteps", None)
        if not isinstance(timesteps, torch.Tensor) or timesteps.numel() == 0:
            return None, None
        return scheduler, timesteps

    def before_call(self, module, args, kwargs):
        self._current = None
        sample = args[0] if args else kwargs.get(self.SAMPLE)
        timestep = args[1] if len(args) > 1 else kwargs.get("timestep")
        scheduler, timesteps = self._scheduler_timesteps()
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
        decision = self.decision(scheduler, step if starts else self._first_step)
        if decision.runs == FULL:  # every step in full
            if self._refused is not type(scheduler):
                self._refused = type(scheduler)
                hint = "" if self.DIT else self.HINT
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
        # The run is over after the last step's last call, as many calls as the run's steps have made (a prompt
        # and a negative prompt as two calls: the second). Where the last step makes fewer, what the cache holds
        # stays until the next run starts or the patch is removed, and is never read by a call of another run.
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
        """What a run that ``scheduler`` steps from its step ``first_step`` runs (``plans.decide``): a run that starts
        later (img2img below strength 1) samples part of the scheduler's sigmas."""
        interval = None if self.DIT else self.schedule.interval
        schedule = karras_or_none(scheduler)
        if schedule == KARRAS and first_step > 0:
            schedule = KARRAS_PART
        return decide(self.plan, scheduler_name(scheduler), schedule, interval, dit=self.DIT)

    def run_for(self, scheduler, steps: int, levels: list[float] | None) -> LayerReuseRun:
        """The run of ``steps`` at noise ``levels`` (None: unknown) that ``scheduler`` starts."""
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


def scheduler_name(scheduler) -> str:
    """The scheduler's class name, the samplers' rule's name for it; a ``DPMSolverMultistepScheduler`` counts as
    DPM++ 2M only as DPM-Solver++ of order 2 (its default), else its name says which it is."""
    name = type(scheduler).__name__
    config = getattr(scheduler, "config", None)
    if name == "DPMSolverMultistepScheduler":
        algorithm, order = getattr(config, "algorithm_type", None), getattr(config, "solver_order", None)
        if algorithm != "dpmsolver++" or order != 2:
            return f"{name} ({algorithm}, order {order})"
    return name


def karras_or_none(scheduler) -> str | None:
    """ "karras" where the scheduler's sigmas are Karras sigmas (``use_karras_sigmas``), else None."""
    return KARRAS if getattr(getattr(scheduler, "config", None), "use_karras_sigmas", False) else None


def _sigma_of(scheduler, step: int, timestep: float) -> float | None:
    """The noise level of a call, where the prediction draws its line (as in the other hosts): the scheduler's own
    sigma of the step (Euler-like schedulers), or the one its timestep stands for (DDIM-like: from the cumulative
    alphas); None (the step index) where neither is known."""
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
    """Give ``unet`` layer reuse on ``schedule`` (the front door's: ``unet_schedule`` of the settings), following
    ``pipeline``'s scheduler, owned by an ``owner_class`` (a ``PipelineReuse``); False where the layout is not one
    this split knows (the UNet is then left as it is)."""
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
