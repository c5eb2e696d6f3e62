"""ComfyUI wiring of reuse across steps: an OUTER_SAMPLE wrapper asks ``plans.decide`` once per sampling run and
keeps the run in a copy of the guider's options; an APPLY_MODEL wrapper finds each call's step and batch layout, and
under a forecast returns a skipped call's output itself. docs/how-it-works.md, 'ComfyUI'."""

from __future__ import annotations

import logging

import torch

from ...calibration.fingerprint import settings_words
from ...reuse import (
    DEFAULT_EXTRAPOLATE,
    FORECAST,
    FULL,
    OUTER_BLOCKS,
    REUSE_PLANS,
    IntervalSchedule,
    LayerReuse,
    LayerReuseRun,
    WholeStepRun,
    attach_forwards,
    decide,
    detach_forwards,
    schedule_of,
)
from ...reuse.plans import Decision
from ...reuse.samplers import BETA, noise_added
from ...schedule import call_sigmas, step_of
from ..shared.model_patcher import REDUCTION_OFF_KEY
from ..shared.unet_layout import inner_layers
from .calibrate import sample_calibrated, sample_calibrated_dit
from .sampling_run import run_options, sample_with_run

log = logging.getLogger("tome_patch")

RUN_KEY = "tome_patch_layer_reuse_run"  # transformer_options: the current run's ``RunState``
WRAPPER_KEY = "tome_patch_layer_reuse"
INJECTION_KEY = "tome_patch_layer_reuse"
OUTER_SAMPLE = "outer_sample"  # comfy.patcher_extension.WrappersMP.OUTER_SAMPLE
APPLY_MODEL = "apply_model"  # comfy.patcher_extension.WrappersMP.APPLY_MODEL
PREDICT_NOISE = "predict_noise"  # comfy.patcher_extension.WrappersMP.PREDICT_NOISE: one sampler call
STEP_CACHE_KEY = "easycache"  # transformer_options: ComfyUI's EasyCache and LazyCache keep their state there


