"""Small trained reference models for measuring picture quality (the fidelity benchmark).

No trained Stable Diffusion or Flux weights can be downloaded here, so the project trains its own small models,
in the hosts' own architectures (ComfyUI's model classes: SD1.x and SDXL UNets, ``ref-sd1`` and ``ref-sdxl``,
and a Flux.1 transformer, ``ref-flux``, sampled by flow matching as ComfyUI samples Flux.1-dev), on synthetic
scenes generated from a seed (``data``), together with a classifier that recognises the prompted attributes
(``classifier``). ``python -m tools.fidelity.reference.train`` makes them; ``python -m tools.fidelity``
measures the patch with them.
"""
