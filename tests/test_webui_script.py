"""The WebUI script in a job run the way WebUI v1.10.1 runs it (see webui_host.py), on the real ldm UNet code."""

from __future__ import annotations

import pytest
import tomesd
import torch
from hosts.webui_host import Host, SDModel, make_unet, run_job, script_args

from tome_core.hosts.webui import ldm_patch

OUR_ATTRS = ("_tome_patch_state", "_tome_patch_hook")


@pytest.fixture(scope="module")
def host():
    return Host()


@pytest.fixture(scope="module")
def sd1():
    return SDModel(make_unet("sd1"))


@pytest.fixture(scope="module")
def sd1_baseline(host, sd1):
    return run_job(host, sd1, script_args(enabled=False))[0]


@pytest.fixture(scope="module")
def sd1_hr_baseline(host, sd1):
    return run_job(host, sd1, script_args(enabled=False), enable_hr=True)[0]


def assert_clean(sd_model):
    """Nothing of ours (or tomesd's) is left: original classes, no attributes, no hooks."""
    unet = sd_model.model.diffusion_model
    assert not ldm_patch.is_patched(unet)
    for module in unet.modules():
        assert type(module).__name__ not in ("TomePatchReducedBlock", "ToMeBlock")
        assert not any(name in module.__dict__ for name in OUR_ATTRS)
    assert not unet._forward_pre_hooks


@pytest.mark.parametrize("layout", ["sd1", "sd2", "sdxl"])
@pytest.mark.parametrize("method", ["ToMe", "ToDo"])
def test_patch_changes_output_then_leaves_nothing(host, layout, method):
    sd_model = SDModel(make_unet(layout))
    baseline, _ = run_job(host, sd_model, script_args(enabled=False))
    patched, p = run_job(host, sd_model, script_args(method=method))
    assert torch.isfinite(patched).all()
    assert not torch.equal(patched, baseline)
    assert p.extra_generation_params["ToMe method"] == method
    assert_clean(sd_model)
    again, _ = run_job(host, sd_model, script_args(enabled=False))
    assert torch.equal(again, baseline)  # removal restores the exact computation
    assert not host.console


def test_sdxl_layout_is_reduced_at_its_finest_attention_level(host):
    sd_model = SDModel(make_unet("sdxl"))
    seen = []

    def probe(p, step):
        seen.append(sorted(sd_model.model.diffusion_model.__dict__["_tome_patch_state"].reducer.levels))

    run_job(host, sd_model, script_args(), on_step=probe)  # max downsample "auto"
    assert seen == [[2]] * 3  # no attention at level 1 on SDXL: auto picks level 2
    assert_clean(sd_model)


def test_off_is_bit_identical(host, sd1, sd1_baseline):
    out, p = run_job(host, sd1, script_args(enabled=False, ratio=0.7, method="ToMe"))
    assert torch.equal(out, sd1_baseline)
    assert not any(key.startswith("ToMe") for key in p.extra_generation_params)
    assert_clean(sd1)


def _probe_settings(sd_model, record):
    def probe(p, step):
        state = sd_model.model.diffusion_model.__dict__.get("_tome_patch_state")
        settings = None if state is None else state.reducer.settings
        record.append((p.is_hr_pass, None if settings is None else (settings.method, settings.ratio)))

    return probe


def _run_probed(host, sd_model, args, **kwargs):
    from hosts.webui_host import Processing, process_images

    record = []
    p = Processing(sd_model, args, **kwargs)
    p.on_step = _probe_settings(sd_model, record)
    with torch.no_grad():
        out = process_images(host, p)
    return out, p, record


def test_highres_pass_uses_its_own_value(host, sd1, sd1_hr_baseline):
    out, p, record = _run_probed(host, sd1, script_args(ratio=0.3, hr_same=False, hr_ratio=0.6), enable_hr=True)
    first = {value for is_hr, value in record if not is_hr}
    second = {value for is_hr, value in record if is_hr}
    assert first == {("tome", 0.3)} and second == {("tome", 0.6)}
    assert p.extra_generation_params["ToMe ratio"] == 0.3 and p.extra_generation_params["ToMe hr ratio"] == 0.6
    assert not torch.equal(out, sd1_hr_baseline)
    assert_clean(sd1)


