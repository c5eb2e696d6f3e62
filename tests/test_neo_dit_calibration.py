"""Forge Neo and lllyasviel's Forge: ``reuse_plan`` "calibrated" on a DiT (``calibrate.dit_schedule_for_pass``). A
job here runs as Neo's ``p.sample`` runs it (``forge_objects`` rebuilt from the job's patcher,
``process_before_every_sampling``, then the pass over ``neo_host``'s sampler, each image's noise from its seed in
``p.rng``): the first job with a key gets the unpatched picture bit for bit and keeps its family's plan at the
interval its calibration found, in at most ``MAX_RUNS`` runs of two seeds; the next jobs run that plan, the same
picture each time, and the infotext says so; a guard's extra steps are counted; reuse interval 1 and highres fix
run as before with one line; nothing stays patched."""

from __future__ import annotations

import json

import pytest
import torch
from hosts import (
    comfy_host,  # noqa: I001  (before any ComfyUI import: sys.path, CPU mode)
    neo_host,
    webui_host,
)
from hosts.webui_host import Host, script_args
from test_webui_neo_dit import assert_clean

from tome_core.calibration import MAX_RUNS
from tome_core.hosts.webui import args as webui_args
from tome_core.hosts.webui import calibrate as webui_calibrate

STEPS = 20
SHAPE = (1, 9, 13)  # batch, height, width of the latent (its channels are the family's)
SEED = 42
# The random weights' picture moves fast under reuse: a loose target keeps a plan that reuses.
CALIBRATED = {"method": "ToDo", "reuse_interval": 3, "reuse_plan": "calibrated", "calibration_target": 0.9}


@pytest.fixture(scope="module")
def host():
    """One WebUI process with the script loaded, shared by the module's jobs."""
    return Host()


def kept(path) -> dict:
    """The kept file's entries (none where no calibration kept one)."""
    return json.loads(path.read_text())["entries"] if path.exists() else {}


class NeoJob(webui_host.Processing):
    """A txt2img job of Neo (or lllyasviel's Forge) on a DiT, sampled by ``p.sample`` as Neo's
    ``modules/processing.py`` does: ``forge_objects`` rebuilt from the patcher, ``process_before_every_sampling``,
    the sampler; with highres fix a second pass the same way (here at the same size)."""

    family = "flux"
    forge = False  # lllyasviel's Forge: its sampler hands the model no list of the pass's sigmas
    sampler_name = "Euler"  # the label (``p.sampler`` is lllyasviel's Forge's sampler object there)
    samples = 0  # ``p.sample`` calls, for the tests

    def sample(self, conditioning, unconditional_conditioning, seeds, subseeds, subseed_strength, prompts):
        """Each image's noise comes from its seed in ``p.rng`` (the calibration draws other seeds through it)."""
        (seed,) = self.rng.seeds
        self.samples += 1
        out = None
        for number in range(2 if self.enable_hr else 1):
            self.is_hr_pass = number > 0
            self.sd_model.forge_objects.unet = self.sd_model.forge_unet_original
            latent = torch.zeros(1, *self.rng.shape)
            self.host.run_hook(self, "process_before_every_sampling", x=latent, noise=latent)
            out = neo_host.sample(self.host, self, self.sd_model.forge_objects.unet, self.family, SHAPE, seed + number)
        self.is_hr_pass = False
        return out


def dit_job(host, patcher, args, family="flux", forge=False, steps=STEPS, enable_hr=False):
    """One job through the script's hooks; returns its latent and ``p``."""
    p = NeoJob(neo_host.NeoSDModel(patcher), args, seed=SEED, enable_hr=enable_hr)
    p.family, p.forge = family, forge
    p.scheduler = "Simple"
    p.neo_steps, p.neo_cfg, p.neo_refiner = steps, 1.0, None
    if forge:
        p.sampler = neo_host.ForgeSampler(patcher)
    channels = comfy_host.DIT_LATENT_CHANNELS.get(family, 16)
    with torch.no_grad(), host:
        host.state.interrupted = host.state.skipped = False
        host.run_hook(p, "before_process")
        host.run_hook(p, "process")
        p.host = host
        p.rng = webui_host.ImageRNG((channels, *SHAPE[1:]), [SEED])
        out = p.sample(None, None, [SEED], [SEED], 0.0, [""])
        p.processed = webui_host.Processed(p, out)
        host.run_hook(p, "postprocess", p.processed)
    assert "sample" not in vars(p)  # p.sample is the host's own again
    assert_clean(patcher)
    return out, p


