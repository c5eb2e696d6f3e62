"""Scope block in the WebUI (ldm class swap) and on Forge (object patches), and tomesd parity of the sub-layer
merges, in jobs run the way the hosts run them (see webui_host.py)."""

from __future__ import annotations

import pytest
import torch
from hosts.webui_host import ForgeSDModel, Host, SDModel, make_unet, run_job, script_args
from ldm.modules.attention import BasicTransformerBlock

from tome_core import PatchSettings
from tome_core.hosts.shared.model_patcher import BlockForward
from tome_core.hosts.webui import ldm_patch

BLOCK = {"scope": "block", "max_downsample": "4"}


@pytest.fixture(scope="module")
def host():
    return Host()


def _inputs(size=8):
    generator = torch.Generator().manual_seed(3)
    return torch.randn(2, 4, size, size, generator=generator), torch.randn(2, 5, 32, generator=generator)


@pytest.mark.parametrize("layout", ["sd1", "sd2", "sdxl"])
def test_block_scope_changes_output_then_leaves_nothing(host, layout):
    sd_model = SDModel(make_unet(layout))
    baseline, _ = run_job(host, sd_model, script_args(enabled=False))
    self_attention, _ = run_job(host, sd_model, script_args(max_downsample="4"))
    patched, p = run_job(host, sd_model, script_args(**BLOCK))
    assert torch.isfinite(patched).all()
    assert not torch.equal(patched, baseline) and not torch.equal(patched, self_attention)
    assert p.extra_generation_params["ToMe scope"] == "block"
    unet = sd_model.model.diffusion_model
    assert not ldm_patch.is_patched(unet) and not unet._forward_pre_hooks and not unet._forward_hooks
    again, _ = run_job(host, sd_model, script_args(enabled=False))
    assert torch.equal(again, baseline)
    assert not host.console


def test_default_scope_writes_no_infotext_key(host):
    _, p = run_job(host, SDModel(make_unet("sd1")), script_args())
    assert "ToMe scope" not in p.extra_generation_params


def test_plans_are_shared_per_level_within_a_call_and_dropped_after_it(monkeypatch):
    from tome_core import matching

    made = []
    real = matching.make_plan
    monkeypatch.setattr(matching, "make_plan", lambda *args: made.append(args[0].shape) or real(*args))
    unet = make_unet("sd1")  # attention at levels 1 and 2, two transformers per level on the way up
    x, context = _inputs(16)
    t = torch.full((2,), 700.0)
    settings = PatchSettings(method="tome", scope="block", max_downsample=2, skip_when_slower=False)
    assert ldm_patch.install_patch(unet, settings)
    state = unet.__dict__["_tome_patch_state"]
    blocks_seen = []
    with torch.no_grad():
        for _ in range(2):
            unet(x, t, context=context)
            blocks_seen.append(state.plans)
    assert made == [(2, 256, 32), (2, 64, 64)] * 2  # level 1 (16x16) and level 2 (8x8), once per call each
    assert blocks_seen == [{}, {}]  # no plan outlives its call
    ldm_patch.remove_patch(unet)
    assert not unet._forward_hooks and not unet._forward_pre_hooks


def test_sgm_extra_arguments_still_pass_through_unreduced():
    class SgmLikeBlock(BasicTransformerBlock):
        def _forward(self, x, context=None, additional_tokens=None, n_times_crossframe_attn_in_self=0):
            return super()._forward(x, context)

    unet = make_unet("sd1")
    block = next(m for _, m in ldm_patch.transformer_blocks(unet))
    block.__class__ = SgmLikeBlock
    x, context = torch.randn(2, 64, 32), torch.randn(2, 5, 32)
    with torch.no_grad():
        plain = block._forward(x, context, additional_tokens=x[:, :3], n_times_crossframe_attn_in_self=2)
        assert ldm_patch.install_patch(unet, PatchSettings(scope="block", max_downsample=1, skip_when_slower=False))
        unet.__dict__["_tome_patch_state"].latent_hw = (8, 8)
        passed = block._forward(x, context, additional_tokens=x[:, :3], n_times_crossframe_attn_in_self=2)
        assert torch.equal(passed, plain)
        reduced = block._forward(x, context)
        assert not torch.equal(reduced, SgmLikeBlock._forward(block, x, context))
    ldm_patch.remove_patch(unet)
    assert type(block) is SgmLikeBlock


