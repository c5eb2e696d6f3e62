"""The ``skip_when_slower`` rule: reduce a level only where its token grid is large enough to pay off.

Shrinking self-attention saves time quadratic in the token count, while matching, merging and downsampling
cost time linear in it plus a fixed cost per call (ToMe's plan also has a quadratic part, about a tenth of
the attention it shrinks). Below some token count the saving is smaller than the cost and the patched UNet
is slower than the unpatched one.

How the minimum token counts were derived (``python -m tools.bench.unet.breakeven``, README "The skip_when_slower
rule"): only the blocks of the reduced level change, so the whole UNet's gain is those blocks' gain. One real
ComfyUI transformer block of SD1.5's level 1 (320 channels, 8 heads) and of SDXL's level 2 (640 channels,
10 heads) was timed unpatched and with each method forced on, on square grids from 16x16 to 72x72 tokens
(2-core CPU, fp32, SDPA). ToDo (factor 2) was faster from 256 tokens on, ToMe (ratio 0.3 and 0.5) from 1600
tokens on with SD1.5 and SDXL alike; each threshold below is that measurement with a safety margin, and the
whole-UNet rows of ``python -m tools.bench.speed`` confirm it at 512 and 768 px.

On CUDA the shares are different: a GPU runs a UNet's kernels faster than the host issues them at the sizes most
people use, so a reduction's extra kernels cost more than the attention it shrinks saves, until the attention is
large: on a data-centre GPU in fp16 every method was slower than off below 16384 tokens and faster from there
(``python -m tools.bench.gpu``; the figures: docs/benchmark.md). So CUDA has its own table, ``MIN_TOKENS_CUDA``; other
devices (MPS included, not measured) keep the CPU's. A smaller GPU, slower per kernel, may already gain below
16384 tokens: there the rule costs a little speed, never a picture; ``skip_when_slower`` off forces the reduction.

DiTs (``joint_attention.py``) weigh the image tokens of one attention call (frames x h x w for video) against
this ToDo threshold, or against a family's own where it was measured higher (Flux, whose wide blocks spend
little of their time in attention at small sizes: ``hosts/shared/dit_families``, docs/dit.md).
"""

from __future__ import annotations

from .settings import PatchSettings

# Minimum tokens at a level (h * w of its grid) for the reduction to be applied there, per method and scope.
# For scale: SD1.5 level 1 has 4096 tokens at 512 px and 2304 at 384 px; SDXL level 2 has 1024 at 512 px,
# 2304 at 768 px and 4096 at 1024 px; SDXL level 4 has 1024 at 1024 px.
MIN_TOKENS = {
    "todo": 1024,
    "tome": 2304,
    "tome block": 256,
}
# On CUDA: SD1.5 at 1024 px (16384 tokens at level 1) and SDXL from 2048 px are reduced, smaller sizes are not.
MIN_TOKENS_CUDA = {
    "todo": 16384,
    "tome": 16384,
    "tome block": 16384,
}


def min_tokens(key: str, device_type: str = "cpu") -> int:
    """The minimum token count of ``key`` (a ``MIN_TOKENS`` key) on a device type ("cpu", "cuda", "mps" ...)."""
    return (MIN_TOKENS_CUDA if device_type == "cuda" else MIN_TOKENS)[key]


def threshold_key(settings: PatchSettings) -> str:
    """The ``MIN_TOKENS`` entry for these settings: ToMe's scope block has its own (ToDo ignores the scope)."""
    return "tome block" if settings.merges_whole_block else settings.method


def worth_reducing(settings: PatchSettings, n_tokens: int, device_type: str = "cpu") -> bool:
    if not settings.skip_when_slower:
        return True
    return n_tokens >= min_tokens(threshold_key(settings), device_type)
