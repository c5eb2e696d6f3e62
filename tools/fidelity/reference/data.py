"""Synthetic scenes with structure at several scales, generated from a seed: the reference models' data.

A scene is a 4-channel "latent" image (channels 0-2 colour, channel 3 a relief map) of one prompted object
(kind, colour, position) on a prompted background texture, with up to two small unprompted grey objects that
the main object may overlap. Edges are anti-aliased by rendering at twice the size and averaging.
Everything is computed from a ``torch.Generator``, so the same seed gives the same data on every machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

KINDS = ("circle", "square", "triangle", "ring")
COLOURS = ("red", "green", "blue", "yellow", "cyan", "magenta")
POSITIONS = ("top-left", "top-right", "bottom-left", "bottom-right")
BACKGROUNDS = ("plain", "stripes", "checks", "waves")
# The prompt's attributes, in token order.
ATTRIBUTES = {"kind": KINDS, "colour": COLOURS, "position": POSITIONS, "background": BACKGROUNDS}
CHANNELS = 4

_RGB = torch.tensor(
    [[0.9, -0.7, -0.7], [-0.7, 0.8, -0.7], [-0.7, -0.6, 0.9], [0.9, 0.8, -0.7], [-0.7, 0.8, 0.9], [0.9, -0.7, 0.9]]
)
# Quadrant centres as fractions of the image size.
_CENTRES = torch.tensor([[0.28, 0.28], [0.28, 0.72], [0.72, 0.28], [0.72, 0.72]])  # (y, x)


@dataclass(frozen=True)
class Prompts:
    """A batch of prompts: one index per attribute, each a LongTensor of shape (N,)."""

    kind: torch.Tensor
    colour: torch.Tensor
    position: torch.Tensor
    background: torch.Tensor

    def as_tensor(self) -> torch.Tensor:
        """(N, 4) attribute indices in ATTRIBUTES order."""
        return torch.stack([self.kind, self.colour, self.position, self.background], dim=1)

    @staticmethod
    def from_tensor(indices: torch.Tensor) -> Prompts:
        return Prompts(*indices.long().unbind(dim=1))

    def __len__(self) -> int:
        return self.kind.shape[0]


def random_prompts(n: int, generator: torch.Generator) -> Prompts:
    sizes = [len(values) for values in ATTRIBUTES.values()]
    return Prompts(*(torch.randint(0, size, (n,), generator=generator) for size in sizes))


def all_prompts() -> Prompts:
    """Every combination of the attributes once (4 * 6 * 4 * 4 = 384 prompts)."""
    grids = torch.meshgrid(*(torch.arange(len(v)) for v in ATTRIBUTES.values()), indexing="ij")
    return Prompts(*(g.reshape(-1) for g in grids))


def describe(prompts: Prompts, i: int) -> str:
    values = [ATTRIBUTES[name][int(index[i])] for name, index in zip(ATTRIBUTES, prompts.as_tensor().T, strict=True)]
    return "{1} {0}, {2}, {3} background".format(*values)


def _shape_masks(kind, cy, cx, radius, yy, xx):
    """Soft-free (0/1) masks and relief of shapes of the given kinds; all arguments broadcast over (N, H, W)."""
    dy, dx = yy - cy, xx - cx
    dist = torch.sqrt(dy * dy + dx * dx)
    circle = dist <= radius
    square = torch.maximum(dy.abs(), dx.abs()) <= radius * 0.85
    top = cy - radius
    depth = (yy - top) / (1.7 * radius)  # 0 at the apex, 1 at the base
    triangle = (depth >= 0) & (depth <= 1) & (dx.abs() <= radius * depth)
    ring = circle & (dist >= radius * 0.55)
    masks = torch.stack([circle, square, triangle, ring])  # (4, N, H, W)
    mask = masks.gather(0, kind.view(1, -1, 1, 1).expand(1, *masks.shape[1:]))[0]
    relief = (1.0 - (dist / radius).clamp(max=1.0) ** 2) * 0.8 + 0.2
    return mask.float(), relief


def _backgrounds(kind, yy, xx, size, generator):
    """(N, 4, H, W) textured backgrounds of the given kinds with a muted random tint."""
    n = kind.shape[0]
    period = (size / 5.0) * (0.8 + 0.4 * torch.rand(n, 1, 1, generator=generator))
    phase = torch.rand(n, 1, 1, generator=generator) * 2 * math.pi
    angle = torch.rand(n, 1, 1, generator=generator) * math.pi
    u = yy * torch.cos(angle) + xx * torch.sin(angle)
    stripes = torch.sign(torch.sin(2 * math.pi * u / period + phase))
    checks = torch.sign(torch.sin(math.pi * yy / period * 2 + phase) * torch.sin(math.pi * xx / period * 2 + phase))
    waves = torch.sin(2 * math.pi * (xx / period + 0.5 * torch.sin(2 * math.pi * yy / (2 * period)) + phase))
    plain = torch.zeros_like(waves)
    patterns = torch.stack([plain, stripes, checks, waves])
    pattern = patterns.gather(0, kind.view(1, -1, 1, 1).expand(1, *patterns.shape[1:]))[0]
    tint = (torch.rand(n, 3, 1, 1, generator=generator) - 0.5) * 0.5 - 0.3
    colour = tint + 0.25 * pattern.unsqueeze(1)
    relief = -0.6 + 0.2 * pattern.unsqueeze(1)
    return torch.cat([colour, relief], dim=1)


def render(prompts: Prompts, size: int, generator: torch.Generator) -> torch.Tensor:
    """(N, 4, size, size) scenes for ``prompts``, values in about [-1, 1]."""
    n = len(prompts)
    fine = size * 2
    coords = (torch.arange(fine, dtype=torch.float32) + 0.5) / 2.0  # in output pixels
    yy, xx = coords.view(1, -1, 1), coords.view(1, 1, -1)
    image = _backgrounds(prompts.background, yy, xx, size, generator)

    # Up to two small grey objects, drawn first so the main object may cover them.
    for _ in range(2):
        present = torch.rand(n, generator=generator) < 0.6
        kind = torch.randint(0, len(KINDS), (n,), generator=generator)
        centre = torch.rand(n, 2, generator=generator) * size * 0.8 + size * 0.1
        radius = size * (0.07 + 0.04 * torch.rand(n, generator=generator))
        mask, relief = _shape_masks(
            kind, centre[:, 0].view(-1, 1, 1), centre[:, 1].view(-1, 1, 1), radius.view(-1, 1, 1), yy, xx
        )
        mask = mask * present.view(-1, 1, 1).float()
        grey = 0.1 + 0.6 * torch.rand(n, 1, 1, 1, generator=generator)
        value = torch.cat([grey.expand(-1, 3, 1, 1) * torch.ones_like(image[:, :3]), relief.unsqueeze(1) * 0.5], dim=1)
        image = torch.where(mask.unsqueeze(1) > 0, value, image)

    jitter = (torch.rand(n, 2, generator=generator) - 0.5) * 0.12
    centre = (_CENTRES[prompts.position] + jitter) * size
    radius = size * (0.17 + 0.06 * torch.rand(n, generator=generator))
    mask, relief = _shape_masks(
        prompts.kind, centre[:, 0].view(-1, 1, 1), centre[:, 1].view(-1, 1, 1), radius.view(-1, 1, 1), yy, xx
    )
    shade = 0.85 + 0.15 * relief.unsqueeze(1)
    colour = _RGB[prompts.colour].view(n, 3, 1, 1) * shade
    value = torch.cat([colour, relief.unsqueeze(1)], dim=1)
    image = torch.where(mask.unsqueeze(1) > 0, value, image)
    return F.avg_pool2d(image, 2)


def batch(n: int, size: int, generator: torch.Generator) -> tuple[torch.Tensor, Prompts]:
    """``n`` random prompts and their scenes."""
    prompts = random_prompts(n, generator)
    return render(prompts, size, generator), prompts


def to_rgb(images: torch.Tensor) -> torch.Tensor:
    """Colour channels mapped to [0, 1] for viewing and for image metrics."""
    return ((images[:, :3] + 1.0) / 2.0).clamp(0.0, 1.0)
