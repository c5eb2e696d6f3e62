"""Timing, peak memory and output deviation of one call, the same way for every row.

Timing: wall clock (``time.perf_counter``) around one call, with the device synchronised before and after (GPU),
garbage collected before; ``clocked`` also takes the process's CPU time (``time.process_time``: user and system
time of all its threads), which does not grow while another process holds the cores, where wall time does.
Spread: how far a median can be trusted (``spread_pct``). Peak memory: on CUDA the allocator's peak above what
was allocated before the call; on the CPU the growth of the process's peak resident set (Linux: the peak is
reset through /proc/self/clear_refs, and freed heap is handed back with malloc_trim first, so the figure is what
this call needed on top of what was there).
"""

from __future__ import annotations

import ctypes
import gc
import statistics
import time
from pathlib import Path

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(call, device: torch.device) -> tuple[float, object]:
    wall, _, result = clocked(call, device)
    return wall, result


def clocked(call, device: torch.device) -> tuple[float, float, object]:
    """(wall seconds, process CPU seconds, result) of one call."""
    gc.collect()
    synchronize(device)
    start, cpu_start = time.perf_counter(), time.process_time()
    result = call()
    synchronize(device)
    return time.perf_counter() - start, time.process_time() - cpu_start, result


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _trim_heap() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakMemory:
    """Context manager: ``.mib`` is the extra peak memory of the code inside it, or None if unmeasurable."""

    def __init__(self, device: torch.device):
        self.device = device
        self.mib: float | None = None

    def __enter__(self):
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            return self
        _trim_heap()
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
            self._base = _status_kib("VmRSS")
        except OSError:
            self._base = None
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.mib = (torch.cuda.max_memory_allocated(self.device) - self._base) / 2**20
        elif self._base is not None:
            peak = _status_kib("VmHWM")
            self.mib = None if peak is None else max(0, peak - self._base) / 1024
        return False


def relative_l2(value: torch.Tensor, reference: torch.Tensor) -> float:
    value, reference = value.double(), reference.double()
    return float((value - reference).norm() / reference.norm().clamp_min(1e-30))


# Fewer values than this give no distribution-free 95% interval of the median (5 values cover it with 93.75%).
FEW = 6


def median_interval(values: list[float]) -> tuple[float, float]:
    """Where the median of ``values`` lies: the range for fewer than 6 values, else its 95% confidence interval.

    The interval is distribution-free (order statistics, binomial; scipy's ``quantile_test``): timings are
    skewed and have outliers, so no normal law is assumed. Unlike the range, it narrows as values accumulate,
    which is what lets a run stop once its figures are stable.
    """
    if len(values) < FEW:
        return min(values), max(values)
    from scipy import stats

    interval = stats.quantile_test(values, q=statistics.median(values), p=0.5).confidence_interval(0.95)
    return float(interval.low), float(interval.high)


def spread_pct(values: list[float]) -> float | None:
    """Half the width of ``median_interval`` relative to the median, in percent; None for fewer than 2 values."""
    if len(values) < 2:
        return None
    median = statistics.median(values)
    low, high = median_interval(values)
    return 100.0 * (high - low) / 2 / median if median > 0 else 0.0


def summary(times: list[float]) -> dict:
    """Median, min, max and spread (``spread_pct``) of repeated timings."""
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "spread_pct": spread_pct(times),
        "times_s": list(times),
    }
