"""The diffusers path against the other hosts' paths and tomesd 0.1.3, on the same weights.

One random-weight UNet of ComfyUI's own classes is the source; the WebUI's ``ldm`` UNet loads its state dict as
it is (the two name their weights alike) and diffusers' UNet2DConditionModel gets it through diffusers' own
converter for original checkpoints (``diffusers.loaders.single_file_utils``), so the three compute the same
function. Where the patch computes the same too, the outputs must agree:
- ToDo downsamples self-attention's keys and values identically in every host;
- ToMe compares tokens by the block input in diffusers, in the WebUI path and in tomesd (ComfyUI's hook sees the
  normalised input instead, so its merges differ and it is not compared).
Tolerance: the three UNets run the same operations in different orders (attention: SDPA in diffusers and ComfyUI,
einsum-softmax in ldm; timestep embeddings written differently), which unpatched already shows as a difference of
about 1e-6 of the output's scale. The bound is 2e-5 of the scale; the patch itself changes the output by more than
1000x that bound, so agreement cannot come from a patch that did nothing.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import tomesd
import torch
from diffusers import UNet2DConditionModel
from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint, create_unet_diffusers_config_from_ldm
from hosts import comfy_host  # noqa: I001  (before any ComfyUI import: sys.path, CPU mode)
from hosts import diffusers_host as H
from ldm.modules.diffusionmodules.openaimodel import UNetModel

import tome_core
from tome_core import PatchSettings
from tome_core.hosts.shared.model_patcher import patched_clone
from tome_core.hosts.webui import ldm_patch

# The token reduction alone, at every size (reuse across steps, on by default, has its own tests).
FORCE = {"skip_when_slower": False, "reuse_interval": 1}
BOUND = 2e-5  # of the output's scale, see the module docstring
# Attention heads per level as ComfyUI builds them whatever the config says (its unet_extra_config): 8 heads in
# SD1.x, 64 channels per head in SDXL (one head at these widths; the converter would divide 32 channels by 64).
HEADS = {"sd15": None, "sdxl": [1, 1, 1]}

# The ldm parameters of comfy_host's tiny models (ComfyUI's detected configs written as an ldm model config).
LDM_PARAMS = {
    "sd15": {
        "in_channels": 4,
        "out_channels": 4,
        "model_channels": 32,
        "channel_mult": [1, 2, 2],
        "num_res_blocks": 1,
        "attention_resolutions": [1, 2, 4],
        "transformer_depth": 1,
        "num_heads": 8,  # ComfyUI sets 8 heads for SD1.x whatever the config says (unet_extra_config)
        "context_dim": 64,
        "use_linear_in_transformer": False,
    },
    "sdxl": {
        "in_channels": 4,
        "out_channels": 4,
        "model_channels": 32,
        "channel_mult": [1, 2, 2],
        "num_res_blocks": 1,
        "attention_resolutions": [2, 4],
        "transformer_depth": [0, 2, 2],
        "num_head_channels": 16,  # for the converter only: ComfyUI uses 64 channels per head (see HEADS)
        "context_dim": 64,
        "use_linear_in_transformer": True,
        "num_classes": "sequential",
        "adm_in_channels": 2816,
    },
}


class Hosts:
    """The same weights in ComfyUI's UNet, the WebUI's ldm UNet (SD1 layout only) and diffusers' UNet."""

    def __init__(self, family: str, seed: int = 0):
        self.family = family
        self.patcher = comfy_host.tiny_model(family, seed)
        state = self.patcher.model.diffusion_model.state_dict()
        params = LDM_PARAMS[family]
        original_config = {
            "model": {
                "params": {
                    "unet_config": {"params": params},
                    "first_stage_config": {"params": {"ddconfig": {"ch_mult": [1, 2]}}},
                }
            }
        }
        checkpoint = {"model.diffusion_model." + key: value for key, value in state.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # image_size given (it cannot be inferred for tiny UNets)
            config = create_unet_diffusers_config_from_ldm(original_config, checkpoint, image_size=32)
        if HEADS[family] is not None:
            config["attention_head_dim"] = HEADS[family]
        self.diffusers = UNet2DConditionModel(**config).eval()
        self.diffusers.load_state_dict(convert_ldm_unet_checkpoint(checkpoint, config), strict=True)
        self.ldm = None
        if family == "sd15":
            self.ldm = UNetModel(
                image_size=32, use_spatial_transformer=True, use_checkpoint=False, legacy=False, **params
            )
            self.ldm.load_state_dict(state, strict=True)
            self.ldm.eval()
        generator = torch.Generator().manual_seed(5)
        self.x = torch.randn(2, 4, 16, 24, generator=generator)  # not square: h and w must not be swapped
        self.t = torch.full((2,), 600.0)
        self.context = torch.randn(2, 7, 64, generator=generator)
        self.y = torch.randn(2, 2816, generator=generator) if family == "sdxl" else None

    def run_diffusers(self, **settings):
        if settings:
            tome_core.apply_patch(self.diffusers, **settings)
        try:
            with torch.no_grad():
                return self.diffusers(self.x, self.t, self.context, class_labels=self.y).sample
        finally:
            tome_core.remove_patch(self.diffusers)

    def run_comfy(self, **settings):
        patcher = self.patcher
        if settings:
            ms = patcher.get_model_object("model_sampling")
            patcher = patched_clone(patcher, PatchSettings.from_values(**settings), ms.percent_to_sigma)
        options = dict(patcher.model_options.get("transformer_options", {}))
        with torch.no_grad():
            unet = patcher.model.diffusion_model
            return unet(self.x, self.t, context=self.context, y=self.y, transformer_options=options)

    def run_ldm(self, **settings):
        if settings:
            ldm_patch.install_patch(self.ldm, PatchSettings.from_values(**settings))
        try:
            with torch.no_grad():
                return self.ldm(self.x, self.t, context=self.context)
        finally:
            ldm_patch.remove_patch(self.ldm)


def assert_agree(results: dict, plain: torch.Tensor, reference: str) -> None:
    scale = float(plain.abs().max())
    effect = float((results[reference] - plain).abs().max())
    assert effect > 1000 * BOUND * scale  # the patch really changed the output
    for name, out in results.items():
        difference = float((out - results[reference]).abs().max())
        assert difference <= BOUND * scale, (name, difference / scale)


def test_unpatched_hosts_compute_the_same():
    hosts = Hosts("sd15")
    plain = hosts.run_diffusers()
    scale = float(plain.abs().max())
    assert float((hosts.run_comfy() - plain).abs().max()) <= BOUND * scale / 10
    assert float((hosts.run_ldm() - plain).abs().max()) <= BOUND * scale / 10


@pytest.mark.parametrize("values", [{"downsample_factor": 2.0}, {"downsample_factor": 3.0, "max_downsample": 2}])
def test_todo_agrees_with_comfyui_and_webui(values):
    hosts = Hosts("sd15")
    settings = {"method": "todo", **values, **FORCE}
    results = {
        "diffusers": hosts.run_diffusers(**settings),
        "comfyui": hosts.run_comfy(**settings),
        "webui": hosts.run_ldm(**settings),
    }
    assert_agree(results, hosts.run_diffusers(), "diffusers")


def test_todo_agrees_with_comfyui_on_the_sdxl_layout():
    hosts = Hosts("sdxl")
    settings = {"method": "todo", **FORCE}  # automatic level: 2, where SDXL's attention starts
    results = {"diffusers": hosts.run_diffusers(**settings), "comfyui": hosts.run_comfy(**settings)}
    assert_agree(results, hosts.run_diffusers(), "diffusers")


@pytest.mark.parametrize(
    "values", [{}, {"merge_crossattn": True, "merge_mlp": True}, {"ratio": 0.3, "sx": 3, "sy": 1, "max_downsample": 2}]
)
def test_tome_agrees_with_webui_and_tomesd(values):
    """Same plan (tokens compared by the block input), same merges: ours in diffusers and in the WebUI path, and
    tomesd 0.1.3 (randomness off) on both UNets. Ours averages with index_add and a multiply, tomesd with
    scatter_reduce(mean): a few ulp per merged token."""
    hosts = Hosts("sd15")
    settings = {"method": "tome", "ratio": 0.5, **values, **FORCE}
    tomesd_args = {
        "ratio": settings["ratio"],
        "max_downsample": settings.get("max_downsample", 1),
        "sx": settings.get("sx", 2),
        "sy": settings.get("sy", 2),
        "use_rand": False,
        "merge_crossattn": settings.get("merge_crossattn", False),
        "merge_mlp": settings.get("merge_mlp", False),
    }
    results = {"diffusers": hosts.run_diffusers(**settings), "webui": hosts.run_ldm(**settings)}
    holder = torch.nn.Module()
    holder.model = torch.nn.Module()
    holder.model.diffusion_model = hosts.ldm
    for name, target in (("tomesd on diffusers", hosts.diffusers), ("tomesd on ldm", holder)):
        tomesd.apply_patch(target, **tomesd_args)
        try:
            results[name] = hosts.run_diffusers() if target is hosts.diffusers else hosts.run_ldm()
        finally:
            tomesd.remove_patch(target)
    assert_agree(results, hosts.run_diffusers(), "diffusers")


def test_tomesd_as_a_peer_on_the_same_pipelines():
    """tomesd 0.1.3 still runs on today's diffusers SD1 pipelines and agrees with ours (randomness off, level 1).
    On the SDXL layout its default max_downsample=1 does nothing (SDXL has no attention at level 1, and tomesd
    does not look for the finest level that has it); with max_downsample=2 it runs and agrees with ours."""
    pipe = H.make_pipeline("txt2img")
    plain = H.run(pipe, "txt2img")
    tomesd.apply_patch(pipe, ratio=0.5, use_rand=False)
    theirs = H.run(pipe, "txt2img")
    tomesd.remove_patch(pipe)
    tome_core.apply_patch(pipe, method="tome", ratio=0.5, max_downsample=1, **FORCE)
    ours = H.run(pipe, "txt2img")
    tome_core.remove_patch(pipe)
    assert not np.array_equal(ours, plain)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5)  # pixel values in [0, 1]

    sdxl = H.make_pipeline("sdxl")
    plain = H.run(sdxl, "sdxl")
    tomesd.apply_patch(sdxl, ratio=0.5, use_rand=False)
    assert np.array_equal(H.run(sdxl, "sdxl"), plain)  # tomesd's defaults: nothing reduced on SDXL
    tomesd.remove_patch(sdxl)
    tomesd.apply_patch(sdxl, ratio=0.5, use_rand=False, max_downsample=2)
    theirs = H.run(sdxl, "sdxl")
    tomesd.remove_patch(sdxl)
    tome_core.apply_patch(sdxl, method="tome", ratio=0.5, **FORCE)  # automatic level: 2
    ours = H.run(sdxl, "sdxl")
    tome_core.remove_patch(sdxl)
    assert not np.array_equal(ours, plain)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5)
