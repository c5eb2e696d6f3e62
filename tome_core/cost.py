"""The ``skip_when_slower`` rule: reduce a level only where its token grid is large enough to pay off.

Shrinking self-attention saves time quadratic in the token count, while matching, merging and downsampling
cost time linear in it (plus a fixed launch cost). Below some token count the saving is smaller than the cost
and the patched UNet is slower than the unpatched one (ComfyUI's built-in ToMe at 512 px runs at 0.9x). The
minimum token counts below were read off the benchmark (``python -m tools.benchmark``): the smallest grid at
which the reduced UNet was faster than the unpatched one on the machines measured, with a margin. They are
documented with their measurements in the README ("The skip_when_slower rule").
"""

from __future__ import annotations

from .settings import PatchSettings

# Minimum tokens at a level (h * w of its grid) for the reduction to be applied there.
# 4096 tokens is SD1.5 at 512 px at level 1; 9216 is 768 px.
MIN_TOKENS = {
    "todo": 6144,
    "tome": 8192,
}


def worth_reducing(settings: PatchSettings, n_tokens: int) -> bool:
    if not settings.skip_when_slower:
        return True
    return n_tokens >= MIN_TOKENS[settings.method]
