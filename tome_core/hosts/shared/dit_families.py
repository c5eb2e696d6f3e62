"""What each DiT family is, once for every host: its measured defaults and the real model's step-to-step change.

A record per family, keyed by the family's name as the hosts' doors call it (ComfyUI's "Lumina 2" is diffusers'
"Z-Image": one record, two names). Every host reads the same record, so a family's default changes everywhere at
once; the engine keeps no family names. Adding a family is a record here and its tests (the checklist:
docs/how-it-works.md, "Adding a DiT family"). A record without blocks names a model every host leaves to run
every block, and why (``no_reuse``).

The measurements behind each value are in docs/dit.md ("The default per family", "What the default computes on
the real models' curves").
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace

from ...reuse.plans import DEFAULT_EXTRAPOLATE
from ...reuse.schedules import SHORT_RUN, StepChangeCurve, StepCountSchedule
from . import step_change_curves as published

HOSTS = ("comfyui", "diffusers", "neo", "forge")


@dataclass(frozen=True)
class BlockLayout:
    """How a family's ComfyUI and Forge Neo classes lay out and call their blocks (``dit_block_hook`` reaches them
    by it); part of the family's record."""

    lists: tuple[tuple[str, str], ...]  # (block type, attribute of the block list), in call order
    # The streams each block passes on, in the order the model joins them where its single blocks take one joined
    # stream (Flux ``cat((txt, img))``, HunyuanVideo ``cat((img, txt))``). Not a stream: the text a block only
    # reads (Wan's and LTX-Video's ``txt``).
    streams: tuple[str, ...]
    last_block_runs: bool = False  # the last block runs at every call (SD3's returns no text stream)
    # Keyword arguments the blocks' ``forward`` takes that tell this family's blocks from those of a family whose
    # classes derive from its own (LTX-Video's ``context``, LTX-2's ``v_context`` and ``a_context``).
    takes: tuple[str, ...] = ()
    # How a door reaches the blocks: "dit", the block hook (``patches_replace["dit"]``); "forward", for a family
    # whose loop hands no block to the hook: each span block gets an instance ``forward`` while the patcher has the
    # model loaded (a patcher injection, as the UNets' layer reuse), whose first positional argument is the one
    # stream and whose return value the stream after the block.
    hook: str = "dit"
    family: str = ""  # the record's name (set by the record)

    def fits(self, model) -> bool:
        """Whether ``model`` (a ComfyUI or Forge diffusion model) has this layout's block lists and its blocks take
        what the layout says: a model whose classes match but whose blocks differ is not this family."""
        for _, attribute in self.lists:
            blocks = getattr(model, attribute, None)
            if blocks is None or not hasattr(blocks, "__len__"):
                return False
        if not self.takes:
            return True
        blocks = getattr(model, self.lists[0][1])
        if len(blocks) == 0:
            return False
        try:
            parameters = inspect.signature(type(blocks[0]).forward).parameters
        except (TypeError, ValueError):
            return False
        return all(name in parameters for name in self.takes)


