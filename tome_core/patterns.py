"""Destination patterns for ToMe: which token of each sy x sx cell is kept as a merge destination. The random
choice is a stateless hash, so the sampler's random state is untouched and ``torch.compile`` needs no graph break."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

# Dynamo cannot trace zlib; the salt depends only on Python constants, so it may be computed at trace time.
_constant_result = getattr(getattr(torch, "compiler", None), "assume_constant_result", lambda fn: fn)


@dataclass(frozen=True)
class DstPattern:
    """Token indices (raster order over the h x w grid) of the src and dst sets."""

    src_idx: torch.Tensor
    dst_idx: torch.Tensor

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
    """A 32-bit integer mix, exact in int64 on every device."""
    for _ in range(2):
        x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    return x ^ (x >> 16)


def _random_offsets(cells_h: int, cells_w: int, cell_size: int, seed: int) -> torch.Tensor:
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
    # A stable sort instead of nonzero keeps the sizes known from the shapes.
    order = is_dst.flatten().to(torch.uint8).argsort(stable=True)
    n_src = h * w - cells_h * cells_w
    return order[:n_src], order[n_src:]


class PatternCache:
    """Builds each pattern once per device. Safe to share between threads (dict get/set are atomic)."""

    def __init__(self) -> None:
        self._patterns: dict[tuple, DstPattern] = {}

    def get(self, h: int, w: int, sx: int, sy: int, seed: int | None, device: torch.device) -> DstPattern:
        key = (h, w, sx, sy, seed, str(device))
        pattern = self._patterns.get(key)
        if pattern is None:
            src_idx, dst_idx = _build_pattern(h, w, sx, sy, seed)
            pattern = DstPattern(src_idx.to(device), dst_idx.to(device))
            if len(self._patterns) > 4096:
                self._patterns.clear()
            self._patterns[key] = pattern
        return pattern
