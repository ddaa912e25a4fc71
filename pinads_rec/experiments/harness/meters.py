"""What an experiment measures around its runs: the CPU other processes took meanwhile
(``CpuMeter``, ``wait_quiet``: these machines are shared) and a process's resident memory
(``rss_mib`` / ``peak_rss_mib``)."""

from __future__ import annotations

import os
import resource
import time
from typing import Dict


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


def wait_quiet(max_wait_s: float, threshold: float = 0.25, window_s: float = 2.0, echo=print) -> float:
    """Waits (up to ``max_wait_s``) until other processes use less than ``threshold`` cores over a
    ``window_s`` window; returns the last window's load."""
    deadline = time.monotonic() + max_wait_s
    told = False
    while True:
        m = CpuMeter()
        time.sleep(window_s)
        load = m.stop()["other_cores"]
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
