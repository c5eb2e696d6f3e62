"""The Flux reference models (ref-flux, ref-flux-deep) as diffusers' ``FluxTransformer2DModel``, for the fidelity
benchmark's diffusers path (``tools.fidelity.diffusers.run``).

The committed weights are in ComfyUI's layout (Black Forest Labs' key names). diffusers ships a converter for that
layout (``convert_flux_transformer_checkpoint_to_diffusers``), but it assumes Flux.1's width (3072) when it
splits a single block's fused projection, so the references (width 96) get this mapping instead: a renaming,
with the fused q/k/v (and the single blocks' q/k/v/MLP) projections split, and the final norm's modulation
halves swapped (ComfyUI's final layer emits shift then scale, diffusers' ``AdaLayerNormContinuous`` scale then
shift). ``max_difference`` checks the result against the ComfyUI model on the same inputs.
"""

from __future__ import annotations

import torch

from tools.fidelity.reference import models

# ComfyUI key prefix -> diffusers key prefix, for the parts that are renamed only.
_RENAMED = {
    "img_in": "x_embedder",
    "txt_in": "context_embedder",
    "time_in.in_layer": "time_text_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_text_embed.timestep_embedder.linear_2",
    "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
    "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
    "guidance_in.in_layer": "time_text_embed.guidance_embedder.linear_1",
    "guidance_in.out_layer": "time_text_embed.guidance_embedder.linear_2",
    "final_layer.linear": "proj_out",
}
_DOUBLE = {
    "img_mod.lin": "norm1.linear",
    "txt_mod.lin": "norm1_context.linear",
    "img_attn.proj": "attn.to_out.0",
    "txt_attn.proj": "attn.to_add_out",
    "img_mlp.0": "ff.net.0.proj",
    "img_mlp.2": "ff.net.2",
    "txt_mlp.0": "ff_context.net.0.proj",
    "txt_mlp.2": "ff_context.net.2",
}
_NORMS = {
    "img_attn.norm.query_norm.scale": "attn.norm_q.weight",
    "img_attn.norm.key_norm.scale": "attn.norm_k.weight",
    "txt_attn.norm.query_norm.scale": "attn.norm_added_q.weight",
    "txt_attn.norm.key_norm.scale": "attn.norm_added_k.weight",
}
_QKV = {"img_attn.qkv": ("to_q", "to_k", "to_v"), "txt_attn.qkv": ("add_q_proj", "add_k_proj", "add_v_proj")}
_SINGLE = {"modulation.lin": "norm.linear", "linear2": "proj_out"}
_SINGLE_NORMS = {"norm.query_norm.scale": "attn.norm_q.weight", "norm.key_norm.scale": "attn.norm_k.weight"}


def transformer_config(name: str) -> dict:
    """``FluxTransformer2DModel`` arguments of a reference model's ComfyUI config (the pipeline packs 2x2 latent
    patches into the channels, so the transformer's own patch is 1)."""
    c = models.FLUX_CONFIGS[name]
    return {
        "patch_size": 1,
        "in_channels": c["in_channels"] * c["patch_size"] ** 2,
        "out_channels": c["out_channels"] * c["patch_size"] ** 2,
        "num_layers": c["depth"],
        "num_single_layers": c["depth_single_blocks"],
        "attention_head_dim": c["hidden_size"] // c["num_heads"],
        "num_attention_heads": c["num_heads"],
        "joint_attention_dim": c["context_in_dim"],
        "pooled_projection_dim": c["vec_in_dim"],
        "guidance_embeds": c["guidance_embed"],
        "axes_dims_rope": tuple(c["axes_dim"]),
    }


