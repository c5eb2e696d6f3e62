"""The script's accordion built by the real gradio 3.41.2 (the version WebUI v1.10.1 pins) inside a gradio page.

Run by tests/test_webui_gradio.py with .venv-webui's interpreter. The script is loaded from scripts/tome_patch.py
as the WebUI loads it, with stand-ins for the two ``modules`` it imports. The page's events are run through
gradio's own ``Blocks.process_api`` (what the page's HTTP call runs), so their updates are the ones the browser
gets. What the browser does with an event's updates (set each value, then fire the ``change`` events of the values
that changed) is done here by ``Page``.
"""

from __future__ import annotations

import asyncio
import copy
import importlib.machinery
import importlib.util
import re
import sys
import types
import warnings
from pathlib import Path

import gradio as gr
import pytest

from tome_core.hosts.webui import args as webui_args

REPO = Path(__file__).resolve().parents[3]
COMBINATIONS = [(m, h, s) for m in ("ToMe", "ToDo") for h in (True, False) for s in ("self-attention", "block")]


class Script:
    """modules/scripts.py ``Script``: what the script uses of it."""

    is_img2img = False
    infotext_fields = None
    paste_field_names = None

    def elem_id(self, item_id):  # an always-on script's ids: tab, title, item
        title = re.sub(r"[^a-z_0-9]", "", self.title().lower().replace(" ", "_"))
        return f"script_{'img2img' if self.is_img2img else 'txt2img'}_{title}_{item_id}"


class InputAccordion(gr.Checkbox):
    """Stands in for modules/ui_components.py ``InputAccordion`` (WebUI 1.7+, Forge): a hidden checkbox holding the
    value, and an accordion that the controls created inside ``with`` go into."""

    def __init__(self, value, **kwargs):
        super().__init__(value, **{**kwargs, "elem_id": kwargs["elem_id"] + "-checkbox", "visible": False})
        self.accordion = gr.Accordion(kwargs["label"], open=value, elem_id=kwargs["elem_id"])

    def __enter__(self):
        self.accordion.__enter__()
        return self

    def __exit__(self, *exc):
        return self.accordion.__exit__(*exc)

    def get_block_name(self):  # the page draws it as the checkbox it is
        return "checkbox"


def _module(name, **attrs):
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


