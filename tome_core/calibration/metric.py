"""The calibration's score: SSIM of each sample's latent against the unpatched run's, channels as an image's."""

from __future__ import annotations

import torch
import torch.nn.functional as F

WINDOW, SIGMA = 11, 1.5  # the usual SSIM window (Wang et al. 2004)
C1, C2 = 0.01**2, 0.03**2


def _window(size: int, channels: int, like: torch.Tensor) -> torch.Tensor:
    ramp = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    line = torch.exp(-(ramp**2) / (2 * SIGMA**2))
    line = line / line.sum()
    return torch.outer(line, line).to(like).expand(channels, 1, size, size).contiguous()


def _as_images(latent: torch.Tensor) -> torch.Tensor:
    """(batch, channels, height, width); a video latent's frames count as channels of its sample."""
    if latent.dim() == 5:
        return latent.flatten(1, 2)
    if latent.dim() != 4:
        raise ValueError(f"a latent of 4 or 5 dimensions, got shape {tuple(latent.shape)}")
    return latent


def latent_ssim(latent: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """SSIM per sample of ``latent`` against ``reference`` (the same shape), each sample scaled to [0, 1] by the
    reference's range; 1 where they are equal."""
    x, y = _as_images(latent.detach().double()), _as_images(reference.detach().double())
    if x.shape != y.shape:
        raise ValueError(f"latents of different shapes: {tuple(x.shape)} and {tuple(y.shape)}")
    low = y.amin(dim=(1, 2, 3), keepdim=True)
    span = (y.amax(dim=(1, 2, 3), keepdim=True) - low).clamp_min(1e-12)
    x, y = (x - low) / span, (y - low) / span
    size = min(WINDOW, x.shape[-1], x.shape[-2])
    size -= 1 - size % 2  # odd
    window = _window(size, x.shape[1], x)

    def blur(image: torch.Tensor) -> torch.Tensor:
        return F.conv2d(image, window, groups=x.shape[1])

    mx, my = blur(x), blur(y)
    vx, vy, cov = blur(x * x) - mx * mx, blur(y * y) - my * my, blur(x * y) - mx * my
    ssim = ((2 * mx * my + C1) * (2 * cov + C2)) / ((mx * mx + my * my + C1) * (vx + vy + C2))
    return ssim.mean(dim=(1, 2, 3)).float()
