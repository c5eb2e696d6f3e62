"""What other processes take of the CPU while the benchmark measures: the basis of its "machine busy" verdict.

The load average cannot tell a busy machine from a busy benchmark: it counts this process's own threads (and,
under a test runner, the runner's), and it lags by a minute, so a test that ran just before still shows. What
matters is the CPU time that *others* took. So the machine's busy CPU time (psutil's system-wide counters:
user, system, irq, softirq and, in a virtual machine, steal, the time the hypervisor gave to another guest) is
read twice, and this process's own CPU time over the same interval is subtracted. The result is in cores: the
number of CPUs that others kept busy on average (0.96 = almost one of the cores, whatever the machine's size).
A torch run uses every core, so any core taken by others slows it; the default limit, 0.2 cores, is about what
an idle desktop session or a browser tab stays under, and a fifth of one core already shows in CPU timings.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import psutil

BUSY_LIMIT_CORES = 0.2


def _counters() -> tuple[float, float, float]:
    """(busy, all, steal) CPU seconds of the whole machine since boot, summed over its cores."""
    t = psutil.cpu_times()
    total = sum(t)
    # Linux counts guest time inside user (and guest_nice inside nice): do not count it twice.
    total -= getattr(t, "guest", 0.0) + getattr(t, "guest_nice", 0.0)
    idle = t.idle + getattr(t, "iowait", 0.0)
    return total - idle, total, getattr(t, "steal", 0.0)


@dataclass
class Mark:
    """The machine's and this process's CPU counters at one moment."""

    wall: float
    busy: float
    total: float
    steal: float
    own: float

    @classmethod
    def now(cls) -> Mark:
        busy, total, steal = _counters()
        return cls(time.perf_counter(), busy, total, steal, time.process_time())


@dataclass
class Load:
    """What others took between two marks, in cores (CPU seconds per wall second)."""

    seconds: float
    others_cores: float | None  # None where the OS gives no counters for the interval
    steal_cores: float | None
    own_cores: float
    cores: int

    def busy(self, limit: float = BUSY_LIMIT_CORES) -> bool:
        return self.others_cores is not None and self.others_cores > limit

    def describe(self) -> str:
        return describe(self.as_dict())

    def as_dict(self) -> dict:
        return {
            "seconds": round(self.seconds, 3),
            "others_cores": None if self.others_cores is None else round(self.others_cores, 3),
            "steal_cores": None if self.steal_cores is None else round(self.steal_cores, 3),
            "own_cores": round(self.own_cores, 3),
            "cores": self.cores,
        }


def between(start: Mark, end: Mark, cores: int | None = None) -> Load:
    seconds = max(end.wall - start.wall, 1e-9)
    own = max(end.own - start.own, 0.0)
    cores = cores or psutil.cpu_count() or os.cpu_count() or 1
    if end.total - start.total <= 0:  # counters did not advance (coarse clock or unsupported OS)
        return Load(seconds, None, None, own / seconds, cores)
    # The counters tick 100 times a second per core: scale them to the wall time actually elapsed, so that a
    # tick that fell just outside the interval does not read as load.
    capacity = (end.total - start.total) / seconds
    scale = min(1.0, cores / capacity) if capacity > 0 else 1.0
    others = max(0.0, (end.busy - start.busy) * scale - own) / seconds
    steal = max(0.0, end.steal - start.steal) * scale / seconds
    return Load(seconds, min(others, float(cores)), steal, own / seconds, cores)


def describe(load: dict) -> str:
    """'other processes used 0.96 of 2 cores (steal 0.02)', from ``Load.as_dict()``."""
    if load.get("others_cores") is None:
        return "others' CPU use not measurable here"
    text = f"other processes used {load['others_cores']:.2f} of {load['cores']} cores"
    if load.get("steal_cores"):
        text += f" (steal {load['steal_cores']:.2f})"
    return text


def sample(seconds: float = 1.0) -> Load:
    """Others' CPU use over the next ``seconds``, this process sleeping meanwhile."""
    start = Mark.now()
    time.sleep(seconds)
    return between(start, Mark.now())


def load_average() -> list[float] | None:
    """Recorded for the reader; not used in the verdict (see the module docstring)."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None
