"""ComfyUI nodes "ToMe Patch" and "ToMe Patch (Advanced)": a MODEL in, a patched clone out.

The inputs are built from ``tome_core.settings.SPECS`` (defaults, ranges, tooltips), so they always agree with
the engine's validation. Input names are public API: saved workflows refer to them; never rename one.
"""

from __future__ import annotations

from .tome_core.hosts.comfyui import calibrate as comfyui_calibrate
from .tome_core.hosts.comfyui import dit_reuse as comfyui_dit_reuse
from .tome_core.hosts.comfyui import patch as comfyui_patch
from .tome_core.settings import IMPLIED_WHEN_ABSENT, RETIRED_CHOICES, SPECS, PatchSettings

NODE_ID = "ToMePatch"
ADVANCED_NODE_ID = "ToMePatchAdvanced"
REPORT_NODE_ID = "ToMeCalibrationReport"
REPORT_DESCRIPTION = (
    "The picture of the last calibration (reuse_plan calibrated): the unpatched and the calibrated latent side by "
    "side, their difference amplified, and the unpatched run's change per step, the computed steps in orange. "
    "Connect the sampler's LATENT output so that it runs after the sampler."
)
CATEGORY = "model_patches/unet"
DESCRIPTION = (
    "Makes sampling faster by reducing the tokens that the transformer blocks work on: ToMe merges similar "
    "tokens (for self-attention only, or for the whole block), ToDo downsamples self-attention's keys and values; "
    "reuse_interval reuses the UNet's inner layers across steps (at the steps reuse_plan says). Returns a patched "
    "copy; the input model is not changed."
)

MODEL_TOOLTIP = (
    f"The diffusion model to patch: SD1.x, SD2.x, SDXL; DiTs ({comfyui_dit_reuse.SUPPORTED_WORDS}) as dit_settings "
    "says."
)

# Saved workflows store widget values by position: new inputs are only ever appended to each tuple.
_FIRST_INPUTS = (
    "method",
    "ratio",
    "downsample_factor",
    "max_downsample",
    "start_percent",
    "end_percent",
    "skip_when_slower",
)
BASIC_INPUTS = _FIRST_INPUTS + ("scope", "reuse_interval", "dit_settings", "reuse_plan")
ADVANCED_INPUTS = _FIRST_INPUTS + (
    "sx",
    "sy",
    "use_rand",
    "seed",
    "merge_attn",
    "merge_crossattn",
    "downsample_method",
    "scope",
    "reuse_interval",
    "dit_settings",
    "reuse_plan",
    "calibration_target",
)

# Inputs added after the first release are optional: an API prompt or a saved workflow without them still
# validates, and they take their default.
OPTIONAL_INPUTS = frozenset({"scope", "reuse_interval", "dit_settings", "reuse_plan", "calibration_target"})

# Integer inputs are settings that stay as the user set them: ComfyUI's front end would otherwise add its
# "control after generate" widget to an input named "seed" and draw a new seed after every run (by default),
# so ``use_rand`` would give a different picture each time for the same prompt.
INT_OPTIONS = {"control_after_generate": False}

# max_downsample is shown as a dropdown of strings; "auto" is the engine's 0.
MAX_DOWNSAMPLE_OPTIONS = ("auto", "1", "2", "4", "8")


def _choices(name) -> list:
    """A combo input's options: the setting's choices, then any retired ones, so that a workflow saved with one
    still validates (it runs as the replacement, with a warning: ``settings.RETIRED_CHOICES``)."""
    if name == "max_downsample":
        return list(MAX_DOWNSAMPLE_OPTIONS)
    return [*SPECS[name].choices, *RETIRED_CHOICES.get(name, ())]


def _ui_value(name, value):
    if name == "max_downsample":
        return "auto" if value == 0 else str(value)
    return value


def _engine_values(values: dict) -> dict:
    values = dict(values)
    if "max_downsample" in values:
        choice = values["max_downsample"]
        values["max_downsample"] = 0 if choice == "auto" else choice
    return values


def patch_model(model, **values):
    """Validate the inputs and return a patched clone of ``model`` (or ``model`` itself if it cannot be patched).

    An optional input that a prompt does not name takes the value it meant when the prompt was saved
    (``IMPLIED_WHEN_ABSENT``), not today's default: a node added anew sends every widget's value, today's
    defaults included, so only prompts saved before the input existed leave it out."""
    values = {**{k: v for k, v in IMPLIED_WHEN_ABSENT.items() if k in OPTIONAL_INPUTS}, **values}
    return comfyui_patch.patch_model(model, PatchSettings.from_values(**_engine_values(values)))