def test_self_attention_scope_with_every_sub_layer_agrees_with_tomesd(host):
    """ToMe for SD with merge_crossattn and merge_mlp on (its whole-block variant: each sub-layer merged and
    unmerged into the full-size residual) is our scope self-attention with all three merge switches on. The
    tolerance is that of test_webui_parity.py: float summation order only, 1000x below the patch's effect."""
    import tomesd

    sd_model = SDModel(make_unet("sd1"))
    baseline, _ = run_job(host, sd_model, script_args(enabled=False), size=16)
    args = script_args(ratio=0.5, max_downsample="1", merge_crossattn=True, merge_mlp=True)
    ours, _ = run_job(host, sd_model, args, size=16)
    tomesd.apply_patch(sd_model, ratio=0.5, max_downsample=1, use_rand=False, merge_crossattn=True, merge_mlp=True)
    try:
        reference, _ = run_job(host, sd_model, script_args(enabled=False), size=16)
    finally:
        tomesd.remove_patch(sd_model)
    scale = baseline.abs().max().item()
    effect = (ours - baseline).abs().max().item()
    difference = (ours - reference).abs().max().item()
    assert difference <= 1e-5 * scale
    assert difference * 1000 <= effect


# --- Forge ------------------------------------------------------------------------------------------------------


def _forge_and_ldm(layout="sd1"):
    return ForgeSDModel(make_unet(layout, seed=5)), SDModel(make_unet(layout, seed=5))


def _forward_patches(forge):
    return [v for v in forge.forge_objects.unet.object_patches.values() if isinstance(v, BlockForward)]


@pytest.mark.parametrize("layout", ["sd1", "sdxl"])
def test_forge_block_scope_gives_the_ldm_result(host, layout):
    """Forge's object-patched block forwards compute what the ldm class swap computes: same plans (the block
    input of the first block of each level), same sub-layers; Forge adds the residual in place."""
    forge, ldm = _forge_and_ldm(layout)
    args = script_args(**BLOCK)
    forge_out, p = run_job(host, forge, args, enable_hr=True)
    ldm_out, _ = run_job(host, ldm, args, enable_hr=True)
    plain, _ = run_job(host, ldm, script_args(enabled=False), enable_hr=True)
    assert not torch.equal(forge_out, plain)
    torch.testing.assert_close(forge_out, ldm_out, rtol=0, atol=1e-6)
    assert p.extra_generation_params["ToMe scope"] == "block"
    assert not host.console


def test_forge_object_patches_are_idempotent_and_undone_by_the_next_load(host):
    forge, _ = _forge_and_ldm()
    unet = forge.forge_unet_original.model.diffusion_model
    blocks = [m for m in unet.modules() if isinstance(m, BasicTransformerBlock)]
    never, _ = run_job(host, forge, script_args(enabled=False), enable_hr=True)
    seen = []

    def probe(p, step):
        patcher = p.sd_model.forge_objects.unet
        forwards = [b.__dict__.get("forward") for b in blocks]
        seen.append(
            (p.is_hr_pass, len(_forward_patches(p.sd_model)), all(isinstance(f, BlockForward) for f in forwards))
        )
        assert not patcher.model_options["transformer_options"].get("patches")  # no attention hooks in scope block

    patched, _ = run_job(host, forge, script_args(**BLOCK), enable_hr=True, on_step=probe)
    # One object patch per block in each pass (the highres pass's double call replaces, never stacks).
    assert seen == [(False, len(blocks), True)] * 3 + [(True, len(blocks), True)] * 2
    assert forge.forge_unet_original.object_patches == {}
    assert forge.forge_unet_original.model_options == {"transformer_options": {}}
    # The next job loads the unpatched patcher: Forge unloads ours and puts back the forward it read (the bound
    # method of the block's class), which computes exactly the original block.
    again, _ = run_job(host, forge, script_args(enabled=False), enable_hr=True)
    assert torch.equal(again, never) and not torch.equal(patched, never)
    for block in blocks:
        restored = block.__dict__.get("forward")
        assert restored is None or (restored.__self__ is block and restored.__func__ is type(block).forward)


def test_forge_block_scope_then_self_attention_scope(host):
    forge, _ = _forge_and_ldm()
    block_out, _ = run_job(host, forge, script_args(**BLOCK))
    attn_out, _ = run_job(host, forge, script_args(max_downsample="4"))
    fresh, _ = _forge_and_ldm()
    attn_fresh, _ = run_job(host, fresh, script_args(max_downsample="4"))
    assert torch.equal(attn_out, attn_fresh) and not torch.equal(block_out, attn_out)