class LayerReuseHooks(LayerReuse):
    """Shared by every clone of one patch; the run lives in the sampling run's options."""

    DIT = False  # a DiT's door: its sampler rules (``plans.DIT_PLAN``), no forecast

    def __init__(self, schedule: IntervalSchedule, layers: int, noise_range, extrapolate=DEFAULT_EXTRAPOLATE):
        super().__init__(schedule, layers, extrapolate)
        self.noise_range = noise_range
        self.last_run: LayerReuseRun | None = None  # the last run, its cache dropped (for the log and the tests)
        self.reduces = False  # the patch reduces tokens: a calibration decides whether its plan does
        self.settings_words: tuple[str, ...] = ()  # the patch's settings in a calibration's key

    def outer_sample_wrapper(self, executor, *args, **kwargs):
        guider = executor.class_obj
        if STEP_CACHE_KEY in guider.model_options.get("transformer_options", {}):
            # EasyCache or LazyCache decides the steps: two step caches take each other's forecasts for the model's.
            log.warning(
                "ToMe reuse across steps is off for this run: ComfyUI's EasyCache/LazyCache already skips steps on "
                "this model (the two together change the picture). ToDo/ToMe still apply."
            )
            return executor(*args, **kwargs)
        if guider.model_options.get("model_function_wrapper") is not None:
            log.warning(
                "ToMe reuse across steps is off for this run: another node wraps the whole model call "
                "(model_function_wrapper: a step cache such as Spectrum decides the steps). ToDo/ToMe still apply."
            )
            return executor(*args, **kwargs)
        if not self.DIT and guider.model_options.get("sampler_post_cfg_function"):
            # PAG, SAG, ...: not measured with a plan (docs/step-reuse.md, 'The workflows around the sampler').
            log.info(
                "ToMe reuse across steps is off for this run: a post-CFG function calls the model again at each step "
                "(PAG, SAG, ...): no plan is measured with one; every step runs in full. ToDo/ToMe still apply."
            )
            return executor(*args, **kwargs)
        sampler = args[2] if len(args) > 2 else kwargs.get("sampler")
        name = sampler_name(sampler)
        raw_sigmas = args[3] if len(args) > 3 else kwargs.get("sigmas")
        interval = None if self.DIT else self.schedule.interval
        schedule = schedule_name(guider, raw_sigmas)
        decision = decide(self.plan, name, schedule, interval, dit=self.DIT)
        noise = noise_added(name, getattr(sampler, "extra_options", None) or {})
        if noise is not None and decision.runs != FULL:
            # No built-in node sets these for Euler or Heun; a custom node's ``ksampler(name, extra_options)`` can.
            decision = Decision(FULL, f"sampler {name} with {noise} adds noise at each step: no plan is measured there")
        if decision.runs == FULL:
            log.info(
                "ToMe reuse across steps is off for this run: %s; every step runs in full. ToDo/ToMe still apply.",
                decision.why,
            )
            return executor(*args, **kwargs)
        sigmas = call_sigmas(raw_sigmas)
        if self.DIT and REUSE_PLANS[self.plan].calibrates:

            def run_dit_with(schedule, run_args=args, run_kwargs=kwargs, reduce=True):
                with run_options(guider, {} if reduce else {REDUCTION_OFF_KEY: True}):
                    if schedule is None:
                        return executor(*run_args, **run_kwargs)
                    run = self.new_run(len(sigmas), sigmas, decision.full_below, schedule=schedule)
                    state = RunState(run, sigmas)
                    return sample_with_run(executor, run_args, run_kwargs, RUN_KEY, state, run, self._ended)

            return sample_calibrated_dit(self, executor, args, kwargs, name, sigmas, decision.full_below, run_dit_with)
        if decision.runs == FORECAST and REUSE_PLANS[self.plan].calibrates:

            def run_with(schedule, run_args=args, run_kwargs=kwargs, reduce=True):
                with run_options(guider, {} if reduce else {REDUCTION_OFF_KEY: True}):
                    if schedule is None:
                        return executor(*run_args, **run_kwargs)
                    run = WholeStepRun(schedule, len(sigmas))
                    state = RunState(run, sigmas)
                    return sample_with_run(executor, run_args, run_kwargs, RUN_KEY, state, run, self._ended)

            return sample_calibrated(self, executor, args, kwargs, name, schedule, run_with)
        if decision.runs == FORECAST:
            run = WholeStepRun(decision.schedule, len(sigmas))
        else:
            run = self.new_run(len(sigmas), sigmas, decision.full_below)
        return sample_with_run(executor, args, kwargs, RUN_KEY, RunState(run, sigmas), run, self._ended)

    def _ended(self, run) -> None:
        self.last_run = run

    def position(self, sigma: float) -> float:
        """Where a call at ``sigma`` lies on the line the prediction follows: its noise level."""
        return sigma

    def predict_noise_wrapper(self, executor, *args, **kwargs):
        """Each sampler call starts counting its model calls afresh (``RunState.key``)."""
        options = args[2] if len(args) > 2 else kwargs.get("model_options")
        state = ((options or {}).get("transformer_options") or {}).get(RUN_KEY)
        if isinstance(state, RunState):
            state.calls.clear()
        return executor(*args, **kwargs)

    def apply_model_wrapper(
        self, executor, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options=None, **kwargs
    ):
        state = (transformer_options or {}).get(RUN_KEY)
        if state is None:  # the model called outside a sampling run: nothing to reuse
            return executor(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs)
        run, sigmas = state.run, state.sigmas
        sigma = float(t.max())
        step = step_of(sigmas, sigma)
        key = state.key(transformer_options.get("uuids"), x, sigma)
        if control is not None and not state.control_said:
            state.control_said = True
            log.info(
                "ToMe reuse across steps: a ControlNet or adapter runs at every step, the skipped ones too (it is "
                "computed before the model call that reuse skips): the speed-up is smaller."
            )
        allowed = self.noise_range.contains(sigma) and sigma >= run.full_below
        if isinstance(run, WholeStepRun):  # the whole call is skipped or computed; the layers run as they are
            run.begin_call(step, key, allowed=allowed, position=sigma)
            try:
                return run.run_call(
                    lambda: executor(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs)
                )
            finally:
                run.end_call()
        self.begin_call(run, step, key, allowed=allowed, position=self.position(sigma))
        try:
            return executor(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs)
        finally:
            self.end_call()


class RunState:
    """One run's state in its options; a second call of a layout in one sampler call has records of its own."""

    __slots__ = ("run", "sigmas", "calls", "sigma", "control_said")

    def __init__(self, run, sigmas):
        self.run, self.sigmas, self.calls, self.sigma, self.control_said = run, sigmas, {}, None, False

    def __deepcopy__(self, memo):
        return self  # shared by every copy of the options, like the run

    def key(self, uuids, x, sigma: float) -> tuple:
        if sigma != self.sigma:  # another step: a new sampler call, where no PREDICT_NOISE wrapper said so
            self.calls.clear()
            self.sigma = sigma
        layout = (tuple(str(u) for u in uuids or ()), tuple(x.shape), x.dtype)
        occurrence = self.calls.get(layout, 0)
        self.calls[layout] = occurrence + 1
        return (*layout, occurrence)


# Sampler functions whose name is not the sampler's: ComfyUI's "uni_pc" runs ``sample_unipc``.
_FUNCTION_TO_SAMPLER = {"unipc": "uni_pc", "unipc_bh2": "uni_pc_bh2"}


