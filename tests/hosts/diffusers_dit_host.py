"""Small diffusers DiT pipelines (Flux, SD3, Wan 2.1 and 2.2) assembled offline from randomly initialised
transformers of the real diffusers classes.

The text encoders are left out: the tests hand the pipelines prompt embeddings of their own (seeded random
tensors of the transformer's text width), and ``output_type="latent"`` skips the VAE, which the pipelines then
do not need (their latent scale falls back to 8). At the default 64 px the latents are 8x8: Flux packs them 2x2
into 16 image tokens (after 8 text tokens), SD3 and Wan take 2x2 patches (16 tokens per frame; Wan: 5 frames, 2
latent frames). The grids are far below the break-even, so tests that want ToDo force it with
``skip_when_slower=False``.
"""

from __future__ import annotations

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    FluxKontextPipeline,
    FluxPipeline,
    FluxTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    WanPipeline,
    WanTransformer3DModel,
)

from hosts.diffusers_host import seeded

TEXT_DIM = 32
TEXT_TOKENS = 8


def flux_transformer(seed: int = 0) -> FluxTransformer2DModel:
    """Flux's layout at width 32: 2 double and 3 single blocks (a span of 3), 2 heads of 16, guidance embedding."""
    return seeded(
        FluxTransformer2DModel(
            patch_size=1,
            in_channels=16,
            num_layers=2,
            num_single_layers=3,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=TEXT_DIM,
            pooled_projection_dim=TEXT_DIM,
            guidance_embeds=True,
            axes_dims_rope=(4, 6, 6),
        ),
        seed,
    )


def sd3_transformer(seed: int = 0) -> SD3Transformer2DModel:
    """SD3's layout: 4 joint blocks (the last one context-pre-only), SD3.5 Medium's dual attention in the first."""
    return seeded(
        SD3Transformer2DModel(
            sample_size=16,
            patch_size=2,
            in_channels=4,
            num_layers=4,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=TEXT_DIM,
            caption_projection_dim=32,
            pooled_projection_dim=TEXT_DIM,
            out_channels=4,
            pos_embed_max_size=32,
            dual_attention_layers=(0,),
            qk_norm="rms_norm",
        ),
        seed,
    )


def wan_transformer(seed: int = 0) -> WanTransformer3DModel:
    """Wan 2.1's layout: 4 blocks of width 32, patches of 1 frame x 2 x 2."""
    return seeded(
        WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=16,
            in_channels=4,
            out_channels=4,
            text_dim=TEXT_DIM,
            freq_dim=32,
            ffn_dim=64,
            num_layers=4,
            rope_max_seq_len=64,
        ),
        seed,
    )


def flux_pipeline() -> FluxPipeline:
    return FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=None,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        transformer=flux_transformer(),
    )


def kontext_pipeline() -> FluxKontextPipeline:
    """Flux Kontext: the reference image goes through a VAE (8x downsampling, 4 latent channels, seeded random
    weights) into reference tokens after the image's."""
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        shift_factor=0.1,
        scaling_factor=0.5,
    )
    return FluxKontextPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=seeded(vae, 5),
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        transformer=flux_transformer(),
    )


def kontext_run(pipe, steps: int = 12) -> torch.Tensor:
    """64 px from a 48 px reference image (3 x 3 reference tokens after the 4 x 4 image tokens)."""
    import numpy as np
    from PIL import Image

    image = Image.fromarray((np.random.default_rng(0).random((48, 48, 3)) * 255).astype(np.uint8))
    prompt, pooled = _text(100, pooled=True)
    with torch.no_grad():
        return pipe(
            image=image,
            prompt_embeds=prompt,
            pooled_prompt_embeds=pooled,
            height=64,
            width=64,
            max_area=64 * 64,
            _auto_resize=False,
            num_inference_steps=steps,
            guidance_scale=2.5,
            generator=torch.Generator().manual_seed(0),
            output_type="latent",
        ).images


def sd3_pipeline() -> StableDiffusion3Pipeline:
    return StableDiffusion3Pipeline(
        transformer=sd3_transformer(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=None,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        text_encoder_3=None,
        tokenizer_3=None,
    )


def wan_pipeline(two_models: bool = False) -> WanPipeline:
    """Wan 2.1 (one transformer), or Wan 2.2's layout: a second transformer for the low-noise half."""
    return WanPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=None,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        transformer=wan_transformer(0),
        transformer_2=wan_transformer(1) if two_models else None,
        boundary_ratio=0.5 if two_models else None,
    )


def _text(seed: int, pooled: bool):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randn(1, TEXT_TOKENS, TEXT_DIM, generator=generator)
    return (tokens, torch.randn(1, TEXT_DIM, generator=generator)) if pooled else (tokens, None)


def run(pipe, steps: int = 12, px: int = 64, seed: int = 0, **extra) -> torch.Tensor:
    """One generation's latents. Flux: guidance-distilled, one call per step; SD3: CFG batched (cond and uncond in
    one call); Wan: CFG as two calls per step (the prompt, then the negative prompt)."""
    generator = torch.Generator().manual_seed(seed)
    common = {"num_inference_steps": steps, "height": px, "width": px, "generator": generator, "output_type": "latent"}
    prompt, pooled = _text(100, pooled=True)
    negative, negative_pooled = _text(101, pooled=True)
    with torch.no_grad():
        if isinstance(pipe, FluxPipeline):
            out = pipe(prompt_embeds=prompt, pooled_prompt_embeds=pooled, guidance_scale=3.5, **common, **extra)
        elif isinstance(pipe, StableDiffusion3Pipeline):
            out = pipe(
                prompt_embeds=prompt,
                pooled_prompt_embeds=pooled,
                negative_prompt_embeds=negative,
                negative_pooled_prompt_embeds=negative_pooled,
                guidance_scale=4.0,
                **common,
                **extra,
            )
        else:
            out = pipe(
                prompt_embeds=prompt,
                negative_prompt_embeds=negative,
                guidance_scale=4.0,
                num_frames=5,
                **common,
                **extra,
            )
    return out.frames if hasattr(out, "frames") else out.images