def model(kind: str, family: str = "flux", **config):
    """A tiny DiT as Neo (its block hook) or lllyasviel's Forge (its ``inner_forward``, no hook) loads it."""
    config = config or {"depth": 2, "depth_single_blocks": 2}
    return neo_host.forge_model(family, **config) if kind == "forge" else neo_host.neo_model(family, **config)


@pytest.mark.parametrize("kind", ["neo", "forge"])
def test_the_first_dit_job_calibrates_and_the_next_runs_the_kept_plan(host, kept_file, searches, kind, capsys):
    """Neo's Flux (its block hook) and lllyasviel's Forge's (object patches, its sampler's sigmas): the user's
    picture first, then the kept plan's, bit for bit each time, with its computed steps and interval in the
    infotext."""
    flux = model(kind)
    forge = kind == "forge"
    plain, _ = dit_job(host, flux, script_args(enabled=False), forge=forge)
    first, p = dit_job(host, flux, script_args(**CALIBRATED), forge=forge)
    assert torch.equal(first, plain)  # the user's picture is the unpatched run's, bit for bit
    (entry,) = kept(kept_file).values()
    result = entry["result"]
    assert result["interval"] is not None and result["computed"] < STEPS  # a plan that reuses was kept
    assert len(result["changes"]) == STEPS  # the chart, from the CFG callbacks of the unpatched pass
    assert 2 <= result["runs"] <= MAX_RUNS and p.samples == 2 * result["runs"]  # each run on two seeds
    extra = entry["key"]["extra"]
    assert {"host:forge", "dit:Flux"} <= set(extra) and any(words.startswith("plan:every 3") for words in extra)
    params = p.extra_generation_params
    assert params[webui_args.KEY_REUSE_PLAN] == "calibrated" and params[webui_args.KEY_DIT] == "Flux calibrated"
    assert params[webui_calibrate.KEY_CALIBRATED].endswith("kept; this picture every step")
    assert f"(one in {result['interval']}" in params[webui_calibrate.KEY_CALIBRATED]
    (search,) = searches
    second, p2 = dit_job(host, flux, script_args(**CALIBRATED), forge=forge)
    third, p3 = dit_job(host, flux, script_args(**CALIBRATED), forge=forge)
    assert p2.samples == p3.samples == 1 and len(searches) == 1 and len(kept(kept_file)) == 1  # no calibration
    assert torch.equal(second, search.kept[:1]) and torch.equal(second, third)  # the kept picture every time
    assert not torch.equal(second, plain)
    (run,) = p2._tome_patch_job.reuse_runs
    assert run.calls == STEPS and STEPS - run.reused_calls == result["computed"]
    last = f", the last {result['last_full']} in full" if result["last_full"] else ""
    expected = f"{result['computed']} of {STEPS} steps (one in {result['interval']}{last})"
    assert p2.extra_generation_params[webui_calibrate.KEY_CALIBRATED] == expected
    said = capsys.readouterr().out
    assert said.count("calibration: kept in") == 1 and "failed" not in said
    assert not host.console


def test_a_guards_extra_steps_are_counted(host, kept_file):
    """Qwen-Image's first-block guard computes steps its plan would reuse (on random weights, every one): each
    candidate is recorded with the steps it computed, not the steps it planned."""
    qwen = model("neo", "qwen_image", num_layers=4)
    dit_job(host, qwen, script_args(**CALIBRATED), family="qwen_image")
    (entry,) = kept(kept_file).values()
    tried = entry["result"]["tried"]
    assert tried and all(computed == STEPS for computed, _ in tried)


