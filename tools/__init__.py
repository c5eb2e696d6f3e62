"""Setup, test and benchmark commands; ``python -m tools.benchmark`` runs the benchmark."""
