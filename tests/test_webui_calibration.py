"""The A1111 WebUI: ``reuse_plan`` "calibrated" on the ldm UNet, in jobs run the way the WebUI runs them
(webui_host.py): the first job with a key runs unpatched (its picture the user's), then ``p.sample`` again on the
same seeds with the candidates, at most ``MAX_RUNS`` runs of two seeds; the next jobs run the kept plan, the same
picture every time; another CFG, step count or weight changed in place is another key; an interrupted calibration
keeps nothing; Forge and highres fix run forecast v3; nothing stays patched."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
from hosts.webui_host import ForgeSDModel, Host, SDModel, make_unet, run_job, script_args
from test_webui_layer_reuse import assert_clean

from tome_core.calibration import MAX_RUNS
from tome_core.hosts.webui import calibrate as webui_calibrate

STEPS = tuple(range(999, 0, -50))  # 20 DDPM timesteps
CALIBRATED = {"method": "ToDo", "downsample_factor": 1.0, "reuse_interval": 3, "reuse_plan": "calibrated"}


@pytest.fixture(scope="module")
def host():
    return Host()


@pytest.fixture(scope="module")
def sd_model():
    return SDModel(make_unet("sd1"))


@pytest.fixture
def kept_file(tmp_path, monkeypatch):
    path = tmp_path / "calibrations.json"
    monkeypatch.setenv(webui_calibrate.ENV, str(path))
    return path


def kept(path) -> dict:
    return json.loads(path.read_text())["entries"] if path.exists() else {}


def counted(host, sd_model, args, on_step=None, **kwargs):
    """One job: its latent, ``p``, the sampler runs it made and the UNet calls that ran its layers."""
    runs, calls = [], []

    def step(p, i):
        runs.extend([1] if i == 0 else [])
        if on_step is not None:
            on_step(p, i, len(runs))

    handle = sd_model.model.diffusion_model.middle_block.register_forward_hook(lambda *_: calls.append(1))
    try:
        out, p = run_job(host, sd_model, args, **{"steps": STEPS, "on_step": step, **kwargs})
    finally:
        handle.remove()
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

    out, _, runs, _ = counted(host, sd_model, script_args(**CALIBRATED), on_step=on_step)
    assert torch.equal(out, plain) and runs == 3
    assert not kept_file.exists()
    said = "stopped (Interrupt or Skip)" if stop == "interrupt" else "failed (RuntimeError('out of memory'))"
    assert f"calibration: {said}; nothing is kept" in capsys.readouterr().out
    assert not host.console


def test_highres_fix_and_forge_run_forecast_v3_with_one_line(host, kept_file, capsys):
    unet = make_unet("sd1", seed=4)
    _, _, runs, _ = counted(host, SDModel(unet), script_args(**CALIBRATED), enable_hr=True)
    assert runs == 2 and not kept_file.exists()  # the two passes, once
    assert capsys.readouterr().out.count("runs forecast v3 for this job: highres fix is on") == 1
    forge = ForgeSDModel(make_unet("sd1", seed=4))
    run_job(host, forge, script_args(**CALIBRATED), steps=STEPS)
    assert not kept_file.exists()
    assert capsys.readouterr().out.count("Forge runs its plan uncalibrated (forecast v3's)") == 1
    assert not host.console