def test_reuse_off_and_highres_fix_run_as_before_with_one_line(host, kept_file, capsys):
    """Reuse interval 1 is the unpatched picture; with highres fix a calibration would run both passes for every
    candidate, so where no plan is kept for its first pass the job runs its family's plan on each pass: one line
    each, nothing kept."""
    flux = model("neo")
    plain, _ = dit_job(host, flux, script_args(enabled=False))
    off, p = dit_job(host, flux, script_args(**{**CALIBRATED, "reuse_interval": 1}))
    assert torch.equal(off, plain) and not p._tome_patch_job.reuse_runs
    assert capsys.readouterr().out.count("reuse across steps is off (reuse interval 1)") == 1
    family_plan, _ = dit_job(host, flux, script_args(**{**CALIBRATED, "reuse_plan": "auto"}), enable_hr=True)
    capsys.readouterr()
    highres, p = dit_job(host, flux, script_args(**CALIBRATED), enable_hr=True)
    assert torch.equal(highres, family_plan) and len(p._tome_patch_job.reuse_runs) == 2 and p.samples == 1
    said = capsys.readouterr().out
    assert said.count("'calibrated' with highres fix: the first pass runs the plan kept for the same job") == 1
    assert not kept_file.exists() and not host.console


def test_highres_fix_runs_the_plan_kept_for_its_first_pass(host, kept_file, capsys, monkeypatch):
    """A highres job's first pass is the job without highres fix: it runs the plan that job kept, bit for bit; the
    highres pass runs the family's plan."""
    flux = model("neo")
    dit_job(host, flux, script_args(**CALIBRATED))  # the job without highres fix calibrates
    kept_plan, _ = dit_job(host, flux, script_args(**CALIBRATED))
    passes, real = [], neo_host.sample
    monkeypatch.setattr(neo_host, "sample", lambda *args: passes.append(real(*args)) or passes[-1])
    capsys.readouterr()
    _, p = dit_job(host, flux, script_args(**CALIBRATED), enable_hr=True)
    assert len(passes) == 2 and torch.equal(passes[0], kept_plan) and p.samples == 1 and len(kept(kept_file)) == 1
    said = capsys.readouterr().out
    assert said.count("the plan kept for this job") == 1 and said.count("with highres fix: the first pass") == 1
    assert not host.console


def with_lora(patcher, strength: float):
    """The job's patcher after a LoRA (Neo's ``forge_objects_after_applying_lora``): a clone with the LoRA's weight
    patch at ``strength`` (ComfyUI's ``add_patches``), merged into the weight when it is loaded."""
    key = "diffusion_model.double_blocks.1.img_attn.qkv.weight"
    diff = torch.full_like(patcher.model.state_dict()[key], 0.01)
    lora = patcher.clone()
    lora.add_patches({key: ("diff", (diff,))}, strength)
    return lora


def test_another_lora_strength_is_another_key(host, kept_file):
    """The key is the job's patcher's (``forge_fingerprints``): its LoRAs by content and strength."""
    flux = model("neo")
    dit_job(host, flux, script_args(**CALIBRATED))
    for strength, calibrates, entries in ((0.8, True, 2), (0.5, True, 3), (0.8, False, 3)):
        _, p = dit_job(host, with_lora(flux, strength), script_args(**CALIBRATED))
        assert (p.samples > 1) == calibrates and len(kept(kept_file)) == entries
    _, p = dit_job(host, flux, script_args(**CALIBRATED))  # the LoRA off: the first key's plan again
    assert p.samples == 1 and len(kept(kept_file)) == 3


def test_a_kept_plan_of_every_step_runs_every_block(host, kept_file, monkeypatch):
    """Where no candidate keeps the target (here every candidate scores 0), every step is kept: the next job runs
    every block, the unpatched picture bit for bit, and its infotext says so."""
    from tome_core.calibration import search as engine_search

    flux = model("neo")
    plain, _ = dit_job(host, flux, script_args(enabled=False))
    with monkeypatch.context() as scores:
        scores.setattr(engine_search, "latent_ssim", lambda latent, reference: torch.zeros(latent.shape[0]))
        dit_job(host, flux, script_args(**CALIBRATED))
    (entry,) = kept(kept_file).values()
    assert entry["result"]["interval"] is None and entry["result"]["runs"] > 1
    again, p = dit_job(host, flux, script_args(**CALIBRATED))
    assert torch.equal(again, plain) and p.samples == 1 and not p._tome_patch_job.reuse_runs
    assert p.extra_generation_params[webui_calibrate.KEY_CALIBRATED] == "every step"
