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


@dataclass
class _Scene:
    """The random parameters of a batch of scenes (all (N, ...) tensors), drawn once, drawn at any time."""

    period: torch.Tensor
    phase: torch.Tensor
    angle: torch.Tensor
    tint: torch.Tensor
    greys: list  # per small object: (present, kind, centre, radius, grey)
    jitter: torch.Tensor
    radius: torch.Tensor


@dataclass
class _Motion:
    """How a clip's scene changes from its first frame (time 0) to its last (time 1)."""

    jitter_end: torch.Tensor  # the main object travels from ``jitter`` to here, inside its quadrant
    grey_velocity: list  # per small object, (N, 2) in pixels over the clip
    drift: torch.Tensor  # background pattern phase travelled over the clip, radians
    tint_end: torch.Tensor  # the background's tint shifts linearly to this


def _sample_scene(n: int, size: int, generator: torch.Generator) -> _Scene:
    # The order of the draws is the data stream the committed reference weights were trained on: keep it.
    period = (size / 5.0) * (0.8 + 0.4 * torch.rand(n, 1, 1, generator=generator))
    phase = torch.rand(n, 1, 1, generator=generator) * 2 * math.pi
    angle = torch.rand(n, 1, 1, generator=generator) * math.pi
    tint = (torch.rand(n, 3, 1, 1, generator=generator) - 0.5) * 0.5 - 0.3
    greys = []
    for _ in range(2):
        present = torch.rand(n, generator=generator) < 0.6
        kind = torch.randint(0, len(KINDS), (n,), generator=generator)
        centre = torch.rand(n, 2, generator=generator) * size * 0.8 + size * 0.1
        radius = size * (0.07 + 0.04 * torch.rand(n, generator=generator))
        grey = 0.1 + 0.6 * torch.rand(n, 1, 1, 1, generator=generator)
        greys.append((present, kind, centre, radius, grey))
    jitter = (torch.rand(n, 2, generator=generator) - 0.5) * 0.12
    radius = size * (0.17 + 0.06 * torch.rand(n, generator=generator))
    return _Scene(period, phase, angle, tint, greys, jitter, radius)


def _sample_motion(n: int, size: int, generator: torch.Generator) -> _Motion:
    jitter_end = (torch.rand(n, 2, generator=generator) - 0.5) * 0.12
    grey_velocity = [(torch.rand(n, 2, generator=generator) - 0.5) * 0.4 * size for _ in range(2)]
    drift = (torch.rand(n, 1, 1, generator=generator) - 0.5) * 2 * math.pi
    tint_end = (torch.rand(n, 3, 1, 1, generator=generator) - 0.5) * 0.5 - 0.3
    return _Motion(jitter_end, grey_velocity, drift, tint_end)


def _background(kind, scene: _Scene, yy, xx, phase, tint):
    """(N, 4, H, W) textured backgrounds of the given kinds with a muted tint."""
    period, angle = scene.period, scene.angle
    u = yy * torch.cos(angle) + xx * torch.sin(angle)
    stripes = torch.sign(torch.sin(2 * math.pi * u / period + phase))
    checks = torch.sign(torch.sin(math.pi * yy / period * 2 + phase) * torch.sin(math.pi * xx / period * 2 + phase))
    waves = torch.sin(2 * math.pi * (xx / period + 0.5 * torch.sin(2 * math.pi * yy / (2 * period)) + phase))
    plain = torch.zeros_like(waves)
    patterns = torch.stack([plain, stripes, checks, waves])
    pattern = patterns.gather(0, kind.view(1, -1, 1, 1).expand(1, *patterns.shape[1:]))[0]
    colour = tint + 0.25 * pattern.unsqueeze(1)
    relief = -0.6 + 0.2 * pattern.unsqueeze(1)
    return torch.cat([colour, relief], dim=1)


