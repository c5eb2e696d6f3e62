"""LTX-2 (audio and video) on the pinned ComfyUI 0.3.75, which predates it: a small stand-in that follows what
ComfyUI 0.8.0's ``LTXAVModel`` (``comfy/ldm/lightricks/av_model.py``) shows the patch.

What it follows, read from 0.8.0 (the code is this project's own):
- the class derives from LTX-Video's ``LTXVModel`` and is called ``LTXAVModel``;
- its blocks (``transformer_blocks``) take ``x`` as the tuple ``(video tokens, audio tokens)``, of two widths and
  two token counts, read the text as ``v_context`` and ``a_context``, add to both streams in place and return the
  tuple; the block hook (``patches_replace["dit"][("double_block", i)]``) hands them over as ``{"img": (vx, ax),
  "v_context": ..., "a_context": ..., ...}`` and reads ``out["img"]`` back as the tuple;
- each stream has its own self-attention, cross-attention to its text, MLP and timestep modulation, and the two
  attend to each other (audio to video, video to audio).

What differs: 0.8.0 samples audio and video as one nested tensor; 0.3.75's samplers take one tensor, so here the
latent carries the video in its first ``VIDEO_CHANNELS`` channels and the audio in the ``AUDIO_CHANNELS`` after
them (two grid positions to an audio token), and the model splits and joins them. No RoPE: positions do not
matter to what the patch sees. Built from ComfyUI's own LTX-Video parts (``CrossAttention``, ``FeedForward``,
``AdaLayerNormSingle``), so attention runs through ComfyUI's ``optimized_attention``.
"""

from __future__ import annotations

import importlib
import math

import torch
from torch import nn

from hosts import comfy_host  # before any ComfyUI import: sys.path, CPU mode

# ComfyUI's LTX-Video parts, imported once the host has put ComfyUI on the path.
_ltxv = importlib.import_module("comfy.ldm.lightricks.model")
AdaLayerNormSingle, CrossAttention, FeedForward = _ltxv.AdaLayerNormSingle, _ltxv.CrossAttention, _ltxv.FeedForward
LTXVModel, PixArtAlphaTextProjection = _ltxv.LTXVModel, _ltxv.PixArtAlphaTextProjection
rms_norm = importlib.import_module("comfy.ldm.common_dit").rms_norm

VIDEO_CHANNELS = 128  # LTX-Video's latent channels
AUDIO_CHANNELS = 8  # LTX-2's audio latent channels
AUDIO_TOKEN = 2  # grid positions to an audio token: fewer audio tokens than video tokens, as in the real model


