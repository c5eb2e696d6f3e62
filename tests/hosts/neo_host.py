"""A stand-in for Forge Neo (Haoming02/sd-webui-forge-classic, branch ``neo``, neo-2.26) sampling a DiT, with
ComfyUI's classes where Neo's are ComfyUI's (the Neo files each part follows are named below).

What is reproduced:
- The job order and the script hooks: ``webui_host`` (Neo keeps the WebUI's ``modules/processing.py`` order;
  ``forge_objects`` is rebuilt from the loaded model before every sampling pass, ``process_before_every_sampling``
  then runs, and the scripts assign their clone back to ``p.sd_model.forge_objects.unet``).
- Neo's patcher (``backend/patcher/base.py``): ComfyUI's ``ModelPatcher`` interface: ``clone``,
  ``set_model_patch_replace(fn, "dit", block_type, i)``, ``add_object_patch`` (applied when the clone is loaded
  for sampling and undone when it is unloaded: ComfyUI's ``patch_model`` / ``unpatch_model`` here),
  ``model_options["model_function_wrapper"]`` (``set_model_unet_function_wrapper``: Spectrum's hook).
- Neo's Flux (``backend/nn/flux.py`` ``IntegratedFluxTransformer2DModel.forward_orig``): a port of ComfyUI's Flux
  loop with the same block hook and the same dicts; here ComfyUI's ``Flux`` under Neo's class name (Chroma,
  ``backend/nn/chroma.py``, likewise). Neo's Anima (``backend/nn/anima.py``, ``MiniTrainDIT``) has no hook either.
  Neo's
  ``NextDiT`` (``backend/nn/lumina.py``, Z-Image / Lumina 2) loops over its layers with no hook: ComfyUI's NextDiT,
  whose class has the same name.
- The sampler: ``modules/sd_samplers_kdiffusion.py`` puts the pass's sigmas into ``transformer_options
  ["sampling_sigmas"]``; ``backend/sampling/sampling_function.py`` calls the model with ``cond_or_uncond`` and the
  call's ``sigmas`` in ``transformer_options`` (at CFG 1, Flux's distilled guidance, one call with the cond alone;
  else cond and uncond batched), through a ``model_function_wrapper`` where one is set; the ``cfg_denoiser`` and
  ``cfg_after_cfg`` callbacks around each denoiser call (``modules/sd_samplers_cfg_denoiser.py``); k-diffusion's
  Euler over ComfyUI's ``normal`` schedule, from the empty latent as ComfyUI's KSampler prepares it, so that a pass
  here computes what ComfyUI's KSampler computes for the same model, seed and steps.
- Neo's SD1.5 and SDXL UNet jobs (``neo_unet_model``): the WebUI's job order and ``p.sample`` of ``webui_host``
  (Neo's ``modules/processing.py`` keeps them: ``forge_objects`` copied from ``forge_objects_after_applying_lora``
  in ``sample`` before ``process_before_every_sampling``), its Euler loop and CFG denoiser, over Neo's
  ``UnetPatcher`` (``backend/patcher/unet.py`` over ``base.py``, ComfyUI's ``ModelPatcher``: a LoRA is
  ``add_patches``' entries in ``patches``, merged into the weights in place when the clone is loaded, the weights
  it replaced kept in ``backup``, a dict its clones share) and ComfyUI's UNet classes (Neo's ``backend/nn/unet.py``
  is a port of them).
"""

from __future__ import annotations

import types

import comfy.ldm.chroma.model
import comfy.ldm.cosmos.predict2
import comfy.ldm.flux.model
import comfy.model_patcher
import comfy.sample
import comfy.samplers
import comfy.supported_models
import torch

from hosts import (
    comfy_host,  # noqa: I001  (before any ComfyUI import: sys.path, CPU mode)
    webui_host,
)


class IntegratedFluxTransformer2DModel(comfy.ldm.flux.model.Flux):
    """Neo's Flux class (its loop is ComfyUI's, ported)."""


class IntegratedChromaTransformer2DModel(comfy.ldm.chroma.model.Chroma):
    """Neo's Chroma class (``backend/nn/chroma.py``: ComfyUI's loop, the same double and single block keys)."""


