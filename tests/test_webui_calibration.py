"""The A1111 WebUI: ``reuse_plan`` "calibrated" on the ldm UNet, in jobs run the way the WebUI runs them
(webui_host.py): the first job with a key runs unpatched (its picture the user's), then ``p.sample`` again on the
same seeds with the candidates, at most ``MAX_RUNS`` runs of two seeds; the next jobs run the kept plan, the same
picture every time; another CFG, step count, weight changed in place or target is another key; the target comes
from its control (0.98 where a request leaves it out) or an X/Y/Z axis; the calibrating job's picture is saved
beside the kept file and, when asked, added to the gallery once; an interrupted calibration keeps nothing;
highres fix runs forecast v3; nothing stays patched. With ToDo or ToMe on, the calibrating job's picture is the
truly unpatched one (the search decides the reduction) and a plan kept without it runs without it. Forge and Forge
Neo: tests/test_forge_calibration.py."""

from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest
import torch
from hosts.webui_host import Host, Processing, SDModel, make_unet, process_images, run_job, script_args
from PIL import Image
from test_webui_layer_reuse import assert_clean

from tome_core.calibration import MAX_RUNS, candidates
from tome_core.calibration import search as calibration_search
from tome_core.hosts.webui import args as webui_args
from tome_core.hosts.webui import calibrate as webui_calibrate
from tome_core.reuse import Spacing

STEPS = tuple(range(999, 0, -50))  # 20 DDPM timesteps
CALIBRATED = {"method": "ToDo", "downsample_factor": 1.0, "reuse_interval": 3, "reuse_plan": "calibrated"}
REDUCING = {"ToDo": {"method": "ToDo", "downsample_factor": 2.0}, "ToMe": {"method": "ToMe", "ratio": 0.5}}
WITH_TODO = {**CALIBRATED, **REDUCING["ToDo"]}  # reuse_plan "calibrated" with ToDo on


@pytest.fixture(scope="module")
def host():
    return Host()


@pytest.fixture(scope="module")
def sd_model():
    return SDModel(make_unet("sd1"))


def kept(path) -> dict:
    return json.loads(path.read_text())["entries"] if path.exists() else {}


def counted(host, sd_model, args, on_step=None, counted_at=None, clean=True, **kwargs):
    """One job: its latent, ``p``, the sampler runs it made and the UNet calls that ran ``counted_at`` (by default
    the middle block); ``clean``: no layer forward, hook or pass of ours stays after it."""
    runs, calls = [], []

    def step(p, i):
        runs.extend([1] if i == 0 else [])
        if on_step is not None:
            on_step(p, i, len(runs))

    module = counted_at if counted_at is not None else sd_model.model.diffusion_model.middle_block
    handle = module.register_forward_hook(lambda *_: calls.append(1))
    try:
        out, p = run_job(host, sd_model, args, **{"steps": STEPS, "on_step": step, **kwargs})
    finally:
        handle.remove()
    if clean:
        assert_clean(sd_model)
    assert "sample" not in vars(p)  # p.sample is the WebUI's own again
    return out, p, len(runs), len(calls)


def test_the_first_job_calibrates_and_the_next_runs_the_kept_plan(host, sd_model, kept_file):
    plain, _, _, plain_calls = counted(host, sd_model, script_args(enabled=False))
    host.console.clear()
    first, p, runs, _ = counted(host, sd_model, script_args(**CALIBRATED))
    assert torch.equal(first, plain)  # the user's picture is the unpatched run's, bit for bit
    (entry,) = kept(kept_file).values()
    result = entry["result"]
    assert 2 <= result["runs"] <= MAX_RUNS and runs == 2 * result["runs"]  # each run on two seeds
    assert p.extra_generation_params["ToMe reuse plan"] == "calibrated"
    assert p.extra_generation_params[webui_calibrate.KEY_CALIBRATED].endswith("kept; this picture every step")
    second, p2, runs2, calls2 = counted(host, sd_model, script_args(**CALIBRATED))
    third, _, _, calls3 = counted(host, sd_model, script_args(**CALIBRATED))
    assert torch.equal(second, third) and runs2 == 1 and calls2 == calls3
    assert calls2 == result["computed"] < plain_calls or (result["spacing"] is None and calls2 == plain_calls)
    computed = "every step" if result["spacing"] is None else f"{result['computed']} of {len(STEPS)} steps"
    assert p2.extra_generation_params[webui_calibrate.KEY_CALIBRATED] == computed
    assert len(kept(kept_file)) == 1  # nothing calibrated again
    assert not [line for line in host.console if "Error" in line]


