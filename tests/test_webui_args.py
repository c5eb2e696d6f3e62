"""The WebUI script's interface: ui() order, API args, infotext and paste-back, X/Y/Z plot axes, install.py."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hosts.webui_host import REPO, Host, SDModel, make_unet, run_job, script_args

from tome_core.hosts.webui import args as webui_args
from tome_core.settings import SPECS, PatchSettings


@pytest.fixture(scope="module")
def host():
    return Host(with_xyz=True)


@pytest.fixture(scope="module")
def sd1():
    return SDModel(make_unet("sd1"))


@pytest.fixture(scope="module")
def baseline(host, sd1):
    return run_job(host, sd1, script_args(enabled=False))[0]


def test_scripts_folder_holds_only_the_script():
    assert sorted(p.name for p in (REPO / "scripts").iterdir() if p.suffix == ".py") == ["tome_patch.py"]


def test_ui_returns_the_documented_order_with_engine_defaults_and_ranges(host):
    components = host.ui()
    assert [c.label for c in components[1:]] == [arg.label for arg in webui_args.ARGS[1:]]
    assert components[0].kind == "InputAccordion" and components[0].value is False
    assert webui_args.parse_args([c.value for c in components]) == webui_args.defaults()
    by_name = dict(zip(webui_args.ARG_NAMES, components, strict=True))
    for name in ("ratio", "downsample_factor", "sx", "end_percent"):
        spec = SPECS[name]
        kwargs = by_name[name].kwargs
        assert (kwargs["minimum"], kwargs["maximum"], kwargs["value"]) == (spec.minimum, spec.maximum, spec.default)
    assert by_name["max_downsample"].kwargs["choices"] == ["auto", "1", "2", "4", "8"]
    assert webui_args.ARG_NAMES[:4] == ("enabled", "method", "ratio", "downsample_factor")  # API positions
    assert webui_args.ARG_NAMES[18] == "scope" and by_name["scope"].kwargs["choices"] == ["self-attention", "block"]
    assert by_name["scope"].kwargs["value"] == "self-attention" and by_name["scope"].kind == "Dropdown"
    assert webui_args.ARG_NAMES[19] == "reuse_interval" and by_name["reuse_interval"].kind == "Slider"
    # Appended after the reuse plan (20): a request naming the first 21 keeps its meaning.
    assert webui_args.ARG_NAMES[21:] == ("calibration_target", "calibration_picture")
    target = by_name["calibration_target"]
    assert target.kind == "Slider" and by_name["calibration_picture"].kind == "Checkbox"
    assert (target.kwargs["minimum"], target.kwargs["maximum"], target.kwargs["step"]) == (0.8, 0.999, 0.001)
    assert target.kwargs["value"] == SPECS["calibration_target"].default == 0.98
    assert by_name["calibration_picture"].kwargs["value"] is False
    reuse = by_name["reuse_interval"].kwargs
    assert (reuse["minimum"], reuse["maximum"], reuse["step"], reuse["value"]) == (1, 16, 1, 3)
    # The shipped default: ToDo, factor 2, with reuse every third step (README "Which setting to use").
    assert by_name["method"].kwargs["value"] == "ToDo" and webui_args.defaults().method == "todo"
    assert dataclasses.replace(webui_args.defaults(), enabled=True).settings_for_pass(False, 0) == PatchSettings()


def test_api_args_from_json_are_cast(host, sd1):
    typed, _ = run_job(host, sd1, script_args(method="ToDo", downsample_factor=3.0, hr_only=False, sx=2))
    json_like = script_args(method="ToDo", downsample_factor=3.0)
    json_like[0], json_like[1], json_like[3], json_like[9] = 1, "todo", "3", 2.0
    json_like[webui_args.ARG_NAMES.index("skip_when_slower")] = "false"
    cast, _ = run_job(host, sd1, json_like)
    assert torch.equal(cast, typed)
    short, p = run_job(host, sd1, [True, "ToMe", 0.5])  # trailing args missing: defaults
    assert p.extra_generation_params["ToMe ratio"] == 0.5


@pytest.mark.parametrize(
    "position,value,words",
    [
        (1, "merge", ['"Method"', "'ToMe', 'ToDo'", "'merge'"]),
        (2, 0.9, ['"Ratio (ToMe)"', "from 0 to 0.75", "0.9"]),
        (2, "half", ['"Ratio (ToMe)"', "'half'"]),
        (3, True, ['"Downsample factor (ToDo)"', "from 1 to 8"]),
        (8, "16", ['"Max downsample"', "'auto'"]),
        (9, 2.5, ['"Stride x (ToMe)"', "whole number"]),
        (16, -0.1, ['"Stop after (fraction of steps)"', "from 0 to 1"]),
        (18, "all", ['"Scope (ToMe)"', "'self-attention', 'block'", "'all'"]),
        (19, 17, ['"Reuse interval (across steps)"', "from 1 to 16"]),
        (19, 2.5, ['"Reuse interval (across steps)"', "whole number"]),
        (21, 0.5, ['"Calibration target (same-seed SSIM)"', "(calibration_target)", "from 0.8 to 0.999", "0.5"]),
        (21, 1, ["(calibration_target)", "from 0.8 to 0.999"]),
        (21, "high", ["(calibration_target)", "from 0.8 to 0.999", "'high'"]),
        (22, "maybe", ['"Show the calibration\'s picture"', "true or false"]),
    ],
)
def test_bad_api_args_are_rejected_with_a_clear_message(host, sd1, baseline, capsys, position, value, words):
    args = script_args()
    args[position] = value
    out, p = run_job(host, sd1, args)
    console = capsys.readouterr().out
    assert console.count("[ToMe Patch]") == 1 and "Traceback" not in console
    assert all(word in console for word in words), console
    assert any(all(word in comment for word in words) for comment in p.comments)  # shown with the result
    assert torch.equal(out, baseline) and not host.console


def test_combination_errors_name_both_settings(capsys, host, sd1):
    args = script_args()
    args[9] = args[10] = 1  # sx, sy: each in range, together no source token
    run_job(host, sd1, args)
    assert "sx and sy" in capsys.readouterr().out
    with pytest.raises(ValueError, match=f"at most {len(webui_args.ARGS)} arguments"):
        webui_args.parse_args([True] * (len(webui_args.ARGS) + 1))


def _infotext(params: dict) -> str:
    """The last line of a picture's parameters, as modules/processing.py create_infotext writes it."""
    return "Steps: 20, Sampler: Euler, " + ", ".join(f"{key}: {value}" for key, value in params.items())


