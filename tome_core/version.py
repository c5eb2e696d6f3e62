"""The project's version (a calibration kept by another version is not used)."""

__version__ = "0.1.0"