def test_another_cfg_step_count_or_weight_is_another_key(host, kept_file):
    sd_model = SDModel(make_unet("sd1", seed=1))
    counted(host, sd_model, script_args(**CALIBRATED))
    counted(host, sd_model, script_args(**CALIBRATED), cfg_scale=4.0)
    counted(host, sd_model, script_args(**CALIBRATED), steps=STEPS[:-1])
    assert len(kept(kept_file)) == 3
    with torch.no_grad():  # a LoRA merged in place, as the WebUI's Lora extension does
        sd_model.model.diffusion_model.out[2].weight.mul_(1.01)
    counted(host, sd_model, script_args(**CALIBRATED))
    assert len(kept(kept_file)) == 4
    _, _, runs, _ = counted(host, sd_model, script_args(**CALIBRATED))
    assert runs == 1 and len(kept(kept_file)) == 4


def test_another_step_count_starts_from_the_plan_kept_for_this_one(host, kept_file):
    sd_model = SDModel(make_unet("sd1", seed=6))
    counted(host, sd_model, script_args(**CALIBRATED, calibration_target=0.8))
    (first,) = (entry["result"] for entry in kept(kept_file).values())
    assert first["spacing"] is not None  # a target this low keeps a plan on the tiny model
    longer = tuple(range(999, 0, -40))  # 25 timesteps
    counted(host, sd_model, script_args(**CALIBRATED, calibration_target=0.8), steps=longer)
    (second,) = (entry["result"] for entry in kept(kept_file).values() if entry["result"]["steps"] == len(longer))
    wanted = first["computed"] / first["steps"] * len(longer)
    grid = candidates(Spacing(0.15, 3).schedule(3), len(longer))
    counts = [spacing.schedule(spacing.every).full_steps(len(longer)) for spacing in grid]
    assert second["tried"][0][0] == min(counts, key=lambda count: abs(count - wanted))


def test_a_batch_of_two_calibrates_on_its_own_seeds(host, kept_file):
    sd_model = SDModel(make_unet("sd1", seed=2))
    plain, _, _, _ = counted(host, sd_model, script_args(enabled=False), batch_size=2)
    first, _, runs, _ = counted(host, sd_model, script_args(**CALIBRATED), batch_size=2)
    assert torch.equal(first, plain)
    (entry,) = kept(kept_file).values()
    assert runs == entry["result"]["runs"] <= MAX_RUNS  # one sampler call per run


def test_the_lora_extension_merge_keeps_the_key_and_its_strength_changes_it(monkeypatch):
    """The Lora extension merges at each layer's first call (``network_apply_weights``), keeping the weight it
    replaced: the key reads that backup, and the networks it applies with their strengths."""
    unet = make_unet("sd1", seed=3)
    layer = unet.out[2]
    on_disk = types.SimpleNamespace(sha256="ab" * 32, filename="style.safetensors")
    lora = types.SimpleNamespace(name="style", te_multiplier=1.0, unet_multiplier=0.8, dyn_dim=None,
                                 network_on_disk=on_disk)  # fmt: skip
    monkeypatch.setitem(sys.modules, "networks", types.SimpleNamespace(loaded_networks=[]))
    plain = (webui_calibrate._unet_fingerprint(unet), webui_calibrate._networks_fingerprint())
    sys.modules["networks"].loaded_networks = [lora]
    before_merge = (webui_calibrate._unet_fingerprint(unet), webui_calibrate._networks_fingerprint())
    with torch.no_grad():
        layer.network_weights_backup = layer.weight.detach().clone()
        layer.network_bias_backup = layer.bias.detach().clone()
        layer.weight.add_(0.01)
        layer.network_current_names = (("style", 1.0, 0.8, None),)
    merged = (webui_calibrate._unet_fingerprint(unet), webui_calibrate._networks_fingerprint())
    assert merged == before_merge and merged[0] == plain[0] and merged[1] != plain[1]
    lora.unet_multiplier = 0.5
    assert webui_calibrate._networks_fingerprint() != merged[1]


@pytest.mark.parametrize("stop", ["interrupt", "error"])
def test_an_interrupted_calibration_keeps_nothing(host, sd_model, kept_file, stop, capsys):
    plain, _, _, _ = counted(host, sd_model, script_args(enabled=False))

    def on_step(p, i, run):
        if run == 3 and i == 5:  # the first candidate's run
            if stop == "error":
                raise RuntimeError("out of memory")
            host.state.interrupted = True

    out, p, runs, _ = counted(host, sd_model, script_args(**CALIBRATED, calibration_picture=True), on_step=on_step)
    assert torch.equal(out, plain) and runs == 3
    assert not kept_file.exists()
    assert p.processed.extra_images == [] and not (kept_file.parent / webui_calibrate.REPORTS).exists()
    said = "stopped (Interrupt or Skip)" if stop == "interrupt" else "failed (RuntimeError('out of memory'))"
    assert f"calibration: {said}; nothing is kept" in capsys.readouterr().out
    assert not host.console


