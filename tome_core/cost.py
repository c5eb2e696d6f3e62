"""The ``skip_when_slower`` rule: reduce a level only where its token grid is large enough to pay off.
See docs/benchmark.md, section 'The skip_when_slower rule'."""

from __future__ import annotations

from .settings import PatchSettings

# Minimum tokens (h * w at a level) per method and scope, chosen by measurement (see the module docstring).
MIN_TOKENS = {
    "todo": 1024,
    "tome": 2304,
    "tome block": 256,
}
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