class AudioVideoBlock(nn.Module):
    """One block on the (video, audio) tuple."""

    def __init__(self, v_dim: int, a_dim: int, heads: int, operations, dtype=None, device=None):
        super().__init__()
        kw = {"dtype": dtype, "device": device, "operations": operations}

        def attention(query, context=None):
            return CrossAttention(query, context_dim=context, heads=heads, dim_head=query // heads, **kw)

        self.attn1, self.audio_attn1 = attention(v_dim), attention(a_dim)
        self.attn2, self.audio_attn2 = attention(v_dim, v_dim), attention(a_dim, a_dim)
        self.audio_to_video_attn = attention(v_dim, a_dim)
        self.video_to_audio_attn = attention(a_dim, v_dim)
        self.ff = FeedForward(v_dim, dim_out=v_dim, glu=True, **kw)
        self.audio_ff = FeedForward(a_dim, dim_out=a_dim, glu=True, **kw)
        self.scale_shift_table = nn.Parameter(torch.empty(6, v_dim, dtype=dtype, device=device))
        self.audio_scale_shift_table = nn.Parameter(torch.empty(6, a_dim, dtype=dtype, device=device))

    @staticmethod
    def _modulation(table, timestep, x):
        return (table[None, None].to(x) + timestep.reshape(x.shape[0], timestep.shape[1], 6, -1)).unbind(dim=2)

    def forward(
        self, x, v_context=None, a_context=None, attention_mask=None, v_timestep=None, a_timestep=None,
        transformer_options=None,
    ):  # fmt: skip
        vx, ax = x
        options = {"transformer_options": transformer_options or {}}
        v_shift, v_scale, v_gate, v_shift_mlp, v_scale_mlp, v_gate_mlp = self._modulation(
            self.scale_shift_table, v_timestep, vx
        )
        a_shift, a_scale, a_gate, a_shift_mlp, a_scale_mlp, a_gate_mlp = self._modulation(
            self.audio_scale_shift_table, a_timestep, ax
        )
        vx += self.attn1(rms_norm(vx) * (1 + v_scale) + v_shift, **options) * v_gate
        vx += self.attn2(rms_norm(vx), context=v_context, mask=attention_mask, **options)
        ax += self.audio_attn1(rms_norm(ax) * (1 + a_scale) + a_shift, **options) * a_gate
        ax += self.audio_attn2(rms_norm(ax), context=a_context, mask=attention_mask, **options)
        v_norm, a_norm = rms_norm(vx), rms_norm(ax)
        vx += self.audio_to_video_attn(v_norm, context=a_norm, **options)
        ax += self.video_to_audio_attn(a_norm, context=v_norm, **options)
        vx += self.ff(rms_norm(vx) * (1 + v_scale_mlp) + v_shift_mlp) * v_gate_mlp
        ax += self.audio_ff(rms_norm(ax) * (1 + a_scale_mlp) + a_shift_mlp) * a_gate_mlp
        return vx, ax


class LTXAVModel(LTXVModel):
    """The stand-in (see the module docstring): LTX-Video's class, LTX-2's blocks and streams."""

    STREAMS = tuple  # what the block hook's ``img`` holds the two streams in (a test may hand over another kind)

    def __init__(self, audio_inner_dim: int = 16, dtype=None, device=None, operations=None, **kwargs):
        super().__init__(dtype=dtype, device=device, operations=operations, **kwargs)
        kw = {"dtype": dtype, "device": device, "operations": operations}
        heads = kwargs["num_attention_heads"]
        self.audio_inner_dim = audio_inner_dim
        self.audio_patchify_proj = operations.Linear(
            AUDIO_CHANNELS * AUDIO_TOKEN, audio_inner_dim, dtype=dtype, device=device
        )
        self.audio_adaln_single = AdaLayerNormSingle(audio_inner_dim, **kw)
        self.audio_caption_projection = PixArtAlphaTextProjection(kwargs["caption_channels"], audio_inner_dim, **kw)
        self.transformer_blocks = nn.ModuleList(
            AudioVideoBlock(self.inner_dim, audio_inner_dim, heads, operations, dtype, device)
            for _ in range(kwargs["num_layers"])
        )
        self.audio_scale_shift_table = nn.Parameter(torch.empty(2, audio_inner_dim, dtype=dtype, device=device))
        self.audio_norm_out = operations.LayerNorm(
            audio_inner_dim, elementwise_affine=False, eps=1e-6, dtype=dtype, device=device
        )
        self.audio_proj_out = operations.Linear(
            audio_inner_dim, AUDIO_CHANNELS * AUDIO_TOKEN, dtype=dtype, device=device
        )

    @staticmethod
    def _out(x, table, embedded, norm, proj):
        shift, scale = (table[None, None].to(x) + embedded[:, :, None]).unbind(dim=2)
        return proj(norm(x) * (1 + scale) + shift)

    def _forward(
        self, x, timestep, context, attention_mask, frame_rate=25, transformer_options=None, keyframe_idxs=None, **kw
    ):
        transformer_options = transformer_options or {}
        batch = x.shape[0]
        video, audio = x[:, :VIDEO_CHANNELS], x[:, VIDEO_CHANNELS:]
        vx, _ = self.patchifier.patchify(video)
        vx = self.patchify_proj(vx)
        positions = math.prod(audio.shape[2:])
        ax = audio.flatten(2).transpose(1, 2).reshape(batch, positions // AUDIO_TOKEN, AUDIO_CHANNELS * AUDIO_TOKEN)
        ax = self.audio_patchify_proj(ax)
        t = (timestep * 1000.0).flatten()
        v_timestep, v_embedded = self.adaln_single(t, batch_size=batch, hidden_dtype=vx.dtype)
        a_timestep, a_embedded = self.audio_adaln_single(t, batch_size=batch, hidden_dtype=vx.dtype)
        v_timestep, a_timestep = v_timestep.view(batch, 1, -1), a_timestep.view(batch, 1, -1)
        v_embedded, a_embedded = v_embedded.view(batch, 1, -1), a_embedded.view(batch, 1, -1)
        if attention_mask is not None and not torch.is_floating_point(attention_mask):
            attention_mask = (
                (attention_mask - 1).to(vx.dtype).reshape(attention_mask.shape[0], 1, -1, attention_mask.shape[-1])
            )
            attention_mask = attention_mask * torch.finfo(vx.dtype).max
        v_context = self.caption_projection(context)
        a_context = self.audio_caption_projection(context)

        replace = transformer_options.get("patches_replace", {}).get("dit", {})
        for i, block in enumerate(self.transformer_blocks):
            args = {
                "img": self.STREAMS((vx, ax)), "v_context": v_context, "a_context": a_context,
                "attention_mask": attention_mask, "v_timestep": v_timestep, "a_timestep": a_timestep,
                "transformer_options": transformer_options,
            }  # fmt: skip
            if ("double_block", i) in replace:

                def block_wrap(args, block=block):
                    streams = block(
                        args["img"], v_context=args["v_context"], a_context=args["a_context"],
                        attention_mask=args["attention_mask"], v_timestep=args["v_timestep"],
                        a_timestep=args["a_timestep"], transformer_options=args["transformer_options"],
                    )  # fmt: skip
                    return {"img": streams}

                vx, ax = replace[("double_block", i)](args, {"original_block": block_wrap})["img"]
            else:
                vx, ax = block(args.pop("img"), **args)

        vx = self._out(vx, self.scale_shift_table, v_embedded, self.norm_out, self.proj_out)
        video = self.patchifier.unpatchify(
            latents=vx, output_height=video.shape[3], output_width=video.shape[4],
            output_num_frames=video.shape[2], out_channels=VIDEO_CHANNELS,
        )  # fmt: skip
        ax = self._out(ax, self.audio_scale_shift_table, a_embedded, self.audio_norm_out, self.audio_proj_out)
        audio = ax.reshape(batch, positions, AUDIO_CHANNELS).transpose(1, 2).reshape(audio.shape)
        return torch.cat((video, audio), 1)


def tiny_ltx2(blocks: int = 4, seed: int = 0, model_class=LTXAVModel):
    """A ModelPatcher over ComfyUI's LTX-Video model (its sampling, conditioning and latent format) whose diffusion
    model is the stand-in, ``blocks`` blocks deep, seeded random weights."""
    import comfy.model_patcher
    import comfy.ops

    from tools.common.host import initialise

    patcher = comfy_host.tiny_dit("ltxv", num_layers=blocks)
    config = {key: value for key, value in comfy_host.DIT_TINY["ltxv"].items() if key != "image_model"}
    config["num_layers"] = blocks
    model = patcher.model
    model.diffusion_model = model_class(operations=comfy.ops.disable_weight_init, **config)
    initialise(model.diffusion_model, seed)
    model.diffusion_model.eval()
    return comfy.model_patcher.ModelPatcher(model, load_device=comfy_host.CPU, offload_device=comfy_host.CPU)


def latent(frames: int = 3, height: int = 8, width: int = 8, seed: int = 7) -> torch.Tensor:
    """A start latent with the video and audio channels (not all zero, so ComfyUI keeps its channel count)."""
    generator = torch.Generator().manual_seed(seed)
    return 0.1 * torch.randn(1, VIDEO_CHANNELS + AUDIO_CHANNELS, frames, height, width, generator=generator)
