"""Every model class of the pinned ComfyUI (``comfy.supported_models.models``) built tiny with random weights
through ComfyUI's own classes, and sampled through ``common_ksampler``: the model zoo of
``tests/test_comfyui_zoo.py``.

``build(cls)`` makes a ModelPatcher of the class from a small config (``TINY``: the family's entry of
``comfy_host``'s tables where there is one, with the class's own keys on top); ``sample_model`` samples it with
the conditioning the class's model asks for (``EXTRA``). A class the harness cannot build or sample is listed in
``HARNESS_CANNOT`` with the reason; the zoo test checks that list against what happens.
"""

from __future__ import annotations

import torch

from hosts import comfy_host as host  # before any ComfyUI import: sys.path, CPU mode
from tools.common.host import initialise

comfy = host.comfy  # ComfyUI's packages and its nodes.py, as the host imported them
comfy_nodes = host.comfy_nodes

CONTEXT = 64  # text width of every tiny model


def _unet(cls) -> dict:
    """A tiny UNet of the class's layout: SDXL's levels where it takes SDXL's vector, SD1.x's elsewhere; the
    class's own input channels, vector width, projections and temporal layers."""
    xl = cls.unet_config.get("adm_in_channels") in (2816, 2560)
    config = dict(host.SDXL_TINY if xl else host.SD15_TINY)
    keys = ("in_channels", "adm_in_channels", "use_linear_in_transformer", "use_temporal_attention",
            "use_temporal_resblock")  # fmt: skip
    config.update({key: cls.unet_config[key] for key in keys if key in cls.unet_config})
    if config.get("adm_in_channels"):
        config["num_classes"] = "sequential"
    if config.get("use_temporal_attention"):  # SVD's and SV3D's temporal layers, as ComfyUI detects them
        config.update(
            extra_ff_mix_layer=True, use_spatial_context=True, merge_strategy="learned_with_images",
            merge_factor=0.0, video_kernel_size=[3, 1, 1], use_temporal_resblock=True,
            disable_temporal_crossattention=False, max_ddpm_temb_period=10000,
        )  # fmt: skip
    return config


BLOCKS = 4  # a DiT's blocks: the first runs at every call, the three after it are the span reuse skips


def _dit(key: str, **overrides) -> dict:
    return {**host.DIT_TINY[key], **host.dit_blocks(key, BLOCKS), **overrides}


HUNYUAN_VIDEO_10 = _dit(
    "hunyuan_video15", in_channels=16, out_channels=16, patch_size=[1, 2, 2], vec_in_dim=32, guidance_embed=True,
    use_cond_type_embedding=False, vision_in_dim=None,
)  # fmt: skip

