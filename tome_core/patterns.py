"""Destination patterns for ToMe: which token of each sy x sx cell is kept as a merge destination.

A pattern depends only on the grid size, the stride and, with randomness on, a seed and a per-block salt.
The random choice is a stateless integer hash of the seed and the cell, not a draw from a generator, so the
global random state (and with it the sampler's noise) is never touched and the same seed gives the same
pattern in every process and on every device. Patterns are cached per device, so
the hot path neither draws random numbers nor copies indices to the device.

Everything here traces under ``torch.compile`` without a graph break, also on a cold cache: the src/dst split
has a size known from the shapes (no ``nonzero``), the random choice needs no generator object, the salt is a
compile-time constant, and the cache takes no
lock (a dict's get and set are atomic; two threads building the same pattern at once store equal values).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

# Dynamo cannot trace zlib; the salt depends only on Python constants, so it may be computed at trace time.
_constant_result = getattr(getattr(torch, "compiler", None), "assume_constant_result", lambda fn: fn)


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


@_constant_result
def stable_salt(*parts: object) -> int:
    """A salt from any printable parts that is the same in every process (unlike ``hash``)."""
    return zlib.crc32(repr(parts).encode())


_MASK32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (xor-shift-multiply), exact in int64 on every device: products stay below 2**63."""
    for _ in range(2):
        x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    return x ^ (x >> 16)


def _random_offsets(cells_h: int, cells_w: int, cell_size: int, seed: int) -> torch.Tensor:
    """For every cell, a position in 0..cell_size-1 that depends only on the seed and the cell's index."""
    seed = (seed ^ (seed >> 32)) & _MASK32
    cell = torch.arange(cells_h * cells_w, dtype=torch.int64)
    mixed = _hash32((_hash32(cell) + seed) & _MASK32)
    return (mixed % cell_size).view(cells_h, cells_w)


def _build_pattern(h: int, w: int, sx: int, sy: int, seed: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    cells_h, cells_w = h // sy, w // sx
    if seed is None:
        offsets = torch.zeros(cells_h, cells_w, dtype=torch.int64)
    else:
        offsets = _random_offsets(cells_h, cells_w, sy * sx, seed)
    rows = torch.arange(cells_h).view(-1, 1) * sy + offsets // sx
    cols = torch.arange(cells_w).view(1, -1) * sx + offsets % sx
    is_dst = torch.zeros(h, w, dtype=torch.bool)
    is_dst[rows, cols] = True  # rows and columns left over by a stride that does not divide stay src
    # Stable sort of the flags: src tokens first, then dst, each in raster order (what nonzero would give, but
    # with sizes known from the shapes).
    order = is_dst.flatten().to(torch.uint8).argsort(stable=True)
    n_src = h * w - cells_h * cells_w
    return order[:n_src], order[n_src:]


class PatternCache:
    """Builds each pattern once and keeps it on the device that asked for it. Safe to share between threads."""

    def __init__(self) -> None:
        self._patterns: dict[tuple, DstPattern] = {}

    def get(self, h: int, w: int, sx: int, sy: int, seed: int | None, device: torch.device) -> DstPattern:
        key = (h, w, sx, sy, seed, str(device))
        pattern = self._patterns.get(key)
        if pattern is None:
            src_idx, dst_idx = _build_pattern(h, w, sx, sy, seed)
            pattern = DstPattern(src_idx.to(device), dst_idx.to(device))
            if len(self._patterns) > 4096:  # many sizes in a long-lived server: start over, never grow
                self._patterns.clear()
            self._patterns[key] = pattern
        return pattern
