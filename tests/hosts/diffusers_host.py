"""Small diffusers pipelines assembled offline from randomly initialised components of the real diffusers.

Nothing is downloaded: the UNets (SD1 and SDXL layouts, 4 and 9 input channels), the CLIP text encoders
(``transformers``), the VAE and the ControlNet are built from configs with seeded random weights; the CLIP
tokenizer reads a small ``vocab.json`` / ``merges.txt`` written here (every lower-case letter as a word piece,
``model_max_length`` 77 as SD's); the schedulers are diffusers' own. Images are 32 px (the VAE downsamples by 2,
so latents are 16x16: 256 tokens at level 1, 64 at level 2); the tests force the reduction there with
``skip_when_slower=False``.
"""

from __future__ import annotations

import json
import string
import tempfile
from pathlib import Path

import numpy as np
import torch
from diffusers import (
    AutoencoderKL,
    ControlNetModel,
    DDIMScheduler,
    EulerDiscreteScheduler,
    StableDiffusionControlNetPipeline,
    StableDiffusionImg2ImgPipeline,
    StableDiffusionInpaintPipeline,
    StableDiffusionPAGPipeline,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

from tools.common.host import initialise

IMAGE_PX = 32
TEXT_DIM = 32
PROMPT = "a cat on a red chair"
_BOS, _EOS = "<|startoftext|>", "<|endoftext|>"


def seeded(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """The benchmark's seeded fan-in-scaled weights (the zero-initialised output convs included, so that every
    layer contributes), in eval mode."""
    initialise(module, seed)
    return module.eval()


_TOKENIZER_DIR: Path | None = None


def tokenizer() -> CLIPTokenizer:
    """A CLIP tokenizer over a tiny vocabulary: each letter alone and as a word end, then the two specials."""
    global _TOKENIZER_DIR
    if _TOKENIZER_DIR is None:
        _TOKENIZER_DIR = Path(tempfile.mkdtemp(prefix="tome_patch_clip_"))
        pieces = list(string.ascii_lowercase) + [c + "</w>" for c in string.ascii_lowercase] + [_BOS, _EOS]
        (_TOKENIZER_DIR / "vocab.json").write_text(json.dumps({piece: i for i, piece in enumerate(pieces)}))
        (_TOKENIZER_DIR / "merges.txt").write_text("#version: 0.2\n")
    folder = _TOKENIZER_DIR
    return CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), model_max_length=77)


def _text_config(tok: CLIPTokenizer, **extra) -> CLIPTextConfig:
    return CLIPTextConfig(
        vocab_size=len(tok),
        hidden_size=TEXT_DIM,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=77,
        bos_token_id=tok.convert_tokens_to_ids(_BOS),
        eos_token_id=tok.convert_tokens_to_ids(_EOS),
        pad_token_id=tok.convert_tokens_to_ids(_EOS),
        **extra,
    )


def text_encoder(seed: int = 10, projection: bool = False):
    config = _text_config(tokenizer(), projection_dim=TEXT_DIM)
    model_class = CLIPTextModelWithProjection if projection else CLIPTextModel
    return seeded(model_class(config), seed)


def vae(seed: int = 20) -> AutoencoderKL:
    return seeded(
        AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
            up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
            block_out_channels=(8, 16),
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=8,
            sample_size=IMAGE_PX,
        ),
        seed,
    )


def sd1_unet(seed: int = 0, in_channels: int = 4, cross_attention_dim: int = TEXT_DIM) -> UNet2DConditionModel:
    """SD1 layout: attention at levels 1 and 2 and in the mid block (8 heads of 4 channels as SD1's 8 heads)."""
    return seeded(
        UNet2DConditionModel(
            sample_size=IMAGE_PX // 2,
            in_channels=in_channels,
            out_channels=4,
            layers_per_block=1,
            block_out_channels=(32, 64),
            down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=cross_attention_dim,
            attention_head_dim=4,  # diffusers' SD1 configs name the head count so
            norm_num_groups=8,
        ),
        seed,
    )


def sdxl_unet(seed: int = 1) -> UNet2DConditionModel:
    """SDXL layout: no attention at level 1, two blocks per transformer at levels 2 and 4, linear projections,
    the text-and-size ("text_time") added embedding, heads of a fixed width (16)."""
    return seeded(
        UNet2DConditionModel(
            sample_size=IMAGE_PX // 2,
            in_channels=4,
            out_channels=4,
            layers_per_block=1,
            block_out_channels=(32, 64, 64),
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            transformer_layers_per_block=(1, 2, 2),
            attention_head_dim=(2, 4, 4),
            use_linear_projection=True,
            cross_attention_dim=2 * TEXT_DIM,  # both text encoders' hidden states, concatenated
            addition_embed_type="text_time",
            addition_time_embed_dim=8,
            projection_class_embeddings_input_dim=TEXT_DIM + 6 * 8,  # pooled text + six size numbers
            norm_num_groups=8,
        ),
        seed,
    )


