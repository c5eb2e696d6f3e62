"""The WebUI's and Forge's front door: what each sampling pass gets (a UNet's token reduction and reuse, a DiT's
family default, or nothing, with one console line), and the removal that leaves no patch behind. The script calls
``start_job`` at ``before_process``, ``patch_for_pass`` at ``process_before_every_sampling`` (every pass) and
``end_reuse_pass`` / ``remove_everywhere`` at ``postprocess``. docs/how-it-works.md, 'AUTOMATIC1111 WebUI'."""

from __future__ import annotations

from ...reducer import Reducer
from ...reuse import FORECAST, FULL, REUSE_PLANS
from ..shared.model_patcher import NotAUNetError, patched_clone
from ..shared.unet_layout import attention_levels
from . import args as webui_args
from . import calibrate as webui_calibrate
from . import dit_reuse as webui_dit_reuse
from . import layer_reuse as webui_layer_reuse
from . import ldm_patch
from . import whole_step as webui_whole_step

TITLE = "ToMe Patch"
JOB = "_tome_patch_job"  # per-job state on the processing object
OVERRIDES = "_tome_patch_overrides"  # X/Y/Z plot axis values on the processing object


def _console(message: str) -> None:
    print(f"[{TITLE}] {message}")


class Job:
    # A plain class: the WebUI imports scripts without registering them in sys.modules, where a dataclass
    # with string annotations would look its module up.
    def __init__(self, args: webui_args.ScriptArgs | None):
        self.args = args
        self.warned: set[str] = set()
        self.infotext_written = False
        self.reuse_runs: list = []
        self.dit_family: str | None = None  # the DiT family whose default a pass ran (Forge Neo), for the infotext
        self.calibration = None  # reuse_plan "calibrated" (``calibrate.JobCalibration``)

    def warn_once(self, message: str) -> None:
        if message not in self.warned:
            self.warned.add(message)
            _console(message)

    def say(self, message: str) -> None:
        _console(message)


def _unet_of(sd_model):
    return getattr(getattr(sd_model, "model", None), "diffusion_model", None)


def remove_everywhere(sd_model=None) -> None:
    """Leave no patch of ours on any UNet: those we patched, and ``sd_model``'s (it may be a reloaded object)."""
    webui_layer_reuse.end_pass()
    ldm_patch.remove_all()
    unet = _unet_of(sd_model)
    if unet is not None and hasattr(unet, "modules"):
        ldm_patch.remove_patch(unet)


def _builtin_ratio(p, is_hr_pass: bool) -> float:
    """The built-in token merging ratio in force for this pass (0 when off)."""
    # The WebUI records what apply_token_merging applied; Forge has only p.get_token_merging_ratio.
    ratios = [getattr(p.sd_model, "applied_token_merged_ratio", 0) or 0]
    try:
        ratios.append(p.get_token_merging_ratio(for_hr=is_hr_pass) or 0)
    except Exception:  # an old or unusual processing object: rely on the applied ratio alone
        pass
    return max(float(r) for r in ratios)


def _job_seed(p) -> int:
    for name in ("seeds", "all_seeds"):
        seeds = getattr(p, name, None)
        if seeds:
            return int(seeds[0])
    return int(getattr(p, "seed", 0) or 0)


def _tensorrt_active() -> bool:
    try:
        from modules import sd_unet
    except ImportError:
        return False
    return getattr(sd_unet, "current_unet", None) is not None


def _forge_percent_to_sigma(unet_patcher):
    predictor = getattr(getattr(unet_patcher, "model", None), "predictor", None)  # Forge backend KModel
    if predictor is not None and hasattr(predictor, "percent_to_sigma"):
        return predictor.percent_to_sigma
    try:  # reForge keeps ComfyUI's model_sampling object
        return unet_patcher.get_model_object("model_sampling").percent_to_sigma
    except Exception:
        return None


def start_job(p, args) -> Job:
    """Read the script's args for this job (UI, API or X/Y/Z plot); on bad input report it once and do nothing."""
    try:
        parsed = webui_args.parse_args(args)
        parsed = webui_args.with_overrides(parsed, getattr(p, OVERRIDES, None) or {})
    except ValueError as err:
        message = f"{err}. This generation runs without it."
        _console(message)
        if hasattr(p, "comment"):
            p.comment(message)
        job = Job(None)
    else:
        job = Job(parsed if parsed.enabled else None)
    setattr(p, JOB, job)
    args = job.args
    if args is not None and args.reuse_interval > 1 and REUSE_PLANS[args.reuse_plan].calibrates:
        webui_calibrate.install(p, job)  # A1111's ldm UNet, Forge's and Neo's UNets and DiTs
    return job


