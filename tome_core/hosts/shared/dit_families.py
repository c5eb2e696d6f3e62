"""What each DiT family is, once for every host: its classes, block layout and defaults, one record per family.
See docs/how-it-works.md, section 'Adding a DiT family', and docs/dit.md, section 'The defaults: `dit_settings`'."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace

from ...reuse.plans import DEFAULT_EXTRAPOLATE
from ...reuse.schedules import SHORT_RUN, StepChangeCurve, StepCountSchedule
from . import step_change_curves as published

HOSTS = ("comfyui", "diffusers", "neo", "forge")


@dataclass(frozen=True)
class BlockLayout:
    """How a family's ComfyUI and Forge Neo classes lay out and call their blocks."""

    lists: tuple[tuple[str, str], ...]  # (block type, attribute of the block list), in call order
    # In the order the model joins them for its single blocks; the text a block only reads is not a stream.
    streams: tuple[str, ...]
    last_block_runs: bool = False
    # ``forward`` arguments that tell this family's blocks from those of a family deriving from its classes.
    takes: tuple[str, ...] = ()
    # "dit": the ``patches_replace["dit"]`` hook; "forward": an instance ``forward`` on each span block.
    hook: str = "dit"
    family: str = ""

    def fits(self, model) -> bool:
        """Whether ``model`` has this layout's block lists and its blocks take ``takes``."""
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
    name: str
    aliases: tuple[str, ...] = ()
    words: str = ""
    # Class names per host; any class of the model's MRO matches.
    comfyui: tuple[str, ...] = ()
    diffusers: tuple[str, ...] = ()
    neo: tuple[str, ...] = ()
    forge: tuple[str, ...] = ()
    # ((from this many steps, interval), ...) for ``dit_settings`` "auto".
    auto_intervals: tuple[tuple[int, int], ...] = ((0, 3),)
    # How far along the line through the last two full steps the prediction moves (1: a whole step).
    extrapolate: float = DEFAULT_EXTRAPOLATE
    todo_min_image_tokens: int | None = None
    # The real model's published step-to-step change; a first-block guard takes its place.
    curve: StepChangeCurve | None = None
    curve_of: str = ""
    # Run in full where the first block's output moved more than this since the last full step.
    first_block_guard: float | None = None
    # Run in full where the first block's output lies more than this off the line through the last two.
    line_guard: float | None = None
    # Runs of fewer steps reuse one step in two at most (0: no cap).
    short_run: int = SHORT_RUN
    blocks: BlockLayout | None = None
    # Why "auto" leaves the family as it is ("": it runs ``auto_schedule``).
    unchanged_by_default: str = ""
    no_reuse: str = ""

    def __post_init__(self):
        if self.blocks is not None and self.blocks.family != self.name:
            object.__setattr__(self, "blocks", replace(self.blocks, family=self.name))

    @property
    def listed_as(self) -> str:
        return self.words or ", ".join((self.name, *self.aliases))

    def classes(self, host: str) -> tuple[str, ...]:
        if host not in HOSTS:
            raise ValueError(f"host must be one of {', '.join(HOSTS)}, got {host!r}")
        return getattr(self, host)

    @property
    def guarded_by_first_block(self) -> bool:
        return self.first_block_guard is not None or self.line_guard is not None

    def auto_schedule(self) -> StepCountSchedule:
        """The schedule "auto" runs: its interval, guarded by the first block if a guard is set, else by the curve."""
        if self.guarded_by_first_block:
            guards = (self.first_block_guard, self.line_guard)
            return StepCountSchedule(self.auto_intervals, None, *guards, short_run=self.short_run)
        return StepCountSchedule(self.auto_intervals, self.curve, short_run=self.short_run)


# MagCache's thresholds, as its authors publish them with the ratios (``step_change_curves``).
FLUX_CURVE = StepChangeCurve(published.FLUX1_DEV, 0.24)
QWEN_IMAGE_CURVE = StepChangeCurve(published.QWEN_IMAGE, 0.10)
HUNYUAN_VIDEO_CURVE = StepChangeCurve(published.HUNYUAN_VIDEO, 0.24)
WAN_CURVE = StepChangeCurve(published.WAN21_T2V_14B, 0.24)