def _parse(line: str) -> dict:
    """modules/infotext_utils.py parse_generation_parameters for a line without quoted values: all text."""
    return dict(part.split(": ", 1) for part in line.split(", "))


def _paste(components, fields, params):
    """modules/infotext_utils.py connect_paste (476-519): a callable per field, None = unchanged, cast by the
    type of the component's value."""
    values = [c.value for c in components]
    for index, (component, key) in enumerate(fields):
        assert component is components[index]
        v = key(params)
        if v is None:
            continue
        kind = type(component.value)
        values[index] = False if kind is bool and v == "False" else float(v) if kind is int else kind(v)
    return values


@pytest.mark.parametrize(
    "values",
    [
        dict(ratio=0.4),
        dict(method="ToDo", downsample_factor=3, hr_same=False, hr_downsample_factor=4, downsample_method="avg_pool"),
        dict(hr_same=False, hr_ratio=0.6, hr_only=True, max_downsample="2", sx=3, sy=2, use_rand=True),
        dict(merge_crossattn=True, merge_mlp=True, merge_attn=False, end_percent=0.7, skip_when_slower=True),
        dict(scope="block", max_downsample="4"),
        dict(method="ToDo", downsample_factor=1, reuse_interval=3),  # reuse alone: the reduction does nothing
        dict(reuse_interval=8, ratio=0.3),
        dict(method="ToDo", downsample_factor=1, reuse_interval=3, reuse_plan="calibrated", calibration_target=0.95),
    ],
)
def test_infotext_round_trip(host, sd1, values):
    args = script_args(**values)
    _, p = run_job(host, sd1, args, enable_hr=True)
    params = _parse(_infotext(p.extra_generation_params))
    assert all(key in webui_args.INFOTEXT_KEYS for key in p.extra_generation_params)
    script = host.script()
    components = host.ui(script)
    pasted = webui_args.parse_args(_paste(components, script.infotext_fields, params))
    original = webui_args.parse_args(args)
    assert pasted.enabled
    for is_hr_pass in (False, True):
        assert pasted.settings_for_pass(is_hr_pass, 7) == original.settings_for_pass(is_hr_pass, 7)


def test_an_infotext_written_before_reuse_became_the_default_pastes_back_without_reuse(host, sd1):
    """Infotexts leave out a setting at its default; reuse_interval's default went from 1 to 3, so an infotext
    without it (every infotext written before, with reuse off) pastes back with reuse off, as it was made, while
    one written now says its interval."""
    script = host.script()
    components = host.ui(script)
    index = webui_args.ARG_NAMES.index("reuse_interval")
    before = _parse("Steps: 20, ToMe method: ToDo, ToMe downsample: 2.0")  # as the script wrote it for ToDo 2
    assert _paste(components, script.infotext_fields, before)[index] == 1
    ticked = webui_args.as_list(webui_args.parse_args([True]))  # the accordion ticked, today's defaults
    _, p = run_job(host, sd1, ticked)
    assert p.extra_generation_params[webui_args.KEY_REUSE] == SPECS["reuse_interval"].default == 3
    now = _parse(_infotext(p.extra_generation_params))
    assert _paste(components, script.infotext_fields, now)[index] == 3
    off = _parse(_infotext(webui_args.infotext_params(webui_args.parse_args(script_args(reuse_interval=1)))))
    assert webui_args.KEY_REUSE not in off and _paste(components, script.infotext_fields, off)[index] == 1