def load_script(with_input_accordion, forge=False):
    scripts = _module("modules.scripts", Script=Script, AlwaysVisible=object(), scripts_data=[])
    register = lambda callback: None  # noqa: E731
    callbacks = _module(
        "modules.script_callbacks",
        **dict.fromkeys(
            ("on_model_loaded", "on_script_unloaded", "on_before_ui", "on_cfg_denoiser", "on_cfg_after_cfg"), register
        ),
    )
    modules = {"modules.scripts": scripts, "modules.script_callbacks": callbacks}
    if with_input_accordion:
        modules["modules.ui_components"] = _module("modules.ui_components", InputAccordion=InputAccordion)
    modules["modules"] = _module("modules", **{name.split(".")[1]: m for name, m in modules.items()})
    if forge:  # Forge's own package, which the WebUI does not have
        modules["modules_forge"] = _module(
            "modules_forge", __spec__=importlib.machinery.ModuleSpec("modules_forge", None)
        )
    saved = {name: sys.modules.get(name) for name in modules}
    sys.modules.update(modules)
    try:
        path = REPO / "scripts" / "tome_patch.py"
        spec = importlib.util.spec_from_file_location(path.name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        script = module.ToMePatchScript()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with gr.Blocks() as page:
                components = script.ui(False)
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    return Page(page, script, components, caught)


class Page:
    """The page in a browser: the value and visibility of each control, changed by running the page's events."""

    def __init__(self, blocks, script, components, warnings_caught):
        self.blocks, self.script, self.warnings = blocks, script, warnings_caught
        self.components = dict(zip(webui_args.ARG_NAMES, components, strict=True))
        config = blocks.get_config_file()
        self.props = {c["id"]: dict(c["props"]) for c in config["components"]}
        self.dependencies = config["dependencies"]

    def prop(self, name, key):
        return self.props[self.components[name]._id].get(key)

    def shown(self):
        return {name: self.prop(name, "visible") is not False for name in webui_args.CONDITIONAL}

    def events(self, trigger, component=None):
        target = [] if component is None else [component._id]
        return [i for i, d in enumerate(self.dependencies) if d["trigger"] == trigger and d["targets"] == target]

    def run(self, fn_index, inputs=None):
        """Run one event as the page does, and apply its updates; returns them."""
        dependency = self.dependencies[fn_index]
        if inputs is None:
            inputs = [self.props[i].get("value") for i in dependency["inputs"]]
        result = asyncio.run(self.blocks.process_api(fn_index=fn_index, inputs=inputs, state={}))
        changed = []
        for block_id, update in zip(dependency["outputs"], result["data"], strict=True):
            assert isinstance(update, dict) and update.get("__type__") == "update", update
            props = self.props[block_id]
            for key, value in update.items():
                if key == "__type__":
                    continue
                if key == "value" and props.get("value") != value:
                    changed.append(block_id)
                props[key] = value
        # Then the browser fires the change events of the values this event changed.
        for block_id in changed:
            for index, d in enumerate(self.dependencies):
                if d["trigger"] == "change" and d["targets"] == [block_id]:
                    self.run(index)
        return result["data"]

    def set_value(self, name, value):
        """A person changes one control: its value, then its change events."""
        component = self.components[name]
        self.props[component._id]["value"] = value
        for index in self.events("change", component):
            self.run(index)

    def paste(self, infotext):
        """modules/infotext_utils.py ``connect_paste``: each field's value from the parsed parameters (None: no
        change) becomes the control's new value, cast to the type of the control's value."""
        params = dict(part.split(": ", 1) for part in infotext.split(", "))

        def paste_values():
            updates = []
            for component, key in self.script.infotext_fields:
                value = key(params)
                if value is None:
                    updates.append(gr.update())
                    continue
                kind = type(component.value)
                value = False if kind is bool and value == "False" else float(value) if kind is int else kind(value)
                updates.append(gr.update(value=value))
            return updates

        with self.blocks:
            button = gr.Button()
            button.click(paste_values, outputs=[c for c, _ in self.script.infotext_fields])
        self.dependencies = self.blocks.get_config_file()["dependencies"]
        self.run(self.events("click", button)[0], inputs=[])


@pytest.fixture(params=[True, False], ids=["InputAccordion", "plain accordion"])
def page(request):
    return load_script(with_input_accordion=request.param)


def test_building_the_accordion_warns_nothing(page):
    assert [f"{w.filename}:{w.lineno}: {w.message}" for w in page.warnings] == []


def test_the_page_starts_with_the_controls_of_the_defaults(page):
    hidden = {name for name, shown in page.shown().items() if not shown}
    # The default method is ToDo: ToMe's controls and both highres values (same as first pass) start hidden.
    assert hidden == {
        "ratio",
        "hr_ratio",
        "hr_downsample_factor",
        "scope",
        "sx",
        "sy",
        "use_rand",
        "merge_attn",
        "merge_crossattn",
        "merge_mlp",
    }
    for name in webui_args.ARG_NAMES[1:]:
        assert page.prop(name, "elem_id") == f"script_txt2img_tome_patch_{name}"  # what the browser tests find
    for name in ("sx", "sy"):  # whole numbers, without the precision gradio does not know
        assert [type(page.prop(name, key)) for key in ("minimum", "maximum", "step", "value")] == [int] * 4
        assert page.prop(name, "precision") is None


@pytest.mark.parametrize("choices", COMBINATIONS)
def test_each_choice_shows_what_acts_and_keeps_the_hidden_values(page, choices):
    values = {name: page.prop(name, "value") for name in webui_args.ARG_NAMES}
    for name, value in zip(webui_args.VISIBILITY_INPUTS, choices, strict=True):
        page.set_value(name, value)
    assert page.shown() == webui_args.controls_shown(*choices)
    after = {name: page.prop(name, "value") for name in webui_args.ARG_NAMES}
    assert after == {**values, **dict(zip(webui_args.VISIBILITY_INPUTS, choices, strict=True))}


def test_the_page_load_shows_what_acts_for_values_saved_as_defaults(page):
    """The WebUI may start the controls on values saved in ui-config.json: the page's load event sets the
    visibility for them."""
    (load,) = page.events("load")
    for choices in COMBINATIONS:
        updates = page.run(load, inputs=list(choices))
        assert all(set(update) == {"__type__", "visible"} for update in updates)  # values stay as they are
        assert page.shown() == webui_args.controls_shown(*choices)


@pytest.mark.parametrize(
    "infotext,choices",
    [
        (
            "Steps: 20, ToMe method: ToDo, ToMe downsample: 3.0, ToMe hr downsample: 4.0",
            ("ToDo", False, "self-attention"),
        ),
        ("Steps: 20, ToMe method: ToMe, ToMe ratio: 0.3, ToMe scope: block", ("ToMe", True, "block")),
        ("Steps: 20, ToMe method: ToMe, ToMe ratio: 0.4, ToMe hr ratio: 0.6", ("ToMe", False, "self-attention")),
    ],
)
def test_pasting_parameters_sets_values_and_visibility_together(page, infotext, choices):
    page.set_value("method", "ToDo" if choices[0] == "ToMe" else "ToMe")  # start from the other method
    page.set_value("scope", "block")
    page.paste(infotext)
    pasted = webui_args.ui_values_from_infotext(dict(part.split(": ", 1) for part in infotext.split(", ")))
    values = [page.prop(name, "value") for name in webui_args.ARG_NAMES]
    assert webui_args.parse_args(values) == webui_args.parse_args([pasted[name] for name in webui_args.ARG_NAMES])
    assert [page.prop(name, "value") for name in webui_args.VISIBILITY_INPUTS] == list(choices)
    assert page.shown() == webui_args.controls_shown(*choices)


def test_pasting_parameters_without_ours_changes_only_the_enable_box(page):
    page.set_value("method", "ToDo")
    before = copy.deepcopy(page.props)
    page.paste("Steps: 20, Sampler: Euler")
    assert page.prop("enabled", "value") is False
    assert {i: p for i, p in page.props.items() if i != page.components["enabled"]._id} == {
        i: p for i, p in before.items() if i != page.components["enabled"]._id
    }
    assert page.shown() == webui_args.controls_shown("ToDo", True, "self-attention")


def test_on_forge_merge_mlp_stays_hidden():
    """Forge's patcher has no hook around the MLP: there the switch never acts."""
    page = load_script(with_input_accordion=True, forge=True)
    for choices in COMBINATIONS:
        for name, value in zip(webui_args.VISIBILITY_INPUTS, choices, strict=True):
            page.set_value(name, value)
        assert page.shown() == {**webui_args.controls_shown(*choices), "merge_mlp": False}