def _draw(prompts: Prompts, scene: _Scene, size: int, motion: _Motion | None = None, time: float = 0.0):
    """(N, 4, size, size): the scene at ``time`` (0 to 1) of its motion; a still scene without one."""
    n = len(prompts)
    fine = size * 2
    coords = (torch.arange(fine, dtype=torch.float32) + 0.5) / 2.0  # in output pixels
    yy, xx = coords.view(1, -1, 1), coords.view(1, 1, -1)
    phase, tint, jitter = scene.phase, scene.tint, scene.jitter
    if motion is not None:
        phase = phase + motion.drift * time
        tint = torch.lerp(tint, motion.tint_end, time)
        jitter = torch.lerp(jitter, motion.jitter_end, time)
    image = _background(prompts.background, scene, yy, xx, phase, tint)

    # Up to two small grey objects, drawn first so the main object may cover them.
    for i, (present, kind, centre, radius, grey) in enumerate(scene.greys):
        if motion is not None:
            centre = centre + motion.grey_velocity[i] * time
        mask, relief = _shape_masks(
            kind, centre[:, 0].view(-1, 1, 1), centre[:, 1].view(-1, 1, 1), radius.view(-1, 1, 1), yy, xx
        )
        mask = mask * present.view(-1, 1, 1).float()
        value = torch.cat([grey.expand(-1, 3, 1, 1) * torch.ones_like(image[:, :3]), relief.unsqueeze(1) * 0.5], dim=1)
        image = torch.where(mask.unsqueeze(1) > 0, value, image)

    centre = (_CENTRES[prompts.position] + jitter) * size
    radius = scene.radius
    mask, relief = _shape_masks(
        prompts.kind, centre[:, 0].view(-1, 1, 1), centre[:, 1].view(-1, 1, 1), radius.view(-1, 1, 1), yy, xx
    )
    shade = 0.85 + 0.15 * relief.unsqueeze(1)
    colour = _RGB[prompts.colour].view(n, 3, 1, 1) * shade
    value = torch.cat([colour, relief.unsqueeze(1)], dim=1)
    image = torch.where(mask.unsqueeze(1) > 0, value, image)
    return F.avg_pool2d(image, 2)


def render(prompts: Prompts, size: int, generator: torch.Generator) -> torch.Tensor:
    """(N, 4, size, size) scenes for ``prompts``, values in about [-1, 1]."""
    return _draw(prompts, _sample_scene(len(prompts), size, generator), size)


def render_clip(prompts: Prompts, size: int, frames: int, generator: torch.Generator) -> torch.Tensor:
    """(N, 4, frames, size, size) moving scenes: the prompted object travels inside its quadrant, the small grey
    objects drift across, the background pattern slides and its tint shifts. Every frame is a scene of the same
    prompt (the attribute classifier judges each), and the first frame is what ``render`` draws from the same
    generator state."""
    n = len(prompts)
    scene = _sample_scene(n, size, generator)
    motion = _sample_motion(n, size, generator)
    times = [f / max(1, frames - 1) for f in range(frames)]
    return torch.stack([_draw(prompts, scene, size, motion, t) for t in times], dim=2)


def batch(n: int, size: int, generator: torch.Generator) -> tuple[torch.Tensor, Prompts]:
    """``n`` random prompts and their scenes."""
    prompts = random_prompts(n, generator)
    return render(prompts, size, generator), prompts


def open_up(images: torch.Tensor, amount: float, generator: torch.Generator, cells: int = 4) -> torch.Tensor:
    """Scenes the prompt leaves more open: ``images`` plus smooth unprompted fields (lighting), one on the colour
    channels together (brightness) and one on the relief channel, each a ``cells`` x ``cells`` grid of N(0,
    ``amount``) values interpolated over the image, so that at high noise the picture's large scales are undecided
    by the prompt, as a real picture's composition is. Brightness and relief, not hue: the classifier still names
    the attributes (mean accuracy 0.99 at ``amount`` 0.4 on real scenes)."""
    if not amount:
        return images
    grid = torch.randn(images.shape[0], 2, cells, cells, generator=generator) * amount
    field = F.interpolate(grid, size=images.shape[-2:], mode="bicubic", align_corners=False)
    return images + torch.cat((field[:, :1].expand(-1, CHANNELS - 1, -1, -1), field[:, 1:]), dim=1)