# The config of each class that is no UNet, by class name (a UNet's: ``_unet``).
TINY = {
    "Flux": _dit("flux"),
    "FluxSchnell": _dit("flux", guidance_embed=False),
    "FluxInpaint": _dit("flux", in_channels=96),
    "Flux2": _dit("flux2"),
    "Chroma": _dit("chroma"),
    "ChromaRadiance": _dit("chroma_radiance"),
    "SD3": _dit("sd3"),
    "QwenImage": _dit("qwen_image"),
    "LTXV": _dit("ltxv"),
    "HiDream": _dit("hidream", llama_layers=[0] * BLOCKS),
    "Omnigen2": _dit("omnigen2"),
    "Lumina2": _dit("lumina2"),
    "ZImage": _dit("z_image"),
    "CosmosT2IPredict2": _dit("cosmos_predict2"),
    "CosmosI2VPredict2": _dit("cosmos_predict2", in_channels=17),
    "WAN21_T2V": _dit("wan"),
    "WAN22_T2V": _dit("wan", in_dim=48, out_dim=48),
    "WAN21_I2V": _dit("wan", model_type="i2v", in_dim=36),
    "WAN21_FunControl2V": _dit("wan", model_type="i2v", in_dim=48),
    "WAN21_Camera": _dit("wan", model_type="camera", in_dim=32),
    "WAN22_Camera": _dit("wan", model_type="camera_2.2", in_dim=36),
    "WAN21_Vace": _dit("wan", model_type="vace", vace_layers=1, vace_in_dim=96),
    "WAN22_S2V": _dit("wan", model_type="s2v"),
    "WAN21_HuMo": _dit("wan", model_type="humo"),
    "WAN22_Animate": _dit("wan", model_type="animate"),
    "HunyuanVideo": HUNYUAN_VIDEO_10,
    "HunyuanVideoI2V": {**HUNYUAN_VIDEO_10, "in_channels": 33},
    "HunyuanVideoSkyreelsI2V": {**HUNYUAN_VIDEO_10, "in_channels": 32},
    "HunyuanImage21": {**HUNYUAN_VIDEO_10, "in_channels": 64, "out_channels": 64, "patch_size": [1, 1],
                       "vec_in_dim": None, "guidance_embed": False, "byt5": False, "axes_dim": [8, 8]},
    "HunyuanImage21Refiner": {**HUNYUAN_VIDEO_10, "in_channels": 128, "out_channels": 64, "patch_size": [1, 1, 1],
                              "vec_in_dim": None, "guidance_embed": False},
    "HunyuanVideo15": _dit("hunyuan_video15"),
    "HunyuanVideo15_SR_Distilled": _dit("hunyuan_video15", in_channels=98),
    "AuraFlow": {"max_seq": 256, "cond_seq_dim": CONTEXT, "n_double_layers": 2, "n_layers": BLOCKS, "dim": 32,
                 "n_heads": 2, "patch_size": 2, "in_channels": 4, "out_channels": 4},
    "PixArtAlpha": {"image_model": "pixart_alpha", "num_heads": 2, "patch_size": 2, "hidden_size": 48,
                    "in_channels": 4, "depth": 2, "input_size": 16, "micro_condition": True,
                    "caption_channels": CONTEXT, "model_max_length": 16, "pe_interpolation": 1.0},
    "PixArtSigma": {"image_model": "pixart_sigma", "num_heads": 2, "patch_size": 2, "hidden_size": 48,
                    "in_channels": 4, "depth": 2, "input_size": 16, "micro_condition": False,
                    "caption_channels": CONTEXT, "model_max_length": 16, "pe_interpolation": 1.0},
    "HunyuanDiT": {"image_model": "hydit", "depth": 2, "hidden_size": 32, "num_heads": 2, "input_size": (16, 16),
                   "text_states_dim": CONTEXT, "text_states_dim_t5": CONTEXT, "text_len": 9, "text_len_t5": 9},
    "HunyuanDiT1": {"image_model": "hydit1", "depth": 2, "hidden_size": 32, "num_heads": 2,
                    "input_size": (16, 16), "size_cond": True, "use_style_cond": True, "text_states_dim": CONTEXT,
                    "text_states_dim_t5": CONTEXT, "text_len": 9, "text_len_t5": 9},
    "CosmosT2V": {"image_model": "cosmos", "max_img_h": 240, "max_img_w": 240, "max_frames": 128,
                  "in_channels": 16, "out_channels": 16, "patch_spatial": 2, "patch_temporal": 1,
                  "model_channels": 32, "num_blocks": 2, "num_heads": 2, "crossattn_emb_channels": CONTEXT,
                  "pos_emb_cls": "rope3d", "use_adaln_lora": True, "adaln_lora_dim": 16,
                  "extra_per_block_abs_pos_emb": True, "concat_padding_mask": True,
                  "block_config": "FA-CA-MLP", "block_x_format": "THWBD", "affline_emb_norm": True,
                  "extra_per_block_abs_pos_emb_type": "learnable"},
    "Hunyuan3Dv2": {"image_model": "hunyuan3d2", "in_channels": 64, "context_in_dim": CONTEXT, "hidden_size": 32,
                    "mlp_ratio": 2.0, "num_heads": 2, "depth": 1, "depth_single_blocks": 1, "qkv_bias": True,
                    "guidance_embed": False},
    "Hunyuan3Dv2mini": {"image_model": "hunyuan3d2", "in_channels": 64, "context_in_dim": CONTEXT,
                        "hidden_size": 32, "mlp_ratio": 2.0, "num_heads": 2, "depth": 1, "depth_single_blocks": 1,
                        "qkv_bias": True, "guidance_embed": False},
    "Stable_Cascade_C": {"stable_cascade_stage": "c", "c_cond": 32, "c_hidden": [32, 32], "nhead": [2, 2],
                         "blocks": [[1, 1], [1, 1]], "block_repeat": [[1, 1], [1, 1]], "c_r": 16,
                         "c_clip_text": CONTEXT, "c_clip_text_pooled": 32, "c_clip_img": 768},
    "Stable_Cascade_B": {"stable_cascade_stage": "b", "c_cond": 32, "c_hidden": [16, 16, 32, 32],
                         "nhead": [-1, -1, 2, 2], "blocks": [[1, 1, 1, 1], [1, 1, 1, 1]],
                         "block_repeat": [[1, 1, 1, 1], [1, 1, 1, 1]], "c_r": 16, "c_clip": 32},
    "StableAudio": {"audio_model": "dit1.0", "embed_dim": 64, "depth": 2, "num_heads": 1},
    "Hunyuan3Dv2_1": {"image_model": "hunyuan3d2_1", "in_channels": 64, "context_dim": CONTEXT, "hidden_size": 32,
                      "mlp_ratio": 2.0, "num_heads": 2, "depth": 2, "qkv_bias": False,
                      "guidance_cond_proj_dim": None},
    # Mochi's blocks assert the full model's MLP width for the video tokens (1536 x 8): one block of that width.
    "GenmoMochi": {"image_model": "mochi_preview", "depth": 1, "patch_size": 2, "num_heads": 24,
                   "hidden_size_x": 1536, "hidden_size_y": 32, "mlp_ratio_x": 8.0, "mlp_ratio_y": 2.0,
                   "learn_sigma": False, "in_channels": 12, "qk_norm": True, "qkv_bias": False, "out_bias": True,
                   "attn_drop": 0.0, "patch_embed_bias": True, "posenc_preserve_area": True,
                   "timestep_mlp_bias": True, "attend_to_padding": False, "timestep_scale": 1000.0,
                   "use_t5": True, "t5_feat_dim": CONTEXT, "t5_token_length": 9, "rope_theta": 10000.0},
}  # fmt: skip
TINY["CosmosI2V"] = {**TINY["CosmosT2V"], "in_channels": 17}

