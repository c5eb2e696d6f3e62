"""A small txt2img page of the AUTOMATIC1111 WebUI around this project's script, for the browser tests.

Run with the WebUI's own gradio (3.41.2, environment ``.venv-webui``):
``python tests/hosts/webui_page.py --port PORT``. It serves, on 127.0.0.1:
- the script's real ``ui()``, built the way WebUI v1.10.1 builds an always-visible script's controls
  (modules/scripts.py ``ScriptRunner.setup_ui``: the script's components in ``ui()`` order, the script dropdown
  at position 0 of the generate call's script args, so this script's ``args_from`` is 1);
- a **Generate** button whose handler does what modules/txt2img.py and modules/processing.py do with those
  values: ``p.script_args`` are the components' values as gradio delivers them, and each hook gets
  ``p.script_args[args_from:args_to]`` (``before_process``, ``process_before_every_sampling`` for the first pass,
  ``postprocess``), on a small UNet of the real ``ldm`` code. The page then shows, as JSON in the textbox
  ``#tome_patch_received``, the args that ``process_before_every_sampling`` received, the generation parameters
  the script wrote, the console lines and the warnings gradio gave while ``ui()`` built the controls;
  ``#html_info_txt2img`` shows the infotext line as the WebUI writes it;
- a paste box (``#txt2img_prompt``) and button (``#paste``) that set the controls from an infotext line the way
  modules/infotext_utils.py ``connect_paste`` does with the script's ``infotext_fields``: each field's value is
  the callable's result for the parsed parameters, None leaves the control unchanged, other values are
  converted to the type of the control's current value.

Stand-ins for the WebUI's ``modules`` are only what the script imports. ``InputAccordion`` (modules/ui_components.py)
is a checkbox whose value is the enable flag, shown with an accordion that the checkbox opens; the WebUI draws that
checkbox in the accordion's header with its own JavaScript, here it sits just above the accordion, with the same
element ids (``<id>-checkbox`` for the checkbox, ``<id>`` for the accordion). Nothing here knows which controls the
script has or where they are: the tests find them by their element ids and labels.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
import traceback
import types
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402

# --- modules.* stand-ins -----------------------------------------------------------------------------------------


class Script:
    """modules/scripts.py ``Script``: the parts this script uses."""

    filename = None
    args_from = None
    args_to = None
    alwayson = False
    is_txt2img = True
    is_img2img = False
    infotext_fields = None
    paste_field_names = None

    def show(self, is_img2img):
        return True

    def elem_id(self, item_id):
        # v1.10.1: the tab name is part of the id when the script shows on both tabs.
        need_tabname = self.show(True) == self.show(False)
        tabname = ("img2img_" if self.is_img2img else "txt2img_") if need_tabname else ""
        title = re.sub(r"[^a-z_0-9]", "", re.sub(r"\s", "_", self.title().lower()))
        return f"script_{tabname}{title}_{item_id}"


class InputAccordion(gr.Checkbox):
    """The enable checkbox and its accordion (see the module's docstring)."""

    def __init__(self, value, **kwargs):
        self.accordion_id = kwargs["elem_id"]
        super().__init__(value, **{**kwargs, "elem_id": f"{self.accordion_id}-checkbox"})
        self.accordion = gr.Accordion(
            kwargs.get("label", "Accordion"),
            open=bool(value),
            elem_id=self.accordion_id,
            elem_classes=["input-accordion"],
        )
        self.change(fn=lambda checked: gr.Accordion.update(open=checked), inputs=[self], outputs=[self.accordion])

    def __enter__(self):
        self.accordion.__enter__()
        return self

    def __exit__(self, *exc):
        return self.accordion.__exit__(*exc)

    def get_block_name(self):
        return "checkbox"


def _module(name, **attrs):
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


def install_modules() -> list:
    """Put the stand-ins in ``sys.modules``; returns the list the callbacks are registered in."""
    callbacks = []
    script_callbacks = _module(
        "modules.script_callbacks",
        on_model_loaded=callbacks.append,
        on_script_unloaded=callbacks.append,
        on_before_ui=callbacks.append,
        on_cfg_denoiser=callbacks.append,
        on_cfg_after_cfg=callbacks.append,
    )
    scripts = _module("modules.scripts", Script=Script, AlwaysVisible=object(), scripts_data=[])
    stand_ins = {
        "modules.scripts": scripts,
        "modules.script_callbacks": script_callbacks,
        "modules.ui_components": _module("modules.ui_components", InputAccordion=InputAccordion),
        "modules.sd_unet": _module("modules.sd_unet", current_unet=None),
    }
    sys.modules["modules"] = _module("modules", **{name.split(".")[1]: mod for name, mod in stand_ins.items()})
    sys.modules.update(stand_ins)
    return callbacks


def load_script():
    """modules/scripts.py ``load_scripts``: the extension folder on sys.path while loading, import by file path."""
    path = REPO / "scripts" / "tome_patch.py"
    saved = sys.path
    sys.path = [str(REPO), *sys.path]
    try:
        spec = importlib.util.spec_from_file_location(path.name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path = saved
    (script_class,) = [
        v for v in vars(module).values() if isinstance(v, type) and issubclass(v, Script) and v is not Script
    ]
    script = script_class()
    script.filename = str(path)
    script.alwayson = True
    return script


# --- the job -----------------------------------------------------------------------------------------------------


def small_sd_model():
    """``p.sd_model`` with a small UNet of the real ldm code (SD1 layout: attention at the finest level)."""
    import torch
    from ldm.modules.diffusionmodules.openaimodel import UNetModel

    torch.manual_seed(0)
    unet = UNetModel(
        image_size=32,
        in_channels=4,
        out_channels=4,
        model_channels=32,
        num_res_blocks=1,
        attention_resolutions=(1, 2),
        channel_mult=(1, 2),
        num_head_channels=16,
        use_spatial_transformer=True,
        transformer_depth=1,
        context_dim=32,
        legacy=False,
    ).eval()
    sd_model = torch.nn.Module()
    sd_model.model = torch.nn.Module()
    sd_model.model.diffusion_model = unet
    return sd_model


class Processing:
    """What a script sees of StableDiffusionProcessingTxt2Img."""

    def __init__(self, sd_model, script_args):
        self.sd_model = sd_model
        self.script_args = script_args
        self.seed = 1234
        self.seeds = self.all_seeds = [1234]
        self.sampler_name = "Euler"  # the WebUI's default sampler, as the infotext below says
        self.is_hr_pass = False
        self.extra_generation_params = {}
        self.comments = []

    def comment(self, text):
        self.comments.append(text)

    def get_token_merging_ratio(self, for_hr=False):
        return 0.0


def infotext_line(params: dict) -> str:
    """The parameters as the WebUI writes them under the picture: ``key: value`` joined by commas."""
    quoted = {k: json.dumps(str(v)) if any(c in str(v) for c in ",:\n") else str(v) for k, v in params.items()}
    return ", ".join(f"{k}: {v}" for k, v in {"Steps": 20, "Sampler": "Euler", **quoted}.items())


def parse_infotext(text: str) -> dict:
    """The parameters of an infotext line as text (values unquoted), as the WebUI's paste reads them."""
    params = {}
    for match in re.finditer(r'\s*([\w][\w \-/]*):\s*("(?:\\.|[^\\"])*"|[^,]*)(?:,|$)', text.strip().splitlines()[-1]):
        key, value = match.group(1).strip(), match.group(2).strip()
        params[key] = json.loads(value) if value.startswith('"') else value
    return params


def build_page(script):
    sd_model = small_sd_model()
    received = []
    console = []
    hook = script.process_before_every_sampling

    def recording_hook(p, *args, **kwargs):
        received.append(list(args))
        return hook(p, *args, **kwargs)

    script.process_before_every_sampling = recording_hook

    def generate(*values):
        received.clear()
        console.clear()
        p = Processing(sd_model, [None, *values])  # position 0: the script dropdown
        args = p.script_args[script.args_from : script.args_to]
        import contextlib
        import io

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            for name in ("before_process", "process_before_every_sampling", "postprocess"):
                extra = (None,) if name == "postprocess" else ()
                try:  # modules/scripts.py: a script's exception is only reported
                    getattr(script, name)(p, *extra, *args)
                except Exception:
                    console.append(traceback.format_exc())
        console.extend(line for line in out.getvalue().splitlines() if line)
        report = {
            "args": received[0] if received else None,
            "params": p.extra_generation_params,
            "console": console,
            "ui_warnings": [str(w.message) for w in ui_warnings],
        }
        return json.dumps(report), infotext_line(p.extra_generation_params)

    def paste(text):
        params = parse_infotext(text or "")
        updates = []
        for component, key in script.infotext_fields:
            value = key(params) if callable(key) else params.get(key)
            if value is None:
                updates.append(gr.update())
                continue
            try:
                kind = type(component.value)
                updates.append(gr.update(value=False if kind is bool and value == "False" else kind(value)))
            except (TypeError, ValueError):
                updates.append(gr.update())
        return updates

    theme = gr.themes.Default(font=["ui-sans-serif", "system-ui", "sans-serif"], font_mono=["monospace"])
    with gr.Blocks(title="Stable Diffusion", theme=theme, analytics_enabled=False) as page:
        with gr.Row():
            prompt = gr.Textbox(label="Prompt (or generation parameters to paste)", elem_id="txt2img_prompt", scale=6)
            paste_button = gr.Button("Read generation parameters", elem_id="paste", scale=1)
            generate_button = gr.Button("Generate", elem_id="txt2img_generate", variant="primary", scale=1)
        with gr.Row():
            with gr.Column(elem_id="txt2img_settings"), warnings.catch_warnings(record=True) as ui_warnings:
                warnings.simplefilter("always")
                components = script.ui(False)
            with gr.Column(elem_id="txt2img_results"):
                info = gr.Textbox(label="Generation parameters", elem_id="html_info_txt2img", lines=3)
                report = gr.Textbox(label="Script arguments", elem_id="tome_patch_received", lines=3)
        script.args_from, script.args_to = 1, 1 + len(components)
        generate_button.click(fn=generate, inputs=components, outputs=[report, info])
        paste_button.click(fn=paste, inputs=[prompt], outputs=[c for c, _ in script.infotext_fields])
    return page


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    options = parser.parse_args()
    install_modules()
    script = load_script()
    page = build_page(script)
    print(f"page ready on port {options.port}", flush=True)
    page.launch(
        server_name="127.0.0.1", server_port=options.port, show_api=False, quiet=True, prevent_thread_lock=False
    )


if __name__ == "__main__":
    main()