def clip_batch(n: int, size: int, frames: int, generator: torch.Generator) -> tuple[torch.Tensor, Prompts]:
    """``n`` random prompts and their clips, (n, 4, frames, size, size)."""
    prompts = random_prompts(n, generator)
    return render_clip(prompts, size, frames, generator), prompts


def frames_of(clips: torch.Tensor) -> torch.Tensor:
    """(N, C, T, H, W) clips as (N * T, C, H, W) images, clip by clip."""
    return clips.transpose(1, 2).flatten(0, 1)


def to_rgb(images: torch.Tensor) -> torch.Tensor:
    """Colour channels mapped to [0, 1] for viewing and for image metrics."""
    return ((images[:, :3] + 1.0) / 2.0).clamp(0.0, 1.0)


# The second generation of scenes (the ``-v2`` references): drawn at twice the latent size, opened up at three
# scales, brought to zero mean and unit variance per channel and folded 2x2 into 16 channels, so that a latent token
# (2x2 patches) carries 64 values as a real Flux.1 latent's does, and what the prompt decides is a minority of the
# picture, as in a real photograph's latent: the prompted mean of a scene holds about 0.4 of its norm where the
# first generation's holds 0.84 (and its step-0 prediction 86% of the final one). See docs/dit.md.
FOLD = 2  # pixels per side folded into channels
FOLDED_CHANNELS = CHANNELS * FOLD * FOLD
OPEN_V2 = ((4, 0.5), (12, 0.25), (32, 0.12))  # (cells, amount) of the unprompted fields: light, shading, grain
# The opened-up scenes' mean and standard deviation per channel (colour, colour, colour, relief), measured once on
# 4096 scenes (seed 0) at 64 px, rounded; they play the part of a VAE's shift and scale factor.
V2_MEAN = (-0.249, -0.254, -0.247, -0.464)
V2_STD = (0.622, 0.613, 0.620, 0.649)


def fold(images: torch.Tensor) -> torch.Tensor:
    """(N, C, 2H, 2W) -> (N, 4C, H, W): each 2x2 block of pixels into channels."""
    return F.pixel_unshuffle(images, FOLD)


def unfold(latents: torch.Tensor) -> torch.Tensor:
    """The inverse of ``fold``."""
    return F.pixel_shuffle(latents, FOLD)


def _per_channel(values, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype).view(1, -1, 1, 1)


def open_up_v2(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``open_up`` at each of ``OPEN_V2``'s scales."""
    for cells, amount in OPEN_V2:
        images = open_up(images, amount, generator, cells)
    return images


def v2_latents(images: torch.Tensor, folded: bool = True) -> torch.Tensor:
    """Opened-up scenes -> the ``-v2`` references' latents: standardised, and (``folded``, the DiTs) folded into
    16 channels at half the size; the UNet's keep the 4 channels of an SD / SDXL latent."""
    latents = (images - _per_channel(V2_MEAN, images)) / _per_channel(V2_STD, images)
    return fold(latents) if folded else latents


def v2_scenes(latents: torch.Tensor) -> torch.Tensor:
    """The ``-v2`` references' latents -> the scenes they stand for (4 channels; a folded latent's at twice the
    size)."""
    scenes = unfold(latents) if latents.shape[1] == FOLDED_CHANNELS else latents
    return scenes * _per_channel(V2_STD, scenes) + _per_channel(V2_MEAN, scenes)


def batch_v2(n: int, size: int, generator: torch.Generator, folded: bool = True) -> tuple[torch.Tensor, Prompts]:
    """``n`` random prompts and their ``-v2`` latents of ``size`` x ``size`` (``folded``: scenes of twice that)."""
    prompts = random_prompts(n, generator)
    scenes = open_up_v2(render(prompts, size * FOLD if folded else size, generator), generator)
    return v2_latents(scenes, folded), prompts
