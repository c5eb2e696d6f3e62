"""Run by the AUTOMATIC1111 WebUI / Forge at every start (a subprocess with the WebUI folder on PYTHONPATH).

The extension needs nothing the WebUI does not already have: torch, which the WebUI owns, and nothing else (the
engine imports torch alone). So nothing is installed here and nothing is downloaded.
"""


def main() -> None:
    """Nothing to install (see the module docstring)."""


if __name__ == "__main__":
    main()