# Classes this harness does not build or sample, and why (the zoo test checks each still fails to build or
# sample here, so the list stays true).
HARNESS_CANNOT = {
    "HunyuanImage21Refiner": "its latent format folds two frames into the channels (process_in), so the sampler's "
    "noise, of the start latent's shape, does not fit it; ComfyUI's refiner workflow makes that latent with its own "
    "nodes",
    "ACEStep": "an audio model whose model asks for lyrics tokens and a speaker embedding of its own text encoders",
}

# Families whose latents are video: (frames, h, w) after the channels; the rest (h, w). The 3-D shape latents of
# Hunyuan 3D: (channels, tokens).
VIDEO = ("wan", "hunyuan_video", "ltxv", "mochi", "cosmos")


def model_class(name: str):
    return next(cls for cls in comfy.supported_models.models if cls.__name__ == name)


def is_unet(cls) -> bool:
    return "model_channels" in cls.unet_config and "image_model" not in cls.unet_config


def build(cls, seed: int = 0) -> comfy.model_patcher.ModelPatcher:
    """A ModelPatcher over a tiny random-weight model of ``cls`` (a class of ``comfy.supported_models``)."""
    config = cls(dict(_unet(cls) if is_unet(cls) else TINY[cls.__name__]))
    unet = config.unet_config
    if is_unet(cls) and unet.get("num_head_channels", -1) > 16:
        unet["num_head_channels"] = 16  # the class's 64 is wider than a tiny model's levels
    if "disable_self_attentions" in unet:  # the x4 upscaler's, per level of the full model
        unet["disable_self_attentions"] = unet["disable_self_attentions"][: len(unet["channel_mult"])]
    config.set_inference_dtype(torch.float32, None)
    state_dict = {}
    if cls.__name__ == "Stable_Zero123":  # its model reads the projection of the image embedding from the file
        state_dict = {"cc_projection.weight": torch.eye(CONTEXT), "cc_projection.bias": torch.zeros(CONTEXT)}
    if cls.__name__ == "StableAudio":  # and Stable Audio its embedders of the seconds
        from comfy.ldm.audio.embedders import NumberConditioner

        for name in ("seconds_start", "seconds_total"):
            weights = NumberConditioner(768, min_val=0, max_val=512).state_dict()
            state_dict.update({f"conditioner.conditioners.{name}.{k}": v for k, v in weights.items()})
    with torch.no_grad():  # as ComfyUI loads a model (Zero123 copies its projection in)
        model = config.get_model(state_dict)
    initialise(model.diffusion_model, seed)
    model.eval()
    return comfy.model_patcher.ModelPatcher(model, load_device=host.CPU, offload_device=host.CPU)