def sampler_name(sampler) -> str | None:
    """ComfyUI's name of a ``KSAMPLER`` (from its function ``sample_<name>``), or None."""
    function = getattr(sampler, "sampler_function", None)
    name = getattr(function, "__name__", "")
    if not name.startswith("sample_"):
        return None
    name = name[len("sample_") :]
    return _FUNCTION_TO_SAMPLER.get(name, name)


def schedule_name(guider, sigmas) -> str | None:
    """The schedule the run's sigmas are (``samplers.schedule_of``): ComfyUI hands over levels, not a name."""
    patcher = getattr(guider, "model_patcher", None)
    try:
        model_sampling = patcher.get_model_object("model_sampling")
        low, high = float(model_sampling.sigma_min), float(model_sampling.sigma_max)
    except (AttributeError, TypeError, ValueError):
        return None
    if not isinstance(sigmas, torch.Tensor):
        return None
    return schedule_of(sigmas, low, high) or _beta_or_none(model_sampling, sigmas)


def _beta_or_none(model_sampling, sigmas: torch.Tensor) -> str | None:
    """``BETA`` where ``sigmas`` are ComfyUI's beta schedule or a stretch of it (its start, or its end from denoise down
    to a quarter): its levels are the model's own, so other schedules are ruled out at once."""
    table = getattr(model_sampling, "sigmas", None)
    levels = sigmas.detach().float().cpu().flatten()
    steps = levels.numel() - 1
    if steps < 2 or not isinstance(table, torch.Tensor):
        return None
    inner = levels[levels > 0]
    gap = (inner[:, None] - table.detach().float().cpu()[None, :]).abs().amin(dim=1)
    if not bool((gap <= 1e-4 * inner).all()):
        return None
    try:
        from comfy.samplers import beta_scheduler

        for total in range(steps, 4 * steps + 1):
            whole = beta_scheduler(model_sampling, total)
            if whole.numel() < levels.numel():
                continue
            for part in (whole[-levels.numel() :], whole[: levels.numel()]):
                if torch.allclose(part, levels, rtol=1e-4, atol=1e-6):
                    return BETA
    except (ImportError, IndexError, ValueError, TypeError, RuntimeError):
        return None
    return None


class LayerInjection:
    """ComfyUI's PatcherInjection: ``inject`` gives the inner layers our forwards, ``eject`` removes them."""

    def __init__(self, hooks: LayerReuseHooks, layers: list, forward_class=None):
        self.hooks = hooks
        self.layers = layers
        self.forward_class = forward_class

    def __deepcopy__(self, memo):
        return self

    def inject(self, patcher) -> None:
        attach_forwards(self.hooks, self.layers, self.forward_class)

    def eject(self, patcher) -> None:
        detach_forwards(self.layers, lambda owner: owner is self.hooks)


def install(clone, settings, noise_range, schedule) -> bool:
    """Give ``clone`` reuse across steps on ``schedule`` (``unet_schedule``); False where it cannot."""
    layers = [layer for _, layer in inner_layers(clone.model.diffusion_model, OUTER_BLOCKS)]
    if not layers:
        return False
    if not (hasattr(clone, "add_wrapper_with_key") and hasattr(clone, "set_injections")):
        return False  # a patcher without wrappers or injections (Forge): the WebUI script runs it there
    hooks = LayerReuseHooks(schedule, len(layers), noise_range, DEFAULT_EXTRAPOLATE)
    hooks.plan = settings.reuse_plan
    hooks.target = settings.calibration_target
    hooks.reduces = not settings.reduces_nothing  # a calibration then decides ToDo/ToMe too
    hooks.settings_words = (settings_words(settings),)  # another ToDo or step range is another kept plan
    clone.add_wrapper_with_key(OUTER_SAMPLE, WRAPPER_KEY, hooks.outer_sample_wrapper)
    clone.add_wrapper_with_key(APPLY_MODEL, WRAPPER_KEY, hooks.apply_model_wrapper)
    clone.add_wrapper_with_key(PREDICT_NOISE, WRAPPER_KEY, hooks.predict_noise_wrapper)
    clone.set_injections(INJECTION_KEY, [LayerInjection(hooks, layers)])
    return True


def remove(patcher) -> None:
    """Remove everything layer reuse put on ``patcher`` (a clone)."""
    if hasattr(patcher, "remove_wrappers_with_key"):
        for kind in (OUTER_SAMPLE, APPLY_MODEL, PREDICT_NOISE):
            patcher.remove_wrappers_with_key(kind, WRAPPER_KEY)
    if hasattr(patcher, "remove_injections"):
        patcher.remove_injections(INJECTION_KEY)