def test_highres_pass_same_value_by_default(host, sd1):
    _, _, record = _run_probed(host, sd1, script_args(ratio=0.4), enable_hr=True)
    assert {value for _, value in record} == {("tome", 0.4)} and len(record) == 5


def test_highres_only_leaves_the_first_pass_unpatched(host, sd1, sd1_hr_baseline):
    out, p, record = _run_probed(host, sd1, script_args(hr_only=True), enable_hr=True)
    assert [value for is_hr, value in record if not is_hr] == [None] * 3
    assert {value for is_hr, value in record if is_hr} == {("tome", 0.5)}
    assert p.extra_generation_params["ToMe hr only"] is True
    assert not torch.equal(out, sd1_hr_baseline)
    assert_clean(sd1)
    # Without highres fix, "highres only" reduces nothing.
    plain, _, record = _run_probed(host, sd1, script_args(hr_only=True))
    assert all(value is None for _, value in record)


def test_highres_pass_on_another_checkpoint_patches_that_one(host):
    base, hr_model = SDModel(make_unet("sd1", seed=1)), SDModel(make_unet("sd1", seed=2))
    _, _, record = _run_probed(host, base, script_args(), enable_hr=True, hr_sd_model=hr_model)
    assert_clean(base)
    assert_clean(hr_model)
    assert [value for is_hr, value in record if not is_hr] == [("tome", 0.5)] * 3
    # The probe looks at the base model's UNet: during the highres pass that one is no longer patched.
    assert [value for is_hr, value in record if is_hr] == [None] * 2


def test_exception_while_sampling_leaves_nothing_for_the_next_job(host, sd1, sd1_baseline):
    from hosts.webui_host import Processing, process_images

    def fail(p, step):
        if step == 1:
            assert ldm_patch.is_patched(sd1.model.diffusion_model)
            raise RuntimeError("out of memory")

    p = Processing(sd1, script_args())
    p.on_step = fail
    with pytest.raises(RuntimeError), torch.no_grad():
        process_images(host, p)  # postprocess is skipped, as in the WebUI
    out, _ = run_job(host, sd1, script_args(enabled=False))
    assert torch.equal(out, sd1_baseline)
    assert_clean(sd1)


def test_model_load_and_script_reload_remove_the_patch(host, sd1):
    assert ldm_patch.install_patch(sd1.model.diffusion_model, _settings())
    host.fire("model_loaded", sd1)
    assert_clean(sd1)
    assert ldm_patch.install_patch(sd1.model.diffusion_model, _settings())
    host.fire("script_unloaded")
    assert_clean(sd1)


def _settings(**values):
    from tome_core import PatchSettings

    return PatchSettings.from_values(skip_when_slower=False, **values)


def test_builtin_token_merging_on_means_we_defer(host, sd1):
    builtin_only, _ = run_job(host, sd1, script_args(enabled=False), token_merging_ratio=0.5)
    record = []
    from hosts.webui_host import Processing, process_images

    p = Processing(sd1, script_args(ratio=0.3))
    p.token_merging_ratio = 0.5
    p.on_step = lambda p, step: record.append([type(m).__name__ for m in sd1.model.diffusion_model.modules()])
    with torch.no_grad():
        out = process_images(host, p)
    assert torch.equal(out, builtin_only)  # the built-in alone did the work
    assert all("ToMeBlock" in names and "TomePatchReducedBlock" not in names for names in record)
    assert not any(key.startswith("ToMe ") for key in p.extra_generation_params)
    assert_clean(sd1)


