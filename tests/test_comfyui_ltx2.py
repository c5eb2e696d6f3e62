"""LTX-2 (audio and video) in real ComfyUI: its blocks hand over the tuple (video, audio), of two widths, which
once made the node fail at the first model call. The model is the stand-in of ``hosts/ltx2_standin.py`` (the
pinned ComfyUI 0.3.75 predates LTX-2; the stand-in follows 0.8.0's ``LTXAVModel`` blocks and streams).

What is asserted: the family is found as LTX-2 (not LTX-Video, whose class it derives from), both streams are
predicted at the reusing steps and the output stays finite and of the unpatched shape, under 10 steps every step
runs exactly as unpatched, the input model is never changed, and a block that hands over a stream of a kind reuse
does not know (a nested tensor) makes the run stand down with one log line and the unpatched output, bit for
bit."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from hosts import comfy_host as host  # noqa: I001  (before any ComfyUI import: sys.path, CPU mode)
from hosts import ltx2_standin as ltx2

from tome_core.hosts.comfyui import dit_reuse

SHAPE = (1, 3, 8, 8)  # batch, frames, h, w
BLOCKS = 4


@pytest.fixture(scope="module")
def node_classes():
    return host.load_our_package()


@pytest.fixture(scope="module")
def model():
    return ltx2.tiny_ltx2(BLOCKS)


def sample(model, steps, **kwargs):
    return host.sample_dit(model, "ltxv", SHAPE, steps, latent=ltx2.latent(), **kwargs)


def block_calls(patched, run) -> list[int]:
    return host.count_calls(list(patched.model.diffusion_model.transformer_blocks), run)


def test_ltx2_is_its_own_family_not_ltx_videos(model):
    layout = dit_reuse.layout_of(model.model.diffusion_model)
    assert layout is not None and layout.family == "LTX-2"
    assert layout.streams == ("img",)


@pytest.mark.parametrize("steps", (12, 28))
def test_the_default_reuses_video_and_audio_and_leaves_the_input_model_alone(node_classes, model, steps, caplog):
    """At the node's defaults: some steps reuse (the span's blocks ran fewer times than the first block), both
    streams come out finite, close to unpatched and not equal to it (each was predicted), of the unpatched shape."""
    options = copy.deepcopy(model.model_options)
    plain = sample(model, steps)
    out = []
    with caplog.at_level(logging.INFO, logger="tome_patch"):
        patched = host.patch_with_node(node_classes, model)
        counts = block_calls(patched, lambda: out.append(sample(patched, steps)))
    assert model.model_options == options
    assert "LTX-2" in caplog.text and "stands down" not in caplog.text
    (out,) = out
    assert out.shape == plain.shape and torch.isfinite(out).all()
    assert counts[1] < counts[0] and len(set(counts[1:])) == 1
    video, audio = slice(0, ltx2.VIDEO_CHANNELS), slice(ltx2.VIDEO_CHANNELS, None)
    for part in (video, audio):
        assert not torch.equal(out[:, part], plain[:, part])
        # Random weights move as noise does; what the reuse changed is still a small share of the output.
        assert (out[:, part] - plain[:, part]).abs().mean() < 0.25 * plain[:, part].abs().mean()
    assert torch.equal(sample(model, steps), plain)  # the input model, sampled after the patched one


def test_under_10_steps_every_step_runs_as_unpatched(node_classes, model):
    """LTX-2's distilled runs take 8 steps: there every block runs and the output is the unpatched one."""
    patched = host.patch_with_node(node_classes, model)
    assert torch.equal(sample(patched, 8), sample(model, 8))


class Nested:
    """Two tensors in an object that is neither a tensor nor a tuple, as ComfyUI's ``NestedTensor``."""

    def __init__(self, tensors):
        self.tensors = list(tensors)

    def __iter__(self):
        return iter(self.tensors)


class LTXAVModel(ltx2.LTXAVModel):  # the real class's name: the registry finds LTX-2's record
    STREAMS = Nested


def test_a_stream_reuse_does_not_know_makes_the_run_stand_down_exactly(node_classes, caplog):
    """A block that hands its streams over in a kind reuse cannot join: that call and every later one runs every
    block; the output is the unpatched one, bit for bit, and the log says so once."""
    model = ltx2.tiny_ltx2(BLOCKS, model_class=LTXAVModel)
    plain = sample(model, 12)
    patched = host.patch_with_node(node_classes, model, reuse_interval=3, dit_settings="as set")
    out = []
    with caplog.at_level(logging.WARNING, logger="tome_patch"):
        counts = block_calls(patched, lambda: out.append(sample(patched, 12)))
    assert torch.equal(out[0], plain)
    assert len(set(counts)) == 1
    assert caplog.text.count("stands down for this run") == 1 and "Nested" in caplog.text
