"""The embedding tables' dtypes side by side in one run: the tables' memory and the whole replica's,
the model alone's rows/s at batches of 1, 16 and 128 requests, and (with ``--raw``) the online path's
p50, at each dtype (serve/quantize.py).

    .venv/bin/python benchmarks/embedding_dtypes.py --run runs/demo [--dtypes fp32 int8 int4]
        [--raw data/demo/raw] [--requests 1 16 128] [--batches 20] [--repeats 5] [--online-requests 200]

1. **Memory.** Per dtype, a fresh process (``python -c``) loads the run as ``serve score`` does
   (``Predictor.from_run`` with ``serve.embedding_dtype``), scores one batch of the largest
   ``--requests`` size and reports the tables' bytes (``quantize.embedding_bytes``: the storages
   measured) and its peak RSS (the whole replica: torch, the model, the batch's work).
2. **The model alone.** In this process, the models of every dtype score the same eval batches of
   N requests each (``requests_batch`` of the eval split's first requests), timed in alternating
   order, median rows/s over ``--repeats``; 1 thread (a replica's share of a small machine).
3. **Online** (``--raw``: the raw logs the run was built from): ``Ranker.score`` -- the service's
   feature path, loader and model, what a replica does per request, HTTP aside -- one eval request at
   a time, p50 and p99 over ``--online-requests`` per dtype, alternating.

The precision of the large layers is the run's unless ``--precision``. Printed as one table, and
``--out`` JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Sequence

import pyarrow as pa
import torch

REPO = Path(__file__).resolve().parents[1]

MEMORY_SCRIPT = """
import json, resource, sys, torch
from pinads_rec.serve.batching import ScoringBatches
from pinads_rec.serve.quantize import embedding_bytes
from pinads_rec.serve.scoring import Predictor
run, precision, dtype, rows = sys.argv[1], sys.argv[2] or None, sys.argv[3], int(sys.argv[4])
torch.set_num_threads(1)
p = Predictor.from_run(run, precision, serve={"embedding_dtype": dtype, "table_dtypes": {}})
_, batch = next(iter(ScoringBatches(p.cfg, p.cfg.data.eval_dir, rows)))
p.score_batch(batch)
print(json.dumps({"tables": embedding_bytes(p.model), "rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def memory(run: str, precision: str, dtype: str, rows: int) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT, run, precision or "", dtype, str(rows)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    if done.returncode != 0:
        raise SystemExit(f"memory of {dtype}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def request_tables(cfg, candidates: int, count: int) -> List[pa.Table]:
    """The eval split's first ``count`` requests, each of ``candidates`` candidate rows."""
    from pinads_rec.experiments.ablate import request_tables as of_data

    return of_data(cfg.features, cfg.data.eval_dir, candidates, count)


def alternate(fns: Dict[str, callable], repeats: int) -> Dict[str, float]:
    """Median seconds of each fn, called in alternating order after one warm-up each."""
    for fn in fns.values():
        fn()
    times: Dict[str, List[float]] = {k: [] for k in fns}
    names = list(fns)
    for i in range(repeats):
        for name in names if i % 2 == 0 else names[::-1]:
            started = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - started)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv: Sequence[str] = None) -> int:
    from pinads_rec.serve.scoring import Predictor

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", default=str(REPO / "runs" / "demo"))
    p.add_argument("--dtypes", nargs="+", default=["fp32", "int8", "int4"], choices=["fp32", "fp16", "int8", "int4"])
    p.add_argument("--precision", default=None, help="the large layers' (default: the run's inference precision)")
    p.add_argument("--requests", type=int, nargs="+", default=[1, 16, 128], help="requests per batch")
    p.add_argument("--candidates", type=int, default=12, help="candidates per request (the demo's mean)")
    p.add_argument("--batches", type=int, default=20, help="batches per timing")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--raw", default=None, help="the run's raw logs: also time the online path")
    p.add_argument("--vocabularies", default=None)
    p.add_argument("--online-requests", type=int, default=200)
    p.add_argument("--out", default=None, help="also write the figures as JSON")
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    rows_at = max(args.requests) * 20  # the memory pass's batch: about the largest batch's rows
    result: Dict[str, dict] = {d: {"memory": memory(args.run, args.precision, d, rows_at)} for d in args.dtypes}
    for d in args.dtypes:
        print(
            f"{d}: tables {result[d]['memory']['tables']:,} B, replica peak RSS {result[d]['memory']['rss_kib']:,} KiB"
        )

    predictors = {
        d: Predictor.from_run(args.run, args.precision, serve={"embedding_dtype": d, "table_dtypes": {}})
        for d in args.dtypes
    }
    cfg = predictors[args.dtypes[0]].cfg
    tables = request_tables(cfg, args.candidates, max(args.requests) * args.batches)
    for n in args.requests:
        groups = [pa.concat_tables(tables[i * n : (i + 1) * n]) for i in range(args.batches)]
        first = predictors[args.dtypes[0]]
        batches = [first.requests_batch(g) for g in groups]
        rows = sum(int(b.valid.sum()) for b in batches)
        fns = {d: (lambda p=p, bs=batches: [p.score_batch(b) for b in bs]) for d, p in predictors.items()}
        secs = alternate(fns, args.repeats)
        for d in args.dtypes:
            result[d][f"rows_per_s@{n}"] = rows / secs[d]
        print(f"{n} requests a batch: " + ", ".join(f"{d} {rows / secs[d]:,.0f} rows/s" for d in args.dtypes))

    if args.raw:
        from pinads_rec.serve.loading import find_checkpoint
        from pinads_rec.serve.online import Ranker

        step = int(find_checkpoint(args.run).name.split("-")[1])
        rankers = {
            d: Ranker(Path(args.run), step, args.raw, args.vocabularies, args.precision, _settings(cfg, d))
            for d in args.dtypes
        }
        requests = rankers[args.dtypes[0]].live.requests_from_logs("eval", args.online_requests)
        ms: Dict[str, List[float]] = {d: [] for d in args.dtypes}
        for i, request in enumerate(requests):
            for d in args.dtypes if i % 2 == 0 else args.dtypes[::-1]:
                started = time.perf_counter()
                rankers[d].score([request])
                ms[d].append(1000 * (time.perf_counter() - started))
        for d in args.dtypes:
            v = sorted(ms[d][2:])  # the first two: warm-up
            result[d]["online_p50_ms"] = v[len(v) // 2]
            result[d]["online_p99_ms"] = v[min(len(v) - 1, int(0.99 * len(v)))]
        print(
            "online (Ranker.score, one request at a time): "
            + ", ".join(f"{d} p50 {result[d]['online_p50_ms']:.1f} ms" for d in args.dtypes)
        )

    base = result[args.dtypes[0]]
    print(f"\n{args.run}, large layers {cfg.model.precision.inference}, 1 thread; ratios against {args.dtypes[0]}\n")
    head = ["dtype", "tables MiB", "x smaller", "replica RSS MiB"] + [f"rows/s @{n} req" for n in args.requests]
    head += ["online p50 ms", "p99 ms"] if args.raw else []
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for d in args.dtypes:
        r = result[d]
        cells = [d, f"{r['memory']['tables'] / 2**20:.2f}", f"{base['memory']['tables'] / r['memory']['tables']:.2f}x"]
        cells += [f"{r['memory']['rss_kib'] / 1024:.0f}"] + [f"{r[f'rows_per_s@{n}']:,.0f}" for n in args.requests]
        cells += [f"{r['online_p50_ms']:.1f}", f"{r['online_p99_ms']:.1f}"] if args.raw else []
        lines.append(" | ".join(cells))
    print("\n".join(f"| {line} |" for line in lines))
    if args.out:
        Path(args.out).write_text(json.dumps({"run": args.run, "dtypes": result}, indent=1) + "\n")
    return 0


def _settings(cfg, dtype: str):
    import dataclasses

    return dataclasses.replace(cfg.serve, embedding_dtype=dtype, table_dtypes={})


if __name__ == "__main__":
    sys.exit(main())