def test_builtin_only_on_the_highres_pass(host, sd1):
    """Ours patches the first pass; the built-in applies its highres ratio on top of our class swap (1442),
    then we step aside: the built-in must keep working and its removal must leave the original classes."""
    from hosts.webui_host import Processing, process_images

    seen = []

    def probe(p, step):
        if p.is_hr_pass:
            for _, block in ldm_patch.transformer_blocks(sd1.model.diffusion_model):
                # tomesd's block class, whose own removal will restore the original class, not ours
                seen.append((type(block).__name__, type(block)._parent.__name__, "_tome_patch_state" in block.__dict__))

    p = Processing(sd1, script_args(), enable_hr=True)
    p.token_merging_ratio_hr = 0.5
    p.on_step = probe
    with torch.no_grad():
        out = process_images(host, p)
    assert seen and set(seen) == {("ToMeBlock", "BasicTransformerBlock", False)}
    assert torch.isfinite(out).all()
    assert_clean(sd1)


def test_builtin_removal_never_touches_our_patch(host, sd1):
    unet = sd1.model.diffusion_model
    x, t, c = torch.randn(2, 4, 16, 16), torch.tensor([500.0, 500.0]), torch.randn(2, 5, 32)
    with torch.no_grad():
        assert ldm_patch.install_patch(unet, _settings())
        patched = unet(x, t, context=c)
        tomesd.remove_patch(sd1)  # what the built-in's finally runs
        assert torch.equal(unet(x, t, context=c), patched)
        ldm_patch.remove_patch(unet)
    assert_clean(sd1)


def test_class_level_attention_replacement_keeps_working(host, sd1):
    """The WebUI's optimisations (sdp, xformers, ...) replace CrossAttention.forward on the class."""
    from ldm.modules.attention import CrossAttention

    reference, _ = run_job(host, sd1, script_args(method="ToDo"))
    calls = []

    def sdp_forward(self, x, context=None, mask=None, **kwargs):  # modules/sd_hijack_optimizations.py signature
        calls.append(x.shape[1])
        context = x if context is None else context
        b, h = x.shape[0], self.heads
        q, k, v = (
            t.view(b, -1, h, t.shape[-1] // h).transpose(1, 2)
            for t in (self.to_q(x), self.to_k(context), self.to_v(context))
        )
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.to_out(out.transpose(1, 2).reshape(b, -1, h * out.shape[-1]))

    original = CrossAttention.forward
    CrossAttention.forward = sdp_forward
    try:
        out, _ = run_job(host, sd1, script_args(method="ToDo"))
        tome, _ = run_job(host, sd1, script_args(method="ToMe"))
    finally:
        CrossAttention.forward = original
    assert calls and torch.isfinite(tome).all()
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4)
    assert_clean(sd1)


def test_unsupported_models_and_conflicts_warn_once_and_run_unpatched(host, sd1, sd1_hr_baseline, capsys):
    class DiT(torch.nn.Module):
        def forward(self, x, timesteps=None, context=None):
            return torch.zeros_like(x)

    dit = SDModel(DiT())
    run_job(host, dit, script_args(), enable_hr=True)
    assert capsys.readouterr().out.count("[ToMe Patch]") == 1

    unet = sd1.model.diffusion_model
    blocks = [m for _, m in ldm_patch.transformer_blocks(unet)]
    cases = {
        "Hypertile": lambda: setattr(blocks[0].attn1, "__webui_hypertile_params", type("P", (), {"enabled": True})()),
        "_forward": lambda: setattr(blocks[0], "_forward", blocks[0]._forward),
        "TensorRT": lambda: setattr(host.sd_unet, "current_unet", object()),
    }
    for word, make_conflict in cases.items():
        make_conflict()
        try:
            out, _ = run_job(host, sd1, script_args(), enable_hr=True)
        finally:
            blocks[0].attn1.__dict__.pop("__webui_hypertile_params", None)
            blocks[0].__dict__.pop("_forward", None)
            host.sd_unet.current_unet = None
        console = capsys.readouterr().out
        assert console.count("[ToMe Patch]") == 1 and word in console
        assert torch.equal(out, sd1_hr_baseline)
    assert not host.console  # never an exception
    assert_clean(sd1)
