"""The WebUI script's controls, built from ``webui_args.ARGS`` in the API's positional order; only the controls that
act for the current choices (or the loaded DiT) are shown, and a hidden one keeps its value. gradio is imported
inside ``build_ui`` only. See docs/how-it-works.md, section 'Which controls are shown'.
"""

from __future__ import annotations

import importlib.util
import sys

from .args import ARG_NAMES, ARGS, VISIBILITY_INPUTS, controls_shown_on
from .dit_reuse import family_of

# Controls shown outside the "Advanced" accordion, in ARGS order.
MAIN = ("method", "ratio", "downsample_factor", "hr_same", "hr_ratio", "hr_downsample_factor", "hr_only")
# The rest, in the order shown: both methods', then ToMe's (scope first), then ToDo's.
ADVANCED = (
    "max_downsample",
    "end_percent",
    "skip_when_slower",
    "reuse_interval",
    "reuse_plan",
    "calibration_target",
    "calibration_picture",
    "scope",
    "sx",
    "sy",
    "use_rand",
    "merge_attn",
    "merge_crossattn",
    "merge_mlp",
    "downsample_method",
)


def _control(gr, arg, elem_id, with_info, visible):
    common = {"label": arg.label, "value": arg.default, "elem_id": elem_id, "visible": visible}
    if with_info:
        common["info"] = arg.tooltip
    if arg.kind == "bool":
        return gr.Checkbox(**common)
    if arg.kind == "method":
        return gr.Radio(choices=list(arg.choices), **common)
    if arg.kind in ("choice", "max_downsample"):
        return gr.Dropdown(choices=list(arg.choices), **common)
    # No ``precision``: gradio 3.41 warns about it and gradio 4 has none; the integer step keeps the value whole.
    return gr.Slider(minimum=arg.minimum, maximum=arg.maximum, step=arg.step, **common)


def _enable_accordion(gr, script, label):
    """The accordion whose header checkbox is the enable toggle (WebUI 1.7+, Forge), else a checkbox inside one."""
    elem_id = script.elem_id("enabled")
    try:
        from modules.ui_components import InputAccordion
    except ImportError:
        accordion = gr.Accordion(label, open=False)
        with accordion:
            enabled = gr.Checkbox(label="Enable", value=ARGS[0].default, elem_id=elem_id)
        return accordion, enabled
    enabled = InputAccordion(ARGS[0].default, label=label, elem_id=elem_id)
    return enabled, enabled


def _never_acting_here():
    """{"merge_mlp"} on Forge and reForge, whose patcher has no hook around the MLP; else nothing."""
    try:
        on_forge = importlib.util.find_spec("modules_forge") is not None
    except ValueError:  # imported without a spec: there all the same
        on_forge = True
    return {"merge_mlp"} if on_forge else set()


def _page_being_built():
    """The gradio page (Blocks) the controls are being added to, or None outside one."""
    try:
        from gradio.context import Context
    except ImportError:
        return None
    return getattr(Context, "root_block", None)


def loaded_dit_family() -> str | None:
    """The DiT family whose default the script runs on the model the WebUI holds, or None; never loads a model."""
    sd_models = sys.modules.get("modules.sd_models")
    sd_model = getattr(getattr(sd_models, "model_data", None), "sd_model", None)
    unet = getattr(getattr(sd_model, "forge_objects", None), "unet", None)
    model = getattr(getattr(unet, "model", None), "diffusion_model", None)
    record = family_of(model)
    return record.name if record is not None else None


def dit_note(family: str | None) -> str:
    if family is None:
        return ""
    return (
        f"**{family}** is loaded: the family's measured default runs (reuse across steps, no ToDo). Reuse interval 1 "
        "turns it off; the other controls act on SD1.x, SD2.x and SDXL."
    )


def _follow_choices(gr, controls, note, hidden_for_good):
    names = [name for name in ARG_NAMES[1:] if name not in hidden_for_good]
    inputs = [controls[name] for name in VISIBILITY_INPUTS]
    outputs = [controls[name] for name in names] + [note]

    def show_what_acts(*choices):
        family = loaded_dit_family()
        shown = controls_shown_on(family is not None, *choices)
        note_update = gr.update(value=dit_note(family), visible=True) if family else gr.update(visible=False)
        return [gr.update(visible=shown[name]) for name in names] + [note_update]

    # queue=False: a visibility change must not wait behind a generation; api_name=False: not in the API.
    options = {"inputs": inputs, "outputs": outputs, "queue": False, "show_progress": "hidden", "api_name": False}
    for control in [*inputs, controls["enabled"]]:
        control.change(show_what_acts, **options)
    page = _page_being_built()
    if page is not None:
        page.load(show_what_acts, **options)


def build_ui(script, is_img2img):
    import gradio as gr

    by_name = {arg.name: arg for arg in ARGS}
    shown = controls_shown_on(False, *(by_name[name].default for name in VISIBILITY_INPUTS))
    hidden_for_good = _never_acting_here()
    shown.update(dict.fromkeys(hidden_for_good, False))
    container, enabled = _enable_accordion(gr, script, script.title())
    controls = {"enabled": enabled}

    def add(name, with_info):
        arg = by_name[name]
        controls[name] = _control(gr, arg, script.elem_id(name), with_info, shown.get(name, True))

    with container:
        note = gr.Markdown(value="", visible=False)
        for name in MAIN:
            add(name, with_info=False)
        with gr.Accordion("Advanced", open=False):
            for name in ADVANCED:
                add(name, with_info=True)
    _follow_choices(gr, controls, note, hidden_for_good)
    return [controls[arg.name] for arg in ARGS]
