"""Small diffusers DiT pipelines (Flux, SD3, Wan 2.1 and 2.2; Flux.2, Qwen-Image, Z-Image, HunyuanVideo 1.5 and
LTX-Video) assembled offline from randomly initialised transformers of the real diffusers classes.

The text encoders are left out: the tests hand the pipelines prompt embeddings of their own (seeded random
tensors of the transformer's text width), and ``output_type="latent"`` skips the VAE, which the pipelines then
do not need (their latent scale falls back to 8). At the default 64 px the latents are 8x8: Flux packs them 2x2
into 16 image tokens (after 8 text tokens), SD3 and Wan take 2x2 patches (16 tokens per frame; Wan: 5 frames, 2
latent frames). The grids are far below the break-even, so tests that want ToDo force it with
``skip_when_slower=False``.

The families with reuse only (``FAMILY_MAKERS``, run by ``family_run``), at 64 px unless said: Flux.2 packs its 8x8
latents 2x2 into 16 image tokens; Qwen-Image the same (true CFG: two calls per step); Z-Image takes 2x2 patches
of the 8x8 latents (16 tokens, padded to 32 with the caption's 32 after them; CFG batched in one call);
HunyuanVideo 1.5 has no VAE-free default (its pipeline reads the VAE's config), so it gets a tiny VAE (never run
here), 16x compression: 4x4 latents, 2 latent frames of 5 (its guider: two calls per step); LTX-Video at 128 px
(32x compression, no VAE): 4x4 latents, 2 latent frames of 9 (CFG batched); LTX-2 at 256 px (its tiny VAE: 64x
spatial, 16x temporal compression): 4x4 latents, 2 latent frames of 17, and 9 audio frames of 16 mel bins (CFG
batched; ``family_run`` returns video and audio latents flattened into one tensor).
"""

from __future__ import annotations

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLHunyuanVideo15,
    AutoencoderKLLTX2Audio,
    AutoencoderKLLTX2Video,
    ClassifierFreeGuidance,
    FlowMatchEulerDiscreteScheduler,
    Flux2Pipeline,
    Flux2Transformer2DModel,
    FluxKontextPipeline,
    FluxPipeline,
    FluxTransformer2DModel,
    HunyuanVideo15Pipeline,
    HunyuanVideo15Transformer3DModel,
    LTX2Pipeline,
    LTX2VideoTransformer3DModel,
    LTXPipeline,
    LTXVideoTransformer3DModel,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    WanPipeline,
    WanTransformer3DModel,
    ZImagePipeline,
    ZImageTransformer2DModel,
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


# The families with reuse across steps only: each with 4 or 5 blocks of width 32 (2 heads of 16), so that the span
# (all blocks but the first) has 3 or 4.


def flux2_pipeline() -> Flux2Pipeline:
    """Flux.2: 2 double and 3 single blocks (a span of 4 across both lists), guidance embedding (dev's layout)."""
    transformer = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=2,
        num_single_layers=3,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=TEXT_DIM,
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=True,
    )
    return Flux2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True),
        vae=None,
        text_encoder=None,
        tokenizer=None,
        transformer=seeded(transformer, 0),
    )


def qwen_image_pipeline() -> QwenImagePipeline:
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=4,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=TEXT_DIM,
        axes_dims_rope=(4, 6, 6),
    )
    return QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True),
        vae=None,
        text_encoder=None,
        tokenizer=None,
        transformer=seeded(transformer, 0),
    )


def z_image_pipeline() -> ZImagePipeline:
    """Z-Image: 1 noise and 1 context refiner (they run at every call), then 4 main layers."""
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=4,
        dim=32,
        n_layers=4,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        cap_feat_dim=TEXT_DIM,
        axes_dims=[4, 6, 6],
        axes_lens=[64, 32, 32],
    )
    return ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=None,
        text_encoder=None,
        tokenizer=None,
        transformer=seeded(transformer, 0),
    )


def hunyuan_video15_pipeline() -> HunyuanVideo15Pipeline:
    """HunyuanVideo 1.5 text-to-video: 4 blocks, 1 token refiner layer; latents, their (zero) condition and mask
    stacked on the channels (4 + 4 + 1). The pipeline's 729 (zero) image-embedding tokens are cut to 4 (an
    attribute it reads at each call): the text stream is then 20 tokens, not 745."""
    transformer = HunyuanVideo15Transformer3DModel(
        in_channels=9,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=4,
        num_refiner_layers=1,
        mlp_ratio=2.0,
        text_embed_dim=TEXT_DIM,
        text_embed_2_dim=TEXT_DIM,
        image_embed_dim=TEXT_DIM,
        rope_axes_dim=(4, 6, 6),
        target_size=64,
        task_type="t2v",
    )
    vae = AutoencoderKLHunyuanVideo15(latent_channels=4, block_out_channels=(8, 8, 8, 8, 8), layers_per_block=1)
    pipe = HunyuanVideo15Pipeline(
        text_encoder=None,
        tokenizer=None,
        transformer=seeded(transformer, 0),
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        text_encoder_2=None,
        tokenizer_2=None,
        guider=ClassifierFreeGuidance(guidance_scale=6.0),
    )
    pipe.vision_num_semantic_tokens = 4
    return pipe


