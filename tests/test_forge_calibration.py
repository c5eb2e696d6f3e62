"""lllyasviel's Forge and Forge Neo: ``reuse_plan`` "calibrated" on their UNets (SD1.5, SDXL), in jobs run the way
they run them: ``p.sample`` copies ``forge_objects`` from the patcher after the LoRAs and calls
``process_before_every_sampling`` (``webui_host``'s Forge mode, lllyasviel/stable-diffusion-webui-forge@dfdcbab
modules/processing.py 1373-1377; Neo's ``modules/processing.py`` keeps the same order), over Forge's patcher
(``webui_host.ForgePatcher``, its LoRAs merged in place by the model's ``lora_loader``) or Neo's (ComfyUI's
``ModelPatcher``, ``neo_host.NeoUnetPatcher``). The first job with a key gets the unpatched picture bit for bit in
at most ``MAX_RUNS`` runs of two seeds; the next job runs the kept plan's picture bit for bit with its count of UNet
calls; another LoRA strength is another key, a LoRA merged in place is not; an interrupted calibration keeps
nothing; highres fix runs forecast v3 with one line; nothing stays patched. With ToDo on, the calibrating job's
picture is the truly unpatched one (the search decides ToDo, where the pass reduces tokens at all) and a plan kept
without ToDo runs without it."""

from __future__ import annotations

import pytest
import torch
from hosts import (
    comfy_host,  # noqa: F401,I001  (before any ComfyUI import: sys.path, CPU mode)
    neo_host,
)
from hosts.webui_host import ForgeSDModel, Host, make_unet, script_args
from test_webui_calibration import WITH_TODO, kept, reduce_kept, reduced_runs_lose
from test_webui_calibration import counted as webui_counted
from test_webui_layer_reuse import assert_clean, unet_of

from tome_core.calibration import MAX_RUNS
from tome_core.hosts.webui import calibrate as webui_calibrate

STEPS = tuple(range(999, 0, -50))  # 20 DDPM timesteps
CALIBRATED = {"method": "ToDo", "downsample_factor": 1.0, "reuse_interval": 3, "reuse_plan": "calibrated"}
MODELS = [("forge", "sd1"), ("forge", "sdxl"), ("neo", "sd15"), ("neo", "sdxl")]


def forge_or_neo(kind: str, layout: str, seed: int = 0):
    """``p.sd_model`` of lllyasviel's Forge (an ldm UNet under ``webui_host``'s Forge patcher, its predictor an
    epsilon one, as Forge's KModel for SD1.5 and SDXL) or of Neo (ComfyUI's UNet under Neo's patcher)."""
    if kind == "neo":
        return neo_host.neo_unet_model(layout, seed)
    sd_model = ForgeSDModel(make_unet(layout, seed=seed))
    sd_model.forge_unet_original.model.predictor.prediction_type = "epsilon"
    return sd_model


@pytest.fixture(scope="module")
def host():
    return Host()


def counted(host, sd_model, args, on_step=None, **kwargs):
    """``test_webui_calibration.counted``, the UNet calls counted at its last module."""
    return webui_counted(host, sd_model, args, on_step, counted_at=unet_of(sd_model).out, clean=False, **kwargs)


def assert_nothing_patched(host, sd_model):
    """A plain job loads the job's patcher again (Forge and Neo unload the clone a job patched): no layer forward,
    hook or pass of ours stays, and the patcher the host keeps has no patch of ours."""
    counted(host, sd_model, script_args(enabled=False))
    assert_clean(sd_model)
    original = sd_model.forge_unet_original
    assert original.object_patches == {} and not original.model_options["transformer_options"].get("patches")


def with_lora(sd_model, strength: float):
    """The job's patcher after a LoRA (Forge's ``forge_objects_after_applying_lora``): a clone of the loaded
    model's patcher with the LoRA's patch at ``strength`` (Forge: ``add_patches(filename=..., strength_patch=...)``;
    Neo: ComfyUI's ``add_patches(patches, strength_patch)``), merged into the weight in place when it is loaded."""
    base = sd_model.forge_unet_original
    diff = torch.full_like(unet_of(sd_model).out[2].weight, 0.01)
    lora = base.clone()
    if hasattr(lora, "lora_patches"):
        lora.add_patches(filename="style.safetensors", patches={"diffusion_model.out.2.weight": ("diff", (diff,))},
                         strength_patch=strength)  # fmt: skip
    else:
        lora.add_patches({"diffusion_model.out.2.weight": (diff,)}, strength_patch=strength)
    sd_model.forge_unet_original = lora
    return base


