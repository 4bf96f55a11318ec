"""torch's CPU threads on a machine that others share: wait without spinning, use the cores left free.

    threads.yield_while_waiting()   # before torch is imported (lab.cli does it for every command)
    tuner = threads.ThreadTuner()   # when the work is about to start
    tuner.tick()                    # between steps: every few seconds, re-chooses torch's threads

Two things make a torch step stall when another process takes a core:

- **Spinning.** torch's CPU wheel runs its parallel regions on GNU OpenMP (libgomp, shipped in
  ``torch/lib``; MKL and oneDNN use it too). By default a libgomp thread that has finished its share
  spins for a while before it sleeps, and a decode step runs its regions back to back, so every thread
  spins through the whole step, even when it has nothing to do. On a core someone else wants, the
  spinner takes the time that process would have used, and the scheduler treats ours as one more
  CPU-bound job. ``OMP_WAIT_POLICY=PASSIVE`` makes a waiting thread sleep at once, but then every
  region of a step wakes its threads through the kernel, which can cost a step more than spinning
  would (measured in docs/inference.md, "Sharing the CPU"). So the lab bounds the spin instead
  (``GOMP_SPINCOUNT``, ``WAIT_POLICY``): a waiting thread spins for a short while, through the gaps
  between one step's regions, then sleeps, so it does not hold a core between steps or while the
  tuner below moves to fewer threads. libgomp reads it once, when it is loaded (that is, when torch
  is imported), so it has to be in the environment first; processes started afterwards (the
  server's workers) inherit it.
- **Too many threads.** Each region ends when its slowest thread does; a thread that shares its core
  with a busy process waits for its turn on it, and the whole step waits with it. ``free_cores``
  measures how much of this process's cores the other processes used over a window (``/proc/stat``'s
  busy time on those cores minus this process's own CPU time), and ``threads_for`` takes one thread
  per core left free. ``ThreadTuner`` measures again every few seconds over the time since it last
  did, so a long training run or a server follows the load as it comes and goes.

Thread counts change the last bits of some fp32 kernels (attention's, among others); pass a fixed
number (``--threads``) where a run must repeat bit for bit whatever the load.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

WAIT_POLICY = {"GOMP_SPINCOUNT": "30000"}
"""What ``yield_while_waiting`` puts in the environment (where the user has set neither variable of
``USER_WAIT_POLICY``): libgomp's wait loop turns 30,000 times (a millisecond or so) before it sleeps,
where its default is 300,000 and PASSIVE's 0."""

USER_WAIT_POLICY = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
"""The variables that choose how libgomp's threads wait (``GOMP_SPINCOUNT`` overrides the policy's
spin); a benchmark clears them to run a peer with libgomp's defaults."""

RETUNE_SECONDS = 2.0
"""How often ``ThreadTuner.tick`` measures the free cores again: long enough that /proc/stat's
1/100 s ticks average out, short enough to follow a job that starts or stops."""


def yield_while_waiting() -> None:
    """Have OpenMP threads sleep soon instead of spin while they wait (``WAIT_POLICY``), unless the
    user chose how they wait (either of ``USER_WAIT_POLICY``). Takes effect only before torch is
    first imported in this process."""
    if not any(name in os.environ for name in USER_WAIT_POLICY):
        os.environ.update(WAIT_POLICY)


def allowed_cores() -> set[int]:
    """The CPUs this process may run on (its affinity mask; all of them where there is none)."""
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return set(range(os.cpu_count() or 1))


@dataclass(frozen=True)
class CpuClock:
    """One reading: the busy seconds of the allowed cores, this process's CPU seconds, and the time."""

    busy: float
    """CPU seconds the allowed cores spent busy since boot, every process's (0 without /proc/stat)."""
    own: float
    """CPU seconds this process (all its threads) has used."""
    wall: float

    @classmethod
    def read(cls, cores: set[int], stat: Path = Path("/proc/stat")) -> CpuClock:
        return cls(busy=_busy_seconds(cores, stat), own=time.process_time(), wall=time.monotonic())


def _busy_seconds(cores: set[int], stat: Path) -> float:
    """Busy CPU seconds of ``cores`` since boot from /proc/stat's per-CPU lines: user, system, irq,
    softirq and steal (a hypervisor running someone else on our CPU). Time at a positive nice value
    counts only if this process is niced too: a niced job yields its core to us when we want it."""
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return 0.0
    niced = os.nice(0) > 0 if hasattr(os, "nice") else False
    ticks = 0
    for line in lines:
        name, *fields = line.split()
        if not (name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores):
            continue
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
        ticks += user + system + irq + softirq + steal + (nice if niced else 0)
    return ticks / os.sysconf("SC_CLK_TCK")


def free_cores(before: CpuClock, after: CpuClock, n_cores: int) -> float:
    """Cores that other processes left free between two readings: the allowed cores, less the busy
    time that was not this process's, per second. ``n_cores`` when the window is empty."""
    wall = after.wall - before.wall
    if wall <= 0:
        return float(n_cores)
    others = max(0.0, (after.busy - before.busy) - (after.own - before.own)) / wall
    return max(0.0, n_cores - others)


def threads_for(free: float, most: int) -> int:
    """One thread per free core, a core counting once more than half of it is free; 1 to ``most``."""
    return max(1, min(most, int(free + 0.5)))


class ThreadTuner:
    """Sets torch's thread count from the cores left free, measured over the time between its calls.

    The first window starts when the tuner is made (model loading and imports count: this process's
    own time is subtracted), so make it before the work and call ``tick`` between steps. ``most``
    caps the threads (default: the allowed cores; a server's workers share them).
    """

    MIN_WINDOW = 0.2
    """Seconds the first choice waits for, at least: /proc/stat counts in 1/100 s ticks."""

    def __init__(
        self,
        most: int | None = None,
        every: float = RETUNE_SECONDS,
        read: Callable[[set[int]], CpuClock] = CpuClock.read,
    ):
        self.cores = allowed_cores()
        self.most = most or len(self.cores)
        self.every = every
        self.read = read  # tests give a scripted clock
        self.last = read(self.cores)
        self.threads: int | None = None  # what the last choice set; None before the first

    def tick(self) -> int | None:
        """Re-choose once ``every`` seconds have passed since the last choice (the first call always
        chooses): the thread count now set, or None when it was not time yet."""
        waited = time.monotonic() - self.last.wall
        if self.threads is not None and waited < self.every:
            return None
        if waited < self.MIN_WINDOW:
            time.sleep(self.MIN_WINDOW - waited)
        import torch

        now = self.read(self.cores)
        self.threads = threads_for(free_cores(self.last, now, len(self.cores)), self.most)
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        self.last = now
        return self.threads
