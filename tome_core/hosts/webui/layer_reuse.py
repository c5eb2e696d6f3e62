"""WebUI and Forge wiring of layer reuse (``reuse_interval``): one ``PassReuse`` per sampling pass. A call's step is
the denoiser's ``step * steps // total_steps`` from the ``cfg_denoiser`` callbacks, checked against the lagging
``sampling_step`` (else it runs in full). The WebUI (ldm, sgm) gets instance ``forward``s and UNet hooks; Forge gets
object patches, set when it loads the clone. docs/how-it-works.md, 'AUTOMATIC1111 WebUI'."""

from __future__ import annotations

import math
import weakref

import torch

from ...reuse import (
    FULL,
    KARRAS,
    KARRAS_PART,
    LAYERS,
    OUTER_BLOCKS,
    Decision,
    IntervalSchedule,
    LayerReuse,
    LayerReuseRun,
    SkippableLayer,
    attach_forwards,
    decide,
    detach_forwards,
    on_karras,
    unet_schedule,
)
from ...reuse.samplers import noise_added, unmeasured_on
from ...schedule import NoiseRange, timestep_of_percent
from ..shared.unet_layout import attention_levels, inner_layers

_STATE = "_tome_patch_layer_reuse"  # on an ldm UNet: (PassReuse, hook handles, layers)
_reusing_unets: weakref.WeakSet = weakref.WeakSet()
_active: PassReuse | None = None  # the pass in progress (a WebUI process samples one pass at a time)


def denoiser_step(params) -> tuple[int, int] | None:
    """(step, steps) of the denoiser call that ``params`` (``CFGDenoiserParams``) announces, or None if unknown."""
    denoiser = getattr(params, "denoiser", None)
    calls, expected = getattr(denoiser, "step", None), getattr(denoiser, "total_steps", None)
    try:
        steps, reported = int(params.total_sampling_steps), int(params.sampling_step)
        calls, expected = int(calls), int(expected)
    except (TypeError, ValueError, AttributeError):
        return None
    if steps <= 0 or expected < steps or calls < 0:
        return None
    step = calls * steps // expected
    if step >= steps or not reported <= step <= reported + 1:
        return None
    return step, steps


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a is b or a == b


def _noise_level(params) -> float | None:
    """The sigma of the denoiser call (``CFGDenoiserParams.sigma``, one per batch entry, all equal in a pass)."""
    sigma = getattr(params, "sigma", None)
    try:
        return float(torch.as_tensor(sigma).max()) if sigma is not None else None
    except (TypeError, ValueError, RuntimeError):
        return None


class PassReuse(LayerReuse):
    """One sampling pass's layer reuse: the owner of its ``SkippableLayer`` forwards."""

    def __init__(self, p, schedule: IntervalSchedule, layers: int, noise_range: NoiseRange, full_below: float = 0.0):
        super().__init__(schedule, layers)
        self.p = p
        self.noise_range = noise_range
        self.full_below = full_below
        self.step: tuple[int, int] | None = None  # (step, steps) of the denoiser call in progress
        self.sigma: float | None = None  # its noise level, where the prediction draws its line (None: the step)
        self.unet_calls = 0
        self.run: LayerReuseRun | None = None
        self.finished = False
        self.conds = None
        self.prompt_changes = 0

    def on_cfg_denoiser(self, params) -> None:
        owner_p = getattr(getattr(params, "denoiser", None), "p", None)
        if owner_p is not None and owner_p is not self.p:  # another job's sampler: not this pass's steps
            self.step = None
            return
        self.step = denoiser_step(params)
        self.sigma = _noise_level(params)
        self.unet_calls = 0
        conds = (getattr(params, "text_cond", None), getattr(params, "text_uncond", None))
        if self.run is not None and self.conds is not None and not _same(conds, self.conds):
            # Prompt editing or alternation changed the prompt: nothing recorded before belongs to it.
            self.run.drop()
            self.prompt_changes += 1
        self.conds = conds

    def on_cfg_after_cfg(self, params) -> None:
        self.step = None

    def begin_unet_call(self, x, noise_level: float | None, layout=None) -> None:
        """A UNet call starts (``noise_level`` None: inside the range; ``layout`` None: its position in the call)."""
        position = self.unet_calls
        self.unet_calls += 1
        if self.finished or x is None:
            return
        if self.step is None:
            if self.run is not None:
                self.run.begin_call(None, None)
            return
        step, steps = self.step
        if self.run is None or self.run.steps != steps:
            self.run = self.new_run(steps, None, self.full_below)
        key = (position if layout is None else layout, tuple(x.shape), x.dtype)
        allowed = noise_level is None or self.noise_range.contains(noise_level)
        allowed = allowed and (self.sigma is None or self.sigma >= self.full_below)
        self.begin_call(self.run, step, key, allowed=allowed, position=self.sigma)

    def end_call(self, failed: bool = False) -> LayerReuseRun | None:
        run = super().end_call(failed)
        if run is not None and failed:
            self.run = None
        return run

    def finish(self) -> LayerReuseRun | None:
        """End the pass: nothing reuses any more; returns its run (its cache dropped) for the log."""
        self.finished = True
        self._current = None
        self.step = None
        run = self.run
        if run is not None:
            run.drop()
        return run


