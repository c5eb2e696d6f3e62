"""The Wan video reference (ref-wan) as diffusers' ``WanTransformer3DModel``, for the fidelity benchmark's
diffusers path (``tools.fidelity.diffusers.run``).

The committed weights are in ComfyUI's layout (Wan's own key names); diffusers' own converter for that layout
(``convert_wan_transformer_to_diffusers``, what ``from_single_file`` uses) renames them, and it works at any
width. ``max_difference`` checks the result against the ComfyUI model on the same inputs.
"""

from __future__ import annotations

import torch

from tools.fidelity.reference import models


def transformer_config(name: str) -> dict:
    """``WanTransformer3DModel`` arguments of a reference model's ComfyUI config."""
    c = models.WAN_CONFIGS[name]
    return {
        "patch_size": tuple(c["patch_size"]),
        "num_attention_heads": c["num_heads"],
        "attention_head_dim": c["dim"] // c["num_heads"],
        "in_channels": c["in_dim"],
        "out_channels": c["out_dim"],
        "text_dim": c["text_dim"],
        "freq_dim": c["freq_dim"],
        "ffn_dim": c["ffn_dim"],
        "num_layers": c["num_layers"],
        "cross_attn_norm": c["cross_attn_norm"],
        "qk_norm": "rms_norm_across_heads" if c["qk_norm"] else None,
        "eps": c["eps"],
    }


def load_transformer(name: str, base=None):
    """(diffusers ``WanTransformer3DModel`` with the reference's trained weights, the ComfyUI base model)."""
    from diffusers import WanTransformer3DModel
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    if base is None:
        base, _ = models.load_reference(name)
    transformer = WanTransformer3DModel(**transformer_config(name))
    state = {k: v.clone() for k, v in base.diffusion_model.state_dict().items()}
    transformer.load_state_dict(convert_wan_transformer_to_diffusers(state), strict=True)
    return transformer.eval(), base


@torch.no_grad()
def max_difference(name: str, size: int = models.CLIP_SIZE, seed: int = 0) -> float:
    """Largest absolute difference between the ComfyUI model's and the converted transformer's outputs on the same
    random clip latent, text and timestep (Wan's timestep: 1000 sigma)."""
    transformer, base = load_transformer(name)
    generator = torch.Generator().manual_seed(seed)
    c = models.WAN_CONFIGS[name]
    latent = torch.randn(2, c["in_dim"], models.CLIP_FRAMES, size, size, generator=generator)
    context = torch.randn(2, 7, c["text_dim"], generator=generator)
    timestep = torch.tensor([700.0, 300.0])
    comfy = base.diffusion_model(latent, timestep, context=context)
    ours = transformer(hidden_states=latent, timestep=timestep, encoder_hidden_states=context, return_dict=False)[0]
    return float((ours - comfy).abs().max())