def end_job(p, job: Job | None) -> None:
    """The job is over: its last pass ends and ``p.sample`` is the WebUI's own again."""
    end_reuse_pass(job)
    if job is not None:
        webui_calibrate.uninstall(p, job)


def end_reuse_pass(job: Job | None) -> None:
    """Finish the reuse across steps of the pass before (its run is dropped) and log what it did."""
    run = webui_layer_reuse.end_pass()
    if run is not None and job is not None:
        job.reuse_runs.append(run)
        _console(f"reuse across steps: {run.summary()}")


def patch_for_pass(p, job: Job, latent=None) -> None:
    """Patch this pass of job ``p`` (``latent``: the hook's ``x``, the noise it starts from, for the key)."""
    end_reuse_pass(job)
    is_hr_pass = bool(getattr(p, "is_hr_pass", False))
    sd_model = p.sd_model
    forge_objects = getattr(sd_model, "forge_objects", None)
    if forge_objects is None:
        remove_everywhere(sd_model)  # the previous pass's patch, maybe on another checkpoint
    if job.args is None:
        return
    settings = job.args.settings_for_pass(is_hr_pass, _job_seed(p))
    if settings is None:
        return
    if _builtin_ratio(p, is_hr_pass) > 0:
        job.warn_once(
            "the built-in token merging (Settings > Optimizations) is on for this pass; ToMe Patch leaves the pass "
            "to it. Set the built-in ratio to 0 to use ToMe Patch."
        )
        return
    if forge_objects is not None:
        patched = _patch_forge(p, forge_objects, settings, job, latent)
    else:
        patched = _patch_ldm(p, sd_model, settings, job, latent)
    if patched and not job.infotext_written:
        if job.dit_family is not None:
            params = webui_args.dit_infotext_params(job.args, job.dit_family)
        else:
            params = webui_args.infotext_params(job.args)
        p.extra_generation_params.update(params)
        job.infotext_written = True


def _unreduced(settings):
    """``settings`` with ToDo and ToMe off (reuse as set): a pass "calibrated" runs without its token reduction."""
    return settings.replace(ratio=0.0, downsample_factor=1.0)


def _patch_ldm(p, sd_model, settings, job: Job, latent=None) -> bool:
    unet = _unet_of(sd_model)
    if unet is None or not hasattr(unet, "named_modules"):
        job.warn_once(f"this model ({type(sd_model).__name__}) has no UNet to patch; generating without it.")
        return False
    if _tensorrt_active():
        job.warn_once("a TensorRT UNet is active and bypasses the transformer blocks; generating without it.")
        return False
    try:
        reduced = ldm_patch.install_patch(unet, settings)  # False where the token reduction does nothing
    except ldm_patch.UnsupportedModelError as err:
        job.warn_once(f"not applied: {err}.")
        return False
    decision = _decision(p, settings, job)
    v_prediction = webui_whole_step.ldm_v_prediction(sd_model)
    if decision.runs == FORECAST and v_prediction is not None:
        schedule = decision.schedule
        calibrates = REUSE_PLANS[settings.reuse_plan].calibrates
        if calibrates:
            fingerprints = webui_calibrate.ldm_fingerprints(unet)
            schedule, reduce = webui_calibrate.schedule_for_pass(
                p, job, settings, decision, fingerprints, latent, reduced
            )
            if reduced and not reduce:  # the calibration's reference, a candidate or a plan kept without them
                reduced = ldm_patch.install_patch(unet, _unreduced(settings))
        # A calibrating job's own pass runs every step; its infotext still says "calibrated".
        reusing = webui_whole_step.install_ldm(unet, settings, p, schedule, v_prediction) is not None or calibrates
    else:
        layers = decision.fallback or decision
        schedule = webui_layer_reuse.schedule_for(settings, unet, layers)
        reusing = webui_layer_reuse.install_ldm(unet, settings, p, schedule, layers.full_below) is not None
    return reduced or reusing