HIGHRES_LINE = "reuse_plan 'calibrated' with highres fix: the first pass runs the plan kept for the same job"


def first_passes(monkeypatch) -> list:
    """Each sampling pass's latent, in order (the stand-in's ``sample``: the first pass, then highres fix's)."""
    import hosts.webui_host as webui_host

    made, real = [], webui_host.sample
    monkeypatch.setattr(webui_host, "sample", lambda *args: made.append(real(*args)) or made[-1])
    return made


def test_highres_fix_runs_the_plan_kept_for_its_first_pass_and_forecast_v3_after(host, kept_file, capsys,
                                                                                    monkeypatch):  # fmt: skip
    """A highres job's first pass is the job without highres fix: it runs the plan that job keeps (none kept yet:
    forecast v3, as the highres pass), with one line; it never calibrates. (Forge and Forge Neo:
    tests/test_forge_calibration.py.)"""
    sd_model = SDModel(make_unet("sd1", seed=4))
    _, _, runs, _ = counted(host, sd_model, script_args(**CALIBRATED), enable_hr=True)
    assert runs == 2 and not kept_file.exists()  # the two passes, once
    assert capsys.readouterr().out.count(HIGHRES_LINE) == 1
    counted(host, sd_model, script_args(**CALIBRATED))  # the same job without highres fix calibrates
    kept_plan, _, _, kept_calls = counted(host, sd_model, script_args(**CALIBRATED))
    (entry,) = kept(kept_file).values()
    passes = first_passes(monkeypatch)
    capsys.readouterr()
    _, p, runs, _ = counted(host, sd_model, script_args(**CALIBRATED), enable_hr=True)
    assert runs == 2 and len(kept(kept_file)) == 1  # nothing calibrated again
    assert torch.equal(passes[0], kept_plan)  # the first pass: the kept plan's picture, bit for bit
    said = capsys.readouterr().out
    assert said.count(HIGHRES_LINE) == 1 and said.count("the plan kept for this job") == 1
    computed = "every step" if entry["result"]["spacing"] is None else f"{entry['result']['computed']} of"
    assert p.extra_generation_params[webui_calibrate.KEY_CALIBRATED].startswith(computed)
    assert kept_calls == entry["result"]["computed"] or entry["result"]["spacing"] is None
    assert not host.console


def reports(path) -> list[str]:
    folder = path.parent / webui_calibrate.REPORTS
    return sorted(item.name for item in folder.iterdir()) if folder.exists() else []


@pytest.fixture
def targets(monkeypatch):
    """The target each calibration of the test was made with (what the engine's search compares against)."""
    made = []
    real = webui_calibrate.Calibration

    def spying(base, steps, target, *args, **kwargs):
        made.append(target)
        return real(base, steps, target, *args, **kwargs)

    monkeypatch.setattr(webui_calibrate, "Calibration", spying)
    return made


def test_the_target_control_reaches_the_search_the_key_and_the_infotext(host, kept_file, targets):
    sd_model = SDModel(make_unet("sd1", seed=5))
    _, p, _, _ = counted(host, sd_model, script_args(**CALIBRATED, calibration_target=0.9))
    assert targets == [0.9]
    (entry,) = kept(kept_file).values()
    assert entry["result"]["target"] == 0.9
    assert p.extra_generation_params[webui_args.KEY_CALIBRATION_TARGET] == 0.9
    # The same job at the default target is another key: it calibrates again, and says no target (0.98).
    _, p, runs, _ = counted(host, sd_model, script_args(**CALIBRATED))
    assert targets == [0.9, 0.98] and runs > 1 and len(kept(kept_file)) == 2
    assert webui_args.KEY_CALIBRATION_TARGET not in p.extra_generation_params
    # Each target's next job runs its kept plan at once.
    for target in (0.9, 0.98):
        _, p, runs, _ = counted(host, sd_model, script_args(**CALIBRATED, calibration_target=target))
        assert runs == 1 and p.extra_generation_params[webui_calibrate.KEY_CALIBRATED].endswith("steps")
    assert targets == [0.9, 0.98] and len(kept(kept_file)) == 2


