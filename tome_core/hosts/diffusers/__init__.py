"""diffusers pipelines: the UNet patch (``tome_core.apply_patch``) and the reuse across steps wiring."""
