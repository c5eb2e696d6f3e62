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
