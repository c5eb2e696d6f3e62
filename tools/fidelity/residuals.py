"""The residual a step cache reuses, recorded while ComfyUI samples a DiT reference: the block stack's input at its
first block and its output after its last, one per model call, and MagCache's step-to-step ratio of its norm. Read
by the step-change tool (``step_change``) and by the fidelity benchmark's MagCache calibration (``run``)."""

from __future__ import annotations

import torch


class ResidualRecorder:
    """Hooks on a ComfyUI Flux or Wan model: the stack's input at its first block, its output after its last,
    one residual per model call."""

    def __init__(self, diffusion_model, image_tokens: bool = False):
        self.residuals: list[torch.Tensor] = []
        self._input = None
        self._text_tokens = 0
        self.image_tokens = image_tokens  # Flux: the image tokens of the joined stream only
        self.image_only = hasattr(diffusion_model, "transformer_blocks")  # Qwen-Image: (txt, img) apart
        if hasattr(diffusion_model, "double_blocks"):
            first, last = diffusion_model.double_blocks[0], diffusion_model.single_blocks[-1]
        elif self.image_only:
            first, last = diffusion_model.transformer_blocks[0], diffusion_model.transformer_blocks[-1]
        else:  # Wan: one stream through ``blocks``
            first, last = diffusion_model.blocks[0], diffusion_model.blocks[-1]
        self.handles = [
            first.register_forward_pre_hook(self._on_input, with_kwargs=True),
            last.register_forward_hook(self._on_output),
        ]

    def _on_input(self, module, args, kwargs):
        if self.image_only:
            joined = kwargs["hidden_states"]
        else:
            joined = args[0] if args else torch.cat((kwargs["txt"], kwargs["img"]), 1)
            self._text_tokens = 0 if args else kwargs["txt"].shape[1]
        if self.image_tokens:
            joined = joined[:, self._text_tokens :]
        self._input = joined.detach().clone()

    def _on_output(self, module, args, output):
        if self.image_only:
            output = output[1]  # (text, image)
        if self.image_tokens:
            output = output[:, self._text_tokens :]
        self.residuals.append((output.detach() - self._input).float())

    def remove(self):
        for handle in self.handles:
            handle.remove()


def token_ratios(previous: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
    """Each token's residual norm over its norm one call before: what MagCache's ratio averages."""
    return current.norm(dim=-1) / (previous.norm(dim=-1) + 1e-8)


def ratios(residuals: list[torch.Tensor]) -> dict:
    """MagCache's ratio (mean over tokens of the norm ratio) and the relative change, per step after the first;
    and the residual split in two (``split``): its part shared by every token and sample of the call, and the
    rest, with MagCache's ratio of the rest."""
    norm_ratio, change = [1.0], [None]
    for previous, current in zip(residuals, residuals[1:], strict=False):
        norm_ratio.append(float(token_ratios(previous, current).mean()))
        change.append(float((current - previous).norm() / previous.norm()))
    return {"norm_ratio": norm_ratio, "relative_change": change, **split(residuals)}


def split(residuals: list[torch.Tensor]) -> dict:
    """Per call: the norm of the residual's mean over every token and sample (the one vector all of them share,
    where a DiT's large time-driven activations sit), its share of the residual's mean square norm per token (the
    rest sums to zero over the tokens, so the two add up), the mean norm per token of the rest, and MagCache's
    ratio of the rest from one call to the next (1 at the first)."""
    shared, shared_share, rest, parts = [], [], [], []
    for residual in residuals:
        tokens = residual.flatten(0, -2)
        mean = tokens.mean(dim=0)
        parts.append(residual - mean)
        shared.append(float(mean.norm()))
        shared_share.append(float(mean.square().sum() / tokens.square().sum(dim=-1).mean()))
        rest.append(float(parts[-1].norm(dim=-1).mean()))
    rest_ratio = [1.0] + [
        float(token_ratios(previous, current).mean()) for previous, current in zip(parts, parts[1:], strict=False)
    ]
    return {"shared_norm": shared, "shared_share": shared_share, "rest_norm": rest, "rest_ratio": rest_ratio}


def per_sample_ratios(residuals: list[torch.Tensor]) -> torch.Tensor:
    """(steps, samples): MagCache's ratio of each sample (the mean over its tokens), 1 at the first step."""
    rows = [torch.ones(len(residuals[0]))]
    for previous, current in zip(residuals, residuals[1:], strict=False):
        rows.append(token_ratios(previous, current).flatten(1).mean(dim=1))
    return torch.stack(rows)
