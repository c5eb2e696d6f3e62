"""The reference models' data (``tools/fidelity/reference/data.py``): still scenes stay the stream the committed
weights were trained on, and clips move while every frame stays a scene of its prompt."""

from __future__ import annotations

import torch

from tools.fidelity.reference import data, models


def test_still_scenes_are_the_stream_the_committed_weights_were_trained_on():
    scenes, prompts = data.batch(4, 32, torch.Generator().manual_seed(0))
    # Recorded from the renderer the committed ref-sd1, ref-sdxl and ref-flux weights were trained with: a change
    # of the order of the random draws would change every retrained model, and each scene's mean and spread with it
    # (by 0.05 and more: other shapes, colours and backgrounds). Not the bytes: the renderer's float maths rounds
    # differently on other CPUs (AMD EPYC and Intel Xeon give other last bits), which moves a mean by about 1e-6,
    # or by up to 2e-3 where a pixel at a shape's edge falls the other way (4 channels of 4096 values).
    expected_means = torch.tensor([-0.37841, -0.30474, -0.42694, -0.23446])
    expected_spreads = torch.tensor([0.32112, 0.36562, 0.34282, 0.29716])
    torch.testing.assert_close(scenes.mean(dim=(1, 2, 3)), expected_means, atol=2e-3, rtol=0)
    torch.testing.assert_close(scenes.std(dim=(1, 2, 3)), expected_spreads, atol=2e-3, rtol=0)
    assert prompts.as_tensor().tolist() == [[0, 1, 1, 0], [3, 3, 3, 3], [1, 1, 1, 2], [0, 1, 2, 0]]


def test_a_clip_starts_at_the_still_scene_and_moves():
    clips, prompts = data.clip_batch(3, 20, 5, torch.Generator().manual_seed(4))
    scenes, same_prompts = data.batch(3, 20, torch.Generator().manual_seed(4))
    assert clips.shape == (3, data.CHANNELS, 5, 20, 20)
    assert torch.equal(clips[:, :, 0], scenes) and torch.equal(prompts.as_tensor(), same_prompts.as_tensor())
    steps = (clips[:, :, 1:] - clips[:, :, :-1]).abs().flatten(2).mean(-1)
    assert bool((steps > 0.0).all())  # every clip changes between every two frames


def test_every_frame_shows_its_prompt():
    classifier = models.load_classifier()
    clips, prompts = data.clip_batch(32, models.CLIP_SIZE, models.CLIP_FRAMES, torch.Generator().manual_seed(9))
    with torch.no_grad():
        logits = classifier(data.frames_of(clips))
    predicted = torch.stack([out.argmax(1) for out in logits], dim=1)
    expected = prompts.as_tensor().repeat_interleave(models.CLIP_FRAMES, 0)
    # The object travels inside its quadrant and the background keeps its kind: the classifier, trained on still
    # scenes, reads each frame as the prompt (measured: 99.9% of 2560 frames at 20x20; 97% leaves room for a
    # hard frame).
    assert (predicted == expected).float().mean() >= 0.97
