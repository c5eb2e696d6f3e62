"""Forge Neo and lllyasviel's Forge: the DiT family's default reuse across steps, one ``PassDitReuse`` per pass.
Neo's loops hand block ``i`` to ``set_model_patch_replace(fn, "dit", block_type, i)``; loops without that hook (Neo's
Z-Image and Anima, Forge's Flux and Chroma) get an object patch on each span block's ``forward``. A call's step comes
from its noise level among Neo's ``transformer_options["sampling_sigmas"]`` (in Forge, the pass's sampler's).
docs/webui.md, 'DiTs in Forge Neo and Forge'."""

from __future__ import annotations

from ...reuse import DIT_OUTER_BLOCKS, FULL, decide
from ...schedule import NoiseRange, call_sigmas, step_of
from ..shared import dit_families
from ..shared.dit_block_hook import (
    PATCH_NAME,
    SpanBlock,
    SpanForward,
    block_keys,
    layout_named,
    replacements,
    why_every_block_runs,
)
from .layer_reuse import CallBoundary, PassReuse, _activate, sampler_and_schedule

_FORWARD = "diffusion_model.forward"


class PassDitReuse(PassReuse):
    """One sampling pass's reuse across steps on a DiT's span of blocks (the residual of the span is the one record)."""

    DIT = True
    RUN_WORDS = ("the first block", "blocks' residual")

    def __init__(self, p, patcher, record, keys, streams, noise_range, full_below: float):
        super().__init__(p, record.auto_schedule(), 1, noise_range)
        self.extrapolate = record.extrapolate
        self.family = record.name
        self.patcher = patcher
        self.keys = keys
        self.streams = streams
        self.blocks: dict = {}  # key -> SpanBlock, to tell ours from another patch's replacement
        self.full_below = full_below
        self.run_sigmas: tuple | None = None  # (steps, sigmas) the current run was made for
        self.warned: set[str] = set()
        self.refiner = _refiner_of(p)
        self.forge_sigmas: tuple | None = None  # lllyasviel's Forge: (steps, the pass's sigmas or None)
        self.forced_schedule = None  # reuse_plan "calibrated": a candidate's or the kept plan (None: the family's)
        self.reuses = True  # False: every block runs (a calibration's unpatched pass)
        self.seen: tuple | None = None  # (steps, sigmas or None) of the pass's calls, for the calibration after it

    def follow(self, schedule) -> None:
        """Plan this pass's runs on ``schedule`` (a calibration's candidate, or the family's plan at a kept interval)
        rather than the family's own; None: every block runs, the pass's noise levels still seen, so that the
        calibration after an unpatched pass plans its candidates on that pass's steps."""
        self.forced_schedule = schedule
        self.reuses = schedule is not None

    def say_once(self, what: str) -> None:
        if what not in self.warned:
            self.warned.add(what)
            print(f"[ToMe Patch] reuse across steps: {what}.")

    def warn_once(self, why: str) -> None:
        self.say_once(f"{why}; every block runs in full")

    def runs_in_full(self, transformer_options) -> bool:
        why = why_every_block_runs(transformer_options, self.keys, self.blocks)
        if why is not None:
            self.warn_once(why)
        return why is not None

    def begin_dit_call(self, x, options: dict) -> None:
        """A model call starts, with the host's ``transformer_options``: its step from its noise level."""
        if self.finished or x is None:
            return
        if (getattr(self.patcher, "model_options", None) or {}).get("model_function_wrapper") is not None:
            self.warn_once("another whole-model wrapper (Neo's Spectrum) decides the steps")
            self._drop_run()
            return
        sigma = _largest(options.get("sigmas"))
        sigmas = call_sigmas(options.get("sampling_sigmas"))
        if sigma is None:
            step = None
        elif sigmas:
            step, steps = step_of(sigmas, sigma), len(sigmas)
        else:  # lllyasviel's Forge hands the model no list of the pass's sigmas
            step, steps, sigmas = self._forge_step(sigma)
        if step is None:  # not a call of this pass's schedule: it runs in full, and the cache goes
            self._drop_run()
            return
        self.seen = (steps, sigmas)
        if not self.reuses:
            return
        refiner = _refiner_of(self.p)
        if refiner != self.refiner:  # the second model (Wan 2.2's low-noise expert) took over: a run of its own
            self.refiner = refiner
            self.say_once(f"the refiner {refiner!r} took over; it starts a run of its own")
            self._drop_run()
            self.run = None
        if self.run is None or self.run_sigmas != (steps, sigmas):
            self.run = self.new_run(steps, sigmas, self.full_below, schedule=self.forced_schedule)
            self.run_sigmas = (steps, sigmas)
        layout = options.get("cond_or_uncond")
        key = (None if layout is None else tuple(layout), tuple(x.shape), x.dtype)
        allowed = self.noise_range.contains(sigma) and sigma >= self.run.full_below
        self.begin_call(self.run, step, key, allowed=allowed, position=sigma)

    def _forge_step(self, sigma: float) -> tuple[int | None, int, list[float] | None]:
        """(step, steps, the pass's sigmas or None) in lllyasviel's Forge: the sigmas from ``sampler_sigmas`` where
        they hold the call's; without them, the step from the ``cfg_denoiser`` callbacks."""
        if self.step is None:
            return None, 0, None
        step, steps = self.step
        if self.forge_sigmas is None or self.forge_sigmas[0] != steps:
            sigmas = sampler_sigmas(self.p, steps)
            if sigmas is not None and step_of(sigmas, sigma) is None:
                sigmas = None
            self.forge_sigmas = (steps, sigmas)
        sigmas = self.forge_sigmas[1]
        if sigmas is None:
            return step, steps, None
        return step_of(sigmas, sigma), steps, sigmas

    def _drop_run(self) -> None:
        if self.run is not None:
            self.run.begin_call(None, None)