# The schedule "Automatic" gives these samplers their own (``samplers_k_diffusion``), as the samplers' rule names it.
AUTOMATIC_SCHEDULES = {"dpm++ 2m": "karras", "dpm++ sde": "karras"}
KARRAS_LABEL = " karras"  # a WebUI without ``p.scheduler`` names the schedule in the label: "DPM++ 2M Karras"


def sampler_and_schedule(p) -> tuple[str | None, str | None]:
    """The pass's sampler label and noise schedule (None and "Automatic": the sampler's own; ``KARRAS_PART`` for
    img2img below denoise 1 and the highres pass)."""
    hires = bool(getattr(p, "is_hr_pass", False))
    sampler = (_chosen(getattr(p, "hr_sampler_name", None)) if hires else None) or getattr(p, "sampler_name", None)
    label = (sampler or "").strip()
    forced = None if hasattr(p, "scheduler") else legacy_schedule(label)
    if label.lower().endswith(KARRAS_LABEL):
        sampler, scheduler = label[: -len(KARRAS_LABEL)], forced or KARRAS
    elif hasattr(p, "scheduler"):
        scheduler = (_chosen(getattr(p, "hr_scheduler", None)) if hires else None) or p.scheduler or "Automatic"
        if scheduler.strip().lower() == "automatic":
            scheduler = AUTOMATIC_SCHEDULES.get(label.lower())
    else:
        scheduler = forced
    part = hires or (hasattr(p, "init_images") and getattr(p, "denoising_strength", 1.0) < 1.0)
    return sampler, KARRAS_PART if part and on_karras(scheduler) else scheduler


def legacy_schedule(label: str | None) -> str | None:
    """Before v1.9 (no ``p.scheduler``): Settings' "Scheduler type" (``k_sched_type``), which sets every k-diffusion
    sampler's sigmas over the label's "Karras" (A1111 v1.6-v1.8 ``KDiffusionSampler.get_sigmas``); None: the label's."""
    chosen = getattr(_webui_opts(), "k_sched_type", None)
    if not isinstance(chosen, str) or chosen.strip().lower() in ("", "automatic"):
        return None
    return None if (label or "").strip().lower() in TIMESTEP_SAMPLERS else chosen.strip().lower()


def _chosen(label):
    """A highres pass's own choice, or None where it takes the first pass's ("Use same sampler", ...)."""
    return None if not isinstance(label, str) or label.startswith("Use same") else label


def decision_for(settings, p, dit: bool = False) -> Decision:
    """What a pass of job ``p`` runs under ``settings`` (``plans.decide`` on its sampler and schedule); every step
    where the sampler adds noise (``sampler_noise``), where the schedule is one no plan is measured on or the
    sampler parameters move its sigmas (``sigma_options``), or where a ControlNet unit switches mid-pass
    (``control_step_range``)."""
    interval = None if dit else settings.reuse_interval
    sampler, schedule = sampler_and_schedule(p)
    decision = decide(settings.reuse_plan, sampler, schedule, interval, dit=dit)
    if decision.runs == FULL:
        return decision
    noise = noise_added(sampler, sampler_noise(p, sampler))
    if noise is not None:
        return Decision(FULL, f"sampler {sampler} with {noise} (Settings > Sampler parameters or the request) adds "
                        "noise at each step: no plan is measured there")  # fmt: skip
    if unmeasured_on(schedule):
        return Decision(FULL, f"sampler {sampler} on {schedule} sigmas: no plan is measured there")
    options = sigma_options(p, sampler, schedule)
    if options is not None:
        return Decision(FULL, f"sampler {sampler} on {schedule} sigmas with {options} (Settings > Sampler "
                        "parameters or the request's override_settings): the plans are measured on the model's own "
                        "sigma range and Karras' rho 7")  # fmt: skip
    control = control_step_range(p)
    if control is not None:
        return Decision(FULL, f"a ControlNet unit with guidance start-end {control} switches on or off mid-pass: a "
                        "step skipped after the switch would be drawn from the steps before it")  # fmt: skip
    return decision