@dataclass(frozen=True)
class DitFamily:
    name: str  # the family's name in messages and docs
    aliases: tuple[str, ...] = ()  # other hosts' names for it
    words: str = ""  # the models as their users name them, in the lists the user reads ("": the name, the aliases)
    # The model classes of the family in each host, by name (any class of the model's MRO matches): ComfyUI's
    # ``comfy.ldm`` classes, diffusers' transformers, Forge Neo's and lllyasviel's Forge's ``backend.nn`` classes.
    comfyui: tuple[str, ...] = ()
    diffusers: tuple[str, ...] = ()
    neo: tuple[str, ...] = ()
    forge: tuple[str, ...] = ()
    # ``dit_settings`` "auto": reuse across steps at this interval, as ((from this many steps, interval), ...).
    auto_intervals: tuple[tuple[int, int], ...] = ((0, 3),)
    # How far along the line through the last two full steps the prediction moves (1: a whole step).
    extrapolate: float = DEFAULT_EXTRAPOLATE
    # ToDo's break-even with ``skip_when_slower``: it runs from this many image tokens (None: the engine's rule).
    todo_min_image_tokens: int | None = None
    # The real model's published step-to-step change and the threshold published with it: the default runs in
    # full wherever reuse would accumulate more error on it (None: the noise-spaced plan alone), unless the family
    # has a first-block guard, which takes its place.
    curve: StepChangeCurve | None = None
    curve_of: str = ""  # whose curve it is, for the log and the docs
    # A reusing step runs in full where the first block's output moved more than this since the last full step
    # (None: no such guard, the curve guards); set only where a reference that passes the curve gate measured it
    # (docs/dit-measurements.md, "Qwen-Image's default: the first-block guard").
    first_block_guard: float | None = None
    # A reusing step runs in full where the first block's output lies more than this off the line through the last
    # two full steps' outputs (the path the residual's prediction follows; None: no such guard); with or without
    # ``first_block_guard``, and likewise in place of the curve.
    line_guard: float | None = None
    # Runs of fewer steps reuse one step in two at most (0: no such cap; the guards decide a short run's steps).
    short_run: int = SHORT_RUN
    # How its ComfyUI and Neo classes lay out their blocks (None: reuse cannot reach them).
    blocks: BlockLayout | None = None
    # Why ``dit_settings`` auto leaves the family as it is ("": it runs ``auto_schedule``); reuse across steps is
    # still there with ``dit_settings`` "as set" and a ``reuse_interval``.
    unchanged_by_default: str = ""
    # Why reuse across steps cannot run on it (a record without ``blocks``): the log says it.
    no_reuse: str = ""

    def __post_init__(self):
        if self.blocks is not None and self.blocks.family != self.name:
            object.__setattr__(self, "blocks", replace(self.blocks, family=self.name))

    @property
    def listed_as(self) -> str:
        """The family in the lists the user reads: its ``words``, else its name and aliases."""
        return self.words or ", ".join((self.name, *self.aliases))

    def classes(self, host: str) -> tuple[str, ...]:
        if host not in HOSTS:
            raise ValueError(f"host must be one of {', '.join(HOSTS)}, got {host!r}")
        return getattr(self, host)

    @property
    def guarded_by_first_block(self) -> bool:
        """Whether the default is guarded by the first block's output (either guard) in place of the curve."""
        return self.first_block_guard is not None or self.line_guard is not None

    def auto_schedule(self) -> StepCountSchedule:
        """The schedule ``dit_settings`` "auto" runs on this family: its interval, guarded by the first block's
        output where the family has a guard measured on a reference that moves as the real model does, by the real
        model's published curve where it has not (a constant from the authors' runs, not the user's)."""
        if self.guarded_by_first_block:
            guards = (self.first_block_guard, self.line_guard)
            return StepCountSchedule(self.auto_intervals, None, *guards, short_run=self.short_run)
        return StepCountSchedule(self.auto_intervals, self.curve, short_run=self.short_run)


# MagCache's thresholds for each model are the ones its authors publish with the ratios (``step_change_curves``).
FLUX_CURVE = StepChangeCurve(published.FLUX1_DEV, 0.24)
QWEN_IMAGE_CURVE = StepChangeCurve(published.QWEN_IMAGE, 0.10)
HUNYUAN_VIDEO_CURVE = StepChangeCurve(published.HUNYUAN_VIDEO, 0.24)
WAN_CURVE = StepChangeCurve(published.WAN21_T2V_14B, 0.24)