@pytest.mark.parametrize(("kind", "layout"), MODELS)
def test_the_first_job_calibrates_and_the_next_runs_the_kept_plan(host, kept_file, searches, kind, layout):
    sd_model = forge_or_neo(kind, layout)
    plain, _, _, plain_calls = counted(host, sd_model, script_args(enabled=False))
    host.console.clear()
    first, p, runs, _ = counted(host, sd_model, script_args(**CALIBRATED))
    assert torch.equal(first, plain)  # the user's picture is the unpatched run's, bit for bit
    (entry,) = kept(kept_file).values()
    result = entry["result"]
    assert 2 <= result["runs"] <= MAX_RUNS and runs == 2 * result["runs"]  # each run on two seeds
    assert "host:forge" in entry["key"]["extra"]
    assert p.extra_generation_params["ToMe reuse plan"] == "calibrated"
    assert p.extra_generation_params[webui_calibrate.KEY_CALIBRATED].endswith("kept; this picture every step")
    (search,) = searches
    second, p2, runs2, calls2 = counted(host, sd_model, script_args(**CALIBRATED))
    third, _, _, calls3 = counted(host, sd_model, script_args(**CALIBRATED))
    assert runs2 == 1 and torch.equal(second, search.kept[:1]) and torch.equal(second, third)  # the kept picture
    assert calls2 == calls3 == (plain_calls if result["spacing"] is None else result["computed"])
    assert result["spacing"] is None or calls2 < plain_calls
    computed = "every step" if result["spacing"] is None else f"{result['computed']} of {len(STEPS)} steps"
    assert p2.extra_generation_params[webui_calibrate.KEY_CALIBRATED] == computed
    assert len(kept(kept_file)) == 1 and len(searches) == 1  # nothing calibrated again
    assert not [line for line in host.console if "Error" in line]
    assert_nothing_patched(host, sd_model)


@pytest.mark.parametrize(("kind", "layout"), [MODELS[0], MODELS[2]])
def test_another_lora_strength_is_another_key_and_a_merged_lora_keeps_its_key(host, kept_file, kind, layout):
    sd_model = forge_or_neo(kind, layout, seed=1)
    counted(host, sd_model, script_args(**CALIBRATED))
    base = with_lora(sd_model, 0.8)
    _, _, runs, _ = counted(host, sd_model, script_args(**CALIBRATED))
    assert runs > 1 and len(kept(kept_file)) == 2
    # The LoRA stays merged into the loaded weights after the job (Forge's lora_loader, Neo's loaded clone): the
    # weights are read from the patcher's backup, so the next job finds its plan.
    unet = unet_of(sd_model)
    _, _, runs, _ = counted(host, sd_model, script_args(**CALIBRATED))
    assert runs == 1 and len(kept(kept_file)) == 2
    sd_model.forge_unet_original = base
    with_lora(sd_model, 0.5)
    _, _, runs, _ = counted(host, sd_model, script_args(**CALIBRATED))
    assert runs > 1 and len(kept(kept_file)) == 3
    sd_model.forge_unet_original = base  # the LoRA off: the first key's plan again
    _, _, runs, _ = counted(host, sd_model, script_args(**CALIBRATED))
    assert runs == 1 and len(kept(kept_file)) == 3
    assert unet_of(sd_model) is unet
    assert_nothing_patched(host, sd_model)


