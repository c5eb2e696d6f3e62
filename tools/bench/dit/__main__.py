"""``python -m tools.bench.dit``: ToDo on DiTs (``todo``)."""

from .todo import main

main()
