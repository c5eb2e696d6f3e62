"""Engine unit tests of the token grid with a frame axis and of joint sequences (the DiT path): no host."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tome_core.downsample import (
    NearestIndexCache,
    downsample_grid,
    downsample_segment,
    downsample_tokens,
    downsampled_grid,
)
from tome_core.joint_attention import ImageTokens, SequenceDownsample
from tome_core.settings import PatchSettings

METHODS = ("nearest-exact", "avg_pool", "bilinear")


def _tokens(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("method", METHODS)
def test_one_frame_grid_is_the_unet_downsampling(method):
    x = _tokens(2, 15 * 23, 8)
    ours = downsample_grid(x, (1, 15, 23), 2.0, 1.0, method, NearestIndexCache())
    assert torch.equal(ours, downsample_tokens(x, 15, 23, 2.0, method, NearestIndexCache()))


@pytest.mark.parametrize("method", METHODS)
def test_video_is_downsampled_frame_by_frame(method):
    frames, h, w = 3, 9, 11
    x = _tokens(2, frames * h * w, 8)
    ours = downsample_grid(x, (frames, h, w), 2.0, 1.0, method, NearestIndexCache())
    per_frame = [
        downsample_tokens(f, h, w, 2.0, method, NearestIndexCache()) for f in x.view(2, frames, h * w, 8).unbind(1)
    ]
    torch.testing.assert_close(ours, torch.cat(per_frame, dim=1), rtol=0, atol=1e-6)


def test_downsampling_in_time_keeps_ceil_frames_and_matches_interpolate():
    frames, h, w = 5, 6, 7
    x = _tokens(1, frames * h * w, 4)
    assert downsampled_grid((frames, h, w), 2.0, 2.0) == (3, 3, 4)
    ours = downsample_grid(x, (frames, h, w), 2.0, 2.0, "nearest-exact", NearestIndexCache())
    volume = x.view(1, frames, h, w, 4).permute(0, 4, 1, 2, 3)
    expected = F.interpolate(volume, size=(3, 3, 4), mode="nearest-exact").permute(0, 2, 3, 4, 1).reshape(1, -1, 4)
    assert torch.equal(ours, expected)
    pooled = downsample_grid(x, (frames, h, w), 2.0, 2.0, "avg_pool", NearestIndexCache())
    assert pooled.shape == (1, 3 * 3 * 4, 4)


@pytest.mark.parametrize("method", METHODS)
def test_segment_keeps_text_and_references_whole(method):
    """Heads layout (batch, heads, tokens, d) as Flux passes it: text first, image grid, then references."""
    text, grid, refs = 7, (1, 5, 7), 6
    x = _tokens(2, 3, text + 35 + refs, 8)
    out = downsample_segment(x, text, grid, 2.0, 1.0, method, NearestIndexCache(), dim=2)
    middle = downsample_grid(x[:, :, text : text + 35], grid, 2.0, 1.0, method, NearestIndexCache(), dim=2)
    torch.testing.assert_close(out, torch.cat([x[:, :, :text], middle, x[:, :, -refs:]], dim=2), rtol=0, atol=1e-6)
    assert out.shape[2] == text + 3 * 4 + refs


def test_sequence_downsample_refuses_other_layouts_and_small_grids():
    settings = PatchSettings.from_values(method="todo")
    reducer = SequenceDownsample(settings)
    k = v = _tokens(1, 9 + 40 * 40, 8)
    out = reducer.keys_values(k, v, ImageTokens((1, 40, 40)), dim=1)
    assert out is not None and out[0].shape[1] == 9 + 20 * 20
    # Text in the same softmax: each kept image key gets log(1600 / 400) back, the text keys nothing.
    expected = torch.cat([torch.zeros(9), torch.full((400,), math.log(4.0))]).view(1, -1)
    torch.testing.assert_close(out[2], expected)
    grid_only = _tokens(1, 40 * 40, 8)  # no other keys in the softmax: no bias, no mask
    assert reducer.keys_values(grid_only, grid_only, ImageTokens((1, 40, 40)), dim=1)[2] is None
    assert reducer.keys_values(k[:, :100], v[:, :100], ImageTokens((1, 40, 40)), dim=1) is None  # too few tokens
    small = _tokens(1, 9 + 16 * 16, 8)  # 256 image tokens: below the skip_when_slower threshold
    assert reducer.keys_values(small, small, ImageTokens((1, 16, 16)), dim=1) is None
    assert SequenceDownsample(settings.replace(downsample_factor=1.0)).does_nothing
    assert SequenceDownsample(settings.replace(method="tome")).does_nothing
    with pytest.raises(ValueError, match="time_factor"):
        SequenceDownsample(settings, time_factor=3.0)


def test_attention_mask_loses_exactly_the_dropped_keys():
    settings = PatchSettings.from_values(method="todo", skip_when_slower=False)
    tokens = ImageTokens((1, 4, 6), after=2)
    k = v = _tokens(1, 2, 3 + 24 + 2, 8)
    mask = _tokens(1, 1, 29, 29)
    kept_k, _, kept_mask = SequenceDownsample(settings).keys_values(k, v, tokens, dim=2, mask=mask)
    index = NearestIndexCache().get_segment(3, (1, 4, 6), (1, 2, 3), 29, torch.device("cpu"))
    bias = torch.zeros(29 - 24 + 6)
    bias[3:9] = math.log(24 / 6)  # the 2 x 3 kept grid keys stand for the 4 x 6 grid
    assert torch.equal(kept_mask, mask[..., index] + bias) and torch.equal(kept_k, k[:, :, index])
    pooled = SequenceDownsample(settings.replace(downsample_method="avg_pool"))
    assert pooled.keys_values(k, v, tokens, dim=2, mask=mask) is None  # averaging a mask is not exact: left alone


def test_proportional_bias_makes_reduced_joint_attention_exact_on_redundant_keys():
    """Image keys and values that repeat within every 2x2 cell carry nothing that ToDo 2 drops: with the bias,
    attention over [text, kept image keys] equals attention over the whole sequence; without it, the text would
    get four times its share (the test fails if the bias is missing or wrong)."""
    settings = PatchSettings.from_values(method="todo", skip_when_slower=False)
    text, h, w, channels = 5, 6, 8, 16
    generator = torch.Generator().manual_seed(0)
    cells = torch.randn(2, 2, h // 2, w // 2, channels, generator=generator)  # (k/v, batch, cells, channels)
    image = cells.repeat_interleave(2, dim=2).repeat_interleave(2, dim=3).flatten(2, 3)
    k, v = (torch.cat([torch.randn(2, text, channels, generator=generator), part], dim=1) for part in image)
    q = torch.randn(2, text + h * w, channels, generator=generator)
    kept_k, kept_v, bias = SequenceDownsample(settings).keys_values(k, v, ImageTokens((1, h, w)), dim=1)
    assert kept_k.shape[1] == text + (h // 2) * (w // 2)
    whole = F.scaled_dot_product_attention(q, k, v)
    reduced = F.scaled_dot_product_attention(q, kept_k, kept_v, attn_mask=bias)
    torch.testing.assert_close(reduced, whole, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(F.scaled_dot_product_attention(q, kept_k, kept_v), whole, atol=1e-3)


def test_a_family_threshold_replaces_the_default_only_with_skip_when_slower():
    settings = PatchSettings.from_values(method="todo")
    k = v = _tokens(1, 9 + 40 * 40, 8)
    tokens = ImageTokens((1, 40, 40))
    assert SequenceDownsample(settings).keys_values(k, v, tokens, dim=1) is not None  # 1600 >= 1024
    assert SequenceDownsample(settings, min_tokens=4096).keys_values(k, v, tokens, dim=1) is None
    forced = SequenceDownsample(settings.replace(skip_when_slower=False), min_tokens=4096)
    assert forced.keys_values(k, v, tokens, dim=1) is not None
