"""Which WebUI controls are shown: exactly those whose value acts for the chosen method, highres box and scope.

The page itself (real gradio 3.41) is tested in tests/hosts/webui_gradio/; here the rule, the engine's view of it
and the controls as ui() builds them.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hosts.webui_host import Host, SDModel, make_unet, run_job, script_args

from tome_core.hosts.webui import args as webui_args
from tome_core.hosts.webui import ui as webui_ui
from tome_core.settings import SPECS

COMBINATIONS = list(itertools.product(("ToMe", "ToDo"), (True, False), ("self-attention", "block")))

# What each combination shows of the controls that are not always shown (written out, not derived).
TOME_ALWAYS = {"ratio", "sx", "sy", "use_rand", "scope"}
MERGE = {"merge_attn", "merge_crossattn", "merge_mlp"}
EXPECTED_SHOWN = {
    ("ToMe", True, "self-attention"): TOME_ALWAYS | MERGE,
    ("ToMe", True, "block"): TOME_ALWAYS,
    ("ToMe", False, "self-attention"): TOME_ALWAYS | MERGE | {"hr_ratio"},
    ("ToMe", False, "block"): TOME_ALWAYS | {"hr_ratio"},
    ("ToDo", True, "self-attention"): {"downsample_factor", "downsample_method"},
    ("ToDo", True, "block"): {"downsample_factor", "downsample_method"},
    ("ToDo", False, "self-attention"): {"downsample_factor", "downsample_method", "hr_downsample_factor"},
    ("ToDo", False, "block"): {"downsample_factor", "downsample_method", "hr_downsample_factor"},
}
ALWAYS_SHOWN = {
    "enabled",
    "method",
    "hr_same",
    "hr_only",
    "max_downsample",
    "end_percent",
    "skip_when_slower",
    "reuse_interval",
    "reuse_plan",
    "calibration_target",
    "calibration_picture",
}

# A valid value other than the default for each control that may be hidden.
OTHER_VALUE = dict(
    ratio=0.3,
    downsample_factor=3.0,
    hr_ratio=0.6,
    hr_downsample_factor=4.0,
    sx=3,
    sy=3,
    use_rand=True,
    merge_attn=False,
    merge_crossattn=True,
    merge_mlp=True,
    downsample_method="avg_pool",
)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny models here run faster on one thread than on two that other work keeps waiting."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def host():
    return Host()


@pytest.fixture(scope="module")
def sd1():
    return SDModel(make_unet("sd1"))


@pytest.fixture(scope="module")
def unpatched(host, sd1):
    return run_job(host, sd1, script_args(enabled=False), enable_hr=True)[0]


def test_every_setting_says_which_method_reads_it():
    expected = {
        "ratio": "ToMe",
        "downsample_factor": "ToDo",
        "max_downsample": "ToMe and ToDo",
        "start_percent": "ToMe and ToDo",
        "end_percent": "ToMe and ToDo",
        "skip_when_slower": "ToMe and ToDo",
        "sx": "ToMe",
        "sy": "ToMe",
        "use_rand": "ToMe",
        "seed": "ToMe",
        "merge_attn": "ToMe, scope self-attention",
        "merge_crossattn": "ToMe, scope self-attention",
        "merge_mlp": "ToMe, scope self-attention",
        "downsample_method": "ToDo",
        "scope": "ToMe",
        "reuse_interval": "ToMe and ToDo",
        "reuse_plan": "ToMe and ToDo",
        "calibration_target": "ToMe and ToDo",
    }
    # dit_settings is read on DiTs only (ComfyUI, diffusers): the WebUI's script patches UNets.
    assert set(expected) == set(SPECS) - {"method", "dit_settings"}
    for name, words in expected.items():
        assert SPECS[name].applies_to == words
        assert SPECS[name].tooltip.startswith(words + ": "), name


@pytest.mark.parametrize("choices", COMBINATIONS)
def test_controls_shown_for_each_choice(choices):
    shown = webui_args.controls_shown(*choices)
    assert set(shown) | ALWAYS_SHOWN == set(webui_args.ARG_NAMES)
    assert {name for name, visible in shown.items() if visible} == EXPECTED_SHOWN[choices]


def test_unreadable_choices_count_as_the_defaults():
    assert webui_args.controls_shown(None, "maybe", 3) == webui_args.controls_shown("ToDo", True, "self-attention")


@pytest.mark.parametrize("choices", COMBINATIONS)
def test_hidden_controls_change_nothing_and_shown_ones_reach_the_engine(host, sd1, unpatched, choices):
    """Hidden: the picture (both passes of a highres job) is bit-identical whatever their values. Shown: each one
    changes the settings of a pass."""
    method, hr_same, scope = choices
    base = dict(method=method, hr_same=hr_same, scope=scope)
    other = {**OTHER_VALUE, "scope": "block" if scope == "self-attention" else "self-attention"}
    shown = webui_args.controls_shown(*choices)
    hidden = {name: other[name] for name, visible in shown.items() if not visible}
    reference, _ = run_job(host, sd1, script_args(**base), enable_hr=True)
    assert not torch.equal(reference, unpatched)  # the patch acts: the comparison below means something
    changed, _ = run_job(host, sd1, script_args(**{**base, **hidden}), enable_hr=True)
    assert torch.equal(changed, reference), sorted(hidden)

    def settings(**values):
        parsed = webui_args.parse_args(script_args(**{**base, **values}))
        return [parsed.settings_for_pass(is_hr_pass) for is_hr_pass in (False, True)]

    for name in (name for name, visible in shown.items() if visible):
        assert settings(**{name: other[name]}) != settings(), name


@pytest.mark.parametrize(
    "choices", [("ToMe", False, "self-attention"), ("ToMe", False, "block"), ("ToDo", False, "block")]
)
def test_each_shown_control_changes_the_picture(host, sd1, choices):
    method, hr_same, scope = choices
    base = dict(method=method, hr_same=hr_same, scope=scope)
    other = {**OTHER_VALUE, "scope": "block" if scope == "self-attention" else "self-attention"}
    reference, _ = run_job(host, sd1, script_args(**base), enable_hr=True)
    for name, visible in webui_args.controls_shown(*choices).items():
        if visible:
            changed, _ = run_job(host, sd1, script_args(**{**base, name: other[name]}), enable_hr=True)
            assert not torch.equal(changed, reference), name


def test_ui_builds_each_control_once_showing_what_acts_with_the_defaults(host):
    assert sorted(webui_ui.MAIN + webui_ui.ADVANCED) == sorted(webui_args.ARG_NAMES[1:])
    components = host.ui()
    by_name = dict(zip(webui_args.ARG_NAMES, components, strict=True))
    hidden = {name for name, c in by_name.items() if c.kwargs.get("visible", True) is False}
    # The default method is ToDo: ToMe's controls and both highres values (same as first pass) start hidden.
    tome_only = {"ratio", "scope", "sx", "sy", "use_rand", "merge_attn", "merge_crossattn", "merge_mlp"}
    assert hidden == tome_only | {"hr_ratio", "hr_downsample_factor"}
    for name in ("sx", "sy"):
        kwargs = by_name[name].kwargs
        assert "precision" not in kwargs
        assert all(type(kwargs[key]) is int for key in ("minimum", "maximum", "step", "value"))
    # Everything passed to a component exists in gradio 4.40 (Forge), whose constructors take no other keywords.
    gradio4 = {"label", "value", "elem_id", "visible", "info", "choices", "minimum", "maximum", "step"}
    for name, component in by_name.items():
        if name != "enabled":
            assert set(component.kwargs) <= gradio4, name


def test_the_choices_drive_the_visibility_through_change_events(host):
    """The choices and the enable box (ticking it reads the loaded model again) show what acts: every control but
    the enable box is an output, and the line about a DiT, hidden with a UNet."""
    components = dict(zip(webui_args.ARG_NAMES, host.ui(), strict=True))
    names = webui_args.ARG_NAMES[1:]
    outputs = [components[name] for name in names]
    for name, control in components.items():
        if name not in (*webui_args.VISIBILITY_INPUTS, "enabled"):
            assert control.changes == [], name
            continue
        ((fn, options),) = control.changes
        assert options["inputs"] == [components[n] for n in ("method", "hr_same", "scope")]
        assert options["outputs"][:-1] == outputs and options["outputs"][-1].kind == "Markdown"
        assert options["queue"] is False and options["api_name"] is False
        for choices in COMBINATIONS:
            *updates, note = fn(*choices)
            shown = {n for n, update in zip(names, updates, strict=True) if update["visible"]}
            assert shown == EXPECTED_SHOWN[choices] | (ALWAYS_SHOWN - {"enabled"})
            assert note["visible"] is False


def neo_holding(diffusion_model):
    """``modules.sd_models`` of a WebUI holding a model whose patcher's diffusion model is ``diffusion_model``."""
    import types

    unet = types.SimpleNamespace(model=types.SimpleNamespace(diffusion_model=diffusion_model))
    sd_model = types.SimpleNamespace(forge_objects=types.SimpleNamespace(unet=unet))
    return types.SimpleNamespace(model_data=types.SimpleNamespace(sd_model=sd_model))


