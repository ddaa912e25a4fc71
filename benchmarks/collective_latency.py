"""What one gloo collective costs between two ranks on this machine, alone and between computations.

    python benchmarks/collective_latency.py [--ranks 2] [--calls 300] [--compute-us 0 1000]

Each rank (one torch thread, as ``torchrun`` runs ``train.py`` here) calls ``all_to_all_single`` on
1,024 floats ``--calls`` times: back to back, then after each of ``--compute-us`` microseconds of
matmuls (the shape of a training step: compute, then a collective the ranks meet at). Printed per
setting: mean, median and 90th percentile of the collective's own time on rank 0, and the step
(compute + collective) against the compute measured alone on both ranks at once. The difference is
what every synchronizing collective of a training step costs: with two busy ranks on two cores, the
process group's worker and transport threads wait for a core at every hand-off.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional, Sequence

from pinads_rec.experiments.harness import run_ranks


def _rank(rank: int, world: int, work_dir: str, calls: int, compute_us: List[float]) -> None:
    """One rank (run_ranks: gloo joined, one torch thread); rank 0 writes ``latency.json``."""
    import torch
    import torch.distributed as dist

    results = []
    x, out = torch.randn(1024), torch.empty(1024)
    a = torch.randn(128, 128)
    # matmuls per compute phase: calibrated once, on this rank
    t0 = time.perf_counter()
    for _ in range(200):
        a @ a
    per_matmul_us = (time.perf_counter() - t0) / 200 * 1e6
    for us in compute_us:
        n = round(us / per_matmul_us)
        for _ in range(20):
            dist.all_to_all_single(out, x)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            for _ in range(n):
                a @ a
        alone = (time.perf_counter() - t0) / calls
        dist.barrier()
        waits = []
        t0 = time.perf_counter()
        for _ in range(calls):
            for _ in range(n):
                a @ a
            t1 = time.perf_counter()
            dist.all_to_all_single(out, x)
            waits.append(time.perf_counter() - t1)
        step = (time.perf_counter() - t0) / calls
        results.append((us, alone, step, waits))
    dist.barrier()
    if rank == 0:
        (Path(work_dir) / "latency.json").write_text(json.dumps(results))


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--compute-us", type=float, nargs="+", default=[0.0, 1000.0])
    args = ap.parse_args(argv)
    print(f"all_to_all_single of 1,024 floats, {args.ranks} gloo ranks, one thread each, {args.calls} calls")
    with tempfile.TemporaryDirectory(prefix="pinads_latency_") as tmp:
        run_ranks(_rank, args.ranks, tmp, args.calls, args.compute_us, timeout_s=600)
        results = json.loads((Path(tmp) / "latency.json").read_text())
    for us, alone, step, waits in results:
        ms = sorted(1e3 * w for w in waits)
        print(
            f"  after {us:6.0f} us of compute: collective mean {statistics.mean(ms):.3f} ms, median "
            f"{ms[len(ms) // 2]:.3f}, p90 {ms[int(0.9 * len(ms))]:.3f}; step {1e3 * step:.3f} ms vs compute "
            f"alone {1e3 * alone:.3f} ms (+{1e3 * (step - alone):.3f})",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
