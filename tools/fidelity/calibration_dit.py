"""The DiT cells of the calibration's evidence (``calibration``): the block a DiT's computed calls are counted at,
the default (``dit_settings`` auto, its family's plan), and beside them at the calibrated plan's work: MagCache
calibrated the same way (its step-to-step ratios from ONE unpatched run of the calibration prompt and seed at the
job's own sampler and steps, as its authors calibrate a model, at three thresholds), ComfyUI's EasyCache and
Spectrum computing the kept count (or the nearest count its plans reach, within two steps)."""

from __future__ import annotations

import torch

MAGCACHE_THRESHOLDS = (0.06, 0.12, 0.24)  # diffusers' default and its authors' Flux settings
EASYCACHE_THRESHOLDS = (0.1, 0.2)


def counted_block(diffusion_model) -> torch.nn.Module:
    """The stack's last block: it runs at a computed call only (a skipped step, a reused span or a step cache's
    skip leaves it out)."""
    for name in ("single_blocks", "transformer_blocks", "blocks"):
        blocks = getattr(diffusion_model, name, None)
        if blocks is not None and len(blocks):
            return blocks[-1]
    raise ValueError(f"{type(diffusion_model).__name__}: no block list to count calls at")


def batch_of(args: tuple, kwargs: dict) -> int:
    first = next(value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor))
    return len(first)


def calibrated_rows(nodes: dict, todo: float = 1.0) -> tuple:
    """The calibrated and the default rows: the family's plan (``dit_settings`` auto), or with ``todo`` above 1
    ToDo at that factor and reuse every 3 as set, which the calibration then decides on or off."""
    from tools.fidelity.row import ours

    if todo > 1:
        settings = {"dit_settings": "as set", "method": "todo", "downsample_factor": todo, "reuse_interval": 3,
                    "skip_when_slower": False}  # fmt: skip
        return ours(nodes, "calibrated", reuse_plan="calibrated", **settings), ours(nodes, "default", **settings)
    calibrated = ours(nodes, "calibrated", dit_settings="auto", reuse_plan="calibrated")
    default = ours(nodes, "default", dit_settings="auto")
    return calibrated, default


def magcache_ratios(patcher, positive, negative, shape, run, cfg: float) -> list[float]:
    """MagCache's calibration from one unpatched run (``residuals.ratios``' norm ratio, the calls' mean per step)."""
    import nodes as comfy_nodes

    from tools.fidelity.residuals import ResidualRecorder, ratios

    sampler, scheduler, steps = run
    recorder = ResidualRecorder(patcher.model.diffusion_model, image_tokens=True)
    try:
        with torch.no_grad():
            comfy_nodes.common_ksampler(patcher, 0, steps, cfg, sampler, scheduler, positive, negative,
                                        {"samples": torch.zeros(shape)})  # fmt: skip
    finally:
        recorder.remove()
    per_step = len(recorder.residuals) // steps  # cond and uncond in one call or two
    streams = [ratios(recorder.residuals[k::per_step])["norm_ratio"] for k in range(per_step)]
    return [sum(values) / len(values) for values in zip(*streams, strict=True)]


def peers(steps: int, computed: int, ratios: list[float]) -> list:
    """Spectrum computing ``computed`` of ``steps``, EasyCache and MagCache (``ratios``) at their thresholds."""
    from tools.fidelity import dit_peers, spectrum
    from tools.fidelity.peer_rows import step_cache_rows
    from tools.fidelity.row import FidelityRow

    rows = [row for row in step_cache_rows(EASYCACHE_THRESHOLDS) if row.name.startswith("EasyCache")]
    for threshold in MAGCACHE_THRESHOLDS:
        patch = dit_peers.magcache_patch(threshold, lambda model: ratios)
        rows.append(FidelityRow(f"MagCache {threshold}", "peer", patch))
    for count in sorted(range(computed - 2, computed + 3), key=lambda c: abs(c - computed)):
        try:  # the nearest count Spectrum's window-2 or -3 plans reach
            settings = spectrum.settings_computing(steps, count)
        except ValueError:
            continue
        return [FidelityRow(f"Spectrum {count} of {steps}", "peer", spectrum.spectrum_patch(settings)), *rows]
    return rows
