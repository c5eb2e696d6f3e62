"""Small trained reference models for measuring picture quality (the fidelity benchmark).

No trained Stable Diffusion weights can be downloaded here, so the project trains its own small UNets, in the
hosts' own architectures (ComfyUI's model classes, SD1.x and SDXL layouts), on synthetic scenes generated from a
seed (``data``), together with a classifier that recognises the prompted attributes (``classifier``).
``python -m tools.fidelity.reference.train`` makes them; ``python -m tools.fidelity`` measures the patch with them.
"""
