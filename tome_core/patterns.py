"""Destination patterns for ToMe: which token of each sy x sx cell is kept as a merge destination.

A pattern depends only on the grid size, the stride and, with randomness on, a seed and a per-block salt.
It is drawn from a private CPU generator, so the global random state (and with it the sampler's noise) is
never touched and the same seed gives the same pattern in every process. Patterns are cached per device, so
the hot path neither draws random numbers nor copies indices to the device.
"""

from __future__ import annotations

import threading
import zlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DstPattern:
    """Token indices (raster order over the h x w grid) of the src and dst sets."""

    src_idx: torch.Tensor  # (n_src,) int64
    dst_idx: torch.Tensor  # (n_dst,) int64

    @property
    def n_src(self) -> int:
        return self.src_idx.shape[0]

    @property
    def n_dst(self) -> int:
        return self.dst_idx.shape[0]


def stable_salt(*parts: object) -> int:
    """A salt from any printable parts that is the same in every process (unlike ``hash``)."""
    return zlib.crc32(repr(parts).encode())


def _build_pattern(h: int, w: int, sx: int, sy: int, seed: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    cells_h, cells_w = h // sy, w // sx
    if seed is None:
        offsets = torch.zeros(cells_h, cells_w, dtype=torch.int64)
    else:
        generator = torch.Generator(device="cpu")
        generator.manual_seed(seed)
        offsets = torch.randint(sy * sx, (cells_h, cells_w), generator=generator)
    rows = torch.arange(cells_h).view(-1, 1) * sy + offsets // sx
    cols = torch.arange(cells_w).view(1, -1) * sx + offsets % sx
    is_dst = torch.zeros(h, w, dtype=torch.bool)
    is_dst[rows, cols] = True  # rows and columns left over by a stride that does not divide stay src
    flat = is_dst.flatten()
    return torch.nonzero(~flat).flatten(), torch.nonzero(flat).flatten()


class PatternCache:
    """Builds each pattern once and keeps it on the device that asked for it. Safe to share between threads."""

    def __init__(self) -> None:
        self._patterns: dict[tuple, DstPattern] = {}
        self._lock = threading.Lock()

    def get(self, h: int, w: int, sx: int, sy: int, seed: int | None, device: torch.device) -> DstPattern:
        key = (h, w, sx, sy, seed, str(device))
        pattern = self._patterns.get(key)
        if pattern is None:
            src_idx, dst_idx = _build_pattern(h, w, sx, sy, seed)
            pattern = DstPattern(src_idx.to(device), dst_idx.to(device))
            with self._lock:
                if len(self._patterns) > 4096:  # many sizes in a long-lived server: start over, never grow
                    self._patterns.clear()
                self._patterns[key] = pattern
        return pattern