def test_the_x_y_z_plots_target_axis_calibrates_at_its_value(kept_file, targets):
    host = Host(with_xyz=True)
    host.fire("before_ui")
    (axis,) = [option for option in host.xyz.axis_options if option.label == "[ToMe Patch] Calibration target"]
    p = Processing(SDModel(make_unet("sd1", seed=6)), script_args(enabled=False, **CALIBRATED))
    p.steps = STEPS
    axis.apply(p, 0.95, [0.95, 0.99])  # a plot cell: the axis value turns the patch on
    with torch.no_grad(), host:  # the WebUI's modules importable for the whole job, as in run_job
        process_images(host, p)
    (entry,) = kept(kept_file).values()
    assert targets == [0.95] and entry["result"]["target"] == 0.95
    assert p.extra_generation_params[webui_args.KEY_CALIBRATION_TARGET] == 0.95


def test_a_request_without_the_new_fields_calibrates_at_0_98_and_a_bad_target_is_named(
    host, kept_file, targets, capsys
):
    """An API request (or a saved one) written before the target and picture fields names 21 args: the target is
    the default and no picture is added; a target out of range is one console line naming the setting and its
    range, and the job runs without the patch."""
    sd_model = SDModel(make_unet("sd1", seed=7))
    older = script_args(**CALIBRATED)[:21]
    assert webui_args.parse_args(older).calibration_target == 0.98
    _, p, runs, _ = counted(host, sd_model, older)
    assert targets == [0.98] and runs > 1
    (identity,) = kept(kept_file)
    assert kept(kept_file)[identity]["result"]["target"] == 0.98
    assert p.processed.extra_images == [] and len(p.processed.images) == 1
    assert reports(kept_file) == [f"{identity}.png", "latest.png"]  # saved beside the kept file all the same
    capsys.readouterr()
    plain, _, _, _ = counted(host, sd_model, script_args(enabled=False))
    bad = script_args(**CALIBRATED)
    bad[webui_args.ARG_NAMES.index("calibration_target")] = 0.5
    out, p, runs, _ = counted(host, sd_model, bad)
    console = capsys.readouterr().out
    assert "(calibration_target) must be a number from 0.8 to 0.999, got 0.5" in console
    assert console.count("[ToMe Patch]") == 1 and torch.equal(out, plain) and runs == 1
    assert targets == [0.98] and len(kept(kept_file)) == 1 and not host.console


def test_the_picture_is_added_once_on_the_job_that_calibrates_when_asked(host, kept_file):
    sd_model = SDModel(make_unet("sd1", seed=8))
    shown = script_args(**CALIBRATED, calibration_picture=True)
    _, p, _, _ = counted(host, sd_model, shown)
    (identity,) = kept(kept_file)
    (picture,) = p.processed.extra_images  # after the job's images (WebUI v1.8+), which stay as they were
    assert isinstance(picture, Image.Image) and picture.mode == "RGB"
    assert len(p.processed.images) == len(p.processed.infotexts) == 1
    assert reports(kept_file) == [f"{identity}.png", "latest.png"]
    with Image.open(kept_file.parent / webui_calibrate.REPORTS / f"{identity}.png") as saved:
        assert np.array_equal(np.asarray(saved.convert("RGB")), np.asarray(picture))
    # The chart: the unpatched run's change per step, recorded from the WebUI's CFG callbacks.
    changes = kept(kept_file)[identity]["result"]["changes"]
    assert len(changes) == len(STEPS) and changes[0] == 0 and all(change > 0 for change in changes[1:])
    # The next job runs the kept plan: no picture.
    _, p, runs, _ = counted(host, sd_model, shown)
    assert runs == 1 and p.processed.extra_images == []
    # Unticked, a job that calibrates (another CFG, another key) saves its picture and adds none.
    _, p, runs, _ = counted(host, sd_model, script_args(**CALIBRATED), cfg_scale=4.0)
    assert runs > 1 and len(kept(kept_file)) == 2 and p.processed.extra_images == []
    assert len(reports(kept_file)) == 3
    assert not host.console


def test_before_webui_1_8_the_picture_follows_the_images_with_an_infotext(host, kept_file):
    """A WebUI without ``Processed.extra_images``: the picture is appended to the images and an infotext naming
    it to the infotexts (so that the gallery's index of each picture still finds its own)."""
    args = script_args(**CALIBRATED, calibration_picture=True)
    _, p, _, _ = counted(host, SDModel(make_unet("sd1", seed=9)), args, batch_size=2, processed_extra_images=False)
    (identity,) = kept(kept_file)
    assert not hasattr(p.processed, "extra_images")
    assert len(p.processed.images) == len(p.processed.infotexts) == 3
    assert isinstance(p.processed.images[2], Image.Image)
    assert p.processed.infotexts[2].startswith("ToMe Patch calibration: ")
    assert p.processed.infotexts[2].endswith(f"{webui_calibrate.REPORTS}/{identity}.png")