# Image models on a video latent format (Wan 2.1's): an image latent, to which ComfyUI adds the frame axis.
STILL = ("QwenImage", "HunyuanImage21Refiner")
# Latent sides other than 8 (PixArt's positions need 48 or more, Stable Cascade B's prior 11 or more).
SIDE = {"PixArtAlpha": 48, "PixArtSigma": 48, "Stable_Cascade_B": 16}


def latent_shape(cls) -> tuple[int, ...]:
    fmt = cls.latent_format
    channels = fmt.latent_channels
    dims = getattr(fmt, "latent_dimensions", 2)
    if dims == 1:
        return (1, channels, 16)
    side = SIDE.get(cls.__name__, 8)
    if dims == 3 and cls.__name__ not in STILL:
        return (1, channels, 3, side, side)
    return (1, channels, side, side)


class _ClipVisionOutput:
    def __init__(self, image_embeds):
        self.image_embeds = image_embeds


# Text widths other than CONTEXT: Stable Audio's seconds embeddings join its T5 tokens, 768 wide.
WIDTH = {"StableAudio": 768}


def conditioning(cls, seed: int, tokens: int = 9) -> list:
    generator = torch.Generator().manual_seed(seed)
    cond = torch.randn(1, tokens, WIDTH.get(cls.__name__, CONTEXT), generator=generator)
    extra = {"pooled_output": torch.randn(1, 32, generator=generator), "guidance": 3.5}
    extra["attention_mask"] = torch.ones(1, tokens, dtype=torch.long)
    adm = cls.unet_config.get("adm_in_channels")
    if adm in (2816, 2560):  # SDXL's vector: the pooled text and the sizes (the refiner: and the aesthetic score)
        extra["pooled_output"] = torch.randn(1, 1280, generator=generator)
        extra.update(width=64, height=64, crop_w=0, crop_h=0, target_width=64, target_height=64)
    if cls.noise_aug_config is not None:  # SD2.1 unCLIP: a CLIP vision embedding, noise-augmented
        embeds = torch.randn(1, cls.noise_aug_config["timestep_dim"], generator=generator)
        extra["unclip_conditioning"] = [
            {"clip_vision_output": _ClipVisionOutput(embeds), "strength": 1.0, "noise_augmentation": 0.0}
        ]
    if cls.__name__.startswith("PixArt"):  # PixArt-alpha's size and aspect embeddings
        extra.update(width=384, height=384)
    if cls.__name__ == "StableAudio":
        extra.update(seconds_start=0.0, seconds_total=4.0)
    if cls.__name__.startswith("HunyuanDiT"):  # a second text (mT5) besides CLIP's
        extra["conditioning_mt5xl"] = torch.randn(1, tokens, CONTEXT, generator=generator)
        extra["attention_mask_mt5xl"] = torch.ones(1, tokens, dtype=torch.long)
    if cls.__name__ == "HiDream":
        extra["conditioning_llama3"] = torch.randn(1, host.HIDREAM_LLAMA_LAYERS, tokens, CONTEXT, generator=generator)
    return [[cond, extra]]


# Classes whose model takes cond and uncond in one call only (it splits the batch in two): sampled with CFG.
WITH_CFG = ("Hunyuan3Dv2_1",)


def sample_model(model, cls, steps: int, cfg: float = 1.0, seed: int = 42) -> torch.Tensor:
    """Sample ``model`` (of ``cls``) with Euler on the normal scheduler, from a small non-zero latent (ComfyUI widens
    an all-zero one to the format's channels); CFG 1 (one call a step) but for ``WITH_CFG``."""
    negative_tokens = 5
    if cls.__name__ in WITH_CFG:  # and with as many tokens in both, so that ComfyUI batches them
        cfg, negative_tokens = max(cfg, 2.0), 9
    generator = torch.Generator().manual_seed(seed + 1)
    latent = {"samples": 0.1 * torch.randn(latent_shape(cls), generator=generator)}
    (out,) = comfy_nodes.common_ksampler(
        model,
        seed,
        steps,
        cfg,
        "euler",
        "normal",
        conditioning(cls, 1),
        conditioning(cls, 2, negative_tokens),
        latent,
        denoise=1.0,
    )
    return out["samples"]