# Samplers of sd_samplers_timesteps.py: they step over timesteps, reading no schedule type and no sigma option.
TIMESTEP_SAMPLERS = frozenset({"ddim", "ddim cfg++", "plms", "unipc"})
# Schedule types whose sigmas do not depend on the sigma range (sd_schedulers.py: the model's own or fixed levels);
# None: "Automatic" for a sampler without a schedule of its own (the model's levels).
RANGE_FREE_SCHEDULES = frozenset({None, "uniform", "simple", "ddim", "turbo"})
RANGE_FREE_PREFIXES = ("align your steps", "align_your_steps")
# The schedules that take ``opts.rho``, and the rho the WebUI gives them at 0 (``Scheduler.default_rho``).
DEFAULT_RHO = {"karras": 7.0, "polyexponential": 1.0}


def sigma_options(p, sampler: str | None, schedule: str | None) -> str | None:
    """The sampler parameters (Settings > Sampler parameters; a request's ``override_settings``, which the WebUI
    puts in ``opts`` for the job) that move the pass's sigmas off ``schedule``'s over the model's own range at its
    default rho, as "rho 5" (A1111's and Forge's ``KDiffusionSampler.get_sigmas``); None where none does."""
    opts = _webui_opts()
    name = (schedule or "").strip().lower() or None
    if opts is None or (sampler or "").strip().lower() in TIMESTEP_SAMPLERS:
        return None
    if name in RANGE_FREE_SCHEDULES or name.startswith(RANGE_FREE_PREFIXES):
        return None
    found = []
    if getattr(opts, "use_old_karras_scheduler_sigmas", False):
        found.append("use_old_karras_scheduler_sigmas (sigmas 0.1 to 10)")
    # Before v1.9 the range and rho apply only under a "Scheduler type" other than Automatic.
    if hasattr(p, "scheduler") or legacy_schedule(sampler) is not None:
        values = {option: getattr(opts, option, 0.0) for option in ("sigma_min", "sigma_max")}
        if name in DEFAULT_RHO:
            values["rho"] = getattr(opts, "rho", 0.0)
        for option, value in values.items():
            number = _number(value)
            if number is None or (number != 0.0 and (option != "rho" or number != DEFAULT_RHO[name])):
                found.append(f"{option} {value!r}" if number is None else f"{option} {number:g}")
    return ", ".join(found) or None


def _number(value) -> float | None:
    try:
        return float(value or 0.0)
    except (TypeError, ValueError):
        return None


def control_step_range(p) -> str | None:
    """The step range (as "0.2-1") of an enabled ControlNet or IP-Adapter unit that guides part of the pass only:
    sd-webui-controlnet and Forge's built-in ControlNet keep their units in ``p.script_args`` and switch each on and
    off per step by its ``guidance_start`` / ``guidance_end``; an X/Y/Z plot sets ``p.control_net_guidance_*``."""
    ranges = []
    for unit in map(_control_unit, getattr(p, "script_args", None) or ()):
        if unit is not None and unit.get("enabled", True):
            ranges.append((unit.get("guidance_start", 0.0), unit.get("guidance_end", 1.0)))
    ends = getattr(p, "control_net_guidance_end", None)
    ends = getattr(p, "control_net_guidance_strength", None) if ends is None else ends  # the end's older name
    for values, as_range in (
        (getattr(p, "control_net_guidance_start", None), lambda value: (value, 1.0)),
        (ends, lambda value: (0.0, value)),
    ):
        for value in values if isinstance(values, (list, tuple)) else (values,):
            if value is not None:
                ranges.append(as_range(value))
    for start, end in ranges:
        first, last = _number(start), _number(1.0 if end is None else end)
        if first is None or last is None:
            return f"{start!r}-{end!r}"
        if first > 0.0 or last < 1.0:
            return f"{first:g}-{last:g}"
    return None


def _control_unit(arg) -> dict | None:
    """A ControlNet unit's ``enabled`` and range as a dict (an API request's units are dicts), else None."""
    if isinstance(arg, dict):
        return arg if "guidance_start" in arg or "guidance_end" in arg else None
    if not (hasattr(arg, "guidance_start") and hasattr(arg, "guidance_end")):
        return None
    return {name: getattr(arg, name) for name in ("enabled", "guidance_start", "guidance_end") if hasattr(arg, name)}