# Intervals: measured on the reference models (docs/dit-measurements.md); SD3 and
# Lumina 2 / Z-Image (one joint stream, as Flux's single blocks) take Flux's, the video families without a reference
# one step more often than Wan's. A family without a published curve takes the nearest family's (docs/dit.md).
# Flux and Qwen-Image predict a whole step along the line (it kept more of their references' picture); the others
# half a step. A record naming the model's own class wins over one naming a class it derives from (``_named``).
# Class names as read in ComfyUI 0.3.75 / 0.8.0, diffusers 0.39.0, Forge Neo neo-2.26 and Forge dfdcbab6; Flux
# covers Flux.1, Flux.2 (the same classes), Kontext and Chroma (Neo's and Forge's ``IntegratedChromaTransformer2DModel``
# lays its blocks out as their Flux class).
FAMILIES = (
    DitFamily(
        "Flux", words="Flux.1, Flux.2, Chroma", auto_intervals=((0, 3), (40, 4)), extrapolate=1.0,
        todo_min_image_tokens=4096,
        curve=FLUX_CURVE, curve_of="FLUX.1-dev",
        comfyui=("Flux", "Chroma"), diffusers=("FluxTransformer2DModel", "Flux2Transformer2DModel"),
        neo=("IntegratedFluxTransformer2DModel", "IntegratedChromaTransformer2DModel"),
        forge=("IntegratedFluxTransformer2DModel", "IntegratedChromaTransformer2DModel"),
        # Flux.1, Flux.2 (the same class with global modulation: its ``vec`` is a tuple, which passes through),
        # Kontext (reference tokens after the image, in the same stream), Chroma and Chroma Radiance (Flux's
        # blocks; Radiance's pixel-space head runs after them, at every call).
        blocks=BlockLayout((("double_block", "double_blocks"), ("single_block", "single_blocks")), ("txt", "img")),
    ),
    # AuraFlow: its class is called ``MMDiT`` as SD3's; its blocks (``double_layers`` then ``single_layers`` on the
    # joined [text, image] stream, as Flux's) tell the two apart. The node passed it through before; with no
    # reference to measure a default on, auto still does (Flux's interval and curve under "as set").
    DitFamily(
        "AuraFlow", auto_intervals=((0, 3), (40, 4)), curve=FLUX_CURVE, curve_of="FLUX.1-dev (nearest family)",
        unchanged_by_default="no reference measures a default on AuraFlow yet; dit_settings 'as set' with a "
        "reuse_interval reuses across steps",
        comfyui=("MMDiT",),
        blocks=BlockLayout((("double_block", "double_layers"), ("single_block", "single_layers")), ("txt", "img")),
    ),
    DitFamily(
        "SD3", words="SD3/SD3.5", auto_intervals=((0, 3), (40, 4)),
        curve=FLUX_CURVE, curve_of="FLUX.1-dev (nearest family)",
        comfyui=("MMDiT",), diffusers=("SD3Transformer2DModel",),
        blocks=BlockLayout((("double_block", "joint_blocks"),), ("txt", "img"), last_block_runs=True),
    ),
    DitFamily(
        # Every 6 with both first-block guards, chosen on the Qwen-Image references, the guards alone deciding a
        # short run's steps (docs/dit-measurements.md).
        "Qwen-Image", auto_intervals=((0, 6),), extrapolate=1.0, curve=QWEN_IMAGE_CURVE, curve_of="Qwen-Image",
        first_block_guard=0.15, line_guard=0.07, short_run=0,
        comfyui=("QwenImageTransformer2DModel",), diffusers=("QwenImageTransformer2DModel",),
        neo=("QwenImageTransformer2DModel",),
        # Qwen-Image and Edit (its reference latents are tokens of the image stream); blocks return ``(txt, img)``,
        # which the hook's ``block_wrap`` turns into the dict.
        blocks=BlockLayout((("double_block", "transformer_blocks"),), ("txt", "img")),
    ),
    DitFamily(
        "Lumina 2", aliases=("Z-Image",), auto_intervals=((0, 3), (40, 4)), todo_min_image_tokens=2304,
        curve=FLUX_CURVE, curve_of="FLUX.1-dev (nearest family)",
        comfyui=("NextDiT",), diffusers=("ZImageTransformer2DModel",), neo=("NextDiT",),
        # No block hook: one joined stream of caption and image tokens through ``layers`` (called as
        # ``layer(x, mask, freqs_cis, adaln_input, ...)``); the refiners before them run at every call.
        blocks=BlockLayout((("layer", "layers"),), ("img",), hook="forward"),
    ),
    # Wan's variants that add inputs of their own between blocks, outside the block hook: a skipped span would miss
    # them or count them twice.
    DitFamily("Wan VACE", comfyui=("VaceWanModel",),
              no_reuse="VACE adds its hints between blocks, outside the block hook, which a skipped span would miss"),
    DitFamily("Wan S2V", comfyui=("WanModel_S2V",),
              no_reuse="Wan S2V injects audio and adds tokens of its own between blocks"),
    DitFamily("Wan HuMo", comfyui=("HumoWanModel",), no_reuse="Wan HuMo adds audio inputs of its own between blocks"),
    DitFamily("Wan Animate", comfyui=("AnimateWanModel",),
              no_reuse="Wan Animate fuses face features every few blocks, outside the block hook"),
    DitFamily(
        # Every 6 with both first-block guards, the guards alone deciding a short run's steps, chosen on the Wan
        # reference, whose step curve follows real Wan 2.1's (docs/dit-measurements.md, "Wan's default").
        "Wan", words="Wan 2.x", auto_intervals=((0, 6),), curve=WAN_CURVE, curve_of="Wan 2.1 T2V 14B",
        first_block_guard=0.15, line_guard=0.1, short_run=0,
        comfyui=("WanModel",), diffusers=("WanTransformer3DModel",), neo=("WanModel",),
        blocks=BlockLayout((("double_block", "blocks"),), ("img",)),
    ),
    # Cosmos Predict2 and Anima (an image model trained from Cosmos Predict2 2B; ComfyUI's and Neo's Anima classes
    # derive from ``MiniTrainDIT``): no reference and no published curve, so an image DiT's (Flux's) interval and
    # curve, the most guarded of the published ones at the start of a run.
    DitFamily(
        "Cosmos Predict2", aliases=("Anima",), auto_intervals=((0, 3), (40, 4)),
        curve=FLUX_CURVE, curve_of="FLUX.1-dev (nearest family: an image DiT)",
        comfyui=("MiniTrainDIT",), neo=("MiniTrainDIT",),
        # No block hook: one stream of (batch, frames, h, w, channels) tokens through ``blocks`` (called as
        # ``block(x, t_embedding, crossattn_emb, **block_kwargs)``).
        blocks=BlockLayout((("layer", "blocks"),), ("img",), hook="forward"),
    ),
    DitFamily(
        "HunyuanVideo", words="HunyuanVideo 1.0/1.5", auto_intervals=((0, 4),),
        curve=HUNYUAN_VIDEO_CURVE, curve_of="HunyuanVideo",
        comfyui=("HunyuanVideo",), diffusers=("HunyuanVideo15Transformer3DModel",),
        # HunyuanVideo 1.0 and 1.5, HunyuanImage 2.1: image before text in the single blocks' joined stream.
        blocks=BlockLayout((("double_block", "double_blocks"), ("single_block", "single_blocks")), ("img", "txt")),
    ),
    # LTX-2 (video and audio): its class derives from LTX-Video's, its blocks pass on one stream, ``img``, that is
    # the tuple (video tokens, audio tokens) of two widths (``cache.join_streams`` cuts both into rows of one
    # width), and read the text as ``v_context`` and ``a_context``. No published curve: LTX-Video's interval and
    # the nearest family's curve (docs/dit.md).
    DitFamily(
        "LTX-2", auto_intervals=((0, 4),), curve=HUNYUAN_VIDEO_CURVE, curve_of="HunyuanVideo (nearest family)",
        comfyui=("LTXAVModel",), diffusers=("LTX2VideoTransformer3DModel",),
        blocks=BlockLayout((("double_block", "transformer_blocks"),), ("img",), takes=("v_context", "a_context")),
    ),
    DitFamily(
        "LTX-Video", auto_intervals=((0, 4),), todo_min_image_tokens=4096,
        curve=HUNYUAN_VIDEO_CURVE, curve_of="HunyuanVideo (nearest family)",
        comfyui=("LTXVModel",), diffusers=("LTXVideoTransformer3DModel",),
        blocks=BlockLayout((("double_block", "transformer_blocks"),), ("img",), takes=("context",)),
    ),
    # OmniGen2 (Lumina 2's layout: refiners, then ``layers`` on one joined stream of text, reference and image
    # tokens, called as ``layer(x, mask, rotary_emb, temb, ...)``). No reference measures a default on it, so auto
    # leaves it as before; no published curve: Lumina 2's (the nearest family's).
    DitFamily(
        "OmniGen2", auto_intervals=((0, 3), (40, 4)), curve=FLUX_CURVE, curve_of="FLUX.1-dev (nearest family)",
        unchanged_by_default="no reference measures a default on OmniGen2 yet; dit_settings 'as set' with a "
        "reuse_interval reuses across steps",
        comfyui=("OmniGen2Transformer2DModel",),
        blocks=BlockLayout((("layer", "layers"),), ("img",), hook="forward"),
    ),
    # Models every host leaves to run every block.
    DitFamily("HiDream", comfyui=("HiDreamImageTransformer2DModel",),
              no_reuse="HiDream hands no block to the block hook, and its blocks change the token count"),
    DitFamily("Cosmos 1.0", comfyui=("GeneralDIT",), no_reuse="Cosmos 1.0 hands no block to the block hook"),
)  # fmt: skip
# A DiT no record names (a family a host door knows before it has a record): Flux's interval and curve.
OTHER = DitFamily("other", curve=FLUX_CURVE, curve_of="FLUX.1-dev (nearest family)")