def ddim() -> DDIMScheduler:
    return DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )


def euler() -> EulerDiscreteScheduler:
    return EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")


def _sd_parts(unet: UNet2DConditionModel, scheduler) -> dict:
    return {
        "unet": unet,
        "vae": vae(),
        "text_encoder": text_encoder(),
        "tokenizer": tokenizer(),
        "scheduler": scheduler,
        "safety_checker": None,
        "feature_extractor": None,
        "requires_safety_checker": False,
    }


def _quiet(pipe):
    pipe.set_progress_bar_config(disable=True)
    return pipe


def cached_pipeline(pipes: dict, kind: str):
    """One pipeline per kind for a test module (``pipes``: its cache; building them is the slow part); every test
    leaves it unpatched."""
    from tome_core.hosts.diffusers import patch

    if kind not in pipes:
        pipes[kind] = make_pipeline(kind)
    pipe = pipes[kind]
    assert not patch.is_patched(pipe)
    return pipe


def make_pipeline(kind: str, scheduler=None):
    """One of: txt2img, img2img, inpaint, controlnet, pag (SD1 layout) and sdxl."""
    if kind == "txt2img":
        return _quiet(StableDiffusionPipeline(**_sd_parts(sd1_unet(), scheduler or ddim())))
    if kind == "img2img":
        return _quiet(StableDiffusionImg2ImgPipeline(**_sd_parts(sd1_unet(), scheduler or ddim())))
    if kind == "inpaint":  # the inpainting UNet takes latent + mask + masked-image latent: 9 channels
        return _quiet(StableDiffusionInpaintPipeline(**_sd_parts(sd1_unet(in_channels=9), scheduler or ddim())))
    if kind == "controlnet":
        unet = sd1_unet()
        # The conditioning image is brought to the latent size by a stride-2 embedding (the VAE's factor 2).
        controlnet = seeded(ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=(8, 16)), 30)
        return _quiet(StableDiffusionControlNetPipeline(**_sd_parts(unet, scheduler or ddim()), controlnet=controlnet))
    if kind == "pag":  # perturbed-attention guidance on the mid block's self-attention, as diffusers' examples
        return _quiet(
            StableDiffusionPAGPipeline(**_sd_parts(sd1_unet(), scheduler or ddim()), pag_applied_layers="mid")
        )
    if kind == "sdxl":
        return _quiet(
            StableDiffusionXLPipeline(
                unet=sdxl_unet(),
                vae=vae(),
                text_encoder=text_encoder(11),
                text_encoder_2=text_encoder(12, projection=True),
                tokenizer=tokenizer(),
                tokenizer_2=tokenizer(),
                scheduler=scheduler or euler(),
            )
        )
    raise ValueError(kind)


def _image(seed: int, channels: int = 3) -> torch.Tensor:
    """A (1, channels, 32, 32) image in [0, 1]."""
    return torch.rand(1, channels, IMAGE_PX, IMAGE_PX, generator=torch.Generator().manual_seed(seed))


def run(pipe, kind: str, steps: int = 3, seed: int = 0, **extra) -> np.ndarray:
    """Generate one image end to end (text encoding, CFG sampling, VAE decoding) with a fixed seed."""
    with torch.no_grad():
        return pipe(**call_arguments(kind, steps, seed, **extra)).images


def call_arguments(kind: str, steps: int = 3, seed: int = 0, **extra) -> dict:
    """The keyword arguments of ``run``'s pipeline call."""
    args = {
        "prompt": PROMPT,
        "num_inference_steps": steps,
        "guidance_scale": 5.0,
        "generator": torch.Generator().manual_seed(seed),
        "output_type": "np",
        **extra,
    }
    if kind in ("txt2img", "controlnet", "pag", "sdxl"):
        args.update(height=IMAGE_PX, width=IMAGE_PX)
    if kind == "img2img":
        args.update(image=_image(1), strength=extra.get("strength", 0.8))
    if kind == "inpaint":
        mask = torch.zeros(1, 1, IMAGE_PX, IMAGE_PX)
        mask[..., 8:24, 8:24] = 1.0
        args.update(image=_image(1), mask_image=mask, height=IMAGE_PX, width=IMAGE_PX, strength=1.0)
    if kind == "controlnet":
        args.update(image=_image(2))
    return args
