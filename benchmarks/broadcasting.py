"""Request-level broadcasting benchmark: throughput with broadcasting on vs off, side by side.

    .venv/bin/python benchmarks/broadcasting.py [--run runs/demo | --config configs/demo.yaml]
                                                [--rows 2048] [--candidates 1 8 32 128] [--repeats 5]

Batches of requests with exactly N candidates each are built from the demo eval data (each request's
real rows, repeated or trimmed to N; ``--rows`` rows per batch, so rows // N requests): the same rows
are then converted to a ``Batch`` twice by the loader's ``BatchBuilder`` -- broadcasting on (one user slot
per request, U = rows / N) and off (one user slot per row, U = rows, ``model.broadcast: false``) --
and timed alternately on the same model:

- inference: the unsharded model's forward in eval mode, large layers in the inference precision
  (``model.precision.inference``, auto by default: BF16 where the CPU has fast BF16; ``--precision``
  overrides), as served;
- training: one step of a 1-rank ``DistributedModelParallel`` train task -- forward, backward with the
  fused embedding optimizer, dense AdamW step -- in ``model.precision.train``.

Each cell is the median over ``--repeats`` alternating repeats (after one warm-up) of examples/s over
``--batches`` distinct batches; "best-of" is the ratio of the fastest repeats (the least disturbed by
other processes). Weights: the run's checkpoint with ``--run``, else a fresh model of
``--config`` (speed does not depend on the values). 2 threads. The machine may be shared: each cell
first waits (up to ``--quiet-wait`` s) for other processes to go quiet, and the ``bg cores`` column
reports how many cores other processes used on average while it was measured.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Sequence

import numpy as np
import pyarrow as pa
import torch

from pinads_rec import config
from pinads_rec.data.loader.batch import Batch, BatchBuilder
from pinads_rec.data.loader.reader import RowGroupReader, list_files, list_row_groups
from pinads_rec.experiments.harness import CpuMeter, wait_quiet
from pinads_rec.features import FeatureLayout

REPO = Path(__file__).resolve().parents[1]


def read_requests(cfg: config.ExperimentConfig, data_dir: str, row_groups: int) -> tuple:
    """(checked Arrow table of the first row groups, [(start, length)] of its requests)."""
    reader = RowGroupReader(cfg.features, cfg.data)
    groups = list_row_groups(list_files(data_dir), cfg.features)[:row_groups]
    table = pa.concat_tables([reader.read(g) for g in groups]).combine_chunks()
    req = table.column(cfg.features.columns.request_id).to_numpy()
    starts = np.flatnonzero(np.concatenate([[True], req[1:] != req[:-1]]))
    lengths = np.diff(np.append(starts, len(req)))
    return table, list(zip(starts.tolist(), lengths.tolist()))


def request_tables(
    table: pa.Table, requests: List[tuple], candidates: int, rows: int, count: int, offset: int = 0
) -> List[pa.Table]:
    """``count`` tables of rows // candidates requests, each request's rows repeated/trimmed to exactly
    ``candidates`` (distinct requests across tables as long as the data has them)."""
    per_batch = rows // candidates
    out = []
    for b in range(count):
        idx = []
        for r in range(per_batch):
            start, length = requests[(offset + b * per_batch + r) % len(requests)]
            idx.append(start + np.arange(candidates) % length)
        out.append(table.take(pa.array(np.concatenate(idx))))
    return out


def to_batches(
    cfg: config.ExperimentConfig, tables: Sequence[pa.Table], rows: int, requests: int
) -> Dict[bool, List[Batch]]:
    """The same rows as broadcast (True) and per-row (False) batches, through the loader's BatchBuilder;
    broadcast batches get exactly one user slot per request."""
    out = {}
    for on in (True, False):
        builder = BatchBuilder(FeatureLayout.of(cfg.features), user_slots=min(requests or rows, rows), broadcast=on)
        out[on] = [builder.build(t) for t in tables]
    return out


def timed(fn, batches: Sequence[Batch]) -> float:
    """examples/s of fn over the batches."""
    started = time.perf_counter()
    for b in batches:
        fn(b)
    return sum(b.batch_size for b in batches) / (time.perf_counter() - started)


def side_by_side(fns: Dict[bool, Callable], batches: Dict[bool, List[Batch]], repeats: int) -> tuple:
    """(median examples/s, best examples/s) per mode, timed alternately after a warm-up."""
    for on in (True, False):  # warm-up: allocator, kernels, oneDNN primitives
        timed(fns[on], batches[on][:1])
    rates = {True: [], False: []}
    for i in range(repeats):
        for on in (True, False) if i % 2 == 0 else (False, True):
            rates[on].append(timed(fns[on], batches[on]))
    return ({on: statistics.median(r) for on, r in rates.items()}, {on: max(r) for on, r in rates.items()})


def inference_model(args, cfg):
    from pinads_rec.models import build_model
    from pinads_rec.modules.precision import resolve
    from pinads_rec.serve.loading import load_model, prepare

    # auto resolved here, so that the report names the precision it measured.
    precision = resolve(args.precision or cfg.model.precision.inference, torch.device("cpu"), "inference precision")
    if args.run:
        model, _ = load_model(args.run, precision)
        return model, precision
    torch.manual_seed(0)
    return prepare(build_model(cfg.features, cfg.model), precision, cfg.model.precision.fp16_overflow), precision


def training_task(cfg):
    """A 1-rank train step on given batches: the trainer's sharded TrainTask (``shard_train_task``)
    and optimizers (``parallel.make_optimizer``: fused embedding optimizer + AdamW); no loader."""
    from pinads_rec import parallel
    from pinads_rec.training.task import shard_train_task

    env = parallel.init_distributed()
    dmp = shard_train_task(cfg, env)
    optimizer, _ = parallel.make_optimizer(dmp, cfg.train, total_steps=1000)
    dmp.train()

    def step(batch: Batch) -> None:
        loss, _ = dmp(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", default=None, help="a trained run (weights for inference); default: fresh weights")
    p.add_argument("--config", default=str(REPO / "configs/demo.yaml"))
    p.add_argument("--data", default=None, help="requests to build batches from (default: the config's eval_dir)")
    p.add_argument("--rows", type=int, default=2048, help="rows per batch")
    p.add_argument("--candidates", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--batches", type=int, default=2, help="distinct batches per measurement")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--train-repeats", type=int, default=3)
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default=None, help="inference precision")
    p.add_argument("--no-train", action="store_true", help="inference only")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=120.0,
        help="seconds to wait, before each cell, for other processes to go quiet (0: no wait)",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    if args.run:
        from pinads_rec.serve.loading import find_checkpoint, run_config

        cfg = run_config(args.run, find_checkpoint(args.run))
    else:
        cfg = config.load(args.config)
    data_dir = args.data or cfg.data.eval_dir
    table, requests = read_requests(cfg, data_dir, row_groups=3)
    model, precision = inference_model(args, cfg)
    train_step = None if args.no_train else training_task(cfg)

    print(
        f"broadcasting on vs off: {args.rows} rows/batch x {args.batches} batches, {len(requests):,} real "
        f"requests of {data_dir} (mean {table.num_rows / len(requests):.1f} candidates) repeated/trimmed to N; "
        f"{'weights of ' + args.run if args.run else 'fresh weights'}; {args.threads} threads; median of "
        f"{args.repeats} (training {args.train_repeats}) alternating repeats\n",
        flush=True,
    )
    header = (
        f"{'phase':<24} {'N cand/req':>10} {'users/batch on':>14} {'on ex/s':>10} {'off ex/s':>10} "
        f"{'on/off':>7} {'best-of on/off':>14} {'bg cores':>8}"
    )
    lines = [header, "-" * len(header)]
    print(header, flush=True)
    results = []
    for n in args.candidates:
        tables = request_tables(table, requests, n, args.rows, args.batches)
        batches = to_batches(cfg, tables, args.rows, args.rows // n)
        users = batches[True][0].num_requests

        @torch.inference_mode()
        def infer(batch: Batch) -> None:
            model(batch)

        phases = [(f"inference ({precision})", {True: infer, False: infer}, args.repeats)]
        if train_step is not None:
            phases.append(
                (
                    f"training step ({cfg.model.precision.train})",
                    {True: train_step, False: train_step},
                    args.train_repeats,
                )
            )
        for name, fns, repeats in phases:
            if args.quiet_wait:
                wait_quiet(args.quiet_wait)
            meter = CpuMeter()
            rate, best = side_by_side(fns, batches, repeats)
            busy = meter.stop()["other_cores"]
            line = (
                f"{name:<24} {n:>10} {users:>14} {rate[True]:>10,.0f} {rate[False]:>10,.0f} "
                f"{rate[True] / rate[False]:>6.2f}x {best[True] / best[False]:>13.2f}x {busy:>8.2f}"
            )
            print(line, flush=True)
            lines.append(line)
            results.append((name, n, rate[True] / rate[False]))
    print("\n" + "\n".join(lines))
    at32 = [r for name, n, r in results if n == 32 and name.startswith("inference")]
    if at32:
        verdict = "met" if at32[0] >= 2.0 else "NOT met"
        print(f"\nacceptance (>= 2x inference throughput at 32 candidates/request): {at32[0]:.2f}x -> {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