class IntegratedAnimaTransformer(comfy.ldm.cosmos.predict2.MiniTrainDIT):
    """Neo's Anima class (``backend/nn/anima.py``: derives from its port of ComfyUI's ``MiniTrainDIT``, whose
    ``for block in self.blocks`` loop has no hook; its text adapter, before the blocks, is left out here)."""


NEO_CLASSES = {
    "flux": IntegratedFluxTransformer2DModel,
    "chroma": IntegratedChromaTransformer2DModel,
    "cosmos_predict2": IntegratedAnimaTransformer,
}


def forge_model(family: str = "flux", **config):
    """lllyasviel's Forge's Flux or Chroma (``backend/nn/flux.py``, ``chroma.py``): a loop in ``inner_forward`` that
    calls each block directly (doubles as ``block(img=, txt=, ...)``, singles with the joined stream first), with
    no block hook. Here ComfyUI's class under Forge's name with an ``inner_forward``: with no replacement set,
    ComfyUI's loop calls the blocks the same way."""
    patcher = comfy_host.tiny_dit(family, **config)
    base = NEO_CLASSES[family]
    patcher.model.diffusion_model.__class__ = type(base.__name__, (base,), {"inner_forward": base.forward_orig})
    return patcher


class ForgeSampler:
    """lllyasviel's Forge's k-diffusion sampler (``modules/sd_samplers_kdiffusion.py``): ``get_sigmas(p, steps)``
    builds the pass's schedule (here ComfyUI's ``normal``, as the stand-in samples)."""

    def __init__(self, patcher):
        self.patcher = patcher

    def get_sigmas(self, p, steps):
        return comfy.samplers.calculate_sigmas(self.patcher.get_model_object("model_sampling"), "normal", steps)


class ForgeProcessing(webui_host.Processing):
    """A job of lllyasviel's Forge: ``p.sampler`` is the pass's sampler object, ``p.sampler_name`` its label."""

    sampler_name = None  # an attribute here, the label (the base class reads it from ``sampler``)


def forge_processing(patcher, script_args, steps: int = 28, sampler=None):
    """A job of lllyasviel's Forge on ``patcher``: as a Neo job but for what its sampler gives the model (no
    ``sampling_sigmas``; ``backend/sampling/sampling_function.py`` sets ``cond_or_uncond`` and ``sigmas`` only) and
    ``p.sampler`` (``sampler``: None, Forge's k-diffusion sampler; or another object)."""
    p = ForgeProcessing(NeoSDModel(patcher), script_args)
    p.sampler_name = "Euler"
    p.sampler = ForgeSampler(patcher) if sampler is None else sampler
    p.scheduler = "Simple"
    p.neo_steps, p.neo_cfg, p.neo_refiner = steps, 1.0, None
    p.forge = True
    return p


class NeoUnetPatcher(comfy.model_patcher.ModelPatcher):
    """Neo's ``UnetPatcher`` for SD1.5 and SDXL, loaded for a pass as ``webui_host.forge_load_models_gpu`` loads
    Forge's (Neo's memory management is ComfyUI's: ``patch_model`` applies the weight and object patches in place,
    ``unpatch_model`` takes them back), and called as Neo's ``sampling_function`` calls the model: the call's
    ``cond_or_uncond`` and ``sigmas`` in ``transformer_options``, the scaled latent and the DDPM timestep into the
    UNet (``BaseModel._apply_model``; SDXL's class embedding from zeros here)."""

    def forge_patch_model(self, target_device=None):
        return self.patch_model()

    def forge_unpatch_model(self, target_device=None):
        self.unpatch_model()

    def apply_model(self, x, t, context, sigma, cond_or_uncond=(0, 1)):
        options = dict(self.model_options["transformer_options"])
        options["cond_or_uncond"] = list(cond_or_uncond)
        options["sigmas"] = torch.full((x.shape[0],), sigma)
        unet = self.model.diffusion_model
        extra = {}
        if unet.num_classes is not None:
            extra["y"] = torch.zeros(x.shape[0], unet.label_emb[0][0].in_features)
        return unet(x, t, context=context, transformer_options=options, **extra)