def _decision(p, settings, job: Job):
    """The pass's decision (``plans.decide``), with one warning where it runs every step though reuse is asked."""
    decision = webui_layer_reuse.decision_for(settings, p)
    if settings.reuse_interval > 1 and decision.runs == FULL:
        job.warn_once(
            f"reuse across steps is off: {decision.why}; every step runs in full, the token reduction still applies."
        )
    return decision


def _patch_forge(p, forge_objects, settings, job: Job, latent=None) -> bool:
    unet = forge_objects.unet
    percent_to_sigma = _forge_percent_to_sigma(unet)
    if percent_to_sigma is None:
        if settings.start_percent > 0 or settings.end_percent < 1:
            job.warn_once("this Forge version exposes no sampling schedule; reducing at every step instead.")
        settings = settings.replace(start_percent=0.0, end_percent=1.0)
    try:
        clone = patched_clone(unet, settings, percent_to_sigma)
    except NotAUNetError as err:
        return _patch_dit(p, forge_objects, settings, percent_to_sigma, job, str(err), latent)
    # The step comes from the WebUI's callbacks: its samplers never run a ComfyUI-style sampler wrapper.
    decision = _decision(p, settings, job)
    v_prediction = webui_whole_step.forge_v_prediction(clone)
    if decision.runs == FORECAST and v_prediction is not None:
        schedule = decision.schedule
        if REUSE_PLANS[settings.reuse_plan].calibrates:  # keyed by the job's own patcher, LoRAs in, ours not
            fingerprints = webui_calibrate.forge_fingerprints(unet, v_prediction)
            reduces = _forge_reduces(clone, settings)
            schedule, reduce = webui_calibrate.schedule_for_pass(
                p, job, settings, decision, fingerprints, latent, reduces
            )
            if reduces and not reduce:  # the calibration's reference, a candidate or a plan kept without them
                clone = patched_clone(unet, _unreduced(settings), percent_to_sigma)
        # None (a calibrating job's own pass, or a kept plan of every step): every step in full.
        webui_whole_step.install_forge(clone, settings, p, percent_to_sigma, schedule, v_prediction)
    else:
        layers = decision.fallback or decision
        schedule = webui_layer_reuse.schedule_for(settings, clone.model.diffusion_model, layers)
        webui_layer_reuse.install_forge(clone, settings, p, percent_to_sigma, schedule, layers.full_below)
    forge_objects.unet = clone
    return True


def _forge_reduces(clone, settings) -> bool:
    """Whether ``patched_clone`` put ToDo or ToMe on ``clone`` (it does where its ``Reducer`` does something)."""
    return not Reducer(settings, attention_levels(clone.model.diffusion_model) or ()).does_nothing


def _patch_dit(p, forge_objects, settings, percent_to_sigma, job: Job, model_name: str, latent=None) -> bool:
    """A DiT in Forge Neo or lllyasviel's Forge: the family's default (under "calibrated" its plan at the kept
    interval, ``calibrate.dit_schedule_for_pass``), or one line saying why not."""
    unet = forge_objects.unet
    why = webui_dit_reuse.why_not(unet, p)
    if why is None and settings.reuse_interval <= 1:
        why = "reuse across steps is off (reuse interval 1)"
    if why is not None:
        job.warn_once(f"this model ({model_name}) is generated unchanged: {why}.")
        return False
    clone = unet.clone()
    owner = webui_dit_reuse.install_neo(clone, settings, p, percent_to_sigma)
    if owner is None:
        job.warn_once(f"this model ({model_name}) is generated unchanged: too few blocks to reuse.")
        return False
    plan = f"the family's measured default, reuse across steps {owner.schedule.describe()}"
    if REUSE_PLANS[settings.reuse_plan].calibrates:
        plan = f"reuse_plan 'calibrated', the family's plan ({owner.schedule.describe()}) at a calibrated interval"
        # Keyed by the job's own patcher (LoRAs in, ours not), with the family and its plan.
        fingerprints = webui_calibrate.dit_fingerprints(unet, owner)
        owner.follow(webui_calibrate.dit_schedule_for_pass(p, job, settings, owner, fingerprints, latent))
    job.warn_once(
        f"{owner.family} ({model_name}): {plan}; no ToDo (on a DiT it shifts the colours; ComfyUI's default runs "
        "none either); the other controls act on SD1.x, SD2.x and SDXL."
    )
    forge_objects.unet = clone
    job.dit_family = owner.family
    return True
