"""The doors into the hosts, one package each; the engine (``tome_core``'s own modules) never imports them.

Each host's front door is its ``patch.py``: it resolves the settings once (a UNet, a DiT of the family registry,
or refused; which schedule reuse runs on) and hands the host's installs what to run.

- ``comfyui``: ComfyUI's reuse across steps wiring, its sampling-run wrapper and its DiT patch (every family of
  the registry, ``shared.dit_families``);
- ``webui``: the AUTOMATIC1111 WebUI, Forge and Forge Neo: the ldm/sgm block patch, Neo's and Forge's DiT blocks,
  the script's arguments and controls, the reuse across steps wiring;
- ``diffusers``: diffusers pipelines: the UNet patch, the DiT patch and the reuse across steps wiring;
- ``shared``: what several hosts share: the UNet layout read from the module tree, undoing a class swap, and the
  ModelPatcher hooks that ComfyUI and Forge (whose patcher has ComfyUI's list hooks) both use.

A host package imports the engine and ``shared`` only, never another host's package.
"""