class NeoUnetSDModel:
    """``p.sd_model`` of a Neo SD1.5 or SDXL job: ``forge_objects.unet`` copied from ``forge_unet_original`` (the
    patcher after the LoRAs, ``forge_objects_after_applying_lora``) before every pass (``webui_host._reset_forge``)."""

    def __init__(self, patcher):
        self.forge_unet_original = patcher
        self.forge_objects = types.SimpleNamespace(unet=patcher)


def neo_unet_model(family: str = "sd15", seed: int = 0) -> NeoUnetSDModel:
    """A Neo SD1.5 or SDXL model: ComfyUI's tiny UNet (``comfy_host``) with the WebUI stand-in's context width."""
    tiny = {"sd15": comfy_host.SD15_TINY, "sdxl": comfy_host.SDXL_TINY}[family]
    config = {"sd15": comfy.supported_models.SD15, "sdxl": comfy.supported_models.SDXL}[family](
        {**tiny, "context_dim": 32}
    )
    config.set_inference_dtype(torch.float32, None)
    model = config.get_model({})
    comfy_host.initialise(model.diffusion_model, seed)
    model.eval()
    return NeoUnetSDModel(NeoUnetPatcher(model, load_device=comfy_host.CPU, offload_device=comfy_host.CPU))


def neo_model(family: str = "flux", **config):
    """A Neo-like patcher over a small random DiT: ComfyUI's ModelPatcher and classes, under Neo's class names where
    Neo's differ (``NEO_CLASSES``)."""
    patcher = comfy_host.tiny_dit(family, **config)
    if family in NEO_CLASSES:
        patcher.model.diffusion_model.__class__ = NEO_CLASSES[family]
    return patcher


class NeoSDModel:
    """``p.sd_model`` of a Neo job: ``forge_objects`` rebuilt from the loaded model before every pass."""

    def __init__(self, patcher):
        self.forge_unet_original = patcher
        self.forge_objects = types.SimpleNamespace(unet=patcher)


def processing(patcher, script_args, steps: int = 28, sampler: str = "Euler", cfg: float = 1.0, refiner=None):
    """A Neo job; ``refiner``: (switch at this sigma, the second model's state dict, its name), Neo's fast refiner
    switch (``modules/sd_samplers_common.py`` ``apply_refiner`` with ``refiner_fast_sd``: the second model's weights
    loaded into the same diffusion model, under the same patcher), as Wan 2.2's low-noise expert takes over."""
    p = webui_host.Processing(NeoSDModel(patcher), script_args)
    p.sampler = sampler
    p.scheduler = "Simple"
    p.neo_steps = steps
    p.neo_cfg = cfg
    p.neo_refiner = refiner
    return p


def process_images(host, p, family: str = "flux", shape=(1, 9, 13), seed: int = 42, passes: int = 1, conditioning=None):
    """A Neo txt2img job: the script hooks around ``sample``; ``passes`` 2: a second pass (the highres pass, here
    at the same size), for which Neo rebuilds ``forge_objects`` and calls ``process_before_every_sampling`` again.
    ``conditioning``: (positive, negative), each ``[context, extras]`` as ComfyUI's CONDITIONING entries (None: a
    tiny DiT's, ``comfy_host.dit_conditioning``)."""
    host.run_hook(p, "before_process")
    host.run_hook(p, "process")
    samples = []
    for number in range(passes):
        p.is_hr_pass = number > 0
        p.sd_model.forge_objects = types.SimpleNamespace(unet=p.sd_model.forge_unet_original)
        host.run_hook(p, "process_before_every_sampling")
        unet = p.sd_model.forge_objects.unet
        samples.append(sample(host, p, unet, family, shape, seed + number, conditioning))
    p.is_hr_pass = False
    host.run_hook(p, "postprocess", samples[-1])  # not in a finally, as in the WebUI
    return samples[0] if passes == 1 else samples


