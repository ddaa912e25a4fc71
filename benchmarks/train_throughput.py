"""Training throughput of the reference models, side by side with a plain-PyTorch baseline.

    python benchmarks/train_throughput.py [--config configs/demo.yaml] [--data data/ablations/train]
        [--ranks 1 2] [--steps 60] [--warmup 15] [--switches] [--out runs/train_throughput]

Every measurement is a fresh set of gloo processes (one torch thread each, the way ``torchrun``
runs ``train.py`` here), the ranks started together by a barrier, all in one run so the ratios
compare like with like on a noisy machine. Examples/s count the valid rows (a batch the
``max_unique_users_per_batch`` bound closed early is padded with invalid rows).

Models (overrides on ``--config``):

- ``full``: the full reference model -- three sequence groups (pins 100, ads 50, queries 50 events),
  a 2-layer Transformer per group with summary / mean pooling and target attention, long/short
  interest, DCNv2, MMoE;
- ``no_sequence``: the same without the sequence groups.

Modes:

- ``pipeline``: what ``train.py`` runs -- DistributedModelParallel (planner-sharded tables, fbgemm
  fused row-wise Adagrad inside backward), ``TrainPipelineSparseDist`` (the next batch's input
  all-to-alls overlap this batch's compute), request-level broadcasting;
- ``loop``: the same model in a plain loop (no pipeline), timed per phase: data wait, forward,
  backward (fused embedding update included), optimizer (dense AdamW) -- the step-time breakdown;
- ``plain``: the plain-PyTorch baseline: the same model function unsharded (TorchRec's unsharded
  collections are ``nn.EmbeddingBag`` / ``nn.Embedding`` modules), no request-level broadcasting
  (every row carries and encodes its own padded sequences), ``DistributedDataParallel`` over every
  parameter (dense embedding gradients all-reduced) and ``torch.optim.Adam``, a plain loop.

``--switches`` adds the training-efficiency ablation on the full model at the largest rank count:
pipeline off, loader workers 0 vs 1, BF16 large layers, batch sizes 1k-16k (the unique-user bound
scaled with the batch). Output: a table on stdout, ``throughput.csv`` and ``throughput.json`` under
``--out``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from pinads_rec import config, scaling  # noqa: E402

REFERENCE = {
    "full": ["model.sequence.num_layers=2", "model.sequence.encoders=[transformer, long_short]",
             "model.sequence.poolings=[summary, mean, target]"],
    "no_sequence": ["features.sequence_groups=[]"],
}


def _valid_rows(batch) -> int:
    return int(batch.valid.sum())


def measure_pipeline(cfg: config.ExperimentConfig, warmup: int, steps: int, num_workers: int) -> dict:
    """``train.py``'s loop: TrainPipelineSparseDist over the sharded model; wall time only."""
    import torch.distributed as dist
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from pinads_rec import parallel
    from pinads_rec.data.loader import make_loader
    from pinads_rec.train import EndTogether, build

    env = parallel.init_distributed()
    group = dist.new_group(backend="gloo") if env.world_size > 1 else None
    dmp = build(cfg, env, group=group)
    optimizer, schedule = parallel.make_optimizer(dmp, cfg.train, warmup + steps + 2)
    loader = make_loader(cfg, cfg.data.train_dir, env.rank, env.world_size, shuffle=True, num_workers=num_workers)
    rows: List[int] = []

    def counted(it):
        for batch in it:
            rows.append(_valid_rows(batch))
            yield batch

    batches = EndTogether(counted(iter(loader)), group)
    pipeline = TrainPipelineSparseDist(dmp, optimizer, env.device, execute_all_batches=True)
    dmp.train()
    started = None
    for i in range(warmup + steps):
        if i == warmup:
            dist.barrier()
            started = time.perf_counter()
        pipeline.progress(batches)
        schedule.step()
    wall = time.perf_counter() - started
    return {"rank": env.rank, "wall_s": wall, "steps": steps, "valid_rows_per_step": sum(rows) / len(rows)}


def measure_loop(cfg: config.ExperimentConfig, warmup: int, steps: int, num_workers: int) -> dict:
    """The sharded model in a plain loop, timed per phase (scaling.measure_rank)."""
    out = scaling.measure_rank(cfg, warmup, steps, num_workers)
    return {"rank": out["rank"], "wall_s": out["wall_s"], "steps": steps,
            **{f"{k}_ms": out[f"{k}_ms"] for k in scaling.PHASES}}


