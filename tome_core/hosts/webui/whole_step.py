"""WebUI and Forge wiring of ``reuse_plan``'s forecasts: a skipped step runs no layer, the UNet's call returning the
forecast as its noise or velocity; the rest is ``layer_reuse``'s. The WebUI's UNet gets an instance ``forward`` (a
``WholeStepCall``), Forge's an object patch. docs/step-reuse.md, "A skipped step that runs nothing: the whole output
along ours' line"."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...reuse import WholeStepRun, denoised_of, output_of
from ...schedule import NoiseRange, timestep_of_percent
from . import layer_reuse as webui_layer_reuse
from .layer_reuse import CallBoundary, PassReuse, _activate, _noise_level


def ldm_v_prediction(sd_model) -> bool | None:
    """Whether the WebUI's model predicts the velocity rather than the noise; None for anything else (no forecast)."""
    return {"eps": False, "v": True}.get(getattr(sd_model, "parameterization", "eps"))


# Forge's ``predictor.prediction_type``; its others (edm, const) are not forecast.
_FORGE_PREDICTIONS = {"epsilon": False, "v_prediction": True}
# ComfyUI-style model sampling (reForge, Forge Neo): the class that computes the denoised image names the kind.
_COMFY_PREDICTIONS = {"EPS": False, "V_PREDICTION": True}


def forge_v_prediction(patcher) -> bool | None:
    """As ``ldm_v_prediction`` for Forge's ``patcher`` (k-diffusion sigmas, unit data scale only)."""
    predictor = getattr(getattr(patcher, "model", None), "predictor", None)
    if getattr(predictor, "prediction_type", None) is not None:
        if getattr(predictor, "sigma_data", 1.0) != 1.0:
            return None
        return _FORGE_PREDICTIONS.get(predictor.prediction_type)
    try:
        sampling = patcher.get_model_object("model_sampling")
    except Exception:
        return None
    if getattr(sampling, "sigma_data", 1.0) != 1.0:
        return None
    for cls in type(sampling).__mro__:
        if "calculate_denoised" in cls.__dict__:
            return _COMFY_PREDICTIONS.get(cls.__name__)
    return None


def _call_sigma(params) -> float | None:
    """The k-diffusion sigma of the denoiser call, converted from the DDPM timestep a timestep sampler (DDIM) passes."""
    level = _noise_level(params)
    alphas = getattr(getattr(params, "denoiser", None), "alphas", None)
    if level is None or not isinstance(alphas, torch.Tensor):
        return level
    index = int(level)  # as the denoiser's own ``get_pred_x0`` reads it
    if not 0 <= index < alphas.numel():
        return None
    alpha = float(alphas.flatten()[index])
    return ((1.0 - alpha) / alpha) ** 0.5


class WholeStepPass(PassReuse):
    """One sampling pass of the forecast: a ``PassReuse`` of one "layer", the whole UNet call (``WholeStepRun``)."""

    run_class = WholeStepRun

    def __init__(self, p, schedule, noise_range: NoiseRange, v_prediction: bool):
        super().__init__(p, schedule, 1, noise_range)
        self.v_prediction = v_prediction

    def on_cfg_denoiser(self, params) -> None:
        super().on_cfg_denoiser(params)
        if self.step is not None:
            self.sigma = _call_sigma(params)

    def run_unet_call(self, x, level, layout, sigma: float | None, compute: Callable[[], torch.Tensor]):
        """One UNet call: ``compute()`` where it is computed, else the forecast (``sigma`` None: the denoiser's)."""
        if sigma is not None:
            self.sigma = sigma
        if self.sigma is None or not self.sigma > 0:
            self.step = None  # no noise level to convert at
        self.begin_unet_call(x, level, layout)
        run = self.layer_run()
        if run is None:
            return compute()
        sigma, v_prediction = self.sigma, self.v_prediction

        def latent(like: torch.Tensor) -> torch.Tensor:
            # An inpainting UNet's input carries the mask and image after the latent's channels.
            return x[:, : like.shape[1]].float()

        def denoised(out: torch.Tensor) -> torch.Tensor:
            return denoised_of(out.float(), latent(out), sigma, v_prediction)

        def output(forecast: torch.Tensor) -> torch.Tensor:
            dtype = run.current.entry.shapes[0][1]
            return output_of(forecast, latent(forecast), sigma, v_prediction).to(dtype)

        try:
            out = run.run_call(compute, denoised=denoised, output=output)
        except BaseException:
            self.end_call(failed=True)
            raise
        self.end_call()
        return out


def _max_of(value) -> float | None:
    return None if value is None else float(torch.as_tensor(value).max())


class WholeStepCall(CallBoundary):
    """The UNet's ``forward`` under the forecast (WebUI: an instance attribute; Forge: an object patch)."""

    def __init__(self, owner: WholeStepPass, unet, inner=None, forge: bool = False):
        super().__init__(owner, unet, inner)
        self.forge = forge
        self.ldm = not forge

    def __call__(self, *args, **kwargs):
        owner = self.owner
        x = args[0] if args else kwargs.get("x")
        if self.forge:
            self.stand_down_for_a_wrapper()
            options = kwargs.get("transformer_options") or {}
            sigma = _max_of(options.get("sigmas"))
            level = sigma
            layout = options.get("cond_or_uncond")
            layout = None if layout is None else tuple(layout)
        else:
            sigma = layout = None
            timesteps = args[1] if len(args) > 1 else kwargs.get("timesteps")
            level = None if owner.noise_range.everywhere else _max_of(timesteps)
        if owner.noise_range.everywhere:
            level = None
        return owner.run_unet_call(x, level, layout, sigma, lambda: self.forward(*args, **kwargs))


def install_ldm(unet, settings, p, schedule, v_prediction: bool, num_timesteps: int = 1000) -> WholeStepPass | None:
    """Give the WebUI's ``unet`` the forecast on ``schedule`` for one pass; ``layer_reuse.remove_ldm`` undoes it."""
    webui_layer_reuse.remove_ldm(unet)
    if schedule is None:
        return None
    # The WebUI's UNet receives the DDPM timestep (999 at the start of sampling, 0 at the end).
    noise_range = NoiseRange(
        settings.start_percent, settings.end_percent, lambda q: timestep_of_percent(q, num_timesteps)
    )
    owner = WholeStepPass(p, schedule, noise_range, v_prediction)
    unet.__dict__["forward"] = WholeStepCall(owner, unet, unet.__dict__.get("forward"))
    webui_layer_reuse.register_ldm(unet, owner)
    return owner


def install_forge(patcher, settings, p, percent_to_sigma, schedule, v_prediction: bool) -> WholeStepPass | None:
    """Give Forge's ``patcher`` the forecast on ``schedule`` for one pass; ``layer_reuse.remove_forge`` undoes it."""
    webui_layer_reuse.remove_forge(patcher)
    if schedule is None or not hasattr(patcher, "add_object_patch"):
        return None
    noise_range = webui_layer_reuse.forge_noise_range(settings, percent_to_sigma)
    owner = WholeStepPass(p, schedule, noise_range, v_prediction)
    inner = getattr(patcher, "object_patches", {}).get("diffusion_model.forward")
    unet = patcher.model.diffusion_model
    patcher.add_object_patch("diffusion_model.forward", WholeStepCall(owner, unet, inner, forge=True))
    return _activate(owner)
