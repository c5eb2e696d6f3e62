"""The peers' rows: ComfyUI's TomePatchModel, EasyCache and LazyCache, tomesd, the ToDo reference patch,
Spectrum and the published DiT step caches ComfyUI does not ship."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from tools.common.host import LdmHolder, build_ldm_unet
from tools.fidelity.row import FidelityRow, node_patch


def comfy_builtin(ratio: float) -> FidelityRow:
    from comfy_extras.nodes_tomesd import TomePatchModel

    return FidelityRow(
        f"ComfyUI TomePatchModel {ratio}",
        "peer",
        lambda model: TomePatchModel.execute(model, ratio).result[0],
        settings={"ratio": ratio},
    )


def todo_reference(factor: float, level: int) -> FidelityRow:
    from tools.common.todo_reference import todo_reference_patch

    def patch(model):
        clone = model.clone()
        clone.set_model_attn1_patch(todo_reference_patch(factor, level))
        return clone

    return FidelityRow(f"ToDo reference {factor:g}", "peer", patch, settings={"factor": factor, "level": level})


def tomesd_row(family, state_dict: dict, ratio: float, level: int, everywhere: bool) -> FidelityRow | None:
    """tomesd 0.1.3 on the WebUI's ldm UNet with the same weights, swapped in for ComfyUI's UNet by an object
    patch, so the same ComfyUI sampler drives it. None where ldm cannot build the layout (SDXL needs sgm)."""
    unet = build_ldm_unet(family, state_dict, torch.float32, torch.device("cpu"))
    if unet is None:
        return None
    import tomesd

    holder = LdmHolder(unet)
    extra = {"merge_crossattn": True, "merge_mlp": True} if everywhere else {}

    def patch(model):
        clone = model.clone()
        clone.add_object_patch("diffusion_model", unet)
        return clone

    name = f"tomesd {ratio}" + (" +cross-attn +MLP" if everywhere else "")
    return FidelityRow(
        name,
        "peer",
        patch,
        enter=lambda: tomesd.apply_patch(holder, ratio=ratio, max_downsample=level, use_rand=False, **extra),
        leave=lambda: tomesd.remove_patch(holder),
        settings={"ratio": ratio, "max_downsample": level, "use_rand": False, **extra},
    )


STEP_CACHE_THRESHOLDS = (0.1, 0.2, 0.4)  # 0.2 is the nodes' default


FLUX_STEP_CACHE_THRESHOLDS = (0.05, 0.1, 0.2, 0.4)  # on ref-flux 0.2 already skips half of the calls


def step_cache_rows(thresholds=STEP_CACHE_THRESHOLDS) -> list[FidelityRow]:
    """ComfyUI's own step caches (comfy_extras/nodes_easycache.py) at three ``reuse_threshold`` values, applied
    by running the node with its other inputs at their defaults, as a graph would. EasyCache runs with
    ``easycache_on_a_copy`` (see there) in place."""
    from comfy_extras import nodes_easycache

    rows = []
    for label, node in (("EasyCache", nodes_easycache.EasyCacheNode), ("LazyCache", nodes_easycache.LazyCacheNode)):
        for threshold in thresholds:
            inputs = {"reuse_threshold": threshold, "start_percent": 0.15, "end_percent": 0.95, "verbose": False}
            row = FidelityRow(f"{label} {threshold}", "peer", node_patch(node, **inputs), settings=inputs)
            if label == "EasyCache":
                row.enter, row.leave = easycache_on_a_copy()
            rows.append(row)
    return rows


def easycache_on_a_copy() -> tuple[Callable, Callable]:
    """``enter`` / ``leave`` that make EasyCache add its cached difference to a copy of the model input.

    ComfyUI's ``EasyCacheHolder.apply_cache_diff`` adds in place into the diffusion model's input. For flow models
    (Flux, SD3, Wan: ``CONST.calculate_input`` returns its input) in float32, where the cast to the model's dtype
    does not copy, that input is the very tensor ``calculate_denoised`` then reads, so every skipped step yields a
    wrong latent and the picture is lost (ref-flux, 28 steps: SSIM 0.32 at threshold 0.05). In fp16 / bf16, where
    users run it, the cast copies and nothing is changed; on eps-prediction UNets the input is scaled first (a new
    tensor), so this changes nothing there. This harness samples in float32: the copy gives EasyCache what its
    users get."""
    from comfy_extras import nodes_easycache

    holder = nodes_easycache.EasyCacheHolder
    original = holder.apply_cache_diff

    def on_a_copy(self, x, *args, **kwargs):
        return original(self, x.clone(), *args, **kwargs)

    def enter():
        holder.apply_cache_diff = on_a_copy

    def leave():
        holder.apply_cache_diff = original

    return enter, leave


def followed_by_easycache(row: FidelityRow, threshold: float = 0.2) -> FidelityRow:
    """``row``'s patch and then ComfyUI's EasyCache node at its defaults, as a graph chains the two nodes."""
    from comfy_extras import nodes_easycache

    inputs = {"reuse_threshold": threshold, "start_percent": 0.15, "end_percent": 0.95, "verbose": False}
    easycache = node_patch(nodes_easycache.EasyCacheNode, **inputs)
    return FidelityRow(
        f"{row.name} + EasyCache {threshold}",
        row.group,
        lambda model: easycache(row.patch(model)),
        settings={**row.settings, "easycache": inputs},
    )


def spectrum_rows(steps: int, shares: tuple[float, ...]) -> list[FidelityRow]:
    """Spectrum (``spectrum``): as Forge Neo ships it, and computing about ``shares`` of the run's steps (the
    fewest warm-up steps whose plan hits that count, window 2 or 3)."""
    from tools.fidelity import spectrum

    chosen = [spectrum.SpectrumSettings()]
    for share in shares:
        try:
            chosen.append(spectrum.settings_computing(steps, math.ceil(share * steps - 1e-9)))
        except ValueError:
            continue
    rows, seen = [], set()
    for index, settings in enumerate(chosen):
        if settings in seen:
            continue
        seen.add(settings)
        kind = "Neo's defaults, " if index == 0 else ""
        name = f"Spectrum ({kind}{settings.label(steps)} computed)"
        rows.append(FidelityRow(name, "peer", spectrum.spectrum_patch(settings), settings=vars(settings)))
    return rows


def dit_peer_rows(ratios_of: Callable | None = None) -> list[FidelityRow]:
    """The published DiT step caches ComfyUI does not ship (``dit_peers``: measured, not offered); MagCache where
    ``ratios_of(model)`` gives its calibration."""
    from tools.fidelity import dit_peers

    rows = []
    for threshold in (0.06, 0.12, 0.24) if ratios_of else ():  # diffusers' default; its authors' Flux settings
        settings = {"threshold": threshold, "max_skips": 3, "retention": 0.2, "ratios": "calibrated"}
        patch = dit_peers.magcache_patch(threshold, ratios_of)
        name = f"MagCache {threshold} (calibrated)"
        rows.append(FidelityRow(name, "peer", patch, settings=settings, prepare=ratios_of))
    for threshold in (0.08, 0.12, 0.2):  # 0.08 and 0.12: the published Flux.1-dev figures (1.55x, 1.91x)
        settings = {"threshold": threshold}
        rows.append(
            FidelityRow(
                f"First Block Cache {threshold}",
                "peer",
                dit_peers.first_block_cache_patch(threshold),
                settings=settings,
            )
        )
    for policy in dit_peers.CACHE_DIT_PLANS:  # cached steps run the first block (DBCache F1B0)
        settings = {"policy": policy, "Fn_compute_blocks": 1, "Bn_compute_blocks": 0}
        patch = dit_peers.cache_dit_plan_patch(policy)
        rows.append(FidelityRow(f"cache-dit fixed plan {policy}", "peer", patch, settings=settings))
    settings = {"interval": 5, "first": 3, "order": 1}
    rows.append(
        FidelityRow("TaylorSeer-style every 5", "peer", dit_peers.taylorseer_style_patch(5, 3), settings=settings)
    )
    return rows
