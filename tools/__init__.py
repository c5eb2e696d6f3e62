"""Setup, test and benchmark commands.

``python -m tools.bench`` runs the speed benchmark (``tools/bench/``); ``python -m tools.fidelity`` the fidelity
benchmark on the trained reference models (``tools/fidelity/``, with the models in ``tools/fidelity/reference/``).
What both use lies below both in ``tools/common/`` (the hosts' UNets, timing, the machine's description); the
benchmark may use the fidelity benchmark, never the other way round (``tests/test_import_graph.py``).
"""
