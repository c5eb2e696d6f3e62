"""The guidance forecast (``tools/fidelity/guidance``, a measured variant): at its prompt-only steps the model runs
on the prompt's half of the batch alone and the unconditional output is the prompt's less the guidance's line; with
no prompt-only step it is the whole-step forecast of the Spectrum lab, bit for bit."""

from __future__ import annotations

import torch
from hosts import comfy_host as host  # noqa: I001  (before any ComfyUI import: sys.path, CPU mode)

from tools.fidelity.guidance import GuidanceForecast, GuidanceSettings, guidance_patch
from tools.fidelity.spectrum import SpectrumSettings, spectrum_patch

COMPUTED = (0, 1, 2, 4, 6, 8, 10, 11)  # of 12 steps


def _sample_counting(model, patch) -> tuple[torch.Tensor, list[int]]:
    """A 12-step run of ``patch(model)`` and the batch entries of each model call."""
    entries = []
    handle = model.model.diffusion_model.register_forward_pre_hook(lambda _m, args: entries.append(args[0].shape[0]))
    try:
        return host.sample(patch(model), steps=12, cfg=5.0), entries
    finally:
        handle.remove()


def test_without_prompt_only_steps_it_is_the_whole_step_forecast_bit_for_bit():
    model = host.tiny_model("sd15")
    ours, entries = _sample_counting(model, guidance_patch(GuidanceSettings(COMPUTED)))
    line = SpectrumSettings(at=COMPUTED, blend=0.0, reach=0.75, by_sigma=True)
    lab, lab_entries = _sample_counting(model, spectrum_patch(line))
    assert torch.equal(ours, lab)
    assert entries == lab_entries == [2] * len(COMPUTED)  # cond and uncond in one call at each computed step


def test_a_prompt_only_step_runs_half_the_batch_and_changes_the_picture():
    model = host.tiny_model("sd15")
    whole, _ = _sample_counting(model, guidance_patch(GuidanceSettings(COMPUTED)))
    half, entries = _sample_counting(model, guidance_patch(GuidanceSettings(COMPUTED, cond_only=(4, 8))))
    assert entries == [2, 2, 2, 1, 2, 1, 2, 2]
    assert torch.isfinite(half).all() and not torch.equal(half, whole)
    assert GuidanceSettings(COMPUTED, cond_only=(4, 8)).label(12) == "7 of 12: full 0 1 2 6 10 11; prompt only 4 8"


def test_the_unconditional_output_is_the_prompt_output_less_the_guidance_line():
    """Guidance measured along a line of the noise level: all the way (reach 1) it is that line's value, at reach 0
    the last measured guidance; with one measured, that one."""
    hook = GuidanceForecast(GuidanceSettings(COMPUTED, guidance_reach=1.0))
    cond = torch.full((1, 4), 3.0)
    hook.guidance_sigmas, hook.guidance = [8.0], [torch.full((1, 4), 1.6)]
    assert torch.allclose(hook.uncond_from(cond, 2.0), cond - 1.6)
    hook.guidance_sigmas, hook.guidance = [8.0, 4.0], [torch.full((1, 4), 1.6), torch.full((1, 4), 0.8)]
    assert torch.allclose(hook.uncond_from(cond, 2.0), cond - 0.4)
    held = GuidanceForecast(GuidanceSettings(COMPUTED, guidance_reach=0.0))
    held.guidance_sigmas, held.guidance = hook.guidance_sigmas, hook.guidance
    assert torch.allclose(held.uncond_from(cond, 2.0), cond - 0.8)