def sample(host, p, patcher, family: str, shape, seed: int, conditioning=None) -> torch.Tensor:
    """One sampling pass on ``patcher``, as Neo's sampler drives the model (see the module docstring)."""
    steps, cfg = p.neo_steps, p.neo_cfg
    sampling = patcher.get_model_object("model_sampling")
    sigmas = comfy.samplers.calculate_sigmas(sampling, "normal", steps)
    batch, *rest = shape
    empty = torch.zeros(batch, comfy_host.DIT_LATENT_CHANNELS.get(family, 16), *rest)
    empty = comfy.sample.fix_empty_latent_channels(patcher, empty)  # as ComfyUI's KSampler (Qwen-Image: a frame axis)
    latent = empty  # the empty latent is not shifted (ComfyUI's CFGGuider; Neo starts from the noise alone)
    noise = comfy.sample.prepare_noise(empty, seed)
    x = sampling.noise_scaling(sigmas[0], noise, latent)
    if conditioning is None:
        (positive,) = comfy_host.dit_conditioning(family, 1)
        (negative,) = comfy_host.dit_conditioning(family, 2, tokens=9)
    else:
        positive, negative = conditioning
    denoiser = webui_host.CFGDenoiser(p)
    denoiser.steps = denoiser.total_steps = steps
    host.state.sampling_steps, host.state.sampling_step = steps, 0
    patcher.patch_model()  # Neo loads the clone for the pass: its object patches applied
    try:
        with torch.no_grad():  # modules/processing.py samples under no_grad
            for i in range(steps):
                sigma, sigma_next = sigmas[i], sigmas[i + 1]
                _apply_refiner(p, patcher, sigma)
                params = webui_host.CFGDenoiserParams(
                    x, None, sigma.expand(batch), i, steps, positive, negative, denoiser
                )
                host.fire("cfg_denoiser", params)
                denoised = _denoise(
                    patcher, family, x, sigma, sigmas, positive, negative, cfg, getattr(p, "forge", False)
                )
                host.fire("cfg_after_cfg", webui_host.AfterCFGCallbackParams(denoised, i, steps))
                denoiser.step += 1
                x = x + (x - denoised) / sigma * (sigma_next - sigma)  # k-diffusion's sample_euler
                host.state.sampling_step = i
    finally:
        patcher.unpatch_model()  # unloaded: the object patches undone
    return patcher.model.process_latent_out(sampling.inverse_noise_scaling(sigmas[-1], x))


def _apply_refiner(p, patcher, sigma) -> None:
    """Neo's ``apply_refiner`` at the start of a denoiser call: past the switch, the refiner named in the infotext
    and its weights loaded into the model in place (its fast switch)."""
    if p.neo_refiner is None or "Refiner" in p.extra_generation_params:
        return
    switch_at, state_dict, name = p.neo_refiner
    if float(sigma) > switch_at:
        return
    p.extra_generation_params["Refiner"] = name
    p.extra_generation_params["Refiner switch at"] = switch_at
    patcher.model.diffusion_model.load_state_dict(state_dict)


def _denoise(patcher, family, x, sigma, sigmas, positive, negative, cfg: float, forge=False) -> torch.Tensor:
    conds = [positive] if cfg == 1.0 else [positive, negative]
    if len(conds) == 2 and positive[0].shape != negative[0].shape:
        raise ValueError("the stand-in batches cond and uncond: give them the same token count")
    context = torch.cat([c[0] for c in conds])
    extra = {}
    for name, value in conds[0][1].items():
        if name == "pooled_output":
            extra["y"] = torch.cat([c[1][name] for c in conds])
        elif name == "guidance":
            extra["guidance"] = torch.full((len(conds) * x.shape[0],), float(value))
    if family in ("lumina2", "z_image"):  # NextDiT's forward takes the caption's token count
        extra["num_tokens"] = context.shape[1]
    xs = torch.cat([x] * len(conds))
    timestep = sigma.expand(xs.shape[0])  # one per batch entry
    options = dict(patcher.model_options.get("transformer_options", {}))
    options.update(cond_or_uncond=list(range(len(conds))), sigmas=timestep)
    if not forge:
        options["sampling_sigmas"] = sigmas  # Neo's sampler sets it; lllyasviel's Forge's does not

    def apply(model_function, call):
        return model_function(call["input"], call["timestep"], **call["c"])

    c = {"c_crossattn": context, "transformer_options": options, **extra}
    wrapper = patcher.model_options.get("model_function_wrapper") or apply
    call = {"input": xs, "timestep": timestep, "c": c, "cond_or_uncond": options["cond_or_uncond"]}
    out = wrapper(patcher.model.apply_model, call)
    if len(conds) == 1:
        return out
    cond, uncond = out.chunk(2)
    return uncond + cfg * (cond - uncond)
