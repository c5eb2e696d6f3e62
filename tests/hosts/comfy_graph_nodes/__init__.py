"""Two helper nodes for the whole-graph test: conditioning without a text encoder, and a latent catcher.

Loaded into the real ComfyUI with its own loader, like any custom node package.
"""

import torch


class TestRandomConditioning:
    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "make"
    CATEGORY = "testing"

    @classmethod
    def INPUT_TYPES(cls):  # noqa: N802
        return {"required": {"seed": ("INT", {"default": 0, "min": 0, "max": 2**31})}}

    def make(self, seed):
        generator = torch.Generator().manual_seed(seed)
        return ([[torch.randn(1, 77, 768, generator=generator), {}]],)


class TestCaptureLatent:
    RETURN_TYPES = ()
    FUNCTION = "capture"
    OUTPUT_NODE = True
    CATEGORY = "testing"
    captured = {}  # read by the test through the class that ComfyUI registered

    @classmethod
    def INPUT_TYPES(cls):  # noqa: N802
        return {"required": {"samples": ("LATENT",), "key": ("STRING", {"default": "out"})}}

    def capture(self, samples, key):
        self.captured[key] = samples["samples"].clone()
        return {}


NODE_CLASS_MAPPINGS = {"TestRandomConditioning": TestRandomConditioning, "TestCaptureLatent": TestCaptureLatent}
