"""The token merging engine: pure PyTorch, no host imports.

``PatchSettings`` validates what the user chose; ``Reducer`` decides per transformer block how to reduce it;
the host adapters in ``tome_core.adapters`` call it from their hook points.
"""

from .levels import find_level, grid_at_level, reduced_levels
from .reducer import BlockReduction, KeyValueDownsample, Reducer, TokenMerge
from .schedule import NoiseRange, timestep_of_percent
from .settings import SPECS, PatchSettings, Spec

__version__ = "0.1.0"

__all__ = [
    "SPECS",
    "BlockReduction",
    "KeyValueDownsample",
    "NoiseRange",
    "PatchSettings",
    "Reducer",
    "Spec",
    "TokenMerge",
    "find_level",
    "grid_at_level",
    "reduced_levels",
    "timestep_of_percent",
]