def test_an_infotext_without_a_reuse_plan_pastes_back_one_step_in_n(host):
    """reuse_plan came after reuse every 3 was the default: an infotext with a reuse interval and no plan was
    made with one step in N and pastes back so; one written now names the plan where it acts, and the pasted
    values give the same settings. Without reuse the plan does not act: not written, and pasted as the default."""
    script = host.script()
    components = host.ui(script)
    index = webui_args.ARG_NAMES.index("reuse_plan")
    older = _parse("Steps: 25, ToMe method: ToDo, ToMe downsample: 2.0, ToMe reuse interval: 3")
    assert _paste(components, script.infotext_fields, older)[index] == "every N"
    for plan in ("forecast v3", "forecast v2", "forecast", "auto", "every N"):
        args = webui_args.parse_args(script_args(reuse_interval=3, reuse_plan=plan))
        params = webui_args.infotext_params(args)
        assert params.get(webui_args.KEY_REUSE_PLAN) == (None if plan == "every N" else plan)
        pasted = _paste(components, script.infotext_fields, _parse(_infotext(params)))
        assert pasted[index] == plan
        assert webui_args.parse_args(pasted).settings_for_pass(False, 0).reuse_plan == plan
    off = webui_args.infotext_params(webui_args.parse_args(script_args(reuse_interval=1)))
    assert webui_args.KEY_REUSE_PLAN not in off
    assert _paste(components, script.infotext_fields, _parse(_infotext(off)))[index] == "forecast v3"  # the default


def test_the_calibration_target_is_written_where_a_calibration_reads_it_and_pastes_back(host):
    """Written with reuse plan calibrated (reuse on) and a target other than 0.98, which an infotext without it
    means; pasted back as written, 0.98 when absent; the picture box is not a parameter of the picture."""
    script = host.script()
    components = host.ui(script)
    index = webui_args.ARG_NAMES.index("calibration_target")
    base = dict(method="ToDo", reuse_interval=3, reuse_plan="calibrated")
    for target, written in ((0.9, 0.9), (0.999, 0.999), (0.98, None)):
        args = webui_args.parse_args(script_args(**base, calibration_target=target, calibration_picture=True))
        params = webui_args.infotext_params(args)
        assert params.get(webui_args.KEY_CALIBRATION_TARGET) == written
        pasted = _paste(components, script.infotext_fields, _parse(_infotext(params)))
        assert pasted[index] == target
        assert webui_args.parse_args(pasted).settings_for_pass(False, 0) == args.settings_for_pass(False, 0)
        assert pasted[index + 1] is False  # the picture box: unchanged by a paste
    for other in (dict(reuse_plan="forecast v3"), dict(reuse_interval=1)):  # no calibration reads it
        args = webui_args.parse_args(script_args(**{**base, **other}, calibration_target=0.9))
        assert webui_args.KEY_CALIBRATION_TARGET not in webui_args.infotext_params(args)
    older = "Steps: 25, ToMe method: ToDo, ToMe reuse interval: 3, ToMe reuse plan: calibrated"
    assert _paste(components, script.infotext_fields, _parse(older))[index] == 0.98
    unreadable = _parse("Steps: 25, ToMe method: ToDo, ToMe calibration target: 2")  # out of range: unchanged
    assert webui_args.ui_values_from_infotext(unreadable)["calibration_target"] is None


def test_api_args_left_out_take_the_new_defaults_and_saved_ones_keep_theirs():
    """An API call that leaves the trailing args out gets today's defaults (reuse every 3 with ToDo 2); one that
    names all 20 as the script took them before keeps reuse off (and the plan, the 21st, does not act then)."""
    assert webui_args.parse_args([True]).settings_for_pass(False, 0).reuse_interval == 3
    saved = webui_args.as_list(webui_args.parse_args([True]))
    saved[webui_args.ARG_NAMES.index("reuse_interval")] = 1
    assert webui_args.parse_args(saved).settings_for_pass(False, 0).reuse_interval == 1


def test_pasting_parameters_without_ours_turns_it_off_and_changes_nothing_else(host):
    script = host.script()
    components = host.ui(script)
    params = _parse("Steps: 20, Sampler: Euler, Token merging ratio: 0.5")
    assert [key(params) for _, key in script.infotext_fields] == [False] + [None] * (len(components) - 1)


