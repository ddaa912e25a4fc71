"""What an experiment measures around its runs: the CPU other processes took meanwhile
(``CpuMeter``, ``wait_quiet``: these machines are shared) and a process's resident memory
(``rss_mib`` / ``peak_rss_mib``)."""

from __future__ import annotations

import os
import resource
import threading
import time
from typing import Dict, List, Optional


class CpuMeter:
    """How busy the machine was during a run: all CPU time (``/proc/stat``) minus this process's and
    its reaped children's (the ranks) = what other users' processes took, in cores on average."""

    def __init__(self):
        self.hz = os.sysconf("SC_CLK_TCK")
        self.start()

    @staticmethod
    def _busy_s(hz: int) -> float:
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return float("nan")
        # user nice system idle iowait irq softirq steal ...: all but idle and iowait
        return (sum(v[:8]) - v[3] - v[4]) / hz

    @staticmethod
    def _ours_s() -> float:
        total = 0.0
        for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
            u = resource.getrusage(who)
            total += u.ru_utime + u.ru_stime
        return total

    def start(self) -> None:
        self.t0, self.busy0, self.ours0 = time.monotonic(), self._busy_s(self.hz), self._ours_s()

    def stop(self) -> Dict[str, float]:
        wall = max(time.monotonic() - self.t0, 1e-9)
        busy, ours = self._busy_s(self.hz) - self.busy0, self._ours_s() - self.ours0
        return {"ours_cores": ours / wall, "other_cores": max(busy - ours, 0.0) / wall, "seconds": wall}


def wait_quiet(
    max_wait_s: float,
    threshold: float = 0.25,
    window_s: float = 2.0,
    echo=print,
    meter=CpuMeter,
    other: str = "other_cores",
) -> float:
    """Waits (up to ``max_wait_s``) until other processes use less than ``threshold`` cores over a
    ``window_s`` window; returns the last window's load. ``meter()`` measures from its making to its
    ``stop()``, whose ``other`` is that load (a meter that counts more processes as its own: the
    serving benchmark's, its Ray included)."""
    deadline = time.monotonic() + max_wait_s
    told = False
    while True:
        m = meter()
        time.sleep(window_s)
        load = m.stop()[other]
        if load < threshold or time.monotonic() >= deadline:
            return load
        if not told:
            echo(f"  waiting for a quiet machine (other processes use {load:.2f} cores)")
            told = True


def rss_mib(field: str = "VmRSS") -> float:
    """This process's RSS (VmRSS) or peak RSS (VmHWM) in MiB. Not ru_maxrss: Linux carries the
    high-water mark over fork + exec, so a spawned rank would report its launcher's peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def peak_rss_mib() -> float:
    return rss_mib("VmHWM")


def reset_peak_rss() -> bool:
    """Resets VmHWM (the kernel's peak RSS) for this process, so ``peak_rss_mib`` measures from now
    (``/proc/self/clear_refs``, Linux >= 4.0); False where that is not supported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def children(pid: int) -> List[int]:
    """The live direct children of ``pid`` (any of its threads'), from ``/proc``."""
    found = set()
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found.update(int(c) for c in f.read().split())
    except OSError:  # gone, or a kernel without the children files: the parent ids of every process
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        # pid (comm) state ppid ...: comm may hold spaces, the last ")" ends it
                        if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                            found.add(int(entry))
                except (OSError, IndexError, ValueError):
                    pass
    return sorted(found)


def status_mib(pid: int, field: str) -> Optional[float]:
    """A memory field of another process's ``/proc/<pid>/status`` (VmRSS, VmHWM...) in MiB; None
    once it has exited (a zombie has no address space left)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def tree_rss_mib(pid: int) -> Optional[float]:
    """The resident memory of process ``pid`` and all its descendants (VmRSS summed) in MiB; None
    once it has exited. A process that starts others (PySpark's driver: a JVM and Python workers)
    holds its memory in them."""
    children: dict = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    own = status_mib(pid, "VmRSS")
    if own is None:
        return None
    total, stack = own, list(children.get(pid, []))
    while stack:
        child = stack.pop()
        total += status_mib(child, "VmRSS") or 0.0
        stack.extend(children.get(child, []))
    return total


def vm_hwm_mib(pid: int) -> Optional[float]:
    """The peak RSS of process ``pid`` (VmHWM) in MiB; None once it has exited."""
    return status_mib(pid, "VmHWM")


class RankMemory:
    """The peak RSS (``VmHWM``, MiB) of each direct child of process ``pid`` -- torchrun's ranks --
    polled from ``/proc`` every ``period_s`` while in the ``with`` block. VmHWM is the high-water
    mark of the process's own address space (reset by exec), so a rank's figure is its own; it only
    grows, so a poll misses at most a rank's last ``period_s`` of life."""

    def __init__(self, pid: int, period_s: float = 0.2):
        self.pid, self.period_s = pid, period_s
        self._peaks: Dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="rank-memory", daemon=True)

    def __enter__(self) -> "RankMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def peaks(self) -> List[float]:
        """Each child's peak RSS (MiB), in order of process id."""
        return [round(self._peaks[p], 1) for p in sorted(self._peaks)]

    def _poll(self) -> None:
        while True:
            for child in children(self.pid):
                hwm = vm_hwm_mib(child)
                if hwm is not None:
                    self._peaks[child] = max(self._peaks.get(child, 0.0), hwm)
            if self._stop.wait(self.period_s):
                return


class TreePeak:
    """The largest peak RSS (VmHWM, MiB) among the live descendants of a process (torchx, torchrun,
    the ranks, their loader workers), polled every ``period_s``: a ``watch`` for
    ``harness.launch.torchx_train``, which calls it with the launched process's id."""

    def __init__(self, period_s: float = 0.5):
        self.period_s, self.peak = period_s, 0.0

    def __call__(self, pid: int) -> "TreePeak":
        self.pid = pid
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        return self

    def __enter__(self) -> "TreePeak":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        while not self._stop.wait(self.period_s):
            todo, seen = [self.pid], set()
            while todo:
                p = todo.pop()
                if p in seen:
                    continue
                seen.add(p)
                todo += children(p)
                self.peak = max(self.peak, vm_hwm_mib(p) or 0.0)
