"""Timing, peak memory and output deviation of one call, the same way for every row.

Timing: on a CUDA device, a pair of CUDA events (``torch.cuda.Event(enable_timing=True)``) recorded on the
current stream before and after one call, the device synchronised before; elsewhere the wall clock
(``time.perf_counter``) around the call. Garbage is collected before. ``clocked`` also takes the process's CPU
time (``time.process_time``: user and system time of all its threads), which does not grow while another process
holds the cores, where wall time does. ``clock_for`` says which clock a device gets.
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


CUDA_EVENTS = "cuda events"
PERF_COUNTER = "perf_counter"


def clock_for(device) -> str:
    """The clock of a call on ``device``: CUDA events on a CUDA device, else the wall clock."""
    return CUDA_EVENTS if getattr(device, "type", None) == "cuda" else PERF_COUNTER


def timed(call, device: torch.device) -> tuple[float, object]:
    wall, _, result = clocked(call, device)
    return wall, result


def clocked(call, device: torch.device) -> tuple[float, float, object]:
    """(seconds, process CPU seconds, result) of one call; the seconds by ``clock_for(device)``."""
    gc.collect()
    if clock_for(device) == CUDA_EVENTS:
        return _clocked_cuda_events(call, device)
    synchronize(device)
    start, cpu_start = time.perf_counter(), time.process_time()
    result = call()
    synchronize(device)
    return time.perf_counter() - start, time.process_time() - cpu_start, result


def _clocked_cuda_events(call, device: torch.device) -> tuple[float, float, object]:
    """GPU time of one call: from an event recorded before it to one recorded after it on the current stream.

    The device is idle when the first event is recorded (synchronised), so the interval also holds the time the
    GPU waits for the host to launch work: it is the call's time as a user sees it, without the host's clock.
    """
    torch.cuda.synchronize(device)
    stream = torch.cuda.current_stream(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cpu_start = time.process_time()
    start.record(stream)
    result = call()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / 1000.0, time.process_time() - cpu_start, result


class EventClock:
    """Many intervals on a CUDA stream without synchronising between them (the calls of a sampling run): ``mark``
    records an event, ``seconds(a, b)`` reads the time between two marks once the work is done."""

    def __init__(self, device: torch.device):
        self.device = device

    def mark(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    @staticmethod
    def seconds(start, end) -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1000.0


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
    """Context manager: ``.mib`` is the extra peak memory of the code inside it, or None if unmeasurable;
    ``.total_mib`` on CUDA the allocator's whole peak inside it (``torch.cuda.max_memory_allocated``: the weights
    and everything else allocated, what the card must hold), None elsewhere."""

    def __init__(self, device: torch.device):
        self.device = device
        self.mib: float | None = None
        self.total_mib: float | None = None

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
            peak = torch.cuda.max_memory_allocated(self.device)
            self.mib, self.total_mib = (peak - self._base) / 2**20, peak / 2**20
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
