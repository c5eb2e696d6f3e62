"""What the benchmarks vary around the shipped choices of reuse across steps, in one object.

The product's entry points never pass one: every host runs ``SHIPPED``, the measured defaults. The fidelity and
speed benchmarks hand a ``ReuseOptions`` to a host door's ``install`` to measure the variants a default was chosen
from (docs/step-reuse.md, docs/dit.md).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReuseOptions:
    # A schedule in place of the one the settings give (None: the settings').
    schedule: object | None = None
    # How far along the line the prediction moves (None: the schedule's own, else the model's measured one).
    extrapolate: float | None = None
    # The blocks that run at every call (None: the shipped ones): a UNet's outer blocks (an int), a DiT's
    # (at the start, at the end).
    outer: int | tuple[int, int] | None = None
    # Where the line is drawn: over the noise level (True), over its logarithm ("log") or over the step (False).
    by_sigma: bool | str = True
    # 2: the prediction follows the parabola through the last three full steps.
    order: int = 1
    # A DiT's reusing call runs in full where the span's input (the first block's output, which every call
    # computes) has moved more than this since the last full call: mean |x - x_full| / mean |x_full| (None: never).
    # On a UNet this guard and the next weigh the first inner layer's input (the outer input block's output).
    first_block_guard: float | None = None
    # A DiT's reusing call runs in full where the span's input lies more than this off the line through the last
    # two full calls' inputs (``LayerReuseRun.line_guard``; None: never).
    line_guard: float | None = None
    # A UNet's reusing call runs in full once the boundary's change predicted from its first inner layer's input
    # passes this (``LayerReuseRun.rate_guard``; None: never).
    rate_guard: float | None = None


SHIPPED = ReuseOptions()