def ltx_pipeline() -> LTXPipeline:
    transformer = LTXVideoTransformer3DModel(
        in_channels=8,
        out_channels=8,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=2,
        attention_head_dim=16,
        cross_attention_dim=32,
        num_layers=4,
        caption_channels=TEXT_DIM,
    )
    return LTXPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True),
        vae=None,
        text_encoder=None,
        tokenizer=None,
        transformer=seeded(transformer, 0),
    )


def ltx2_pipeline() -> LTX2Pipeline:
    """LTX-2's video and audio: video tokens 32 wide, audio tokens 16 wide (8 latent channels x 16 mel bins in, as
    the real model's 128), 4 blocks; the text connectors and both VAEs tiny (the VAEs never run: their configs give
    the latent sizes and the latents' scale)."""
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors

    transformer = LTX2VideoTransformer3DModel(
        in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=16, cross_attention_dim=32,
        audio_in_channels=128, audio_out_channels=128, audio_num_attention_heads=2, audio_attention_head_dim=8,
        audio_cross_attention_dim=16, num_layers=4, caption_channels=TEXT_DIM,
    )  # fmt: skip
    connectors = LTX2TextConnectors(
        caption_channels=TEXT_DIM, text_proj_in_factor=1, video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=16, video_connector_num_layers=1,
        video_connector_num_learnable_registers=None, audio_connector_num_attention_heads=2,
        audio_connector_attention_head_dim=16, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None, video_hidden_dim=32, audio_hidden_dim=32,
    )  # fmt: skip
    video_vae = AutoencoderKLLTX2Video(
        latent_channels=8, block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8),
        layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1),
    )  # fmt: skip
    audio_vae = AutoencoderKLLTX2Audio(base_channels=128, ch_mult=(1,), num_res_blocks=1, mel_bins=64)
    return LTX2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True),
        vae=video_vae,
        audio_vae=audio_vae,
        text_encoder=None,
        tokenizer=None,
        connectors=seeded(connectors, 1),
        transformer=seeded(transformer, 0),
        vocoder=None,
    )


FAMILY_MAKERS = {
    "flux2": flux2_pipeline,
    "qwen-image": qwen_image_pipeline,
    "z-image": z_image_pipeline,
    "hunyuanvideo-1.5": hunyuan_video15_pipeline,
    "ltx-video": ltx_pipeline,
    "ltx-2": ltx2_pipeline,
}


def family_run(pipe, steps: int = 12, seed: int = 0) -> torch.Tensor:
    """One generation's latents on a ``FAMILY_MAKERS`` pipeline (its prompt embeddings as ``run``'s: seeded)."""
    generator = torch.Generator().manual_seed(seed)
    common = {"num_inference_steps": steps, "generator": generator, "output_type": "latent"}
    prompt, _ = _text(100, pooled=False)
    negative, _ = _text(101, pooled=False)
    mask = torch.ones(1, TEXT_TOKENS, dtype=torch.long)
    with torch.no_grad():
        if isinstance(pipe, Flux2Pipeline):
            out = pipe(prompt_embeds=prompt, height=64, width=64, guidance_scale=3.5, **common)
        elif isinstance(pipe, QwenImagePipeline):
            out = pipe(
                prompt_embeds=prompt,
                prompt_embeds_mask=mask,
                negative_prompt_embeds=negative,
                negative_prompt_embeds_mask=mask,
                true_cfg_scale=4.0,
                height=64,
                width=64,
                **common,
            )
        elif isinstance(pipe, ZImagePipeline):  # a list of (tokens, width) embeddings, one per prompt
            out = pipe(
                prompt_embeds=[prompt[0]],
                negative_prompt_embeds=[negative[0]],
                guidance_scale=4.0,
                height=64,
                width=64,
                **common,
            )
        elif isinstance(pipe, HunyuanVideo15Pipeline):
            second, _ = _text(102, pooled=False)
            negative_second, _ = _text(103, pooled=False)
            out = pipe(
                prompt_embeds=prompt,
                prompt_embeds_mask=mask,
                negative_prompt_embeds=negative,
                negative_prompt_embeds_mask=mask,
                prompt_embeds_2=second,
                prompt_embeds_mask_2=mask,
                negative_prompt_embeds_2=negative_second,
                negative_prompt_embeds_mask_2=mask,
                height=64,
                width=64,
                num_frames=5,
                **common,
            )
        else:
            video = {"height": 128, "width": 128, "num_frames": 9}
            if isinstance(pipe, LTX2Pipeline):  # 64x spatial, 16x temporal compression: 4x4 latents, 2 frames
                video = {"height": 256, "width": 256, "num_frames": 17}
            out = pipe(
                prompt_embeds=prompt,
                prompt_attention_mask=mask,
                negative_prompt_embeds=negative,
                negative_prompt_attention_mask=mask,
                guidance_scale=3.0,
                **video,
                **common,
            )
    if isinstance(pipe, LTX2Pipeline):  # the video and the audio latents, as one tensor
        return torch.cat((out.frames.flatten(1), out.audio.flatten(1)), 1)
    return out.frames if hasattr(out, "frames") else out.images
