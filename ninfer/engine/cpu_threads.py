"""How many CPU threads the torch backend computes with, and how its OpenMP threads wait.

Chosen at start from the cores actually free: a decode step runs hundreds of small parallel
regions, and each waits at a barrier for its slowest thread. With two threads on two cores while
another process keeps one of them busy, every barrier waits for a thread the kernel has put aside
(the default model decoded at 0.6 tok/s that way, ~60 quietly). So: as many threads as cores
that other processes leave free (at least one), and OpenMP threads that sleep instead of spinning
when the machine is shared (OMP_WAIT_POLICY=PASSIVE); on a quiet machine libgomp's default (spin
briefly, then sleep). `--threads N` overrides the count; OMP_WAIT_POLICY set by the user is kept.

The wait policy is read by the OpenMP runtime when torch is first imported, so `prepare` must run
before that (the CLI commands call it first); the count applies per thread and is set again on
the engine's worker thread (`apply`).
"""
from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass

log = logging.getLogger("ninfer.engine")

# /proc/stat's aggregate "cpu" line: user nice system idle iowait irq softirq steal ...
_IDLE_FIELDS = (3, 4)  # idle, iowait
_SAMPLE_S = 0.2


@dataclass(frozen=True, slots=True)
class ThreadPlan:
    threads: int
    wait_policy: str  # the OMP_WAIT_POLICY in effect: "PASSIVE", "ACTIVE" or "default" (libgomp's)
    cores: int  # cores this process may run on
    busy_elsewhere: float | None  # cores other processes kept busy while measured (None: not measured)
    source: str  # "--threads", "measured", "unmeasured"

    def describe(self) -> str:
        if self.source == "--threads":
            why = "set by --threads"
        elif self.busy_elsewhere is None:
            why = "load not measurable here"
        else:
            why = f"{self.busy_elsewhere:.1f} of them busy with other processes"
        return (f"cpu threads: {self.threads} of {self.cores} cores ({why}); "
                f"OpenMP wait policy {self.wait_policy}")


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) clock ticks of all CPUs since boot, from /proc/stat; None where unreadable."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    total = sum(fields)
    return total - sum(fields[i] for i in _IDLE_FIELDS), total


def _own_ticks() -> int | None:
    """Clock ticks this process (all its threads) has run, from /proc/self/stat."""
    try:
        with open("/proc/self/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(rest[11]) + int(rest[12])  # utime, stime (fields 14 and 15)


class LoadProbe:
    """Cores kept busy by other processes between two readings (this process's own use taken out)."""

    def __init__(self) -> None:
        self._last = self._read()

    @staticmethod
    def _read() -> tuple[int, int, int, float] | None:
        cpu, own = _cpu_ticks(), _own_ticks()
        if cpu is None or own is None:
            return None
        return cpu[0], cpu[1], own, time.monotonic()

    def busy_elsewhere(self, cores: int) -> float | None:
        """Since the last reading: the average number of the machine's cores other processes used."""
        now = self._read()
        last, self._last = self._last, now
        if now is None or last is None or now[1] <= last[1]:
            return None
        ncpu = os.cpu_count() or cores
        busy = (now[0] - last[0]) - (now[2] - last[2])  # all busy ticks minus this process's
        return max(0.0, min(float(ncpu), busy / (now[1] - last[1]) * ncpu))


def choose(cores: int, busy_elsewhere: float | None) -> int:
    """Threads for `cores` usable cores when others keep `busy_elsewhere` of them busy: the free
    ones, rounding a partly busy core as free below a third of its time."""
    if busy_elsewhere is None:
        return cores
    free = cores - busy_elsewhere
    return max(1, min(cores, int(free + 1 / 3)))


def plan(requested: int | None = None, *, sample_s: float = _SAMPLE_S) -> ThreadPlan:
    """The plan for this process: `requested` threads (--threads; None or 0: measure)."""
    cores = usable_cores()
    policy = os.environ.get("OMP_WAIT_POLICY", "").upper() or "default"
    if requested:
        return ThreadPlan(requested, policy, cores, None, "--threads")
    probe = LoadProbe()
    time.sleep(sample_s)
    busy = probe.busy_elsewhere(cores)
    return ThreadPlan(choose(cores, busy), policy, cores, busy, "measured" if busy is not None else "unmeasured")


_current: ThreadPlan | None = None


def prepare(requested: int | None = None) -> ThreadPlan:
    """Measure and fix the plan for this process, before torch is imported where possible: sets
    OMP_WAIT_POLICY=PASSIVE when fewer threads than cores are used (others share the machine) and
    OMP_NUM_THREADS, unless the user set them. Call once at start; `current()` returns it."""
    global _current
    if requested is not None and requested < 0:
        from ninfer.errors import ConfigError
        raise ConfigError(f"--threads must be >= 0 (0: choose from the free cores), got {requested}")
    p = plan(requested)
    if "torch" not in sys.modules:  # the OpenMP runtime reads these when torch loads it
        if "OMP_WAIT_POLICY" not in os.environ and p.threads < p.cores:
            os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
            p = ThreadPlan(p.threads, "PASSIVE", p.cores, p.busy_elsewhere, p.source)
        os.environ.setdefault("OMP_NUM_THREADS", str(p.threads))
    _current = p
    return p


def current() -> ThreadPlan | None:
    return _current


def apply(p: ThreadPlan) -> None:
    """Set the thread count on the calling thread (OpenMP's count is per thread: call it on the
    thread that runs the model) and log the choice."""
    import torch

    torch.set_num_threads(p.threads)
    log.info("%s", p.describe())


class ThreadAdapter:
    """Keeps the count right when the load changes after start: every `every_s` seconds (checked
    between steps on the compute thread, two small /proc reads) the cores other processes used since
    the last check give the count again (`choose`), and torch's count follows. With more threads
    than free cores every parallel op waits for a descheduled thread, so a server started on a quiet
    machine must step down when other work arrives, and back up when it leaves."""

    def __init__(self, plan: ThreadPlan, every_s: float = 2.0) -> None:
        self.threads = plan.threads
        self.cores = plan.cores
        self.every_s = every_s
        self._probe = LoadProbe()
        self._next = time.monotonic() + every_s

    def tick(self) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.every_s
        want = choose(self.cores, self._probe.busy_elsewhere(self.cores))
        if want != self.threads:
            import torch

            torch.set_num_threads(want)
            log.info("cpu threads: %d -> %d (the load changed)", self.threads, want)
            self.threads = want