@pytest.mark.parametrize("method", ["ToDo", "ToMe"])
def test_with_the_reduction_on_the_first_job_gets_the_truly_unpatched_picture(host, kept_file, searches, method):
    """The calibrating job's own pass is the search's reference: without ToDo or ToMe as without reuse, the
    picture of the job with the patch off (not the one of the reduction alone); the search decides the reduction
    and the infotext says the picture ran without it."""
    sd_model = SDModel(make_unet("sd1", seed=10))
    plain, _, _, _ = counted(host, sd_model, script_args(enabled=False))
    reduced, _, _, _ = counted(host, sd_model, script_args(**REDUCING[method]))
    assert not torch.equal(reduced, plain)  # the reduction acts on the stand-in
    first, p, runs, _ = counted(host, sd_model, script_args(**{**CALIBRATED, **REDUCING[method]}))
    assert torch.equal(first, plain) and runs > 2
    (search,) = searches
    assert search.reduces
    said = p.extra_generation_params[webui_calibrate.KEY_CALIBRATED]
    assert said.endswith(f"kept; this picture every step, without {method}")


def reduced_runs_lose(monkeypatch, searches) -> None:
    """The engine's score: every run that reduces tokens loses the picture, every other keeps it, so that the
    search keeps its plan without the reduction."""

    def scored(latent, reference):
        """0 for a run with ToDo or ToMe, 1 for one without."""
        return torch.full((latent.shape[0],), 0.0 if searches[-1].reducing else 1.0)

    monkeypatch.setattr(calibration_search, "latent_ssim", scored)


def reduce_kept(path, identity: str, reduce: bool) -> None:
    """Set the kept result's ``reduce`` in the kept file, as another search could have kept it."""
    data = json.loads(path.read_text())
    data["entries"][identity]["result"]["reduce"] = reduce
    path.write_text(json.dumps(data))


def test_a_plan_kept_without_todo_runs_without_it(host, kept_file, searches, monkeypatch, capsys):
    """A result kept with ``reduce`` False: the next job runs the kept plan without ToDo (its picture the
    search's unreduced run of it) and says so; the same entry with ``reduce`` True runs the plan with ToDo."""
    sd_model = SDModel(make_unet("sd1", seed=11))
    reduced_runs_lose(monkeypatch, searches)
    _, p, _, _ = counted(host, sd_model, script_args(**WITH_TODO))
    (search,) = searches
    ((identity, entry),) = kept(kept_file).items()
    result = entry["result"]
    assert result["reduce"] is False and result["spacing"] is not None
    computed = f"{result['computed']} of {len(STEPS)} steps"
    said = p.extra_generation_params[webui_calibrate.KEY_CALIBRATED]
    assert said == f"{computed}, without ToDo, kept; this picture every step, without ToDo"
    capsys.readouterr()
    second, p, runs, calls = counted(host, sd_model, script_args(**WITH_TODO))
    assert runs == 1 and calls == result["computed"] and torch.equal(second, search.kept[:1])
    assert p.extra_generation_params[webui_calibrate.KEY_CALIBRATED] == f"{computed}, without ToDo"
    assert "without ToDo or ToMe" in capsys.readouterr().out
    reduce_kept(kept_file, identity, True)
    third, p, runs, calls = counted(host, sd_model, script_args(**WITH_TODO))
    assert runs == 1 and calls == result["computed"] and not torch.equal(third, second)
    assert p.extra_generation_params[webui_calibrate.KEY_CALIBRATED] == computed
    assert len(searches) == 1 and not host.console


def test_a_run_too_short_to_calibrate_keeps_its_reduction_and_keeps_nothing(host, kept_file, searches, capsys):
    """Under 10 steps nothing could be kept: the job runs as forecast v3 (every step) with ToDo as set, not the
    unreduced reference of a calibration that cannot follow."""
    sd_model = SDModel(make_unet("sd1", seed=10))
    short = STEPS[::3]  # 7 timesteps
    reduced, _, _, _ = counted(host, sd_model, script_args(**REDUCING["ToDo"]), steps=short)
    out, _, runs, _ = counted(host, sd_model, script_args(**WITH_TODO), steps=short)
    assert torch.equal(out, reduced) and runs == 1 and searches == [] and not kept_file.exists()
    assert "a run of 7 steps forecasts nothing" in capsys.readouterr().out
