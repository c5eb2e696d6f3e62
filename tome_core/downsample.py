"""ToDo: self-attention keys and values downsampled on the (frames, h, w) token grid; queries stay full.

``nearest-exact`` picks the tokens ``F.interpolate`` would, as one cached row gather without layout copies."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

Grid = tuple[int, int, int]  # (frames, h, w) of tokens; images have one frame


def downsampled_size(h: int, w: int, factor: float) -> tuple[int, int]:
    return max(1, math.ceil(h / factor)), max(1, math.ceil(w / factor))


def downsampled_grid(grid: Grid, factor: float, time_factor: float = 1.0) -> Grid:
    frames, h, w = grid
    out_h, out_w = downsampled_size(h, w, factor)
    return max(1, math.ceil(frames / time_factor)), out_h, out_w


def _nearest_exact_index(size: int, out_size: int) -> torch.Tensor:
    scale = size / out_size
    return ((torch.arange(out_size, dtype=torch.float64) + 0.5) * scale).floor().clamp_max(size - 1).long()


class NearestIndexCache:
    """The flat token indices that nearest-exact keeps, built once per grid size and device."""

    def __init__(self) -> None:
        self._index: dict[tuple, torch.Tensor] = {}

    def get(self, h: int, w: int, out_h: int, out_w: int, device: torch.device) -> torch.Tensor:
        return self.get_grid((1, h, w), (1, out_h, out_w), device)

    def get_grid(self, grid: Grid, out_grid: Grid, device: torch.device, offset: int = 0) -> torch.Tensor:
        """Indices of the kept tokens of ``grid`` (flattened frame-first), shifted by ``offset``."""
        key = (grid, out_grid, offset, str(device))
        index = self._index.get(key)
        if index is None:
            (frames, h, w), (out_frames, out_h, out_w) = grid, out_grid
            times = _nearest_exact_index(frames, out_frames)
            rows = _nearest_exact_index(h, out_h)
            cols = _nearest_exact_index(w, out_w)
            index = times.view(-1, 1, 1) * (h * w) + rows.view(1, -1, 1) * w + cols.view(1, 1, -1)
            index = (index.flatten() + offset).to(device)
            # No lock: dict get and set are atomic, and a lock would break torch.compile's graph here.
            if len(self._index) > 4096:
                self._index.clear()
            self._index[key] = index
        return index

    def get_segment(self, start: int, grid: Grid, out_grid: Grid, total: int, device: torch.device) -> torch.Tensor:
        """Indices that keep a sequence of ``total`` tokens whole except the grid at ``start``, downsampled."""
        key = ("segment", start, grid, out_grid, total, str(device))
        index = self._index.get(key)
        if index is None:
            end = start + math.prod(grid)
            kept = self.get_grid(grid, out_grid, device, offset=start)
            index = torch.cat([torch.arange(start, device=device), kept, torch.arange(end, total, device=device)])
            self._index[key] = index
        return index


def downsample_tokens(
    x: torch.Tensor, h: int, w: int, factor: float, method: str, index_cache: NearestIndexCache
) -> torch.Tensor:
    """Downsample (batch, h*w, c) tokens by ``factor`` on their h x w grid."""
    return downsample_grid(x, (1, h, w), factor, 1.0, method, index_cache, dim=1)


def _resample(grid: torch.Tensor, out_grid: Grid, method: str) -> torch.Tensor:
    """(batch, c, frames, h, w) -> (batch, c, *out_grid) by ``method`` (avg_pool or bilinear)."""
    if method not in ("avg_pool", "bilinear"):
        raise ValueError(f"downsample_method must be one of nearest-exact, avg_pool, bilinear, got {method!r}")
    batch, channels, frames, h, w = grid.shape
    if out_grid[0] == frames:  # per frame: the 2D operation, exactly as on the UNets
        flat = grid.transpose(1, 2).reshape(batch * frames, channels, h, w)
        if method == "avg_pool":
            out = F.adaptive_avg_pool2d(flat, out_grid[1:])
        else:
            out = F.interpolate(flat, size=out_grid[1:], mode="bilinear", align_corners=False)
        return out.view(batch, frames, channels, *out_grid[1:]).transpose(1, 2)
    if method == "avg_pool":
        return F.adaptive_avg_pool3d(grid, out_grid)
    return F.interpolate(grid, size=out_grid, mode="trilinear", align_corners=False)


def downsample_grid(
    x: torch.Tensor,
    grid: Grid,
    factor: float,
    time_factor: float,
    method: str,
    index_cache: NearestIndexCache,
    dim: int = 1,
) -> torch.Tensor:
    """Downsample the frames*h*w tokens that lie along ``dim`` of ``x`` (channels last) on their grid."""
    out_grid = downsampled_grid(grid, factor, time_factor)
    if out_grid == grid:
        return x
    if method == "nearest-exact":
        return x.index_select(dim, index_cache.get_grid(grid, out_grid, x.device))
    moved = x.movedim(dim, -2)
    lead, channels = moved.shape[:-2], moved.shape[-1]
    volume = moved.reshape(-1, *grid, channels).permute(0, 4, 1, 2, 3)
    out = _resample(volume, out_grid, method).permute(0, 2, 3, 4, 1)
    return out.reshape(*lead, math.prod(out_grid), channels).movedim(-2, dim)


def downsample_segment(
    x: torch.Tensor,
    start: int,
    grid: Grid,
    factor: float,
    time_factor: float,
    method: str,
    index_cache: NearestIndexCache,
    dim: int = 1,
) -> torch.Tensor:
    """Downsample the grid tokens at ``start`` along ``dim``; the tokens before and after stay whole, in place."""
    n_grid = math.prod(grid)
    total = x.shape[dim]
    if start == 0 and n_grid == total:
        return downsample_grid(x, grid, factor, time_factor, method, index_cache, dim)
    out_grid = downsampled_grid(grid, factor, time_factor)
    if out_grid == grid:
        return x
    if method == "nearest-exact":
        return x.index_select(dim, index_cache.get_segment(start, grid, out_grid, total, x.device))
    before, middle, after = x.split([start, n_grid, total - start - n_grid], dim=dim)
    middle = downsample_grid(middle, grid, factor, time_factor, method, index_cache, dim)
    return torch.cat([before, middle, after], dim=dim)