def test_with_a_dit_loaded_in_neo_the_accordion_shows_what_acts_there(host, monkeypatch):
    """Forge Neo holding Flux, or lllyasviel's Forge holding Chroma: only the controls that act on the family's
    default (highres only, stop after, the reuse interval) and a line naming the family; a DiT the registry does
    not name and no model at all show the UNet's controls."""
    import sys

    (fn, options), *_ = dict(zip(webui_args.ARG_NAMES, host.ui(), strict=True))["method"].changes
    neo_flux = type("IntegratedFluxTransformer2DModel", (torch.nn.Module,), {})()
    forge_chroma = type("IntegratedChromaTransformer2DModel", (torch.nn.Module,), {"inner_forward": None})()
    for model in (neo_flux, forge_chroma):  # Flux's block lists: the registry knows a family by its blocks too
        model.double_blocks, model.single_blocks = torch.nn.ModuleList(), torch.nn.ModuleList()
    for model in (neo_flux, forge_chroma):
        monkeypatch.setitem(sys.modules, "modules.sd_models", neo_holding(model))
        for choices in COMBINATIONS:
            *updates, note = fn(*choices)
            shown = {n for n, update in zip(webui_args.ARG_NAMES[1:], updates, strict=True) if update["visible"]}
            assert shown == set(webui_args.DIT_CONTROLS)
            assert note["visible"] and note["value"].startswith("**Flux** is loaded")
    krea = type("IntegratedKreaTransformer", (torch.nn.Module,), {})()
    for held in (neo_holding(krea), neo_holding(None)):
        monkeypatch.setitem(sys.modules, "modules.sd_models", held)
        *updates, note = fn("ToDo", True, "self-attention")
        assert sum(update["visible"] for update in updates) > len(webui_args.DIT_CONTROLS)
        assert note["visible"] is False
