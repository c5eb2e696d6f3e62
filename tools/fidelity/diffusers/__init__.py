"""The fidelity benchmark's diffusers path for the DiT references (``python -m tools.fidelity.diffusers.run``): the
run, and the conversion of the Flux and Wan references to diffusers' transformers."""
