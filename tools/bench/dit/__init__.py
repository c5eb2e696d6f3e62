"""The DiT benchmarks: ToDo per model call (``python -m tools.bench.dit``) and reuse across steps at full width over
whole runs (``python -m tools.bench.dit.reuse``)."""
