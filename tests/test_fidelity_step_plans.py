"""The lab's step plans for a skipped step that runs nothing (``tools/fidelity``): plans named step by step, a plan
decided per image (``adaptive``) and full, reusing and skipped steps in one run (``hybrid``); each runs the model
exactly where its plan says, in ComfyUI."""

from __future__ import annotations

import torch
from hosts import comfy_host as host  # noqa: I001  (before any ComfyUI import: sys.path, CPU mode)

from tools.fidelity.adaptive import AdaptiveSettings, AdaptiveWrapper, adaptive_patch
from tools.fidelity.hybrid import NamedSchedule, SkipSteps
from tools.fidelity.spectrum import SpectrumSettings, spectrum_patch


def _count_calls(model):
    """(calls, batch entries) of the UNet's forward, as a list the hook appends to."""
    seen = []
    handle = model.model.diffusion_model.register_forward_hook(lambda _m, args, _o: seen.append(int(args[0].shape[0])))
    return seen, handle


def test_a_named_plan_computes_exactly_its_steps():
    at = (0, 1, 3, 6, 9, 12, 15, 18, 22, 23, 24)
    settings = SpectrumSettings(at=at, blend=0.0, reach=0.75, by_sigma=True)
    assert [step for step, c in enumerate(settings.computed(25)) if c] == list(at)
    assert settings.label(25).startswith("11 of 25: 0 1 3")
    model = host.tiny_model("sd15")
    seen, handle = _count_calls(model)
    try:
        host.sample(spectrum_patch(settings)(model), steps=25, cfg=5.0)
    finally:
        handle.remove()
    assert len(seen) == 11  # cond and uncond batched: one call per computed step


def _run_adaptive(settings: AdaptiveSettings, images: int, steps: int = 25, curve=None):
    """The wrapper over a fake model whose denoised image of image ``i`` at step ``s`` is ``curve(i, s)``; returns
    the steps each image computed and the model calls' batch sizes."""
    wrapper = AdaptiveWrapper(settings)
    sigmas = torch.linspace(14.0, 0.0, steps + 1)
    computed = {i: [] for i in range(images)}
    sizes = []
    step = {"now": 0}

    def model_function(x, timestep, **c):
        sizes.append(x.shape[0])
        rows = c["rows"] if torch.is_tensor(c.get("rows")) else torch.arange(x.shape[0])
        for row in rows.tolist():
            if row < images:
                computed[row].append(step["now"])
        return torch.stack([torch.full((1, 2, 2), curve(row % images, step["now"])) for row in rows.tolist()])

    for s in range(steps):
        step["now"] = s
        x = torch.zeros(2 * images, 1, 2, 2)
        timestep = torch.full((2 * images,), float(sigmas[s]))
        c = {"transformer_options": {"sample_sigmas": sigmas}, "rows": torch.arange(2 * images)}
        out = wrapper(model_function, {"input": x, "timestep": timestep, "c": c, "cond_or_uncond": [0, 1]})
        assert out.shape == x.shape and torch.isfinite(out).all()
    return computed, sizes


def test_the_per_image_plan_keeps_its_budget_warm_up_and_tail():
    """Each image computes its warm-up, its last step and at most ``budget`` steps; an image whose output follows
    a line (which the whole line never misses) takes the longest gaps and computes fewer steps than one that turns,
    and the steps where only some images compute run as a smaller batch (cond and uncond of those images)."""
    settings = AdaptiveSettings(budget=11, warm_up=4, tail=1, tolerance=0.05, max_gap=4, reach=1.0)

    def curve(image: int, step: int) -> float:
        return 1.0 + 0.1 * step if image == 0 else 1.0 + (-1.0) ** step * 0.5 * step

    computed, sizes = _run_adaptive(settings, images=2, curve=curve)
    for image in (0, 1):
        steps = sorted(set(computed[image]))
        assert steps[:4] == [0, 1, 2, 3] and steps[-1] == 24 and len(steps) <= 11
    assert sorted(set(computed[0])) == [0, 1, 2, 3, 7, 11, 15, 19, 23, 24] and len(set(computed[1])) == 11
    assert 2 in sizes and 4 in sizes  # some steps for one image (cond and uncond), some for both


def test_the_per_image_plan_runs_in_comfyui():
    model = host.tiny_model("sd15")
    seen, handle = _count_calls(model)
    settings = AdaptiveSettings(budget=8, warm_up=3, tail=1, tolerance=0.1)
    try:
        out = host.sample(adaptive_patch(settings)(model), batch=2, steps=20, cfg=5.0)
    finally:
        handle.remove()
    assert torch.isfinite(out).all() and out.shape[0] == 2
    assert sum(seen) <= 8 * 2 * 2  # at most 8 computed steps per image, cond and uncond each


def test_a_hybrid_run_calls_the_model_at_its_full_and_reusing_steps_only():
    """The layers' reuse on a named schedule with the other steps skipped: the UNet runs at the full and the
    reusing steps (at a reusing one only its outer layers: the forward hook sees every such call)."""
    from tools.fidelity.hybrid import hybrid_patch
    from tools.fidelity.unet_rows import layer_reuse_variant

    full, reused = (0, 1, 3, 6, 9, 11), (2, 5)
    schedule = NamedSchedule(3, full=full, steps=12)
    assert [s for s in range(12) if schedule.is_full(s, 12)] == list(full) and schedule.is_full(4, 13)
    model = host.tiny_model("sd15")
    skipped = tuple(s for s in range(12) if s not in full + reused)
    patched = hybrid_patch(layer_reuse_variant(3, kind="named", full=full, steps=12), skipped)(model)
    wrapper = patched.wrappers["apply_model"]["tome-lab-skip"][0]
    assert isinstance(wrapper, SkipSteps) and wrapper.skipped == set(skipped)
    wrapper.steps = 12
    seen, handle = _count_calls(model)
    try:
        out = host.sample(patched, steps=12, cfg=5.0)
    finally:
        handle.remove()
    assert torch.isfinite(out).all() and len(seen) == len(full) + len(reused)