def sampler_noise(p, sampler: str | None) -> dict:
    """The noise options the WebUI hands ``sampler`` (sd_samplers_common.py ``Sampler.initialize``): DDIM's eta is
    the request's, else ``eta_ddim``; Euler's and Heun's s_churn is the request's or the setting's, whichever is set."""
    opts = _webui_opts()
    label = (sampler or "").strip().lower()
    if label == "ddim":
        eta = getattr(p, "eta", None)
        return {"eta": getattr(opts, "eta_ddim", 0.0) if eta is None else eta}
    churns = [getattr(p, "s_churn", None), getattr(opts, "s_churn", None)]
    return {"s_churn": next((churn for churn in churns if churn), 0.0)}


def _webui_opts():
    try:
        from modules import shared
    except ImportError:  # not inside a WebUI (tests, tools): the request's values alone
        return None
    return getattr(shared, "opts", None)


def schedule_for(settings, unet, decision: Decision):
    """The layer-reuse schedule of a pass that ``decision`` gives layer reuse; None where it runs every step."""
    if decision.runs != LAYERS:
        return None
    return unet_schedule(settings.reuse_interval, attention_levels(unet), settings.reuse_plan)


def _activate(owner: PassReuse) -> PassReuse:
    global _active
    end_pass()
    _active = owner
    return owner


def end_pass() -> LayerReuseRun | None:
    """Finish the pass in progress (if any); returns its run when it made model calls."""
    global _active
    owner, _active = _active, None
    if owner is None:
        return None
    run = owner.finish()
    return run if run is not None and run.calls else None


def active_pass() -> PassReuse | None:
    return _active


def on_cfg_denoiser(params) -> None:
    """``script_callbacks.on_cfg_denoiser``: the step of the denoiser call that starts."""
    if _active is not None:
        _active.on_cfg_denoiser(params)


def on_cfg_after_cfg(params) -> None:
    """``script_callbacks.on_cfg_after_cfg``: the denoiser call is over."""
    if _active is not None:
        _active.on_cfg_after_cfg(params)


def install_ldm(unet, settings, p, schedule, full_below: float = 0.0, num_timesteps: int = 1000) -> PassReuse | None:
    """Give the WebUI's ``unet`` layer reuse on ``schedule`` for one pass of job ``p``; None where nothing to do."""
    remove_ldm(unet)
    layers = [layer for _, layer in inner_layers(unet, OUTER_BLOCKS)]
    if schedule is None or not layers:
        return None
    # The WebUI's UNet receives the DDPM timestep (999 at the start of sampling, 0 at the end).
    noise_range = NoiseRange(
        settings.start_percent, settings.end_percent, lambda q: timestep_of_percent(q, num_timesteps)
    )
    owner = PassReuse(p, schedule, len(layers), noise_range, full_below)

    def before(module, args, kwargs):
        x = args[0] if args else kwargs.get("x")
        timesteps = args[1] if len(args) > 1 else kwargs.get("timesteps")
        level = None
        if timesteps is not None and not noise_range.everywhere:
            level = float(torch.as_tensor(timesteps).max())  # one host sync per UNet call
        owner.begin_unet_call(x, level)
        return None

    def after(module, args, output):
        owner.end_call(failed=output is None)  # always called; no output: the call raised
        return None

    attach_forwards(owner, layers)
    handles = (
        unet.register_forward_pre_hook(before, with_kwargs=True),
        unet.register_forward_hook(after, always_call=True),
    )
    return register_ldm(unet, owner, handles, layers)


def register_ldm(unet, owner: PassReuse, handles=(), layers=()) -> PassReuse:
    """Record what a pass installed on ``unet`` (for ``remove_ldm``) and make it the pass in progress."""
    unet.__dict__[_STATE] = (owner, tuple(handles), list(layers))
    _reusing_unets.add(unet)
    return _activate(owner)


def is_installed_ldm(unet) -> bool:
    if _STATE in unet.__dict__ or _ldm_forward(unet) is not None:
        return True
    return any(isinstance(m.__dict__.get("forward"), SkippableLayer) for m in unet.modules())


