"""The WebUI script's controls, built from ``webui_args.ARGS`` (and through it from the engine's ``SPECS``).

gradio and the WebUI's ``modules.ui_components`` are imported inside ``build_ui`` only, so this module imports
anywhere. The returned list is in ``ARGS`` order, which is the API's positional order.
"""

from __future__ import annotations

from .webui_args import ARGS

# Controls shown outside the "Advanced" accordion, in ARGS order; the rest go inside it.
_MAIN = ("method", "ratio", "downsample_factor", "hr_same", "hr_ratio", "hr_downsample_factor", "hr_only")


def _control(gr, arg, elem_id, with_info):
    common = {"label": arg.label, "value": arg.default, "elem_id": elem_id}
    if with_info:
        common["info"] = arg.tooltip
    if arg.kind == "bool":
        return gr.Checkbox(**common)
    if arg.kind == "method":
        return gr.Radio(choices=list(arg.choices), **common)
    if arg.kind in ("choice", "max_downsample"):
        return gr.Dropdown(choices=list(arg.choices), **common)
    # A step of 1 keeps whole-number sliders whole. gradio's Slider has no ``precision`` argument: the WebUI's
    # gradio 3.41 warns about it in the console at every start.
    return gr.Slider(minimum=arg.minimum, maximum=arg.maximum, step=arg.step, **common)


def _enable_accordion(gr, script, label):
    """The accordion whose header checkbox is the enable toggle (WebUI 1.7+ and Forge); a plain checkbox inside
    an accordion on older versions."""
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


def build_ui(script, is_img2img):
    import gradio as gr

    container, enabled = _enable_accordion(gr, script, script.title())
    controls = {"enabled": enabled}
    with container:
        for arg in ARGS[1:]:
            if arg.name in _MAIN:
                controls[arg.name] = _control(gr, arg, script.elem_id(arg.name), with_info=False)
        with gr.Accordion("Advanced", open=False):
            for arg in ARGS[1:]:
                if arg.name not in _MAIN:
                    controls[arg.name] = _control(gr, arg, script.elem_id(arg.name), with_info=True)
    return [controls[arg.name] for arg in ARGS]
