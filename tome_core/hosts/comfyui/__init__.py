"""ComfyUI: the reuse across steps wiring, the sampling-run wrapper, the DiT patch (Flux, SD3, Wan, Qwen-Image,
HunyuanVideo, LTX-Video, Lumina 2 / Z-Image)."""
