"""The picture of a calibration: the unpatched and the calibrated latent side by side, their difference amplified,
and under them the unpatched run's change per step, the computed steps in orange. docs/calibration.md, 'The
picture'."""

from __future__ import annotations

import torch
import torch.nn.functional as F

AMPLIFY = 10.0
HEIGHT = 192  # the latents' row, in pixels
CHART = 96  # the chart's height
GAP = 4
COMPUTED, SKIPPED, BACKGROUND = (1.0, 0.55, 0.1), (0.35, 0.45, 0.6), (0.08, 0.08, 0.08)


def step_changes(denoised: list[torch.Tensor]) -> list[float]:
    """Each step's relative change of the denoised image from the step before (the first: 0)."""
    changes = [0.0]
    for before, now in zip(denoised, denoised[1:], strict=False):
        scale = float(before.float().norm()) or 1.0
        changes.append(float((now.float() - before.float()).norm()) / scale)
    return changes


def _as_rgb(latent: torch.Tensor, low: torch.Tensor, span: torch.Tensor) -> torch.Tensor:
    image = ((latent - low) / span).clamp(0, 1)
    return image.repeat(3, 1, 1)[:3] if image.shape[0] < 3 else image[:3]


def _panel(image: torch.Tensor) -> torch.Tensor:
    height, width = image.shape[-2:]
    size = (HEIGHT, max(1, round(width * HEIGHT / height)))
    return F.interpolate(image[None], size=size, mode="nearest")[0]


def _chart(changes: list[float], computed: set[int], width: int) -> torch.Tensor:
    chart = torch.tensor(BACKGROUND).view(3, 1, 1).expand(3, CHART, width).clone()
    steps = len(changes)
    top = max(max(changes), 1e-12)
    for step, change in enumerate(changes):
        left, right = step * width // steps, max((step + 1) * width // steps - 1, step * width // steps + 1)
        bar = max(1, round(change / top * (CHART - 2)))
        colour = torch.tensor(COMPUTED if step in computed else SKIPPED).view(3, 1, 1)
        chart[:, CHART - bar :, left:right] = colour
    return chart


def draw_report(reference: torch.Tensor, calibrated: torch.Tensor, changes: list[float], computed: set[int]
                ) -> torch.Tensor:  # fmt: skip
    """An RGB image (height, width, 3) of floats in [0, 1] for the first sample of ``reference`` and
    ``calibrated`` (latents of one shape; a video's first frame), and the chart of ``changes`` per step."""
    first, second = reference[0].float().cpu(), calibrated[0].float().cpu()
    if first.dim() == 4:  # (channels, frames, height, width)
        first, second = first[:, 0], second[:, 0]
    channels = first.flatten(1)
    low, high = channels.amin(1).view(-1, 1, 1), channels.amax(1).view(-1, 1, 1)
    span = (high - low).clamp_min(1e-12)
    difference = ((second - first).abs() * AMPLIFY / span).clamp(0, 1)
    panels = [_panel(_as_rgb(first, low, span)), _panel(_as_rgb(second, low, span)), _panel(_as_rgb(difference, 0, 1))]
    gap = torch.zeros(3, HEIGHT, GAP)
    top = torch.cat([panels[0], gap, panels[1], gap, panels[2]], dim=2)
    bottom = _chart(changes, computed, top.shape[2])
    image = torch.cat([top, torch.zeros(3, GAP, top.shape[2]), bottom], dim=1)
    return image.permute(1, 2, 0).contiguous()
