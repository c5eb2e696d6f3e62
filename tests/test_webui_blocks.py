"""The ldm/sgm block patch on its own: sgm's extra arguments, step range, re-patching, exact removal."""

from __future__ import annotations

import torch
from hosts.webui_host import make_unet
from ldm.modules.attention import BasicTransformerBlock

from tome_core import PatchSettings
from tome_core.hosts.webui import ldm_patch


def _settings(**values):
    return PatchSettings.from_values(**{"method": "tome", "skip_when_slower": False, **values})


def _inputs(size=8):
    generator = torch.Generator().manual_seed(3)
    return torch.randn(2, 4, size, size, generator=generator), torch.randn(2, 5, 32, generator=generator)


class SgmLikeBlock(BasicTransformerBlock):
    """sgm's BasicTransformerBlock._forward signature (generative-models@45c443b sgm/modules/attention.py 463)."""

    calls: list = []

    def _forward(self, x, context=None, additional_tokens=None, n_times_crossframe_attn_in_self=0):
        type(self).calls.append((additional_tokens is not None, n_times_crossframe_attn_in_self))
        return super()._forward(x, context)


def test_sgm_extra_arguments_are_passed_through_unreduced():
    unet = make_unet("sd1")
    block = next(m for _, m in ldm_patch.transformer_blocks(unet))
    block.__class__ = SgmLikeBlock
    x, context = torch.randn(2, 64, 32), torch.randn(2, 5, 32)
    extra = torch.randn(2, 3, 32)
    with torch.no_grad():
        plain = block._forward(x, context, additional_tokens=extra, n_times_crossframe_attn_in_self=2)
        assert ldm_patch.install_patch(unet, _settings(max_downsample=1))
        state = unet.__dict__["_tome_patch_state"]
        state.latent_hw = (8, 8)  # as the UNet's pre-hook records it
        SgmLikeBlock.calls.clear()
        passed = block._forward(x, context, additional_tokens=extra, n_times_crossframe_attn_in_self=2)
        assert SgmLikeBlock.calls == [(True, 2)]
        assert torch.equal(passed, plain)
        reduced = block._forward(x, context)  # no extras: the reduced body runs, the parent's is not called
        assert SgmLikeBlock.calls == [(True, 2)]
        assert not torch.equal(reduced, block.__class__.__mro__[1]._forward(block, x, context))
    ldm_patch.remove_patch(unet)
    assert type(block) is SgmLikeBlock


def test_step_range_follows_the_timestep_the_unet_receives():
    unet = make_unet("sd1")
    x, context = _inputs()
    early, late = torch.full((2,), 900.0), torch.full((2,), 400.0)
    with torch.no_grad():
        plain_early, plain_late = unet(x, early, context=context), unet(x, late, context=context)
        assert ldm_patch.install_patch(unet, _settings(end_percent=0.5))  # stop at timestep 499.5
        assert not torch.equal(unet(x, early, context=context), plain_early)
        assert torch.equal(unet(x, late, context=context), plain_late)
    ldm_patch.remove_patch(unet)


def test_patching_twice_replaces_and_removal_is_exact():
    unet = make_unet("sd2")
    x, context = _inputs()
    t = torch.full((2,), 700.0)
    with torch.no_grad():
        plain = unet(x, t, context=context)
        ldm_patch.install_patch(unet, _settings(ratio=0.3))
        assert ldm_patch.install_patch(unet, _settings(ratio=0.6))
        once = unet(x, t, context=context)
        for _, block in ldm_patch.transformer_blocks(unet):
            assert [c.__name__ for c in type(block).__mro__].count("TomePatchReducedBlock") == 1
        assert len(unet._forward_pre_hooks) == 1
        ldm_patch.remove_patch(unet)
        ldm_patch.install_patch(unet, _settings(ratio=0.6))
        assert torch.equal(unet(x, t, context=context), once)
        ldm_patch.remove_patch(unet)
        assert torch.equal(unet(x, t, context=context), plain)
    assert not ldm_patch.is_patched(unet)


def test_settings_that_change_nothing_install_nothing():
    unet = make_unet("sd1")
    assert not ldm_patch.install_patch(unet, _settings(ratio=0.0))
    assert not ldm_patch.install_patch(unet, _settings(method="todo", downsample_factor=1.0))
    assert not ldm_patch.is_patched(unet)
