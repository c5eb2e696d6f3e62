"""The WebUI script against references: tomesd 0.1.3 (the WebUI's built-in) and the Forge hook path."""

from __future__ import annotations

import torch
from hosts.webui_host import ForgeSDModel, Host, SDModel, make_unet, run_job, script_args

from tome_core.hosts.shared.model_patcher import PatcherHooks


def test_tome_path_agrees_with_tomesd_on_the_same_unet():
    """Same UNet, same job: ours (randomness off, level 1 only) against the built-in token merging, which is
    tomesd 0.1.3 with use_rand=False, max_downsample=1 (modules/sd_models.py 1025-1032).

    Both merge the same tokens into the same destinations (the plan is the same function of the block input);
    they differ only in float summation order (ours: index_add and a multiply by 1/count; tomesd: scatter_reduce
    mean), a few fp32 ulp (1.2e-7 relative) per merged token. Carried through the UNet's layers, CFG (x5) and 3
    Euler steps this measures about 1e-6 of the result's scale; the bound is 1e-5 of it. The patch itself moves
    the result by about 0.2 of its scale, so the bound is also required to be 1000x below that effect: the
    comparison cannot pass because the patch did nothing.
    """
    host = Host()
    sd_model = SDModel(make_unet("sd1"))
    baseline, _ = run_job(host, sd_model, script_args(enabled=False), size=16)
    ours, _ = run_job(host, sd_model, script_args(ratio=0.5, max_downsample="1"), size=16)
    builtin, _ = run_job(host, sd_model, script_args(enabled=False), size=16, token_merging_ratio=0.5)
    scale = baseline.abs().max().item()
    effect = (ours - baseline).abs().max().item()
    difference = (ours - builtin).abs().max().item()
    assert difference <= 1e-5 * scale
    assert difference * 1000 <= effect


def _forge_and_ldm(layout="sd1"):
    return ForgeSDModel(make_unet(layout, seed=5)), SDModel(make_unet(layout, seed=5))


def test_forge_path_gives_the_ldm_result():
    """On a patcher with Forge's hook signature, ToDo computes exactly what the ldm class swap computes."""
    host = Host()
    forge, ldm = _forge_and_ldm()
    plain_forge, _ = run_job(host, forge, script_args(enabled=False), enable_hr=True)
    plain_ldm, _ = run_job(host, ldm, script_args(enabled=False), enable_hr=True)
    assert torch.equal(plain_forge, plain_ldm)  # the stand-in Forge block is the ldm block with hook points
    args = script_args(method="ToDo", hr_same=False, hr_downsample_factor=3)
    todo_forge, p = run_job(host, forge, args, enable_hr=True)
    todo_ldm, _ = run_job(host, ldm, args, enable_hr=True)
    assert not torch.equal(todo_forge, plain_forge)
    torch.testing.assert_close(todo_forge, todo_ldm, rtol=0, atol=1e-6)
    assert p.extra_generation_params["ToMe hr downsample"] == 3.0
    assert not host.console


def test_forge_highres_double_call_is_idempotent_and_input_patcher_untouched():
    host = Host()
    forge, _ = _forge_and_ldm()
    seen = []

    def probe(p, step):
        patches = p.sd_model.forge_objects.unet.model_options["transformer_options"].get("patches", {})
        ours = [hook for hooks in patches.values() for hook in hooks if isinstance(hook.__self__, PatcherHooks)]
        seen.append((p.is_hr_pass, len(ours)))

    tome, _ = run_job(host, forge, script_args(merge_crossattn=True), enable_hr=True, on_step=probe)
    assert seen == [(False, 4)] * 3 + [(True, 4)] * 2  # attn1 in/out and attn2 in/out, once each
    assert forge.forge_unet_original.model_options == {"transformer_options": {}}
    plain, _ = run_job(host, forge, script_args(enabled=False), enable_hr=True)
    assert not torch.equal(tome, plain) and torch.isfinite(tome).all()


def test_forge_unsupported_model_warns_once(capsys):
    host = Host()
    forge = ForgeSDModel(make_unet("sd1"))
    forge.forge_unet_original.model.diffusion_model = torch.nn.Identity()  # a DiT stand-in: no UNet layout
    forge.forge_objects.unet = forge.forge_unet_original
    args = script_args()
    from hosts.webui_host import Processing, _reset_forge

    p = Processing(forge, args, enable_hr=True)
    _reset_forge(p)
    host.run_hook(p, "before_process")
    for is_hr in (False, True, True):
        p.is_hr_pass = is_hr
        host.run_hook(p, "process_before_every_sampling")
    assert capsys.readouterr().out.count("[ToMe Patch]") == 1
    assert p.sd_model.forge_objects.unet is forge.forge_unet_original