def sampler_sigmas(p, steps: int) -> list[float] | None:
    """The last ``steps`` sigmas of ``p.sampler.get_sigmas`` (lllyasviel's Forge), or None where the sampler gives
    none (DDIM, UniPC); the caller checks the call's sigma against them."""
    get_sigmas = getattr(getattr(p, "sampler", None), "get_sigmas", None)
    if get_sigmas is None:
        return None
    counts = (steps, getattr(p, "hr_second_pass_steps", 0), getattr(p, "steps", 0))
    for count in dict.fromkeys(n for n in counts if isinstance(n, int) and n >= steps):
        try:
            sigmas = call_sigmas(get_sigmas(p, count))
        except Exception:  # a sampler that cannot give them here: the plan is spaced by step
            return None
        if len(sigmas) >= steps:
            return sigmas[len(sigmas) - steps :]
    return None


class ForgeSpanForward(SpanForward):
    """One span block's instance ``forward`` in lllyasviel's Forge's Flux and Chroma: a double block takes
    ``img=, txt=`` and returns ``(img, txt)``, a single block takes and returns the joined stream."""

    def __call__(self, *args, **kwargs):
        hooks = self.owner
        run = hooks.layer_run()
        if run is None or run.current is None:
            return self.original(*args, **kwargs)
        if "txt" in kwargs and "img" in kwargs:
            streams = {"txt": kwargs["txt"], "img": kwargs["img"]}

            def streams_of(out):
                return {"txt": out[1], "img": out[0]}

            def pack(passed):
                return passed["img"], passed["txt"]

        elif args:
            streams = {"txt": None, "img": args[0]}

            def streams_of(out):
                return {"txt": None, "img": out}

            def pack(passed):
                return passed["img"]

        else:
            return self.original(*args, **kwargs)
        return run.span_block(
            first=self.index == 0,
            last=self.index == len(hooks.keys) - 1,
            streams=streams,
            run_block=lambda: self.original(*args, **kwargs),
            streams_of=streams_of,
            in_full=lambda: False,
            pack=pack,
        )


def _refiner_of(p):
    """The refiner the job has switched to (Neo's ``apply_refiner`` names it before loading it into the same model):
    the second model must not be predicted from the first's records."""
    return (getattr(p, "extra_generation_params", None) or {}).get("Refiner")


def _largest(values) -> float | None:
    try:
        return None if values is None else float(values.max())
    except (AttributeError, TypeError, RuntimeError):
        return None


class DitCallBoundary(CallBoundary):
    """Forge's call boundary for a DiT pass; Neo passes ``transformer_options`` and ``control`` as keywords."""

    def begin(self, x, options: dict) -> None:
        self.owner.begin_dit_call(x, options)

    def __call__(self, x, *args, **kwargs):
        if kwargs.get("control") is not None:  # a ControlNet adds between blocks, which a skipped span would miss
            return self.forward(x, *args, **kwargs)
        return super().__call__(x, *args, **kwargs)