def test_the_key_reads_a_weight_merged_in_place_from_the_backup_and_the_patch_by_strength():
    """Forge's LoRA loader and Neo's patcher merge a LoRA into the weight in place and keep the weight it replaced:
    the key's weights are the file's, its patches the LoRA's with their strength."""
    forge = forge_or_neo("forge", "sd1", seed=2)
    base = forge.forge_unet_original
    plain = (webui_calibrate._forge_unet_fingerprint(base), webui_calibrate._forge_patches_fingerprint(base))
    with_lora(forge, 0.8)
    lora = forge.forge_unet_original
    before = (webui_calibrate._forge_unet_fingerprint(lora), webui_calibrate._forge_patches_fingerprint(lora))
    lora.refresh_loras()  # merged in place, as when it is loaded for sampling
    assert lora.model.lora_loader.backup
    merged = (webui_calibrate._forge_unet_fingerprint(lora), webui_calibrate._forge_patches_fingerprint(lora))
    assert merged == before and merged[0] == plain[0] and merged[1] != plain[1]
    neo = forge_or_neo("neo", "sd15", seed=2)
    base = neo.forge_unet_original
    plain = (webui_calibrate._forge_unet_fingerprint(base), webui_calibrate._forge_patches_fingerprint(base))
    with_lora(neo, 0.8)
    lora = neo.forge_unet_original
    lora.patch_model()
    try:
        assert lora.backup
        merged = (webui_calibrate._forge_unet_fingerprint(lora), webui_calibrate._forge_patches_fingerprint(lora))
    finally:
        lora.unpatch_model()
    assert merged[0] == plain[0] and merged[1] != plain[1]


@pytest.mark.parametrize("kind", ["forge", "neo"])
@pytest.mark.parametrize("stop", ["interrupt", "error"])
def test_an_interrupted_calibration_keeps_nothing(host, kept_file, kind, stop, capsys):
    sd_model = forge_or_neo(kind, "sd1" if kind == "forge" else "sd15", seed=3)
    plain, _, _, _ = counted(host, sd_model, script_args(enabled=False))

    def on_step(p, i, run):
        if run == 3 and i == 5:  # the first candidate's run
            if stop == "error":
                raise RuntimeError("out of memory")
            host.state.interrupted = True

    out, p, runs, _ = counted(host, sd_model, script_args(**CALIBRATED, calibration_picture=True), on_step=on_step)
    assert torch.equal(out, plain) and runs == 3
    assert not kept_file.exists() and not (kept_file.parent / webui_calibrate.REPORTS).exists()
    assert p.processed.extra_images == []
    said = "stopped (Interrupt or Skip)" if stop == "interrupt" else "failed (RuntimeError('out of memory'))"
    assert f"calibration: {said}; nothing is kept" in capsys.readouterr().out
    assert not host.console
    assert_nothing_patched(host, sd_model)


@pytest.mark.parametrize("kind", ["forge", "neo"])
def test_highres_fix_without_a_kept_plan_runs_forecast_v3_with_one_line(host, kept_file, kind, capsys):
    sd_model = forge_or_neo(kind, "sd1" if kind == "forge" else "sd15", seed=4)
    _, _, runs, _ = counted(host, sd_model, script_args(**CALIBRATED), enable_hr=True)
    assert runs == 2 and not kept_file.exists()  # the two passes, once
    assert capsys.readouterr().out.count("'calibrated' with highres fix: the first pass runs the plan kept") == 1
    assert not host.console
    assert_nothing_patched(host, sd_model)


@pytest.mark.parametrize("kind", ["forge", "neo"])
def test_highres_fix_runs_the_plan_kept_for_its_first_pass(host, kept_file, kind, capsys, monkeypatch):
    import hosts.webui_host as webui_host

    sd_model = forge_or_neo(kind, "sd1" if kind == "forge" else "sd15", seed=4)
    counted(host, sd_model, script_args(**CALIBRATED))  # the job without highres fix calibrates
    kept_plan, _, _, _ = counted(host, sd_model, script_args(**CALIBRATED))
    passes, real = [], webui_host.sample
    monkeypatch.setattr(webui_host, "sample", lambda *args: passes.append(real(*args)) or passes[-1])
    capsys.readouterr()
    _, _, runs, _ = counted(host, sd_model, script_args(**CALIBRATED), enable_hr=True)
    assert runs == 2 and len(kept(kept_file)) == 1 and len(passes) == 2
    assert torch.equal(passes[0], kept_plan)  # the first pass: the kept plan's picture, bit for bit
    assert capsys.readouterr().out.count("the plan kept for this job") == 1
    assert_nothing_patched(host, sd_model)


