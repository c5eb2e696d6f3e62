"""ComfyUI: the reuse across steps wiring, the sampling-run wrapper, the DiT patch (Flux, SD3, Wan)."""