def convert(state: dict, name: str) -> dict:
    """A ComfyUI Flux state dict (keys without ``diffusion_model.``) in diffusers' names and shapes."""
    c = models.FLUX_CONFIGS[name]
    width = c["hidden_size"]
    out = {}
    for key, tensor in state.items():
        stem, kind = key.rsplit(".", 1)
        if stem in _RENAMED:
            out[f"{_RENAMED[stem]}.{kind}"] = tensor
        elif stem == "final_layer.adaLN_modulation.1":
            shift, scale = tensor.chunk(2, dim=0)
            out[f"norm_out.linear.{kind}"] = torch.cat([scale, shift], dim=0)
        elif key.startswith("double_blocks."):
            _, index, rest = key.split(".", 2)
            prefix = f"transformer_blocks.{index}."
            stem = rest.rsplit(".", 1)[0]
            if rest in _NORMS:
                out[prefix + _NORMS[rest]] = tensor
            elif stem in _DOUBLE:
                out[f"{prefix}{_DOUBLE[stem]}.{kind}"] = tensor
            elif stem in _QKV:
                for part, piece in zip(_QKV[stem], tensor.chunk(3, dim=0), strict=True):
                    out[f"{prefix}attn.{part}.{kind}"] = piece
            else:
                raise KeyError(f"unmapped key {key}")
        elif key.startswith("single_blocks."):
            _, index, rest = key.split(".", 2)
            prefix = f"single_transformer_blocks.{index}."
            stem = rest.rsplit(".", 1)[0]
            if rest in _SINGLE_NORMS:
                out[prefix + _SINGLE_NORMS[rest]] = tensor
            elif stem in _SINGLE:
                out[f"{prefix}{_SINGLE[stem]}.{kind}"] = tensor
            elif stem == "linear1":
                sizes = (width, width, width, tensor.shape[0] - 3 * width)
                parts = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")
                for part, piece in zip(parts, torch.split(tensor, sizes, dim=0), strict=True):
                    out[f"{prefix}{part}.{kind}"] = piece
            else:
                raise KeyError(f"unmapped key {key}")
        else:
            raise KeyError(f"unmapped key {key}")
    return out


def load_transformer(name: str, base=None):
    """(diffusers ``FluxTransformer2DModel`` with the reference's trained weights, the ComfyUI base model)."""
    from diffusers import FluxTransformer2DModel

    if base is None:
        base, _ = models.load_reference(name)
    transformer = FluxTransformer2DModel(**transformer_config(name))
    transformer.load_state_dict(convert(base.diffusion_model.state_dict(), name), strict=True)
    return transformer.eval(), base


def pack(latent: torch.Tensor) -> torch.Tensor:
    """(batch, channels, h, w) -> (batch, h/2 * w/2, channels * 4): how diffusers' Flux pipelines pack latents."""
    b, c, h, w = latent.shape
    return latent.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The inverse of ``pack`` for latents of h x w."""
    b, _, packed = tokens.shape
    c = packed // 4
    return tokens.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)


def image_ids(h: int, w: int) -> torch.Tensor:
    rows, cols = torch.meshgrid(torch.arange(h // 2), torch.arange(w // 2), indexing="ij")
    return torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3).float()


@torch.no_grad()
def max_difference(name: str, size: int = 32, seed: int = 0) -> float:
    """Largest absolute difference between the ComfyUI model's and the converted transformer's outputs on the same
    random latent, text, pooled text, noise level and guidance."""
    transformer, base = load_transformer(name)
    generator = torch.Generator().manual_seed(seed)
    c = models.FLUX_CONFIGS[name]
    latent = torch.randn(2, c["in_channels"], size, size, generator=generator)
    context = torch.randn(2, 7, c["context_in_dim"], generator=generator)
    pooled = torch.randn(2, c["vec_in_dim"], generator=generator)
    sigma = torch.tensor([0.7, 0.3])
    guidance = torch.full((2,), models.FLUX_GUIDANCE)
    comfy = base.diffusion_model(latent, sigma, context=context, y=pooled, guidance=guidance)
    ours = transformer(
        hidden_states=pack(latent),
        encoder_hidden_states=context,
        pooled_projections=pooled,
        timestep=sigma,
        img_ids=image_ids(size, size),
        txt_ids=torch.zeros(context.shape[1], 3),
        guidance=guidance,
        return_dict=False,
    )[0]
    return float((unpack(ours, size, size) - comfy).abs().max())