def test_xyz_axes_are_added_once_and_apply(host, sd1, baseline):
    host.fire("before_ui")
    host.fire("before_ui")
    labels = [option.label for option in host.xyz.axis_options]
    assert labels == [
        "[ToMe Patch] Method",
        "[ToMe Patch] Ratio",
        "[ToMe Patch] Downsample factor",
        "[ToMe Patch] Scope",
        "[ToMe Patch] Reuse interval",
        "[ToMe Patch] Reuse plan",
        "[ToMe Patch] Calibration target",
    ]
    method_axis, ratio_axis, _, scope_axis, reuse_axis, plan_axis, target_axis = host.xyz.axis_options
    assert plan_axis.choices() == ["forecast v3", "forecast v2", "forecast", "auto", "every N", "calibrated"]
    assert method_axis.choices() == ["ToMe", "ToDo"]
    assert scope_axis.choices() == ["self-attention", "block"]
    from hosts.webui_host import Processing, process_images

    outputs = {}
    for ratio in (0.25, 0.5):
        p = Processing(sd1, script_args(enabled=False))
        ratio_axis.apply(p, ratio, [0.25, 0.5])  # a plot cell: the axis value turns the patch on
        with torch.no_grad():
            outputs[ratio] = process_images(host, p)
        assert p.extra_generation_params["ToMe ratio"] == ratio
    assert not torch.equal(outputs[0.25], outputs[0.5]) and not torch.equal(outputs[0.5], baseline)
    p = Processing(sd1, script_args(enabled=False))
    scope_axis.apply(p, "block", ["self-attention", "block"])
    with torch.no_grad():
        block = process_images(host, p)
    assert p.extra_generation_params["ToMe scope"] == "block" and not torch.equal(block, outputs[0.5])
    p = Processing(sd1, script_args(enabled=False))
    reuse_axis.apply(p, 3, [1, 3])
    with torch.no_grad():
        process_images(host, p)
    assert p.extra_generation_params["ToMe reuse interval"] == 3
    # every N is what an infotext without it means
    plans = (
        ("forecast v3", "forecast v3"),
        ("forecast v2", "forecast v2"),
        ("forecast", "forecast"),
        ("auto", "auto"),
        ("every N", None),
    )
    for plan, written in plans:
        p = Processing(sd1, script_args(enabled=False, reuse_interval=3))
        plan_axis.apply(p, plan, ["forecast v3", "forecast v2", "forecast", "auto", "every N", "calibrated"])
        with torch.no_grad():
            process_images(host, p)
        assert p.extra_generation_params.get("ToMe reuse plan") == written
    # The target axis: its value reaches the settings (a calibration's run: tests/test_webui_calibration.py).
    p = Processing(sd1, script_args(enabled=False, reuse_interval=3, reuse_plan="forecast v3"))
    target_axis.apply(p, 0.95, [0.95, 0.99])
    parsed = webui_args.with_overrides(webui_args.parse_args(p.script_args[1:]), p._tome_patch_overrides)
    assert parsed.enabled and parsed.settings_for_pass(False, 0).calibration_target == 0.95
    target_axis.apply(p, 1.5, [1.5])
    with pytest.raises(ValueError, match=r"\(calibration_target\) must be a number from 0.8 to 0.999, got 1.5"):
        webui_args.with_overrides(webui_args.parse_args(p.script_args[1:]), p._tome_patch_overrides)
    # Without the X/Y/Z script (e.g. disabled), nothing is added and nothing fails.
    assert Host().script() is not None


def _run_install(tmp_path, launch_source):
    if launch_source is not None:
        (tmp_path / "launch.py").write_text(textwrap.dedent(launch_source))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    return subprocess.run(
        [sys.executable, str(REPO / "install.py")], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )


def test_install_py_installs_nothing_when_everything_is_there(tmp_path):
    launch = """
        import pathlib
        def is_installed(name):
            return True
        def run_pip(command, desc=None):
            pathlib.Path("pip_calls.txt").open("a").write(command + "\\n")
    """
    result = _run_install(tmp_path, launch)
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "pip_calls.txt").exists()
    plain = tmp_path / "no_webui"
    plain.mkdir()
    result = _run_install(plain, None)  # outside the WebUI: a plain import check, nothing installed
    assert result.returncode == 0 and not result.stdout, result.stderr + result.stdout


def test_install_py_installs_nothing_even_where_the_webui_lacks_a_package(tmp_path):
    """The extension needs torch alone (the WebUI's own): install.py never calls pip, whatever is missing."""
    launch = """
        import pathlib
        def is_installed(name):
            return False
        def run_pip(command, desc=None):
            pathlib.Path("pip_calls.txt").open("a").write(command + "\\n")
    """
    result = _run_install(tmp_path, launch)
    assert result.returncode == 0 and not result.stdout, result.stderr + result.stdout
    assert not (tmp_path / "pip_calls.txt").exists()