def is_lllyasviels_forge(model) -> bool:
    """lllyasviel's Forge's DiTs call their blocks directly in ``inner_forward``; Neo's use the block hook."""
    return hasattr(model, "inner_forward")


def family_of(model) -> dit_families.DitFamily | None:
    """The family record of a Forge Neo or lllyasviel's Forge diffusion model (None: not one for that host)."""
    if model is None:
        return None
    return dit_families.of_model("forge" if is_lllyasviels_forge(model) else "neo", model)


def why_not(patcher, p) -> str | None:
    """Why reuse does not run on the DiT of ``patcher`` for job ``p`` (None: it does)."""
    model = getattr(getattr(patcher, "model", None), "diffusion_model", None)
    forge = is_lllyasviels_forge(model)
    record = family_of(model)
    if record is None:
        return f"{type(model).__name__} is no DiT family this patch knows in {'this Forge' if forge else 'Forge Neo'}"
    if layout_named(record.name) is None:
        return f"{record.name} has no block layout in this patch"
    needs = ("add_object_patch",) if forge else ("set_model_patch_replace", "add_object_patch")
    if not all(hasattr(patcher, name) for name in needs):
        return "this Forge has no block replacements on its patcher"
    decision = decide(None, *sampler_and_schedule(p), dit=True)
    return decision.why if decision.runs == FULL else None


def install_neo(patcher, settings, p, percent_to_sigma) -> PassDitReuse | None:
    """Give ``patcher`` (this pass's clone) the DiT family's reuse across steps; None where it does not run."""
    remove_neo(patcher)
    if why_not(patcher, p) is not None:
        return None
    model = patcher.model.diffusion_model
    forge = is_lllyasviels_forge(model)
    record = family_of(model)
    layout = layout_named(record.name)
    keys = block_keys(model, layout)
    first, last = DIT_OUTER_BLOCKS
    if layout.last_block_runs:
        last = max(last, 1)
    if keys is None or len(keys) <= first + last + 1:
        return None
    span = keys[first : len(keys) - last]
    if percent_to_sigma is None:
        noise_range = NoiseRange(0.0, 1.0, lambda q: q)
    else:
        noise_range = NoiseRange(settings.start_percent, settings.end_percent, percent_to_sigma)
    full_below = decide(None, *sampler_and_schedule(p), dit=True).full_below
    owner = PassDitReuse(p, patcher, record, span, layout.streams, noise_range, full_below)
    patches = getattr(patcher, "object_patches", None) or {}
    if layout.hook == "dit" and not forge:
        replaced = replacements(patcher)
        for position, (block_type, index) in enumerate(span):
            block = SpanBlock(owner, position, replaced.get((block_type, index)))
            owner.blocks[(block_type, index)] = block
            patcher.set_model_patch_replace(block, PATCH_NAME, block_type, index)
    else:  # no hook reaches the blocks: an object patch on each span block's forward
        forward = ForgeSpanForward if forge else SpanForward
        lists = dict(layout.lists)
        for position, (block_type, index) in enumerate(span):
            name = f"diffusion_model.{lists[block_type]}.{index}.forward"
            layer = getattr(model, lists[block_type])[index]
            patcher.add_object_patch(name, forward(owner, position, layer, patches.get(name)))
    inner = patches.get(_FORWARD)
    patcher.add_object_patch(_FORWARD, DitCallBoundary(owner, model, inner))
    return _activate(owner)


def remove_neo(patcher) -> None:
    """Drop what ``install_neo`` put on ``patcher``; another patch's replacement that ours wrapped comes back."""
    replaced = replacements(patcher)
    for key, value in list(replaced.items()):
        if isinstance(value, SpanBlock) and isinstance(value.hooks, PassDitReuse):
            if value.previous is None:
                del replaced[key]
            else:
                replaced[key] = value.previous
    patches = getattr(patcher, "object_patches", None) or {}
    for name, value in list(patches.items()):
        ours = isinstance(value, SpanForward) and isinstance(value.owner, PassDitReuse)
        if ours or isinstance(value, DitCallBoundary):
            if value.inner is None:
                del patches[name]
            else:
                patches[name] = value.inner
