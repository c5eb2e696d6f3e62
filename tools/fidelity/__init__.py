"""The fidelity benchmark (``run``, ``python -m tools.fidelity``), its charts and grids (``report``) and the small
trained reference models it samples (``reference``)."""