def measure_plain(cfg: config.ExperimentConfig, warmup: int, steps: int, num_workers: int) -> dict:
    """The plain-PyTorch baseline: unsharded model, no broadcasting, DDP + Adam, plain loop."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from pinads_rec import parallel
    from pinads_rec.data.loader import make_loader
    from pinads_rec.models import build_model
    from pinads_rec.models.train_task import TrainTask
    from pinads_rec.train import EndTogether

    env = parallel.init_distributed()
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, broadcast=False))
    group = dist.new_group(backend="gloo") if env.world_size > 1 else None
    torch.manual_seed(cfg.train.seed)
    task = TrainTask(build_model(cfg.features, cfg.model))
    net = DistributedDataParallel(task) if env.world_size > 1 else task
    optimizer = torch.optim.Adam(task.parameters(), lr=cfg.train.lr)
    loader = make_loader(cfg, cfg.data.train_dir, env.rank, env.world_size, shuffle=True, num_workers=num_workers)
    batches = EndTogether(iter(loader), group)
    net.train()
    sums = dict.fromkeys(scaling.PHASES, 0.0)
    rows = 0
    started = None
    for i in range(warmup + steps):
        if i == warmup:
            dist.barrier()
            started = time.perf_counter()
        t0 = time.perf_counter()
        batch = next(batches)
        t1 = time.perf_counter()
        loss, _ = net(batch)
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        t4 = time.perf_counter()
        if i >= warmup:
            for k, dt in zip(scaling.PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                sums[k] += dt
            rows += _valid_rows(batch)
    wall = time.perf_counter() - started
    return {"rank": env.rank, "wall_s": wall, "steps": steps, "valid_rows_per_step": rows / steps,
            **{f"{k}_ms": 1000.0 * v / steps for k, v in sums.items()}}


MEASURES = {"pipeline": measure_pipeline, "loop": measure_loop, "plain": measure_plain}


def dense_flops_per_example(cfg: config.ExperimentConfig, batches: int = 3) -> float:
    """Forward + backward FLOPs per valid row of the model's dense part (matmuls, attention:
    ``torch.utils.flop_counter``), request-level broadcasting on, as trained."""
    from torch.utils.flop_counter import FlopCounterMode

    from pinads_rec.data.loader import ParquetBatches
    from pinads_rec.models import build_model
    from pinads_rec.models.train_task import TrainTask

    torch.manual_seed(0)
    task = TrainTask(build_model(cfg.features, cfg.model))
    flops = rows = 0
    for i, batch in enumerate(ParquetBatches(cfg, cfg.data.train_dir, shuffle=False)):
        if i == batches:
            break
        counter = FlopCounterMode(display=False)
        with counter:
            loss, _ = task(batch)
            loss.backward()
        flops += counter.get_total_flops()
        rows += _valid_rows(batch)
    return flops / rows


def matmul_peak(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of one thread on an n x n matmul (the best of ``repeats``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        torch.mm(a, b)
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t)
        return 2.0 * n ** 3 / best
    finally:
        torch.set_num_threads(threads)


def run(name: str, cfg: config.ExperimentConfig, mode: str, ranks: int, warmup: int, steps: int, workers: int,
        out: Path) -> dict:
    t0 = time.perf_counter()
    per_rank = scaling.launch(cfg, ranks, warmup, steps, out / "runs" / f"{name}-{mode}-r{ranks}", num_workers=workers,
                              measure=MEASURES[mode])
    wall = max(r["wall_s"] for r in per_rank)
    # The loop mode counts whole batches (scaling.measure_rank); the padding share is the pipeline's.
    valid = sum(r.get("valid_rows_per_step", cfg.data.batch_size) for r in per_rank)
    row = {"model": name, "mode": mode, "ranks": ranks, "batch_size": cfg.data.batch_size, "workers": workers,
           "precision": cfg.model.precision.train, "steps": steps, "step_ms": 1000.0 * wall / steps,
           "examples_per_s": valid * steps / wall, "run_s": time.perf_counter() - t0}
    for k in scaling.PHASES:
        if f"{k}_ms" in per_rank[0]:
            row[f"{k}_ms"] = sum(r[f"{k}_ms"] for r in per_rank) / len(per_rank)
    print(f"  {name:<24} {mode:<9} ranks {ranks}  {row['examples_per_s']:>9,.0f} ex/s  step {row['step_ms']:7.1f} ms"
          + "".join(f"  {k} {row[k + '_ms']:6.1f}" for k in scaling.PHASES if k + "_ms" in row), flush=True)
    return row


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "demo.yaml"))
    ap.add_argument("--data", default=None, help="train data (default: the config's data.train_dir)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--models", nargs="+", default=list(REFERENCE), choices=list(REFERENCE))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=15)
    ap.add_argument("--workers", type=int, default=1, help="loader worker processes per rank")
    ap.add_argument("--switches", action="store_true", help="the training-efficiency ablation (full model)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default="runs/train_throughput")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = list(args.set) + ([f"data.train_dir={args.data}"] if args.data else [])
    try:
        cfgs = {m: config.load(args.config, common + REFERENCE[m]) for m in args.models}
    except config.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2

    rows: List[dict] = []
    print("reference models (examples/s: valid rows, all ranks; phases: ms per step, mean over ranks)")
    for name, cfg in cfgs.items():
        for ranks in args.ranks:
            for mode in ("pipeline", "loop", "plain"):
                rows.append(run(name, cfg, mode, ranks, args.warmup, args.steps, args.workers, out))
    if args.switches and "full" in cfgs:
        ranks = max(args.ranks)
        print(f"training-efficiency switches (full model, {ranks} ranks)")
        full = cfgs["full"]
        rows.append(run("full, 0 loader workers", full, "pipeline", ranks, args.warmup, args.steps, 0, out))
        bf16 = config.load(args.config, common + REFERENCE["full"] + ["model.precision.train=bf16"])
        rows.append(run("full, BF16 large layers", bf16, "pipeline", ranks, args.warmup, args.steps, args.workers, out))
        for batch in (1024, 2048, 4096, 8192, 16384):
            users = max(64, batch // 8)  # ~12 candidates per request: room for every request of a batch
            cfg = config.load(args.config, common + REFERENCE["full"] + [f"data.batch_size={batch}",
                                                                         f"data.max_unique_users_per_batch={users}"])
            steps = max(8, args.steps * 512 // batch)
            rows.append(run(f"full, batch {batch}", cfg, "pipeline", ranks, max(3, steps // 4), steps, args.workers, out))

    def rate(model, mode, ranks):
        return next((r["examples_per_s"] for r in rows if (r["model"], r["mode"], r["ranks"]) == (model, mode, ranks)),
                    None)

    if "full" in cfgs:
        ranks = max(args.ranks)
        flops = dense_flops_per_example(cfgs["full"])
        achieved = flops * rate("full", "pipeline", ranks)
        peaks = {name: ranks * matmul_peak(dt) for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
        print(f"\nutilization (full model, {ranks} ranks = {ranks} cores): {flops / 1e6:.1f} dense MFLOP per example "
              f"(forward + backward) -> {achieved / 1e9:.2f} GFLOP/s achieved; matmul peak ({ranks} x one thread, "
              f"2048^2): fp32 {peaks['fp32'] / 1e9:.1f} GFLOP/s ({100 * achieved / peaks['fp32']:.0f}%), "
              f"bf16 {peaks['bf16'] / 1e9:.1f} GFLOP/s ({100 * achieved / peaks['bf16']:.0f}%)")
        rows.append({"model": "full", "mode": "utilization", "ranks": ranks, "dense_flops_per_example": flops,
                     "achieved_flops": achieved, "peak_fp32_flops": peaks["fp32"], "peak_bf16_flops": peaks["bf16"]})

    print("\nratios (same run):")
    for name in cfgs:
        for ranks in args.ranks:
            p, lo, pl = rate(name, "pipeline", ranks), rate(name, "loop", ranks), rate(name, "plain", ranks)
            print(f"  {name:<12} {ranks} rank(s): pipeline / plain PyTorch {p / pl:5.2f}x, pipeline / loop {p / lo:5.2f}x")
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with open(out / "throughput.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        w.writerows(rows)
    (out / "throughput.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {out / 'throughput.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