def classic_input_types(names):
    """INPUT_TYPES of the classic node API."""
    required = {"model": ("MODEL", {"tooltip": MODEL_TOOLTIP})}
    optional = {}
    for name in names:
        spec = SPECS[name]
        options = {"default": _ui_value(name, spec.default), "tooltip": spec.tooltip}
        group = optional if name in OPTIONAL_INPUTS else required
        if spec.kind == "choice":
            group[name] = (_choices(name), options)
        elif spec.kind == "bool":
            group[name] = ("BOOLEAN", options)
        elif spec.kind == "int":
            options.update(min=spec.minimum, max=spec.maximum, step=spec.step, **INT_OPTIONS)
            group[name] = ("INT", options)
        else:
            options.update(min=spec.minimum, max=spec.maximum, step=spec.step)
            group[name] = ("FLOAT", options)
    return {"required": required, "optional": optional} if optional else {"required": required}


class ClassicToMePatch:
    """The node for ComfyUI versions without the V3 API (``comfy_api``)."""

    INPUT_NAMES = BASIC_INPUTS
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    CATEGORY = CATEGORY
    DESCRIPTION = DESCRIPTION

    @classmethod
    def INPUT_TYPES(cls):  # noqa: N802 (ComfyUI's name)
        return classic_input_types(cls.INPUT_NAMES)

    def patch(self, model, **values):
        return (patch_model(model, **values),)


class ClassicToMePatchAdvanced(ClassicToMePatch):
    INPUT_NAMES = ADVANCED_INPUTS


def calibration_picture():
    """The last calibration's picture as an IMAGE; a black square (and one log line) where there is none yet."""
    import torch

    picture = comfyui_calibrate.latest_picture()
    if picture is None:
        comfyui_calibrate.log.info("ToMe calibration: no calibration has run yet in this user directory.")
        return torch.zeros(1, 64, 64, 3)
    return picture


class ClassicToMeCalibrationReport:
    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "report"
    CATEGORY = CATEGORY
    DESCRIPTION = REPORT_DESCRIPTION

    @classmethod
    def INPUT_TYPES(cls):  # noqa: N802 (ComfyUI's name)
        return {"required": {"samples": ("LATENT", {"tooltip": "The sampler's output (only to run after it)."})}}

    def report(self, samples):
        return (calibration_picture(),)


def v3_nodes():
    """The nodes for the V3 API; imported only where the running ComfyUI has it."""
    from comfy_api.latest import io

    def v3_inputs(names):
        inputs = [io.Model.Input("model", tooltip=MODEL_TOOLTIP)]
        for name in names:
            spec = SPECS[name]
            default = _ui_value(name, spec.default)
            if spec.kind == "choice":
                inputs.append(
                    io.Combo.Input(
                        name,
                        options=_choices(name),
                        default=default,
                        tooltip=spec.tooltip,
                        optional=name in OPTIONAL_INPUTS,
                    )
                )
            elif spec.kind == "bool":
                inputs.append(io.Boolean.Input(name, default=default, tooltip=spec.tooltip))
            elif spec.kind == "int":
                inputs.append(
                    io.Int.Input(
                        name,
                        default=default,
                        min=int(spec.minimum),
                        max=int(spec.maximum),
                        step=int(spec.step),
                        tooltip=spec.tooltip,
                        optional=name in OPTIONAL_INPUTS,
                        **INT_OPTIONS,
                    )
                )
            else:
                inputs.append(
                    io.Float.Input(
                        name,
                        default=default,
                        min=spec.minimum,
                        max=spec.maximum,
                        step=spec.step,
                        tooltip=spec.tooltip,
                        optional=name in OPTIONAL_INPUTS,
                    )
                )
        return inputs

    def node_class(node_id, display_name, input_names):
        # One independent class per node: ComfyUI stores per-class schema state, so no node inherits another.
        class Node(io.ComfyNode):
            @classmethod
            def define_schema(cls):
                return io.Schema(
                    node_id=node_id,
                    display_name=display_name,
                    category=CATEGORY,
                    description=DESCRIPTION,
                    inputs=v3_inputs(input_names),
                    outputs=[io.Model.Output()],
                )

            @classmethod
            def execute(cls, model, **values):
                return io.NodeOutput(patch_model(model, **values))

        Node.__name__ = Node.__qualname__ = node_id
        return Node

    class ToMeCalibrationReport(io.ComfyNode):
        @classmethod
        def define_schema(cls):
            return io.Schema(
                node_id=REPORT_NODE_ID,
                display_name="ToMe Calibration Report",
                category=CATEGORY,
                description=REPORT_DESCRIPTION,
                inputs=[io.Latent.Input("samples", tooltip="The sampler's output (only to run after it).")],
                outputs=[io.Image.Output()],
            )

        @classmethod
        def execute(cls, samples):
            return io.NodeOutput(calibration_picture())

    return [
        node_class(NODE_ID, "ToMe Patch", BASIC_INPUTS),
        node_class(ADVANCED_NODE_ID, "ToMe Patch (Advanced)", ADVANCED_INPUTS),
        ToMeCalibrationReport,
    ]
