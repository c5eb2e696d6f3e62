"""The doors into the hosts, one package each; the engine (``tome_core``'s own modules) never imports them.

- ``comfyui``: ComfyUI's reuse across steps wiring, its sampling-run wrapper and its DiT patch (Flux, SD3, Wan,
  Qwen-Image, HunyuanVideo, LTX-Video, Lumina 2);
- ``webui``: the AUTOMATIC1111 WebUI and Forge: the ldm/sgm block patch, the script's arguments and controls,
  the reuse across steps wiring;
- ``diffusers``: diffusers pipelines: the UNet patch and the reuse across steps wiring;
- ``shared``: what several hosts share: the UNet layout read from the module tree, undoing a class swap, and the
  ModelPatcher hooks that ComfyUI and Forge (whose patcher has ComfyUI's list hooks) both use.

A host package imports the engine and ``shared`` only, never another host's package.
"""