# Chosen by measurement (docs/dit-measurements.md); a family without a reference takes the nearest family's.
# A record naming the model's own class wins over one naming a class it derives from (``_named``).
FAMILIES = (
    DitFamily(
        "Flux", words="Flux.1, Flux.2, Chroma", auto_intervals=((0, 3), (40, 4)), extrapolate=1.0,
        todo_min_image_tokens=4096,
        curve=FLUX_CURVE, curve_of="FLUX.1-dev",
        comfyui=("Flux", "Chroma"), diffusers=("FluxTransformer2DModel", "Flux2Transformer2DModel"),
        neo=("IntegratedFluxTransformer2DModel", "IntegratedChromaTransformer2DModel"),
        forge=("IntegratedFluxTransformer2DModel", "IntegratedChromaTransformer2DModel"),
        blocks=BlockLayout((("double_block", "double_blocks"), ("single_block", "single_blocks")), ("txt", "img")),
    ),
    # AuraFlow's class is called ``MMDiT`` as SD3's; its block lists tell the two apart.
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
        "Qwen-Image", auto_intervals=((0, 6),), extrapolate=1.0, curve=QWEN_IMAGE_CURVE, curve_of="Qwen-Image",
        first_block_guard=0.15, line_guard=0.07, short_run=0,
        comfyui=("QwenImageTransformer2DModel",), diffusers=("QwenImageTransformer2DModel",),
        neo=("QwenImageTransformer2DModel",),
        # Blocks return ``(txt, img)``, which the hook's ``block_wrap`` turns into the dict.
        blocks=BlockLayout((("double_block", "transformer_blocks"),), ("txt", "img")),
    ),
    DitFamily(
        "Lumina 2", aliases=("Z-Image",), auto_intervals=((0, 3), (40, 4)), todo_min_image_tokens=2304,
        curve=FLUX_CURVE, curve_of="FLUX.1-dev (nearest family)",
        comfyui=("NextDiT",), diffusers=("ZImageTransformer2DModel",), neo=("NextDiT",),
        blocks=BlockLayout((("layer", "layers"),), ("img",), hook="forward"),
    ),
    DitFamily("Wan VACE", comfyui=("VaceWanModel",),
              no_reuse="VACE adds its hints between blocks, outside the block hook, which a skipped span would miss"),
    DitFamily("Wan S2V", comfyui=("WanModel_S2V",),
              no_reuse="Wan S2V injects audio and adds tokens of its own between blocks"),
    DitFamily("Wan HuMo", comfyui=("HumoWanModel",), no_reuse="Wan HuMo adds audio inputs of its own between blocks"),
    DitFamily("Wan Animate", comfyui=("AnimateWanModel",),
              no_reuse="Wan Animate fuses face features every few blocks, outside the block hook"),
    DitFamily(
        "Wan", words="Wan 2.x", auto_intervals=((0, 6),), curve=WAN_CURVE, curve_of="Wan 2.1 T2V 14B",
        first_block_guard=0.15, line_guard=0.1, short_run=0,
        comfyui=("WanModel",), diffusers=("WanTransformer3DModel",), neo=("WanModel",),
        blocks=BlockLayout((("double_block", "blocks"),), ("img",)),
    ),
    DitFamily(
        "Cosmos Predict2", aliases=("Anima",), auto_intervals=((0, 3), (40, 4)),
        curve=FLUX_CURVE, curve_of="FLUX.1-dev (nearest family: an image DiT)",
        comfyui=("MiniTrainDIT",), neo=("MiniTrainDIT",),
        blocks=BlockLayout((("layer", "blocks"),), ("img",), hook="forward"),
    ),
    DitFamily(
        "HunyuanVideo", words="HunyuanVideo 1.0/1.5", auto_intervals=((0, 4),),
        curve=HUNYUAN_VIDEO_CURVE, curve_of="HunyuanVideo",
        comfyui=("HunyuanVideo",), diffusers=("HunyuanVideo15Transformer3DModel",),
        blocks=BlockLayout((("double_block", "double_blocks"), ("single_block", "single_blocks")), ("img", "txt")),
    ),
    # LTX-2's ``img`` is the tuple (video, audio) of two widths; ``cache.join_streams`` cuts both into one width.
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
    DitFamily(
        "OmniGen2", auto_intervals=((0, 3), (40, 4)), curve=FLUX_CURVE, curve_of="FLUX.1-dev (nearest family)",
        unchanged_by_default="no reference measures a default on OmniGen2 yet; dit_settings 'as set' with a "
        "reuse_interval reuses across steps",
        comfyui=("OmniGen2Transformer2DModel",),
        blocks=BlockLayout((("layer", "layers"),), ("img",), hook="forward"),
    ),
    DitFamily("HiDream", comfyui=("HiDreamImageTransformer2DModel",),
              no_reuse="HiDream hands no block to the block hook, and its blocks change the token count"),
    DitFamily("Cosmos 1.0", comfyui=("GeneralDIT",), no_reuse="Cosmos 1.0 hands no block to the block hook"),
)  # fmt: skip
# A DiT no record names: Flux's interval and curve.
OTHER = DitFamily("other", curve=FLUX_CURVE, curve_of="FLUX.1-dev (nearest family)")

_BY_NAME = {name: family for family in FAMILIES for name in (family.name, *family.aliases)}


def listed(host: str) -> str:
    return ", ".join(f.listed_as for f in FAMILIES if f.blocks is not None and f.classes(host))


def family(name: str) -> DitFamily:
    """The record of the family a host door calls ``name`` (``OTHER`` for a name no record has)."""
    return _BY_NAME.get(name, OTHER)


# The hosts whose classes a record's ``BlockLayout`` describes (diffusers' layouts are its door's own).
_LAID_OUT = ("comfyui", "neo", "forge")


def _named(host: str, model) -> list[DitFamily]:
    """The records naming one of ``model``'s classes, its own class first, then those it derives from."""
    return [family for cls in type(model).__mro__ for family in FAMILIES if cls.__name__ in family.classes(host)]


def of_model(host: str, model) -> DitFamily | None:
    """The record of the first of ``_named`` whose block layout ``model``'s blocks fit, or None."""
    for family in _named(host, model):
        if host not in _LAID_OUT or family.blocks is None or family.blocks.fits(model):
            return family
    return None


def named_but_unfit(host: str, model) -> DitFamily | None:
    """A record naming one of ``model``'s classes whose blocks it lacks, where no record fits (for the log)."""
    if of_model(host, model) is not None:
        return None
    return next(iter(_named(host, model)), None)


def auto_schedule(name: str) -> StepCountSchedule:
    return family(name).auto_schedule()