def test_the_picture_is_added_on_forge_when_asked(host, kept_file):
    sd_model = forge_or_neo("forge", "sd1", seed=5)
    _, p, _, _ = counted(host, sd_model, script_args(**CALIBRATED, calibration_picture=True))
    (identity,) = kept(kept_file)
    (picture,) = p.processed.extra_images
    assert picture.mode == "RGB"
    changes = kept(kept_file)[identity]["result"]["changes"]  # the chart, from Forge's CFG callbacks
    assert len(changes) == len(STEPS) and all(change > 0 for change in changes[1:])
    assert sorted(item.name for item in (kept_file.parent / webui_calibrate.REPORTS).iterdir()) == [
        f"{identity}.png",
        "latest.png",
    ]


@pytest.mark.parametrize(("kind", "layout"), [MODELS[0], MODELS[2]])
def test_with_todo_on_the_first_job_gets_the_truly_unpatched_picture(host, kept_file, searches, kind, layout):
    """The calibrating job's own pass is the search's reference: without ToDo as without reuse, the picture of
    the job with the patch off, not the one of ToDo alone; the search decides ToDo."""
    sd_model = forge_or_neo(kind, layout, seed=6)
    plain, _, _, _ = counted(host, sd_model, script_args(enabled=False))
    todo, _, _, _ = counted(host, sd_model, script_args(method="ToDo", downsample_factor=2.0))
    assert not torch.equal(todo, plain)  # ToDo acts on the stand-in
    first, p, runs, _ = counted(host, sd_model, script_args(**WITH_TODO))
    assert torch.equal(first, plain) and runs > 2
    (search,) = searches
    assert search.reduces
    said = p.extra_generation_params[webui_calibrate.KEY_CALIBRATED]
    assert said.endswith("kept; this picture every step, without ToDo")
    assert_nothing_patched(host, sd_model)


def test_a_pass_whose_todo_reduces_nothing_leaves_the_search_none_to_decide(host, kept_file, searches):
    """ToDo on, but on no level of this UNet (SDXL's attention is at downsampling 2 and 4, ToDo asked at 1 only):
    the pass reduces no tokens, so the search has no reduction to decide and the infotext names none."""
    sd_model = forge_or_neo("forge", "sdxl", seed=7)
    _, p, runs, _ = counted(host, sd_model, script_args(**WITH_TODO, max_downsample=1))
    (search,) = searches
    assert not search.reduces and runs > 2
    assert p.extra_generation_params[webui_calibrate.KEY_CALIBRATED].endswith("kept; this picture every step")
    (entry,) = kept(kept_file).values()
    assert entry["result"]["reduce"] is True


@pytest.mark.parametrize(("kind", "layout"), [MODELS[0], MODELS[2]])
def test_a_plan_kept_without_todo_runs_without_it(host, kept_file, searches, monkeypatch, kind, layout):
    """A result kept with ``reduce`` False: the next job runs the kept plan without ToDo (its picture the
    search's unreduced run of it, bit for bit) and says so; the same entry with ``reduce`` True runs it with ToDo."""
    sd_model = forge_or_neo(kind, layout, seed=8)
    reduced_runs_lose(monkeypatch, searches)
    counted(host, sd_model, script_args(**WITH_TODO))
    (search,) = searches
    ((identity, entry),) = kept(kept_file).items()
    result = entry["result"]
    assert result["reduce"] is False and result["spacing"] is not None
    computed = f"{result['computed']} of {len(STEPS)} steps"
    second, p, runs, calls = counted(host, sd_model, script_args(**WITH_TODO))
    assert runs == 1 and calls == result["computed"] and torch.equal(second, search.kept[:1])
    assert p.extra_generation_params[webui_calibrate.KEY_CALIBRATED] == f"{computed}, without ToDo"
    reduce_kept(kept_file, identity, True)
    third, p, runs, calls = counted(host, sd_model, script_args(**WITH_TODO))
    assert runs == 1 and calls == result["computed"] and not torch.equal(third, second)
    assert p.extra_generation_params[webui_calibrate.KEY_CALIBRATED] == computed
    assert len(searches) == 1 and not host.console
    assert_nothing_patched(host, sd_model)
