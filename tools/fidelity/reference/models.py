"""The reference models: two small UNets and a small Flux transformer of ComfyUI's own classes, their prompt
encoder, and a classifier.

- ``ref-sd1``: SD1.x layout (attention at levels 1, 2 and 4, one transformer block each, conv projections).
- ``ref-sdxl``: SDXL layout (no attention at level 1; two blocks per transformer at levels 2 and 4, linear
  projections, a pooled vector input through ComfyUI's SDXL ``encode_adm``).
- ``ref-flux``: Flux.1 layout (ComfyUI's ``comfy.ldm.flux`` model, found by ComfyUI's own config detection as
  Flux.1-dev): 2x2 patches, so a 32x32 latent is 16x16 = 256 image tokens, joined by the prompt's 4 text tokens
  in double-stream blocks (joint attention, separate weights per stream) and then single-stream blocks; the
  pooled prompt vector is Flux's ``y`` input. Widths and depths are tiny (``FLUX_CONFIGS``); the positions use
  Flux's 3-axis RoPE. ``ref-flux-deep``: the same with 4 double and 8 single blocks.
- ``ref-flux2``: Flux.2 layout (the same ``Flux`` class with global modulation, found by ComfyUI's detection as
  ``supported_models.Flux2``): 4 double and 8 single blocks, its prompt padded to 512 tokens as ComfyUI pads it.
- ``ref-qwen``: Qwen-Image layout (``QwenImageTransformer2DModel``, found as ``supported_models.QwenImage``): 10
  joint text+image blocks, one-frame 3-D latents of Wan 2.1's format, as ComfyUI samples Qwen-Image.
- ``ref-wan``: Wan 2.1 text-to-video layout (``WanModel``), on short clips.
- ``ref-flux-v2``, ``ref-qwen-v2``: the second generation, ``ref-flux-deep``'s and ``ref-qwen``'s layouts on
  16-channel latents of scenes the prompt decides less of (``data.batch_v2``), so that their residual changes over the
  first steps as the real models' does (docs/dit-measurements.md, "The second generation of references"); judged by a
  classifier of their own (``classifier-v2``).
The UNets are trained at 32x32 latents (``TRAIN_SIZE``) as v-prediction models on ComfyUI's discrete SD schedule
(as SD 2.x 768-v and the v-prediction SDXL fine-tunes are), so any ComfyUI sampler samples them as it samples
Stable Diffusion. v-prediction, not eps: a small model trained for an hour predicts the noise only roughly, and
an eps model's error at the highest noise levels is multiplied by sigma (14.6) and stays in the image, while a
v model's error there is an error in the predicted image, which later steps correct.
``ref-flux`` is trained at the same size as ComfyUI samples Flux.1-dev: flow matching (``ModelSamplingFlux``,
shifted sigmas in (0, 1], CONST prediction: input ``(1 - sigma) * x0 + sigma * noise``, timestep ``sigma``,
output ``noise - x0``), with the guidance embedding fed ComfyUI's default 3.5. The guidance embedding is kept
because without it ComfyUI's detection takes the model for Flux.1-schnell (unshifted schedule); it is sampled
with real classifier-free guidance, like the UNets. Its latent format is Flux's scale and shift on the scenes'
4 channels (``scene_latent_format``), so ComfyUI's ``process_latent_in`` / ``process_latent_out`` round-trip.
Trained at one size only, it knows the image positions 0-15 of its RoPE: at twice the size it mostly draws the
background without the object (unlike the UNets, which drift less), so compare rows there by SSIM only.

The "prompt" is a sequence of four tokens (kind, colour, position, background), each an embedding of its
attribute value plus a slot embedding; index ``len(values)`` of each attribute is the empty prompt used for
classifier-free guidance.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tools.common.host import Family, comfy_unet_config

from . import data

WEIGHTS = Path(__file__).resolve().parent / "weights"
TRAIN_SIZE = 32
CONTEXT_DIM = 64
POOLED_DIM = 1280  # what ComfyUI's SDXL encode_adm expects as pooled text
FLUX_POOLED_DIM = 128  # ref-flux's ``y`` width (Flux.1 takes CLIP-L's 768 there; a tiny model needs less)
FLUX_GUIDANCE = 3.5  # what ComfyUI feeds Flux.1-dev's guidance embedding when no FluxGuidance node sets it

FAMILIES = {
    "ref-sd1": Family("ref-sd1", 32, (1, 2, 2), 1, (1, 1, 1), 1, CONTEXT_DIM, head_channels=32),
    "ref-sd1-v2": Family("ref-sd1-v2", 32, (1, 2, 2), 1, (1, 1, 1), 1, CONTEXT_DIM, head_channels=32),
    "ref-sdxl": Family(
        "ref-sdxl", 32, (1, 2, 2), 1, (0, 2, 2), 2, CONTEXT_DIM, head_channels=32, linear=True, adm_channels=2816
    ),
    "ref-sdxl-v2": Family(
        "ref-sdxl-v2", 32, (1, 2, 2), 1, (0, 2, 2), 2, CONTEXT_DIM, head_channels=32, linear=True, adm_channels=2816
    ),
}
# ComfyUI's detected-config dicts (comfy/model_detection.py, "image_model": "flux") of the Flux references.
FLUX_CONFIGS = {
    "ref-flux": {
        "image_model": "flux",
        "in_channels": data.CHANNELS,
        "out_channels": data.CHANNELS,
        "patch_size": 2,
        "hidden_size": 96,
        "num_heads": 3,
        "axes_dim": [8, 12, 12],  # RoPE widths per id axis (index, row, column); sum = head width 32
        "depth": 2,
        "depth_single_blocks": 3,
        "mlp_ratio": 4.0,
        "context_in_dim": CONTEXT_DIM,
        "vec_in_dim": FLUX_POOLED_DIM,
        "theta": 10000,
        "qkv_bias": True,
        "guidance_embed": True,
    },
}
# Deeper (4 double and 8 single blocks, as Flux.1 has 19 and 38): enough blocks between the first and the last
# that reuse across steps on DiTs, which runs those two and predicts the rest, is measured on a model where the
# predicted blocks are most of the work, as on the real one (docs/dit.md).
FLUX_CONFIGS["ref-flux-deep"] = {**FLUX_CONFIGS["ref-flux"], "depth": 4, "depth_single_blocks": 8}
# Flux.2's layout (comfy/model_detection.py, "flux2": the Flux class with global modulation, one shared set of
# modulations per kind of block instead of one per block, no biases, a SiLU-gated MLP of ratio 3, 4-axis RoPE at
# theta 2000, guidance embedding, no pooled vector), 4 double and 8 single blocks as ref-flux-deep (Flux.2 dev
# has 8 and 48). Patches 2x2 on the 4 scene channels: the real model takes 1x1 patches of latents its VAE packs
# 2x2 (128 = 32 x 4 channels), the same tokens from the same numbers. ComfyUI pads Flux.2's text to 512 tokens
# (``model_base.Flux2.extra_conds``), so the prompt's 4 tokens come after 508 zeros, in training as in sampling.
FLUX_CONFIGS["ref-flux2"] = {
    "image_model": "flux2",
    "in_channels": data.CHANNELS,
    "out_channels": data.CHANNELS,
    "patch_size": 2,
    "hidden_size": 96,
    "num_heads": 3,
    "axes_dim": [8, 8, 8, 8],  # the real model's (32, 32, 32, 32) at head width 32
    "depth": 4,
    "depth_single_blocks": 8,
    "mlp_ratio": 3.0,
    "context_in_dim": CONTEXT_DIM,
    "vec_in_dim": None,
    "theta": 2000,
    "qkv_bias": False,
    "guidance_embed": True,
    "global_modulation": True,
    "mlp_silu_act": True,
    "ops_bias": False,
    "default_ref_method": "index",
    "ref_index_scale": 10.0,
}
FLUX2_TEXT_TOKENS = 512
# The second generation (``-v2``): the same layouts on the 16-channel latents of ``data.batch_v2`` (scenes of 64 px
# folded 2x2, opened up, at unit variance), so a 2x2 patch is 64 values as in real Flux.1, whose 16-channel latent
# format (``comfy.latent_formats.Flux``) ComfyUI then keeps; trained with logit-normal time sampling through the
# family's shift, as Flux.1 and SD3 are. ``ref-flux-v2``: ref-flux-deep's 4 double and 8 single blocks.
FLUX_CONFIGS["ref-flux-v2"] = {
    **FLUX_CONFIGS["ref-flux-deep"],
    "in_channels": data.FOLDED_CHANNELS,
    "out_channels": data.FOLDED_CHANNELS,
}  # model_base.Flux2.extra_conds' target_text_len
# ComfyUI's detected-config dict of the Wan 2.1 video reference (comfy/model_detection.py, "wan2.1", t2v): 8
# blocks of self-attention over every frame's tokens, cross-attention to the prompt and an MLP, as Wan 2.1 1.3B
# has 30. One clip is CLIP_FRAMES latent frames (Wan 2.1's 17 video frames) of CLIP_SIZE x CLIP_SIZE.
WAN_CONFIGS = {
    "ref-wan": {
        "image_model": "wan2.1",
        "model_type": "t2v",
        "dim": 96,
        "num_heads": 3,  # head width 32, RoPE widths 12 (frame), 10 (row), 10 (column)
        "ffn_dim": 384,
        "num_layers": 8,
        "patch_size": (1, 2, 2),
        "freq_dim": 256,
        "window_size": (-1, -1),
        "qk_norm": True,
        "cross_attn_norm": True,
        "eps": 1e-6,
        "in_dim": data.CHANNELS,
        "out_dim": data.CHANNELS,
        "text_dim": CONTEXT_DIM,
    },
}
CLIP_FRAMES = 5
CLIP_SIZE = 20
# ComfyUI's detected-config dict of the Qwen-Image reference (comfy/model_detection.py, "qwen_image"): one list of
# joint text+image blocks (MMDiT: separate weights per stream, joint attention), as Qwen-Image has 60; width 96, 3
# heads of 32, 2x2 patches (``in_channels`` is the patchified width, 4 channels x 4, as the real model's 64 is 16
# x 4), the prompt's 64-wide tokens through ``txt_norm`` and ``txt_in``. RoPE widths per id axis (frame, row,
# column) in the real model's proportions (16, 56, 56). Its latents are Wan 2.1's 3-D format, one frame.
QWEN_CONFIGS = {
    "ref-qwen": {
        "image_model": "qwen_image",
        "in_channels": data.CHANNELS * 4,
        "out_channels": data.CHANNELS,
        "patch_size": 2,
        "num_layers": 10,
        "attention_head_dim": 32,
        "num_attention_heads": 3,
        "joint_attention_dim": CONTEXT_DIM,
        "axes_dims_rope": [4, 14, 14],
    },
}
# ``ref-qwen-v2``: ref-qwen on the second generation's 16-channel latents (2x2 patches of 64 values, as real
# Qwen-Image's 16-channel latents of Wan 2.1's format give its 64-wide patches).
QWEN_CONFIGS["ref-qwen-v2"] = {
    **QWEN_CONFIGS["ref-qwen"],
    "in_channels": data.FOLDED_CHANNELS * 4,
    "out_channels": data.FOLDED_CHANNELS,
}
MODELS = (*FAMILIES, *FLUX_CONFIGS, *WAN_CONFIGS, *QWEN_CONFIGS)
# The blocks of the real model each DiT reference stands for (Flux.1: 19 double + 38 single; Wan 2.1 1.3B: 30;
# Qwen-Image: 60): a step cache's work on the reference is converted to that depth
# (``tools.fidelity.work.at_depth``).
# Flux.2 dev: 8 double + 48 single (diffusers' Flux2Transformer2DModel defaults; ComfyUI counts them from the
# weights).
FULL_DEPTH = {
    "ref-flux": 57,
    "ref-flux-deep": 57,
    "ref-flux-v2": 57,
    "ref-wan": 30,
    "ref-qwen": 60,
    "ref-qwen-v2": 60,
    "ref-flux2": 56,
}


def _known(name: str) -> str:
    if name not in MODELS:
        raise ValueError(f"unknown reference model {name!r}; choose from {', '.join(MODELS)}")
    return name


def is_v2(name: str) -> bool:
    """True for the second generation of references (16-channel latents of ``data.batch_v2``)."""
    return _known(name).endswith("-v2")


def is_folded(name: str) -> bool:
    """True for the second-generation DiTs, whose latents fold 2x2 pixels into 16 channels as Flux.1's and
    Qwen-Image's do; the UNets ``ref-sd1-v2`` / ``ref-sdxl-v2`` keep SD's 4 channels."""
    return is_v2(name) and is_dit(name)


def latent_channels(name: str) -> int:
    return data.FOLDED_CHANNELS if is_folded(name) else data.CHANNELS


def is_flux(name: str) -> bool:
    """True for the Flux transformers, False for the UNets and the video model."""
    return _known(name) in FLUX_CONFIGS


def is_flux2(name: str) -> bool:
    """True for the Flux.2 transformer (a Flux with global modulation)."""
    return is_flux(name) and FLUX_CONFIGS[name]["image_model"] == "flux2"


def is_video(name: str) -> bool:
    """True for the Wan video transformer: its samples are clips (N, 4, frames, size, size)."""
    return _known(name) in WAN_CONFIGS


def is_qwen(name: str) -> bool:
    """True for the Qwen-Image transformer: images as one-frame 3-D latents (N, 4, 1, size, size)."""
    return _known(name) in QWEN_CONFIGS


def is_dit(name: str) -> bool:
    """True for the transformers (flow matching, tokens, no UNet levels): Flux, Wan and Qwen-Image."""
    return is_flux(name) or is_video(name) or is_qwen(name)


def train_size(name: str) -> int:
    """The latent size (per frame) the model was trained at."""
    return CLIP_SIZE if is_video(name) else TRAIN_SIZE


def latent_shape(name: str, n: int, size: int) -> tuple[int, ...]:
    """The shape of an empty latent of ``n`` samples at ``size``: images, or clips of CLIP_FRAMES frames."""
    channels = latent_channels(name)
    if is_video(name):
        return (n, channels, CLIP_FRAMES, size, size)
    if is_qwen(name):  # ComfyUI's empty latent for Qwen-Image is one frame of Wan 2.1's 3-D format
        return (n, channels, 1, size, size)
    return (n, channels, size, size)


def as_images(name: str):
    """(how to view a batch of the model's samples as images, images per sample): clips become their frames, each
    an image the metrics judge; scenes stay as they are."""
    if is_video(name):
        return data.frames_of, CLIP_FRAMES
    if is_qwen(name):  # one frame per sample
        return ((lambda samples: data.v2_scenes(data.frames_of(samples))) if is_v2(name) else data.frames_of), 1
    if is_v2(name):  # the scenes the latents stand for
        return data.v2_scenes, 1
    return (lambda samples: samples), 1


def samples(name: str, n: int, size: int, generator: torch.Generator):
    """``n`` real samples of the model's kind (scenes or clips) and their prompts."""
    if is_video(name):
        return data.clip_batch(n, size, CLIP_FRAMES, generator)
    if is_qwen(name):
        scenes, prompts = (data.batch_v2 if is_v2(name) else data.batch)(n, size, generator)
        return scenes.unsqueeze(2), prompts
    if is_v2(name):
        return data.batch_v2(n, size, generator, folded=is_folded(name))
    return data.batch(n, size, generator)


def pooled_dim(name: str) -> int:
    if is_video(name) or is_qwen(name):
        return 1  # Wan and Qwen-Image take no pooled vector; the encoder's pooling is left unused
    return FLUX_POOLED_DIM if is_flux(name) else POOLED_DIM


class PromptEncoder(nn.Module):
    """Attribute tokens -> cross-attention context (N, 4, CONTEXT_DIM) and a pooled vector (N, ``pooled``).

    For ``ref-flux`` the context is Flux's text tokens (``txt``) and the pooled vector its ``y``."""

    def __init__(self, pooled: int = POOLED_DIM):
        super().__init__()
        self.tables = nn.ModuleList(nn.Embedding(len(values) + 1, CONTEXT_DIM) for values in data.ATTRIBUTES.values())
        self.slots = nn.Parameter(torch.randn(len(data.ATTRIBUTES), CONTEXT_DIM) * 0.1)
        self.norm = nn.LayerNorm(CONTEXT_DIM)
        self.pool = nn.Linear(len(data.ATTRIBUTES) * CONTEXT_DIM, pooled)

    def forward(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.stack([table(indices[:, i]) for i, table in enumerate(self.tables)], dim=1) + self.slots
        context = self.norm(tokens)
        return context, self.pool(context.flatten(1))

    @staticmethod
    def empty(n: int) -> torch.Tensor:
        """Indices of the empty prompt (the unconditional branch of classifier-free guidance)."""
        return torch.tensor([len(values) for values in data.ATTRIBUTES.values()]).expand(n, -1).clone()


def _preview_factors(channels: int) -> list[list[float]]:
    """Previews: the colour channels as they are (a folded latent's four sub-pixels averaged), relief left out."""
    per = channels // data.CHANNELS
    return [[1.0 / per if c // per == rgb else 0.0 for rgb in range(3)] for c in range(channels)]


def scene_latent_format(channels: int = data.CHANNELS):
    """Flux's latent format (scale 0.3611, shift 0.1159) on the scenes' latents: they are the model's working
    space, and ComfyUI's empty latent has their channels (the first generation's 4, or Flux's own 16)."""
    import comfy.latent_formats

    class SceneFlux(comfy.latent_formats.Flux):
        latent_channels = channels

        def __init__(self):
            super().__init__()
            self.latent_rgb_factors = _preview_factors(channels)
            self.latent_rgb_factors_bias = [0.0, 0.0, 0.0]
            self.taesd_decoder_name = None

    return SceneFlux()


def scene_flux2_format():
    """Flux.2's latent format (no scale, no shift) for 4-channel latents: the scenes as they are."""
    import comfy.latent_formats

    class SceneFlux2(comfy.latent_formats.Flux2):
        latent_channels = data.CHANNELS

        def __init__(self):
            self.latent_rgb_factors = [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]
            self.latent_rgb_factors_bias = [0.0, 0.0, 0.0]
            self.taesd_decoder_name = None

    return SceneFlux2()


def scene_video_format(channels: int = data.CHANNELS):
    """Wan 2.1's latent format for the scenes' clips (4 channels, or the second generation's 16), with the
    latents as they are (mean 0, scale 1): they are the model's working space."""
    import comfy.latent_formats

    class SceneWan(comfy.latent_formats.Wan21):
        latent_channels = channels

        def __init__(self):  # Wan21's own __init__ sets its 16 channels' statistics
            self.scale_factor = 1.0
            self.latents_mean = torch.zeros(1, channels, 1, 1, 1)
            self.latents_std = torch.ones(1, channels, 1, 1, 1)
            self.latent_rgb_factors = _preview_factors(channels)
            self.latent_rgb_factors_bias = [0.0, 0.0, 0.0]
            self.taesd_decoder_name = None

    return SceneWan()


def build_wan_model(name: str):
    """ComfyUI's Wan 2.1 BaseModel (text to video: flow matching with shift 8, CONST) as its config detection
    builds it for the config, weights uninitialised."""
    import comfy.model_detection
    import comfy.supported_models

    config = comfy.model_detection.model_config_from_unet_config(dict(WAN_CONFIGS[name]))
    if type(config) is not comfy.supported_models.WAN21_T2V:
        raise RuntimeError(f"ComfyUI detected {type(config).__name__} for {name}, not Wan 2.1 text to video")
    config.latent_format = scene_video_format()
    config.set_inference_dtype(torch.float32, None)
    return config.get_model({}, device="cpu")


def build_qwen_model(name: str):
    """ComfyUI's Qwen-Image BaseModel (flow matching, ``ModelSamplingFlux`` at QwenImage's shift 1.15, CONST) as
    its config detection builds it for the config, weights uninitialised."""
    import comfy.model_detection
    import comfy.supported_models

    config = comfy.model_detection.model_config_from_unet_config(dict(QWEN_CONFIGS[name]))
    if type(config) is not comfy.supported_models.QwenImage:
        raise RuntimeError(f"ComfyUI detected {type(config).__name__} for {name}, not Qwen-Image")
    config.latent_format = scene_video_format(latent_channels(name))  # Qwen-Image's latents are Wan 2.1's
    config.set_inference_dtype(torch.float32, None)
    return config.get_model({}, device="cpu")


def build_flux_model(name: str):
    """ComfyUI's Flux BaseModel as ComfyUI's config detection builds it for the config, weights uninitialised."""
    import comfy.model_detection
    import comfy.supported_models

    config = comfy.model_detection.model_config_from_unet_config(dict(FLUX_CONFIGS[name]))
    # Flux.1-dev's sampling: ModelSamplingFlux, CONST; Flux.2's the same at its shift 2.02
    expected = comfy.supported_models.Flux2 if is_flux2(name) else comfy.supported_models.Flux
    if type(config) is not expected:
        raise RuntimeError(f"ComfyUI detected {type(config).__name__} for {name}, not {expected.__name__}")
    config.latent_format = scene_flux2_format() if is_flux2(name) else scene_latent_format(latent_channels(name))
    config.set_inference_dtype(torch.float32, None)
    return config.get_model({}, device="cpu")


def build_base_model(name: str):
    """ComfyUI's BaseModel (SD15, SDXL or Flux config) with the reference layout, weights uninitialised."""
    import comfy.supported_models

    if is_flux(name):
        return build_flux_model(name)
    if is_video(name):
        return build_wan_model(name)
    if is_qwen(name):
        return build_qwen_model(name)
    family = FAMILIES[name]
    config_class = comfy.supported_models.SDXL if family.adm_channels else comfy.supported_models.SD15
    config = config_class(comfy_unet_config(family))
    # ComfyUI's SD15 config forces 8 heads (SD1.5's 320 channels); at 32 channels that would be 4-wide heads.
    # One head per 32 channels keeps the heads' width sensible and the CPU training affordable.
    config.unet_config.update(num_heads=family.num_heads, num_head_channels=family.head_channels)
    config.set_inference_dtype(torch.float32, None)
    from comfy.model_base import ModelType

    config.model_type = lambda state_dict, prefix="": ModelType.V_PREDICTION
    return config.get_model({}, device="cpu")


def adm_vector(name: str, base_model, pooled: torch.Tensor, size: int) -> torch.Tensor | None:
    """The ``y`` input as ComfyUI computes it at sampling time: SDXL pooled text + size embeddings, Flux the
    pooled text; None for SD1, Wan and Qwen-Image."""
    if is_video(name) or is_qwen(name):
        return None
    if is_flux(name):
        return base_model.encode_adm(pooled_output=pooled)
    if FAMILIES[name].adm_channels is None:
        return None
    pixels = size * 8
    return base_model.encode_adm(
        pooled_output=pooled, width=pixels, height=pixels, crop_w=0, crop_h=0, target_width=pixels, target_height=pixels
    )


def model_inputs(
    name: str, base_model, context: torch.Tensor, pooled: torch.Tensor, size: int, guidance: float = FLUX_GUIDANCE
) -> dict:
    """The conditioning inputs of the diffusion model's forward as ComfyUI passes them while sampling (``guidance``:
    the value fed a Flux model's guidance embedding)."""
    if is_video(name) or is_qwen(name):
        return {"context": context}
    if is_flux2(name):  # ComfyUI pads Flux.2's text in front to 512 tokens
        pad = FLUX2_TEXT_TOKENS - context.shape[1]
        context = nn.functional.pad(context, (0, 0, pad, 0))
    inputs = {"context": context, "y": adm_vector(name, base_model, pooled, size)}
    if is_flux(name) and FLUX_CONFIGS[name]["guidance_embed"]:
        inputs["guidance"] = torch.full((context.shape[0],), guidance)
    return inputs


def save_reference(name: str, unet_state: dict, encoder_state: dict, info: dict) -> Path:
    WEIGHTS.mkdir(parents=True, exist_ok=True)
    tensors = {f"diffusion_model.{k}": v.detach().contiguous() for k, v in unet_state.items()}
    tensors.update({f"prompt_encoder.{k}": v.detach().contiguous() for k, v in encoder_state.items()})
    path = WEIGHTS / f"{name}.safetensors"
    save_file(tensors, str(path), metadata={k: str(v) for k, v in info.items()})
    return path


def trained_steps(path) -> int:
    """The optimiser steps behind a saved reference: its own run's and those of the weights it started from."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as weights:
        metadata = weights.metadata() or {}
    return int(metadata.get("steps", 0)) + int(metadata.get("steps_before", 0))


def load_reference(name: str, path: Path | None = None):
    """(ComfyUI BaseModel with trained weights, PromptEncoder) of a committed reference model, or of the weights
    at ``path`` (a file ``save_reference`` wrote for ``name``'s layout)."""
    tensors = load_file(str(path or WEIGHTS / f"{name}.safetensors"))
    base = build_base_model(name)
    unet_sd = {k[len("diffusion_model.") :]: v for k, v in tensors.items() if k.startswith("diffusion_model.")}
    base.diffusion_model.load_state_dict(unet_sd, strict=True)
    encoder = PromptEncoder(pooled_dim(name))
    prefix = "prompt_encoder."
    encoder.load_state_dict({k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)})
    base.eval()
    encoder.eval()
    return base, encoder


class AttributeClassifier(nn.Module):
    """A small CNN that names each attribute of a 4-channel scene; its pooled features serve the Frechet distance."""

    num_features = 128  # read by torchmetrics' FrechetInceptionDistance for a custom feature extractor

    def __init__(self):
        super().__init__()

        def stage(cin, cout, stride):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1), nn.GroupNorm(8, cout), nn.SiLU())

        self.body = nn.Sequential(
            stage(data.CHANNELS, 32, 1), stage(32, 32, 1), stage(32, 64, 2), stage(64, 64, 1), stage(64, 128, 2),
            stage(128, 128, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )  # fmt: skip
        self.heads = nn.ModuleList(nn.Linear(128, len(values)) for values in data.ATTRIBUTES.values())

    def features(self, images: torch.Tensor) -> torch.Tensor:
        if images.shape[-1] != TRAIN_SIZE:  # larger samples are judged at the size the classifier knows
            images = nn.functional.interpolate(images, size=(TRAIN_SIZE, TRAIN_SIZE), mode="area")
        return self.body(images)

    def forward(self, images: torch.Tensor) -> list[torch.Tensor]:
        feats = self.features(images)
        return [head(feats) for head in self.heads]


class ClassifierFeatures(nn.Module):
    """The classifier's pooled features as a module, the form torchmetrics takes a feature extractor in."""

    num_features = AttributeClassifier.num_features

    def __init__(self, classifier: AttributeClassifier):
        super().__init__()
        self.classifier = classifier

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier.features(images)


def classifier_file(name: str | None = None) -> str:
    """The classifier that judges a reference's scenes: the second generation's opened-up scenes have their own."""
    return "classifier-v2.safetensors" if name is not None and is_v2(name) else "classifier.safetensors"


def load_classifier(name: str | None = None) -> AttributeClassifier:
    classifier = AttributeClassifier()
    classifier.load_state_dict(load_file(str(WEIGHTS / classifier_file(name))))
    return classifier.eval()
