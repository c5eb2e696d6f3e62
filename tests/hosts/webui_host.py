"""A small stand-in for the AUTOMATIC1111 WebUI v1.10.1 that runs a job the way the WebUI does.

What is reproduced (file and line numbers of WebUI v1.10.1, tag commit 82a973c):
- Script loading: modules/scripts.py ``load_scripts`` (lines 487-525) puts the extension folder on ``sys.path``
  while loading and imports each ``scripts/*.py`` by file path through modules/script_loading.py ``load_module``
  (``spec_from_file_location(os.path.basename(path), path)``), then registers every ``Script`` subclass.
- Script hooks: modules/scripts.py lines 820-872, every call wrapped in try/except that only reports the error.
- Job order, modules/processing.py:
    ``process_images`` (819-860): ``before_process`` (821) -> built-in token merging applied (841) ->
    ``process_images_inner`` (847) in a ``try`` whose ``finally`` removes the built-in patch (849-850).
    ``process_images_inner`` (863): ``process`` (915) -> per batch ``p.sample`` -> ``postprocess`` (1148) with the
    ``Processed`` result, NOT in a ``finally``: an exception while sampling skips it.
    txt2img ``sample`` (1307): ``process_before_every_sampling`` (1338) -> sampler -> highres checkpoint reload
    (1359-1360) -> ``sample_hr_pass`` (1364): ``is_hr_pass = True`` (1368) -> built-in highres ratio (1442) ->
    ``before_hr`` (1445) -> ``process_before_every_sampling`` (1446) -> sampler -> built-in first-pass ratio back
    (1456) -> ``is_hr_pass = False`` (1463).
- Built-in token merging: modules/sd_models.py ``apply_token_merging`` (1011-1034) with the real tomesd 0.1.3;
  ``get_token_merging_ratio`` of txt2img (modules/processing.py 412-416).
- Forge (lllyasviel/stable-diffusion-webui-forge@dfdcbab): the UNet patcher's list hooks
  (backend/patcher/base.py 161-186: ``set_model_attn1_patch`` ...; ``clone`` 79-84 deep-copies ``model_options``)
  and its object patches (``add_object_patch`` 188-189, applied by ``forge_patch_model`` and undone by
  ``forge_unpatch_model``), loaded before every sampling pass (backend/sampling/sampling_function.py
  ``sampling_prepare`` -> backend/memory_management.py ``load_models_gpu``, which first unloads every loaded
  clone of the same model, ``unload_model_clones`` 552-559, and ``model_unload`` calls ``forge_unpatch_model``);
  the transformer block that calls the hooks (backend/nn/unet.py 180-279: ``forward(x, context,
  transformer_options)``, residual added in place) and the SpatialTransformer that passes the options to it
  (308-321); ``forge_objects`` reset before each pass and ``process_before_every_sampling`` called twice in the
  highres pass (modules/processing.py 1510, 1522).
The sampler is a plain Euler (or Heun) loop over the DDPM schedule the WebUI's k-diffusion wrapper uses, with CFG,
inside the sampler and denoiser bookkeeping that scripts can see (v1.10.1; Forge dfdcbab has the same code):
- modules/sd_samplers_common.py ``launch_sampling``: ``denoiser.steps = steps``, ``denoiser.total_steps =
  config.total_steps(steps)`` (twice the steps for a second-order sampler, ``SamplerData.total_steps``),
  ``state.sampling_steps = steps``, ``state.sampling_step = 0``; ``callback_state`` sets ``state.sampling_step =
  d['i']``, called by k-diffusion's samplers after step i's model calls. ``steps`` is the pass's own step count
  (``p.steps``; ``t_enc + 1`` for img2img and the highres pass, sd_samplers_kdiffusion.py ``sample_img2img``).
- modules/sd_samplers_cfg_denoiser.py ``CFGDenoiser.forward`` (lines 156-311): cond and uncond in one batch, cond
  first (203-205) -> ``cfg_denoiser_callback(CFGDenoiserParams(x_in, image_cond_in, sigma_in, state.sampling_step,
  state.sampling_steps, tensor, uncond, self))`` (211-212) -> one UNet call (249), or one per half when
  ``batch_cond_uncond`` is off (251-255) -> ``cfg_after_cfg_callback`` (306-307) -> ``self.step += 1`` (310).
  ``step`` is reset by the sampler's ``initialize`` before each pass. Forge: the same at lines 183-184, 218-219,
  222, and its sampling_function (backend/sampling/sampling_function.py 253-254) puts ``cond_or_uncond`` and
  ``sigmas`` into the call's ``transformer_options``, which backend/modules/k_model.py line 45 hands to the UNet.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import sys
import traceback
import types
from collections import namedtuple
from pathlib import Path

import tomesd
import torch
from einops import rearrange
from ldm.modules.attention import BasicTransformerBlock, SpatialTransformer
from ldm.modules.diffusionmodules.openaimodel import UNetModel

REPO = Path(__file__).resolve().parents[2]

# --- modules.* stand-ins ----------------------------------------------------------------------------------------


class Script:
    """modules/scripts.py ``Script`` (line 52): the parts a script uses."""

    filename = None
    args_from = None
    args_to = None
    alwayson = False
    is_img2img = False
    infotext_fields = None
    paste_field_names = None

    def title(self):
        raise NotImplementedError()

    def show(self, is_img2img):
        return True

    def before_process(self, p, *args):
        pass

    def process(self, p, *args):
        pass

    def process_before_every_sampling(self, p, *args, **kwargs):
        pass

    def before_hr(self, p, *args):
        pass

    def postprocess(self, p, processed, *args):
        pass

    def elem_id(self, item_id):
        title = "".join(c for c in self.title().lower().replace(" ", "_") if c.isalnum() or c == "_")
        return f"script_{'img2img' if self.is_img2img else 'txt2img'}_{title}_{item_id}"


AlwaysVisible = object()
ScriptClassData = namedtuple("ScriptClassData", ["script_class", "path", "basedir", "module"])


class Callbacks:
    """modules/script_callbacks.py: the callbacks a script registers (``on_model_loaded``, ``on_script_unloaded``,
    ``on_before_ui``, ``on_cfg_denoiser``, ``on_cfg_after_cfg``)."""

    def __init__(self):
        self.model_loaded, self.script_unloaded, self.before_ui = [], [], []
        self.cfg_denoiser, self.cfg_after_cfg = [], []

    def install(self, module):
        module.on_model_loaded = self.model_loaded.append
        module.on_script_unloaded = self.script_unloaded.append
        module.on_before_ui = self.before_ui.append
        module.on_cfg_denoiser = self.cfg_denoiser.append
        module.on_cfg_after_cfg = self.cfg_after_cfg.append


class CFGDenoiserParams:
    """modules/script_callbacks.py ``CFGDenoiserParams`` (v1.10.1; Forge lines 45-69)."""

    def __init__(
        self, x, image_cond, sigma, sampling_step, total_sampling_steps, text_cond, text_uncond, denoiser=None
    ):
        self.x, self.image_cond, self.sigma = x, image_cond, sigma
        self.sampling_step, self.total_sampling_steps = sampling_step, total_sampling_steps
        self.text_cond, self.text_uncond, self.denoiser = text_cond, text_uncond, denoiser


class AfterCFGCallbackParams:
    """modules/script_callbacks.py ``AfterCFGCallbackParams``."""

    def __init__(self, x, sampling_step, total_sampling_steps):
        self.x, self.sampling_step, self.total_sampling_steps = x, sampling_step, total_sampling_steps


class SharedState:
    """modules/shared_state.py ``State``: the fields the samplers keep, and the Interrupt and Skip buttons' flags
    (``begin`` clears them at the start of each job)."""

    sampling_step = 0
    sampling_steps = 0
    interrupted = False
    skipped = False


class InterruptedException(BaseException):
    """modules/sd_samplers_common.py ``InterruptedException``."""


class ImageRNG:
    """modules/rng.py ``ImageRNG`` (v1.6+): the initial noise of a batch, each image's from its own seed's
    generator; ``p.sample`` draws it with ``next()``, so noise drawn again needs a new one from the same seeds."""

    def __init__(self, shape, seeds, subseeds=None, subseed_strength=0.0, seed_resize_from_h=0, seed_resize_from_w=0):
        self.shape = tuple(map(int, shape))
        self.seeds, self.subseeds, self.subseed_strength = seeds, subseeds, subseed_strength
        self.seed_resize_from_h, self.seed_resize_from_w = seed_resize_from_h, seed_resize_from_w
        self.generators = [torch.Generator().manual_seed(int(seed)) for seed in seeds]

    def next(self):
        return torch.cat([torch.randn((1, *self.shape), generator=generator) for generator in self.generators])


class CFGDenoiser:
    """modules/sd_samplers_cfg_denoiser.py ``CFGDenoiser``: the counters and the job a callback can read."""

    def __init__(self, p):
        self.p = p
        self.step = 0  # calls so far in this pass (reset by the sampler's initialize)
        self.last_latent = None
        self.steps = None  # the pass's steps (launch_sampling)
        self.total_steps = None  # the calls the sampler is expected to make


def _module(name, **attrs):
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


class FakeComponent:
    """Enough of a gradio component for ui(): its constructor arguments, ``value`` and the ``change`` events."""

    def __init__(self, *args, **kwargs):
        if args:
            kwargs.setdefault("value", args[0])
        self.kind = type(self).__name__
        self.kwargs = kwargs
        self.value = kwargs.get("value")
        self.label = kwargs.get("label")
        self.changes = []  # (fn, keyword arguments) of each change event

    def change(self, fn, **kwargs):
        self.changes.append((fn, kwargs))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def fake_gradio():
    kinds = ("Checkbox", "Slider", "Radio", "Dropdown", "Accordion", "Row", "Group", "Column", "Markdown")
    components = {kind: type(kind, (FakeComponent,), {}) for kind in kinds}
    return _module("gradio", update=lambda **kwargs: {"__type__": "update", **kwargs}, **components)


class Host:
    """One WebUI process: its ``modules`` stand-ins, the loaded scripts, the console."""

    def __init__(self, with_xyz=False):
        self.callbacks = Callbacks()
        self.state = SharedState()
        self.console: list[str] = []
        self.scripts_data: list = []
        scripts_mod = _module(
            "modules.scripts", Script=Script, AlwaysVisible=AlwaysVisible, scripts_data=self.scripts_data
        )
        callbacks_mod = _module("modules.script_callbacks")
        self.callbacks.install(callbacks_mod)
        self.sd_unet = _module("modules.sd_unet", current_unet=None)
        # modules/shared_options.py: the sampler parameters a sampler reads when the request leaves them unset.
        self.opts = types.SimpleNamespace(
            eta_ddim=0.0, eta_ancestral=1.0, s_churn=0.0, s_tmin=0.0, s_noise=1.0,
            rho=0.0, sigma_min=0.0, sigma_max=0.0, use_old_karras_scheduler_sigmas=False,
        )  # fmt: skip
        shared = _module("modules.shared", opts=self.opts, state=self.state)
        gradio = fake_gradio()
        ui_components = _module("modules.ui_components", InputAccordion=type("InputAccordion", (gradio.Checkbox,), {}))
        self.modules = {
            "modules": _module(
                "modules", scripts=scripts_mod, script_callbacks=callbacks_mod, sd_unet=self.sd_unet, shared=shared
            ),
            "modules.shared": shared,
            "modules.scripts": scripts_mod,
            "modules.script_callbacks": callbacks_mod,
            "modules.sd_unet": self.sd_unet,
            "modules.ui_components": ui_components,
            "gradio": gradio,
        }
        self.xyz = None
        if with_xyz:
            self.xyz = _module("xyz_grid.py", axis_options=[], AxisOption=AxisOption)
            xyz_class = type("Script", (Script,), {"__module__": "xyz_grid.py"})
            self.scripts_data.append(ScriptClassData(xyz_class, "xyz_grid.py", "", self.xyz))
        self.scripts = self._load_scripts()

    def __enter__(self):
        self._depth = getattr(self, "_depth", 0) + 1
        if self._depth == 1:  # re-entrant: a job runs its hooks inside it
            self._saved = {name: sys.modules.get(name) for name in self.modules}
            sys.modules.update(self.modules)
        return self

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth:
            return False
        for name, module in self._saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        return False

    def _load_scripts(self):
        """modules/scripts.py load_scripts (487-525) + script_loading.load_module, for this repository."""
        loaded = []
        with self:
            for path in sorted((REPO / "scripts").glob("*.py")):
                saved_path = sys.path
                sys.path = [str(REPO)] + sys.path
                try:
                    spec = importlib.util.spec_from_file_location(os.path.basename(path), path)
                    module = importlib.util.module_from_spec(spec)
                    spec.loader.exec_module(module)
                finally:
                    sys.path = saved_path
                for value in list(module.__dict__.values()):
                    if isinstance(value, type) and issubclass(value, Script) and value is not Script:
                        self.scripts_data.append(ScriptClassData(value, str(path), str(REPO), module))
                        script = value()
                        script.filename = str(path)
                        loaded.append(script)
        always_on = [s for s in loaded if s.show(False) is AlwaysVisible]
        start = 1  # position 0 of script_args belongs to the script dropdown
        for script in always_on:
            script.alwayson = True
            script.args_from, script.args_to = start, start + _ui_len(script)
            start = script.args_to
        return always_on

    def script(self, title="ToMe Patch"):
        return next(s for s in self.scripts if s.title() == title)

    def ui(self, script=None, is_img2img=False):
        with self:
            return (script or self.script()).ui(is_img2img)

    def fire(self, name, *args):
        with self:
            for callback in getattr(self.callbacks, name):
                callback(*args)

    # modules/scripts.py 820-872: each hook is called for every always-on script and only reported on error.
    def run_hook(self, p, name, *extra, **kwargs):
        with self:
            for script in self.scripts:
                args = p.script_args[script.args_from : script.args_to]
                try:
                    getattr(script, name)(p, *extra, *args, **kwargs)
                except Exception:
                    self.console.append(f"Error running {name}: {script.filename}\n{traceback.format_exc()}")


def _ui_len(script) -> int:
    from tome_core.hosts.webui.args import ARGS

    return len(ARGS) if script.title() == "ToMe Patch" else 0


class AxisOption:
    """scripts/xyz_grid.py ``AxisOption`` (line 214)."""

    def __init__(self, label, type, apply, format_value=None, confirm=None, cost=0.0, choices=None, prepare=None):
        self.label, self.type, self.apply, self.choices = label, type, apply, choices


# --- models -----------------------------------------------------------------------------------------------------


def make_unet(layout="sd1", seed=0) -> UNetModel:
    """A small UNet of the real ldm code with random weights (its zero-initialised output layers re-drawn)."""
    if layout == "sd1":  # attention at levels 1 and 2 (SD1/SD2 have it at 1, 2, 4)
        config = dict(channel_mult=(1, 2), attention_resolutions=(1, 2), transformer_depth=1)
    elif layout == "sd2":  # linear projections in the transformer, as SD2
        config = dict(
            channel_mult=(1, 2), attention_resolutions=(1, 2), transformer_depth=1, use_linear_in_transformer=True
        )
    elif layout == "sdxl":  # no attention at level 1, attention at levels 2 and 4, linear projections
        # (depth 1: this ldm version needs one context per block for deeper transformers, sgm's does not)
        config = dict(
            channel_mult=(1, 2, 4), attention_resolutions=(2, 4), transformer_depth=1, use_linear_in_transformer=True
        )
    else:
        raise ValueError(layout)
    torch.manual_seed(seed)
    unet = UNetModel(
        image_size=32,
        in_channels=4,
        out_channels=4,
        model_channels=32,
        num_res_blocks=1,
        num_head_channels=16,
        use_spatial_transformer=True,
        context_dim=32,
        use_checkpoint=False,
        legacy=False,
        **config,
    ).eval()
    with torch.no_grad():
        for module in unet.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)):
                fan_in = module.weight[0].numel()
                module.weight.normal_(0.0, 1.0 / fan_in**0.5)
                if module.bias is not None:
                    module.bias.normal_(0.0, 0.02)
    return unet


class SDModel(torch.nn.Module):
    """What ``p.sd_model`` is to a script: ``model.diffusion_model`` is the UNet (tomesd patches through it)."""

    def __init__(self, unet):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.diffusion_model = unet


def apply_token_merging(sd_model, ratio):
    """modules/sd_models.py apply_token_merging, v1.10.1 lines 1011-1034."""
    current = getattr(sd_model, "applied_token_merged_ratio", 0)
    if current == ratio:
        return
    if current > 0:
        tomesd.remove_patch(sd_model)
    if ratio > 0:
        tomesd.apply_patch(sd_model, ratio=ratio, use_rand=False, merge_attn=True, merge_crossattn=False)
    sd_model.applied_token_merged_ratio = ratio


# --- sampling ---------------------------------------------------------------------------------------------------

_BETAS = torch.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=torch.float64) ** 2
_ALPHAS_CUMPROD = torch.cumprod(1.0 - _BETAS, dim=0)
SIGMAS = ((1 - _ALPHAS_CUMPROD) / _ALPHAS_CUMPROD).sqrt().float()  # sigma of each DDPM timestep


def sigma_of_percent(percent: float) -> float:
    return float(SIGMAS[round((1.0 - percent) * 999)])


def sample(host, p, apply_model, x, timesteps, cond, uncond):
    """One sampling pass: KDiffusionSampler ``initialize`` and ``launch_sampling``, k-diffusion's Euler or Heun loop
    over the given DDPM timesteps (eps prediction, as the WebUI's CompVis denoiser), and ``callback_state``. The
    Interrupt or Skip button ends it early: ``launch_sampling`` returns the last denoised latent, no error."""
    denoiser = CFGDenoiser(p)  # initialize: step 0
    try:
        return _sample_loop(host, p, denoiser, apply_model, x, timesteps, cond, uncond, p.cfg_scale)
    except InterruptedException:
        return denoiser.last_latent


def _sample_loop(host, p, denoiser, apply_model, x, timesteps, cond, uncond, cfg):
    steps = len(timesteps)
    denoiser.steps = steps  # launch_sampling
    # The highres pass samples with ``hr_sampler_name or sampler_name`` (modules/processing.py sample_hr_pass).
    heun = ((p.hr_sampler_name if p.is_hr_pass else None) or p.sampler) == "Heun"
    denoiser.total_steps = steps * 2 if heun else steps
    host.state.sampling_steps = steps
    host.state.sampling_step = 0
    sigmas = [float(SIGMAS[t]) for t in timesteps] + [0.0]
    for i, t in enumerate(timesteps):
        if p.on_step is not None:
            p.on_step(p, i)
        sigma, sigma_next = sigmas[i], sigmas[i + 1]
        # Prompt editing ("[a:b:when]"): the WebUI rebuilds the cond batch at every step, switching at ``when``.
        edit = p.prompt_edit
        step_cond = (edit[1] if edit is not None and i >= edit[0] else cond).clone()
        denoised = cfg_denoise(host, p, denoiser, apply_model, x, t, sigma, step_cond, uncond, cfg)
        d = (x - denoised) / sigma
        if heun and sigma_next > 0:  # k-diffusion sample_heun: a second call at the next sigma
            x_2 = x + d * (sigma_next - sigma)
            denoised_2 = cfg_denoise(
                host, p, denoiser, apply_model, x_2, timesteps[i + 1], sigma_next, step_cond, uncond, cfg
            )
            d = (d + (x_2 - denoised_2) / sigma_next) / 2
        x = x + d * (sigma_next - sigma)
        host.state.sampling_step = i  # callback_state, after the step's model calls
    return x


def cfg_denoise(host, p, denoiser, apply_model, x, t, sigma, cond, uncond, cfg):
    """CFGDenoiser.forward (lines 156-311), reduced: cond first, then uncond."""
    if host.state.interrupted or host.state.skipped:  # CFGDenoiser.forward, first lines
        raise InterruptedException
    batch = x.shape[0]
    x_in = torch.cat([x, x])
    sigma_in = torch.full((2 * batch,), sigma)
    state = host.state
    params = CFGDenoiserParams(x_in, None, sigma_in, state.sampling_step, state.sampling_steps, cond, uncond, denoiser)
    host.fire("cfg_denoiser", params)  # 211-212
    x_in = x_in / (sigma**2 + 1) ** 0.5
    t_in = torch.full((2 * batch,), float(t))
    context = torch.cat([cond, uncond])
    if p.batch_cond_uncond:  # 249
        out = apply_model(x_in, t_in, context, sigma, [0, 1])
    else:  # 251-255: the cond half, then the uncond half
        out = torch.cat(
            [
                apply_model(x_in[a : a + batch], t_in[a : a + batch], context[a : a + batch], sigma, [a // batch])
                for a in (0, batch)
            ]
        )
    eps_cond, eps_uncond = out.chunk(2)
    denoised = x - (eps_uncond + cfg * (eps_cond - eps_uncond)) * sigma
    host.fire("cfg_after_cfg", AfterCFGCallbackParams(denoised, host.state.sampling_step, host.state.sampling_steps))
    denoiser.last_latent = denoised  # the sampler's ``last_latent``
    denoiser.step += 1  # 310
    return denoised


class Processing:
    """The parts of StableDiffusionProcessingTxt2Img (modules/processing.py) a script and the job order use."""

    @property
    def sampler_name(self) -> str:
        """The WebUI's label of the job's sampler (``p.sampler_name``), which this host's loop runs."""
        return self.sampler

    def __init__(self, sd_model, script_args, *, seed=1234, enable_hr=False, hr_sd_model=None, size=8, batch_size=1):
        self.sd_model = sd_model
        self.hr_sd_model = hr_sd_model  # highres checkpoint (line 1360 reloads it); None: same model
        self.script_args = [0, *script_args]
        self.seed = seed
        self.batch_size = batch_size
        self.all_seeds = [seed + i for i in range(batch_size)]
        self.seeds = list(self.all_seeds)
        self.subseeds = list(self.all_seeds)
        self.subseed_strength = 0.0
        self.rng = None  # the batch's ImageRNG, made by process_images_inner before ``sample``
        self.cfg_scale = 5.0
        self.enable_hr = enable_hr
        self.is_hr_pass = False
        self.extra_generation_params = {}
        self.comments = {}
        self.token_merging_ratio = 0.0
        self.token_merging_ratio_hr = 0.0
        self.size = size
        self.steps = (999, 749, 499)
        self.hr_steps = (599, 299)
        self.on_step = None  # test probe: called at each sampler step with (p, step)
        self.sampler = "Euler"  # or "Heun" (second order: two model calls per step but the last)
        # The schedule type (v1.9+: "Automatic", "Karras", ...): read by scripts; this host's loop keeps its sigmas.
        self.scheduler = "Automatic"
        # The highres pass's own sampler and schedule type (None: the first pass's; v1.10 Txt2Img processing).
        self.hr_sampler_name = None
        self.hr_scheduler = None
        self.prompt_edit = None  # (step, cond): prompt editing switches to ``cond`` from that step on
        self.batch_cond_uncond = True  # Settings > Optimizations "Batch cond/uncond" (shared.opts.batch_cond_uncond)
        self.forge_objects_after_applying_lora = None
        # The request's sampler parameters (None: the settings'); this host's loop adds no noise whatever they are.
        self.eta = None
        self.s_churn = None
        # An API request's options for this job only (``set_config`` in ``process_images``, restored after it).
        self.override_settings = {}
        self.extra_result_images = []  # v1.8+: images a script adds to the gallery while processing
        self.processed_extra_images = True  # False: a WebUI before v1.8 (no ``Processed.extra_images``)
        self.processed = None  # what ``process_images`` returned (a ``Processed``), for the tests

    def comment(self, text):
        self.comments[text] = 1

    def sample(self, conditioning, unconditional_conditioning, seeds, subseeds, subseed_strength, prompts):
        """txt2img ``sample`` (1307-1362): the initial noise from ``self.rng`` (v1.6+; ``seeds`` is not read)."""
        return _sample(self.host, self, self.rng.next(), conditioning, unconditional_conditioning)

    def get_token_merging_ratio(self, for_hr=False):  # lines 412-416 (options folded into the fields)
        if for_hr:
            return self.token_merging_ratio_hr or self.token_merging_ratio
        return self.token_merging_ratio


def _ldm_apply_model(sd_model):
    unet = sd_model.model.diffusion_model

    def apply_model(x, t, context, sigma, cond_or_uncond):
        return unet(x, t, context=context)  # ldm's DiffusionWrapper

    return apply_model


def process_images(host: Host, p: Processing):
    """modules/processing.py process_images (819-861) and process_images_inner (863-1150), reduced."""
    host.run_hook(p, "before_process")  # 821
    stored = {name: getattr(host.opts, name) for name in p.override_settings}
    try:
        vars(host.opts).update(p.override_settings)  # set_config(p.override_settings), after before_process
        apply_token_merging(p.sd_model, p.get_token_merging_ratio())  # 841
        result = _process_images_inner(host, p)  # 847
    finally:
        apply_token_merging(p.sd_model, 0)  # 849-850
        vars(host.opts).update(stored)  # the options restored
    return result


def _process_images_inner(host, p):
    host.state.interrupted = host.state.skipped = False  # state.begin
    host.run_hook(p, "process")  # 915
    # The prompt's conditioning: drawn after the first seed's noise from its generator, the same for every image.
    generator = torch.Generator().manual_seed(p.seed)
    torch.randn(1, 4, p.size, p.size, generator=generator)
    cond = torch.randn(1, 5, 32, generator=generator).expand(p.batch_size, -1, -1)
    uncond = torch.zeros(p.batch_size, 5, 32)
    p.host = host
    p.rng = ImageRNG((4, p.size, p.size), p.seeds, subseeds=p.subseeds, subseed_strength=p.subseed_strength)
    samples = p.sample(  # process_images_inner, once per batch
        conditioning=cond, unconditional_conditioning=uncond, seeds=p.seeds, subseeds=p.subseeds,
        subseed_strength=p.subseed_strength, prompts=[""] * p.batch_size,
    )  # fmt: skip
    p.processed = Processed(p, samples)
    host.run_hook(p, "postprocess", p.processed)  # 1148, not in a finally
    return samples


class Processed:
    """modules/processing.py ``Processed`` as a script's ``postprocess`` gets it: the gallery's ``images`` (here the
    latents of the batch, one per image) with one infotext each, and (v1.8+) ``extra_images``, ``p.extra_result_images``
    at its making, which the txt2img and img2img tabs show after the images (modules/txt2img.py returns
    ``processed.images + processed.extra_images``) and do not save; ``p.processed_extra_images`` False: a WebUI
    before v1.8, without them."""

    def __init__(self, p, samples):
        self.images = [sample for sample in samples]
        self.infotexts = [str(p.extra_generation_params)] * len(self.images)
        if p.processed_extra_images:
            self.extra_images = p.extra_result_images


def _sample(host, p, noise, cond, uncond):
    """txt2img sample (1307-1362) and sample_hr_pass (1364-1464)."""
    _reset_forge(p)
    host.run_hook(p, "process_before_every_sampling", x=noise, noise=noise, c=cond, uc=uncond)  # 1338
    samples = sample(host, p, _apply_model(p), noise * float(SIGMAS[p.steps[0]]), p.steps, cond, uncond)
    if not p.enable_hr:
        return samples
    if p.hr_sd_model is not None:  # 1359-1360: the highres checkpoint is loaded
        p.sd_model = p.hr_sd_model
        host.fire("model_loaded", p.sd_model)
    p.is_hr_pass = True  # 1368
    latent = torch.nn.functional.interpolate(samples, scale_factor=2, mode="nearest")
    hr_noise = ImageRNG(latent.shape[1:], p.seeds, subseeds=p.subseeds, subseed_strength=p.subseed_strength).next()
    apply_token_merging(p.sd_model, p.get_token_merging_ratio(for_hr=True))  # 1442
    host.run_hook(p, "before_hr")  # 1445
    host.run_hook(p, "process_before_every_sampling", x=latent, noise=hr_noise, c=cond, uc=uncond)  # 1446
    if _is_forge(p):  # Forge: reset, then the hook a second time (forge modules/processing.py 1518-1522)
        _reset_forge(p)
        host.run_hook(p, "process_before_every_sampling", x=latent, noise=hr_noise, c=cond, uc=uncond)
    start = latent + hr_noise * float(SIGMAS[p.hr_steps[0]])
    samples = sample(host, p, _apply_model(p), start, p.hr_steps, cond, uncond)
    apply_token_merging(p.sd_model, p.get_token_merging_ratio())  # 1456
    p.is_hr_pass = False  # 1463
    return samples


# --- Forge ------------------------------------------------------------------------------------------------------


def _is_forge(p):
    return getattr(p.sd_model, "forge_objects", None) is not None


def _reset_forge(p):
    if _is_forge(p):  # forge modules/processing.py 1373 / 1518: a fresh copy before every pass
        p.sd_model.forge_objects = types.SimpleNamespace(unet=p.sd_model.forge_unet_original)


def _apply_model(p):
    if not _is_forge(p):
        return _ldm_apply_model(p.sd_model)
    patcher = p.sd_model.forge_objects.unet
    forge_load_models_gpu(patcher)  # sampling_prepare at the start of each pass (sd_samplers_kdiffusion.py 138)

    def apply_model(x, t, context, sigma, cond_or_uncond):
        return patcher.apply_model(x, t, context, sigma, cond_or_uncond)

    return apply_model


class ForgeLikeBlock(BasicTransformerBlock):
    """A transformer block that calls the patch lists as Forge's does (backend/nn/unet.py 180-279)."""

    def forward(self, x, context=None, transformer_options={}):  # noqa: B006 (Forge's signature)
        return self._forward(x, context, transformer_options)

    def _forward(self, x, context=None, transformer_options={}):  # noqa: B006
        extra_options = {k: v for k, v in transformer_options.items() if k != "patches"}
        patches = transformer_options.get("patches", {})
        n = self.norm1(x)
        context_attn1 = value_attn1 = None
        if "attn1_patch" in patches:
            context_attn1 = value_attn1 = n
            for patch in patches["attn1_patch"]:
                n, context_attn1, value_attn1 = patch(n, context_attn1, value_attn1, extra_options)
        # Forge's attention takes the values separately; the ldm one uses context for both (they are the same).
        assert value_attn1 is context_attn1
        n = self.attn1(n, context=context_attn1)
        for patch in patches.get("attn1_output_patch", []):
            n = patch(n, extra_options)
        x += n  # in place, as Forge's block does
        n = self.norm2(x)
        context_attn2 = context
        for patch in patches.get("attn2_patch", []):
            n, context_attn2, _ = patch(n, context_attn2, context_attn2, extra_options)
        n = self.attn2(n, context=context_attn2)
        for patch in patches.get("attn2_output_patch", []):
            n = patch(n, extra_options)
        x += n
        x_skip = x
        x = self.ff(self.norm3(x))
        x += x_skip
        return x


class ForgeLikeSpatialTransformer(SpatialTransformer):
    """Forge's SpatialTransformer (backend/nn/unet.py 308-327): passes the call's options to every block. (The ldm
    UNet around it does not pass options down, so the patcher hands them to each transformer before the call.)"""

    def forward(self, x, context=None):
        options = self.forge_transformer_options
        if not isinstance(context, list):
            context = [context] * len(self.transformer_blocks)
        b, c, h, w = x.shape
        x_in = x
        x = self.norm(x)
        if not self.use_linear:
            x = self.proj_in(x)
        x = rearrange(x, "b c h w -> b (h w) c").contiguous()
        if self.use_linear:
            x = self.proj_in(x)
        for i, block in enumerate(self.transformer_blocks):
            options["block_index"] = i
            options["block"] = self.forge_block_name
            x = block(x, context=context[i], transformer_options=options)
        if self.use_linear:
            x = self.proj_out(x)
        x = rearrange(x, "b (h w) c -> b c h w", h=h, w=w).contiguous()
        if not self.use_linear:
            x = self.proj_out(x)
        return x + x_in


def _get_attr(obj, name):
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _set_attr_raw(obj, name, value):  # backend/utils.py set_attr_raw (57-61)
    *path, last = name.split(".")
    for part in path:
        obj = getattr(obj, part)
    setattr(obj, last, value)


_forge_loaded: list = []  # backend/memory_management.py current_loaded_models


def forge_load_models_gpu(patcher):
    """backend/memory_management.py load_models_gpu (614-700) for one patcher on the CPU: nothing to do if it is
    loaded; else every loaded clone of the same model is unloaded (its object patches undone) and it is patched."""
    if any(loaded is patcher for loaded in _forge_loaded):
        return
    for loaded in [m for m in _forge_loaded if m.is_clone(patcher)]:
        _forge_loaded.remove(loaded)
        loaded.forge_unpatch_model()
    patcher.forge_patch_model()
    if hasattr(patcher, "refresh_loras"):  # LoadedModel.model_load (488-518): the LoRAs merged after the patches
        patcher.refresh_loras()
    _forge_loaded.insert(0, patcher)


class ForgeLoraLoader:
    """backend/patcher/lora.py ``LoraLoader`` (344-460), one per model (``model.lora_loader``, base.py 63-66):
    ``refresh`` does nothing when the patchers' LoRA identifiers are the ones merged; else it puts back the weights
    it kept in ``backup`` and merges each key's patches into the weight in place, keeping the weight it replaced
    (the offline mode; only the "diff" patch type, ``weight * strength_model + strength_patch * diff``)."""

    def __init__(self, model):
        self.model = model
        self.backup = {}
        self.loaded_hash = str([])

    def refresh(self, lora_patches):
        hashes = str(list(lora_patches.keys()))
        if hashes == self.loaded_hash:
            return
        for key, weight in self.backup.items():
            _set_attr_raw(self.model, key, torch.nn.Parameter(weight, requires_grad=False))
        self.backup = {}
        merged = {}
        for patches in lora_patches.values():
            for key, entries in patches.items():
                merged[key] = merged.get(key, []) + entries
        for key, entries in merged.items():
            weight = _get_attr(self.model, key)
            self.backup.setdefault(key, weight.detach().clone())
            value = weight.detach().float()
            for strength_patch, patch, strength_model, _offset, _function in entries:
                kind, (diff,) = patch
                assert kind == "diff"
                value = value * strength_model + strength_patch * diff.float()
            _set_attr_raw(self.model, key, torch.nn.Parameter(value.to(weight.dtype), requires_grad=False))
        self.loaded_hash = hashes


class ForgePatcher:
    """Forge's UnetPatcher as far as patches go (backend/patcher/base.py 79-205, 241-271), and its LoRA patches
    (``add_patches`` 91-117: ``lora_patches[(filename, strength_patch, strength_model, online_mode)]`` -> key ->
    entries; ``refresh_loras`` 125-127, called when the patcher is loaded for sampling)."""

    def __init__(self, unet):
        self.model = types.SimpleNamespace(
            diffusion_model=unet, predictor=types.SimpleNamespace(percent_to_sigma=sigma_of_percent)
        )
        self.model.lora_loader = ForgeLoraLoader(self.model)
        self.lora_patches = {}
        self.model_options = {"transformer_options": {}}
        self.object_patches = {}
        self.object_patches_backup = {}
        self.transformers = []
        for name, module in unet.named_modules():
            if type(module) is BasicTransformerBlock:
                module.__class__ = ForgeLikeBlock
            elif type(module) is SpatialTransformer:
                module.__class__ = ForgeLikeSpatialTransformer
                # Forge's UNet forward names the block of each call (unet.py 710, 726, 734).
                part, number = name.split(".")[:2]
                kind = {"input_blocks": "input", "middle_block": "middle", "output_blocks": "output"}[part]
                module.forge_block_name = (kind, 0 if kind == "middle" else int(number))
                self.transformers.append(module)

    def clone(self):
        clone = copy.copy(self)
        clone.model_options = copy.deepcopy(self.model_options)
        clone.object_patches = self.object_patches.copy()
        clone.object_patches_backup = {}
        clone.lora_patches = self.lora_patches.copy()
        return clone

    def add_patches(self, *, filename, patches, strength_patch=1.0, strength_model=1.0, online_mode=False):
        """base.py 91-117: the keys of ``patches`` that are the model's parameters, under this LoRA's identifier."""
        names = {name for name, _ in self.model.diffusion_model.named_parameters()}
        ours = {key: [[strength_patch, patch, strength_model, None, None]] for key, patch in patches.items()
                if key.removeprefix("diffusion_model.") in names}  # fmt: skip
        self.lora_patches[(filename, strength_patch, strength_model, online_mode)] = ours
        return set(ours)

    def refresh_loras(self):
        self.model.lora_loader.refresh(self.lora_patches)

    def is_clone(self, other):
        return getattr(other, "model", None) is self.model

    def set_model_patch(self, patch, name):
        patches = self.model_options["transformer_options"].setdefault("patches", {})
        patches[name] = patches.get(name, []) + [patch]

    def set_model_attn1_patch(self, patch):
        self.set_model_patch(patch, "attn1_patch")

    def set_model_attn1_output_patch(self, patch):
        self.set_model_patch(patch, "attn1_output_patch")

    def set_model_attn2_patch(self, patch):
        self.set_model_patch(patch, "attn2_patch")

    def set_model_attn2_output_patch(self, patch):
        self.set_model_patch(patch, "attn2_output_patch")

    def add_object_patch(self, name, obj):
        self.object_patches[name] = obj

    def get_model_object(self, name):
        if name in self.object_patches:
            return self.object_patches[name]
        if name in self.object_patches_backup:
            return self.object_patches_backup[name]
        return _get_attr(self.model, name)

    def forge_patch_model(self, target_device=None):
        for name, item in self.object_patches.items():
            old = _get_attr(self.model, name)
            if name not in self.object_patches_backup:
                self.object_patches_backup[name] = old
            _set_attr_raw(self.model, name, item)
        return self.model

    def forge_unpatch_model(self, target_device=None):
        for name, old in self.object_patches_backup.items():
            _set_attr_raw(self.model, name, old)
        self.object_patches_backup = {}

    def apply_model(self, x, t, context, sigma, cond_or_uncond=(0, 1)):
        # Forge's sampling_function copies the options per call and sets which conds the batch holds and the sigmas
        # (sampling_function.py 253-254); KModel.apply_model hands them to the UNet (k_model.py 45); its UNet forward
        # sets the original shape (unet.py 697).
        options = dict(self.model_options["transformer_options"])
        options["cond_or_uncond"] = list(cond_or_uncond)
        options["sigmas"] = torch.full((x.shape[0],), sigma)
        options["original_shape"] = list(x.shape)
        for transformer in self.transformers:
            transformer.forge_transformer_options = options
        return self.model.diffusion_model(x, t, context=context, transformer_options=options)


class ForgeSDModel(torch.nn.Module):
    """``p.sd_model`` on Forge: ``forge_objects.unet`` is the patcher, reset before every sampling pass."""

    def __init__(self, unet):
        super().__init__()
        self.forge_unet_original = ForgePatcher(unet)
        self.forge_objects = types.SimpleNamespace(unet=self.forge_unet_original)


class ControlNetUnit:
    """sd-webui-controlnet's ``ControlNetUnit`` (internal_controlnet/args.py; Forge's built-in ControlNet has the
    same fields) as far as its step range goes: ``Script.get_enabled_units`` reads the units from the ControlNet
    script's part of ``p.script_args``, and hook.py's ``guidance_schedule_handler`` (a ``cfg_denoiser`` callback)
    stops a unit at the steps whose ``sampling_step / total_sampling_steps`` lie outside ``guidance_start`` -
    ``guidance_end``. This stand-in's loop applies no control."""

    def __init__(self, enabled=True, guidance_start=0.0, guidance_end=1.0, module="none", model="None"):
        self.enabled, self.guidance_start, self.guidance_end = enabled, guidance_start, guidance_end
        self.module, self.model = module, model


# --- helpers for the tests --------------------------------------------------------------------------------------


def script_args(enabled=True, **values) -> list:
    """Positional args of the script (UI/API order, UI values such as "ToDo" or "auto"): the defaults, on,
    reducing at any size, method ToMe and reuse across steps off unless given (most paths under test are the token
    reduction's, ToMe's; the shipped defaults, ToDo 2 with reuse every 3, are checked where defaults are the
    subject), with ``values``."""
    from tome_core.hosts.webui import args as webui_args

    values.setdefault("skip_when_slower", False)
    values.setdefault("method", "ToMe")
    values.setdefault("reuse_interval", 1)
    args = webui_args.as_list(webui_args.defaults())
    for name, value in {"enabled": enabled, **values}.items():
        args[webui_args.ARG_NAMES.index(name)] = value
    webui_args.parse_args(args)  # a test must not pass what the script would reject
    return args


def run_job(host: Host, sd_model, args, **kwargs):
    """One generation through the host; returns the final latent and the processing object. Keyword arguments
    that are not Processing's own set attributes (token_merging_ratio, on_step, ...)."""
    settable = (
        *("token_merging_ratio", "token_merging_ratio_hr", "on_step", "steps", "hr_steps", "sampler", "scheduler"),
        *("hr_sampler_name", "hr_scheduler", "prompt_edit", "eta", "s_churn", "override_settings", "cfg_scale"),
        "processed_extra_images",
    )
    attributes = {k: kwargs.pop(k) for k in list(kwargs) if k in (*settable, "batch_cond_uncond")}
    p = Processing(sd_model, args, **kwargs)
    for name, value in attributes.items():
        setattr(p, name, value)
    with torch.no_grad(), host:  # the WebUI's modules stay importable for the whole job
        samples = process_images(host, p)
    return samples, p