_BY_NAME = {name: family for family in FAMILIES for name in (family.name, *family.aliases)}


def listed(host: str) -> str:
    """The families whose blocks ``host`` reaches, as the user reads them (the node's tooltip, the log)."""
    return ", ".join(f.listed_as for f in FAMILIES if f.blocks is not None and f.classes(host))


def family(name: str) -> DitFamily:
    """The record of the family a host door calls ``name`` (``OTHER`` for a name no record has)."""
    return _BY_NAME.get(name, OTHER)


# The hosts whose classes a record's ``BlockLayout`` describes (diffusers' layouts are its door's own).
_LAID_OUT = ("comfyui", "neo", "forge")


def _named(host: str, model) -> list[DitFamily]:
    """The records naming one of ``model``'s classes, the model's own class first, then the classes it derives from
    in order (a variant's record before its parent's); records naming the same class in ``FAMILIES`` order."""
    return [family for cls in type(model).__mro__ for family in FAMILIES if cls.__name__ in family.classes(host)]


def of_model(host: str, model) -> DitFamily | None:
    """The record of the family ``model`` (a host's diffusion model) belongs to in ``host``: the first of ``_named``
    that, in the hosts its block layout describes, the model's blocks fit (their lists, and what they take:
    ``BlockLayout.fits``). None for a model no record fits."""
    for family in _named(host, model):
        if host not in _LAID_OUT or family.blocks is None or family.blocks.fits(model):
            return family
    return None


def named_but_unfit(host: str, model) -> DitFamily | None:
    """A record that names one of ``model``'s classes but whose blocks the model does not have (a subclass laid
    out otherwise), where no record fits: the log names it."""
    if of_model(host, model) is not None:
        return None
    return next(iter(_named(host, model)), None)


def auto_schedule(name: str) -> StepCountSchedule:
    """The schedule ``dit_settings`` "auto" runs on the family a host calls ``name``."""
    return family(name).auto_schedule()
