"""The reference models' training goes on across sessions: a run stopped after a saved training state and resumed
with ``--resume`` gives the same weights, bit for bit, as one run that was never stopped (deterministic mode, one
thread, the data generator's state saved with the rest)."""

from __future__ import annotations

import pytest
import torch
from hosts import comfy_host  # noqa: F401, I001  (before any ComfyUI import: sys.path, CPU mode)
from safetensors.torch import load_file

from tools.fidelity.reference import models, train

STEPS = 4
COMMITTED = models.WEIGHTS  # the committed weights' folder (the tests' fixture moves models.WEIGHTS)


class SessionEndError(Exception):
    """Stands for the end of a session right after a training state was saved."""


@pytest.fixture
def weights_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(models, "WEIGHTS", tmp_path)
    monkeypatch.setattr(train, "SAVE_EVERY", 2)
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    yield tmp_path
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)


def trained(name: str, *extra: str) -> dict:
    args = train.parse_args(["--models", name, "--steps", str(STEPS), "--batch", "2", "--threads", "1", *extra])
    train.train_model(name, args)
    return load_file(str(models.WEIGHTS / f"{name}.safetensors"))


def test_a_resumed_run_gives_the_weights_of_an_unbroken_one(weights_folder, monkeypatch):
    name = "ref-sd1"
    unbroken = trained(name)
    assert not train.resume_path(name).exists()  # removed once the model is saved

    save = train.save_training_state

    def save_then_stop(*args, **kwargs):
        save(*args, **kwargs)
        raise SessionEndError

    monkeypatch.setattr(train, "save_training_state", save_then_stop)
    with pytest.raises(SessionEndError):
        trained(name)
    state = torch.load(train.resume_path(name), weights_only=False)
    assert state["step"] == 2 and len(state["losses"]) == 2
    monkeypatch.setattr(train, "save_training_state", save)
    resumed = trained(name, "--resume")
    assert resumed.keys() == unbroken.keys()
    assert all(torch.equal(resumed[key], unbroken[key]) for key in unbroken)
    assert not train.resume_path(name).exists()


def test_a_state_of_another_recipe_is_refused(weights_folder, monkeypatch):
    name = "ref-sd1"
    save = train.save_training_state

    def save_then_stop(*args, **kwargs):
        save(*args, **kwargs)
        raise SessionEndError

    monkeypatch.setattr(train, "save_training_state", save_then_stop)
    with pytest.raises(SessionEndError):
        trained(name)
    with pytest.raises(SystemExit, match="another recipe"):
        trained(name, "--resume", "--lr", "0.002")


def test_a_guidance_distilled_fine_tune_starts_from_saved_weights(weights_folder):
    """``--init-from`` with ``--distill-cfg`` and logit-normal times: trains from the committed weights, and with no
    step taken (learning rate 0) the saved average is the starting weights."""
    name = "ref-flux"
    start = COMMITTED / f"{name}.safetensors"
    if not start.exists():
        pytest.skip(f"{name} weights missing from the checkout")
    options = ["--distill-cfg", "3.5", "--time-sampling", "logit-normal", "--lr", "1e-12"]
    tuned = trained(name, "--init-from", str(start), *options)
    original = load_file(str(start))
    assert tuned.keys() == original.keys()
    assert all(torch.allclose(tuned[key], original[key], atol=1e-6) for key in original)


def test_logit_normal_times_lie_on_the_shifted_schedule():
    from tools.common.host import setup_comfy

    setup_comfy("cpu")
    base = models.build_base_model("ref-flux")
    table = base.model_sampling.sigmas.float()
    t, sigmas = train.draw_times("ref-flux", base, table, 4096, "logit-normal", torch.Generator().manual_seed(0))
    drawn = sigmas[t]
    assert drawn.min() > 0.0 and drawn.max() < 1.0
    # Flux's shift pushes the logit-normal's median time 0.5 up to sigma e^1.15 / (e^1.15 + 1) = 0.76.
    assert float(drawn.median()) == pytest.approx(0.76, abs=0.02)
    with pytest.raises(ValueError, match="flow-matching"):
        train.draw_times("ref-sd1", base, table, 4, "logit-normal", torch.Generator())


def test_open_scenes_add_a_smooth_unprompted_field():
    from tools.fidelity.reference import data

    scenes, _ = data.batch(8, 32, torch.Generator().manual_seed(0))
    assert data.open_up(scenes, 0.0, torch.Generator()) is scenes
    opened = data.open_up(scenes, 0.3, torch.Generator().manual_seed(1))
    field = opened - scenes
    assert torch.allclose(field[:, 0], field[:, 1], atol=1e-6) and torch.allclose(
        field[:, 0], field[:, 2], atol=1e-6
    )  # brightness, no hue
    assert 0.15 < float(field.std()) < 0.45
    assert float((field[..., 1:] - field[..., :-1]).abs().mean()) < 0.25 * float(
        field.abs().mean()
    )  # smooth (noise: 1.1)


def test_the_guidance_constant_stays_at_zero_and_the_file_is_still_flux1_dev(weights_folder):
    """``--no-guidance-constant``: the guidance embedding's output layer is zero in the saved weights after
    training steps that move every other layer, and ComfyUI still detects the file as Flux.1 with its guidance
    embedding (Flux.1-dev, not schnell); refused for a layout without Flux.1's ``guidance_in``."""
    from tools.common.host import setup_comfy

    setup_comfy("cpu")
    import comfy.model_detection

    name = "ref-flux"
    saved = trained(name, "--no-guidance-constant", "--lr", "1e-2")
    out_layer = "diffusion_model.guidance_in.out_layer."
    assert not saved[out_layer + "weight"].any() and not saved[out_layer + "bias"].any()
    assert saved["diffusion_model.guidance_in.in_layer.weight"].any()  # the embedding is in the file
    assert saved["diffusion_model.final_layer.linear.weight"].any()  # zero-started and trained: the steps ran
    state = {f"model.{key}": value for key, value in saved.items() if key.startswith("diffusion_model.")}
    config = comfy.model_detection.model_config_from_unet(state, "model.diffusion_model.")
    assert type(config).__name__ == "Flux" and config.unet_config["guidance_embed"]
    with pytest.raises(SystemExit):
        train.parse_args(["--models", "ref-qwen-v2", "--no-guidance-constant"])
