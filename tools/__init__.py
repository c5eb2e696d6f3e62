"""Setup, test and benchmark commands.

``python -m tools.bench`` runs the speed benchmark (``tools/bench/``); ``python -m tools.fidelity`` the fidelity
benchmark on the trained reference models (``tools/fidelity/``, with the models in ``tools/fidelity/reference/``).
"""
