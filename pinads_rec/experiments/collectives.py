"""Time in collectives per phase of a training step, read from torch.profiler, and DDP's gradient
all_reduce timed through DDP's comm-hook API: nothing of torch.distributed is replaced.

torch.profiler records every gloo collective as an event ``gloo:<op>`` (e.g. ``gloo:all_to_all``)
on the process group's worker thread, from when the worker starts it until it completes: waiting
for the slower peer is included. ``PhaseProfile`` profiles a stretch of steps in which the caller
marks each phase (``with profile.phase("forward"): ...``); ``summary(steps)`` then gives per phase

- ``ms``: the phase's wall time during which at least one collective was in flight (the union of
  the events' intervals, clipped to the phase; so never more than the phase), per step;
- per ``"<phase> <op>"``: [collectives started per step, their summed duration in ms per step].

``DdpAllReduceTimer`` registers a comm hook doing what DDP's default hook does (an averaging
all_reduce of each gradient bucket) and adds up each bucket's wall time from enqueue to completion.
"""

from __future__ import annotations

import contextlib
import time
from typing import Dict, Iterator, List, Optional, Tuple

import torch

PHASE_PREFIX = "phase:"
COLLECTIVE_PREFIXES = ("gloo:", "nccl:")


def _union_ms(intervals: List[Tuple[float, float]]) -> float:
    """Total length (ms) of the union of [start, end] intervals given in microseconds."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total / 1000.0


class PhaseProfile:
    """torch.profiler over the measured steps; ``phase(name)`` marks where each phase runs."""

    def __init__(self):
        self._profile: Optional[torch.profiler.profile] = None

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        with torch.profiler.record_function(PHASE_PREFIX + name):
            yield

    def start(self) -> None:
        self._profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self._profile.__enter__()

    def stop(self) -> None:
        self._profile.__exit__(None, None, None)

    def summary(self, steps: int, exclude: Dict[str, Tuple[str, ...]] = None) -> dict:
        """{"ms": {phase: ms per step}, "ops": {"<phase> <op>": [calls per step, ms per step]}}.
        ``exclude``: per phase, ops left out of its ``ms`` (still listed in ``ops``)."""
        phases: List[Tuple[str, float, float]] = []
        collectives: List[Tuple[str, float, float]] = []
        # The raw events (a CPU step here has ~7,000): events() would first build a FunctionEvent
        # tree of them, ~50 us and ~4 KiB each.
        for e in self._profile.profiler.kineto_results.events():
            name = e.name()
            if name.startswith(PHASE_PREFIX):
                phases.append((name[len(PHASE_PREFIX) :], e.start_ns() / 1e3, e.end_ns() / 1e3))
            elif name.startswith(COLLECTIVE_PREFIXES):
                collectives.append((name.split(":", 1)[1], e.start_ns() / 1e3, e.end_ns() / 1e3))
        in_flight: Dict[str, List[Tuple[float, float]]] = {}
        ops: Dict[str, List[float]] = {}
        for name, a, b in phases:
            skip = (exclude or {}).get(name, ())
            clipped = in_flight.setdefault(name, [])
            for op, start, end in collectives:
                if start < b and end > a and op not in skip:
                    clipped.append((max(start, a), min(end, b)))
                if a <= start < b:  # counted where it started
                    entry = ops.setdefault(f"{name} {op}", [0, 0.0])
                    entry[0] += 1
                    entry[1] += (end - start) / 1000.0
        return {
            "ms": {name: _union_ms(spans) / steps for name, spans in in_flight.items()},
            "ops": {k: [v[0] / steps, round(v[1] / steps, 3)] for k, v in sorted(ops.items())},
        }


class DdpAllReduceTimer:
    """DDP's default gradient all_reduce as a comm hook that records each bucket's wall time."""

    def __init__(self):
        self.seconds = 0.0

    def hook(self, group, bucket):  # no annotations: DDP checks them as types, and here they are strings
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        t0 = time.perf_counter()

        def done(fut: torch.futures.Future) -> torch.Tensor:
            self.seconds += time.perf_counter() - t0
            return fut.value()

        return allreduce_hook(group, bucket).then(done)

    def install(self, model: torch.nn.Module) -> "DdpAllReduceTimer":
        """Registers the hook on the DistributedDataParallel inside ``model`` (DMP wraps the dense
        part in one); a model without DDP has no all_reduce to time."""
        ddp = next((m for m in model.modules() if isinstance(m, torch.nn.parallel.DistributedDataParallel)), None)
        if ddp is not None:
            ddp.register_comm_hook(None, self.hook)
        return self