def remove_ldm(unet) -> None:
    """Undo ``install_ldm`` (or ``whole_step.install_ldm``) on ``unet`` and finish the pass."""
    state = unet.__dict__.pop(_STATE, None)
    _reusing_unets.discard(unet)
    forward = _ldm_forward(unet)
    if forward is not None:  # the whole-step forecast's; one wrapped around ours stays
        if forward.inner is None:
            del unet.__dict__["forward"]
        else:
            unet.__dict__["forward"] = forward.inner
    if state is None:
        return
    owner, handles, layers = state
    for handle in handles:
        handle.remove()
    detach_forwards(layers, lambda other: other is owner)
    owner.finish()


def _ldm_forward(unet) -> CallBoundary | None:
    forward = unet.__dict__.get("forward")
    return forward if isinstance(forward, CallBoundary) and forward.ldm else None


def remove_all_ldm() -> None:
    for unet in list(_reusing_unets):
        remove_ldm(unet)


class CallBoundary:
    """Forge: the UNet's ``forward`` (an object patch) that tells the pass where each UNet call begins and ends."""

    ldm = False  # an ldm UNet's instance forward (``remove_ldm`` takes it), not a Forge object patch

    def __init__(self, owner: PassReuse, unet, inner=None):
        self.owner = owner
        self.unet = unet
        self.inner = inner  # an object patch of the UNet's forward that was there before ours (None: the class's)

    def __deepcopy__(self, memo):
        return self

    def stand_down_for_a_wrapper(self) -> None:
        """Finish the pass where another whole-model wrapper decides the steps, with one console line."""
        if not self.owner.finished and whole_model_wrapped(self.owner.p):
            print("[ToMe Patch] reuse across steps: another whole-model wrapper (Neo's Spectrum) decides the steps; "
                  "every step runs in full.")  # fmt: skip
            self.owner.finish()

    def begin(self, x, options: dict) -> None:
        self.stand_down_for_a_wrapper()
        sigmas = options.get("sigmas")
        level = None
        if sigmas is not None and not self.owner.noise_range.everywhere:
            level = float(torch.as_tensor(sigmas).max())
        layout = options.get("cond_or_uncond")
        self.owner.begin_unet_call(x, level, None if layout is None else tuple(layout))

    def forward(self, *args, **kwargs):
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.unet).forward(self.unet, *args, **kwargs)

    def __call__(self, x, *args, **kwargs):
        self.begin(x, kwargs.get("transformer_options") or {})
        try:
            out = self.forward(x, *args, **kwargs)
        except BaseException:
            self.owner.end_call(failed=True)
            raise
        self.owner.end_call()
        return out


def whole_model_wrapped(p) -> bool:
    """Whether the patcher the job samples with wraps the whole model call (``set_model_unet_function_wrapper``)."""
    unet = getattr(getattr(getattr(p, "sd_model", None), "forge_objects", None), "unet", None)
    return (getattr(unet, "model_options", None) or {}).get("model_function_wrapper") is not None


def forge_noise_range(settings, percent_to_sigma) -> NoiseRange:
    """The user's step range over Forge's sigmas (everywhere where Forge gives no schedule)."""
    if percent_to_sigma is None:
        return NoiseRange(0.0, 1.0, lambda q: math.nan)
    return NoiseRange(settings.start_percent, settings.end_percent, percent_to_sigma)


def install_forge(patcher, settings, p, percent_to_sigma, schedule, full_below: float = 0.0) -> PassReuse | None:
    """Give Forge's ``patcher`` (this pass's clone) layer reuse on ``schedule`` for one pass of job ``p``."""
    remove_forge(patcher)
    unet = patcher.model.diffusion_model
    layers = inner_layers(unet, OUTER_BLOCKS)
    if schedule is None or not layers or not hasattr(patcher, "add_object_patch"):
        return None
    noise_range = forge_noise_range(settings, percent_to_sigma)
    owner = PassReuse(p, schedule, len(layers), noise_range, full_below)
    for index, (name, layer) in enumerate(layers):
        patcher.add_object_patch(f"diffusion_model.{name}.forward", SkippableLayer(owner, index, layer))
    inner = getattr(patcher, "object_patches", {}).get("diffusion_model.forward")
    patcher.add_object_patch("diffusion_model.forward", CallBoundary(owner, unet, inner))
    return _activate(owner)


def remove_forge(patcher) -> None:
    """Drop our object patches from ``patcher`` (a clone), putting back a forward patch that was there before."""
    patches = getattr(patcher, "object_patches", None)
    if not patches:
        return
    for name, value in list(patches.items()):
        if isinstance(value, SkippableLayer) and isinstance(value.owner, PassReuse):
            del patches[name]
        elif isinstance(value, CallBoundary):
            if value.inner is None:
                del patches[name]
            else:
                patches[name] = value.inner
