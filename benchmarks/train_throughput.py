"""Training throughput of the reference models, side by side with a plain-PyTorch baseline.

    python benchmarks/train_throughput.py [--config configs/demo.yaml] [--data data/ablations/train]
        [--ranks 1 2] [--steps 60] [--warmup 15] [--switches] [--profile] [--out runs/train_throughput]

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

- ``pipeline``: what ``train.py`` runs -- its trainer (``Trainer.setup()`` through
  ``harness.measured_trainer``, then ``Trainer.train_step``): DistributedModelParallel
  (planner-sharded tables, fbgemm fused row-wise Adagrad inside backward),
  ``TrainPipelineSparseDist`` (the next batch's input all-to-alls overlap this batch's compute),
  request-level broadcasting;
- ``loop``: the same trainer in a plain loop (no pipeline; ``harness.measure_training``), timed per
  phase: data wait, forward, backward (fused embedding update included), optimizer (dense AdamW) --
  the step-time breakdown;
- ``plain``: the plain-PyTorch baseline: the same model function unsharded (TorchRec's unsharded
  collections are ``nn.EmbeddingBag`` / ``nn.Embedding`` modules), no request-level broadcasting
  (every row carries and encodes its own padded sequences), ``DistributedDataParallel`` over every
  parameter (dense embedding gradients all-reduced), train.py's optimizer recipe in ``torch.optim``
  (Adagrad on the tables, AdamW with warm-up and decay on the dense layers: ``parallel.lr_multiplier``),
  a plain loop. Built by hand on purpose (it is what the trainer is compared with), on the same
  loader, end-of-data agreement (``EndTogether``) and evaluation (``evaluation_rows``).

``--switches`` adds the training-efficiency ablation (``switches()``) on both models at the largest
rank count, one switch at a time: loader workers 0 vs 1 and prefetch depth, the dense AdamW fused /
multi-tensor / per-parameter, every sharding type allowed to the planner instead of the CPU's
table-wise default, SDPA's fused (flash) kernel vs the MATH one and BF16 large layers (full
model), tables replicated with a separate Adagrad step vs sharded with the fused one (no-sequence
model: the CPU cannot replicate EmbeddingCollection tables), and batches of 1k-16k rows per rank
(the unique-user bound scaled with the batch). Each switch is a config override
(``data.num_workers``, ``data.prefetch_factor``, ``train.dense_optimizer_kernel``,
``train.sharding_types``, ``model.precision.train``, ``data.batch_size``), except SDPA's kernel,
pinned by ``modules.transformer.set_attention_backends``. Pinned memory applies to CUDA only
(train.py pins when it trains on a GPU). The pipeline-off switch is the ``loop`` mode above.

Then, per model, for the reference row and the fastest switch: utilization (dense FLOPs per
example from ``torch.utils.flop_counter`` against the measured matmul peaks, fp32 and bf16),
embedding lookups/s against fbgemm's table-batched kernel measured alone, and the loader's
examples/s (one rank's batches, built in-process on one thread; also with the batch builder's
allocations zero-filled, ``BatchBuilder.zero_fill``) against a rank's consumption. ``--profile``
writes torch.profiler tables of each model (plain loop, rank 0: at 1 rank and at the most
``--ranks``). Output: a table on stdout, ``throughput.csv`` and ``throughput.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import itertools
import json
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence

import torch

from pinads_rec import config
from pinads_rec.experiments import harness
from pinads_rec.plan import SHARDING_TYPES

REPO = Path(__file__).resolve().parents[1]

REFERENCE = {
    "full": [
        "model.sequence.num_layers=2",
        "model.sequence.encoders=[transformer, long_short]",
        "model.sequence.poolings=[summary, mean, target]",
    ],
    "no_sequence": ["features.sequence_groups=[]"],
}


# The training-efficiency ablation: (label, config overrides, measure_pipeline keywords, loader
# workers (None: --workers), rows per rank), one switch at a time against the model's pipeline row.
def switches(model: str) -> List[tuple]:
    out = [
        ("0 loader workers (batches built in the trainer)", [], {}, 0, 512),
        ("prefetch 1 batch per worker (instead of 4)", ["data.prefetch_factor=1"], {}, None, 512),
        ("dense AdamW foreach (instead of fused)", ["train.dense_optimizer_kernel=foreach"], {}, None, 512),
        ("dense AdamW for-loop", ["train.dense_optimizer_kernel=for_loop"], {}, None, 512),
        # the planner free to mix types (its cost model does not see gloo's per-collective cost)
        (
            "every sharding type allowed (instead of table-wise)",
            [f"train.sharding_types=[{', '.join(SHARDING_TYPES)}]"],
            {},
            None,
            512,
        ),
    ]
    if model == "full":
        out += [
            ("SDPA on the MATH kernel (instead of flash)", [], {"attention": "math"}, None, 512),
            ("BF16 large layers", ["model.precision.train=bf16"], {}, None, 512),
        ]
    else:  # EmbeddingCollection tables cannot be data_parallel on CPU (fbgemm's dense kernel pools)
        out += [
            (
                "tables replicated, Adagrad after backward (not fused)",
                ["train.sharding_types=[data_parallel]"],
                {},
                None,
                512,
            )
        ]
    out += [(f"batch {b:,}", [], {}, None, b) for b in (1024, 2048, 4096, 8192, 16384)]
    out += [(f"batch {b:,}, 0 loader workers", [], {}, 0, b) for b in (4096, 16384)]
    # BF16 where the matmuls are large enough to use the bf16 units
    if model == "full":
        out += [("batch 4,096, 0 loader workers, BF16", ["model.precision.train=bf16"], {}, 0, 4096)]
    else:
        out += [(f"batch {b:,}, BF16", ["model.precision.train=bf16"], {}, None, b) for b in (8192, 16384)]
    return out


def batch_overrides(batch: int) -> List[str]:
    # ~12 candidates per request: room for every request of a batch under the unique-user bound
    return (
        [] if batch == 512 else [f"data.batch_size={batch}", f"data.max_unique_users_per_batch={max(64, batch // 8)}"]
    )


def _valid_rows(batch) -> int:
    return int(batch.valid.sum())


def measure_pipeline(
    cfg: config.ExperimentConfig, warmup: int, steps: int, num_workers: int, attention: str = "automatic"
) -> dict:
    """``train.py``'s loop: ``Trainer.train_step`` (TrainPipelineSparseDist over the sharded model,
    then the LR schedule) of the trainer ``train.py`` builds (harness.measured_trainer); wall time
    only.

    ``attention="math"`` (a switch of the training-efficiency ablation) pins every self-attention
    layer to SDPA's unfused MATH kernel (modules.transformer.set_attention_backends) instead of the
    automatic choice (the fused flash kernel in FP32). The other switches are config overrides
    (train.dense_optimizer_kernel, data.prefetch_factor, ...)."""
    import torch.distributed as dist
    from torch.nn.attention import SDPBackend

    from pinads_rec.modules.transformer import set_attention_backends

    rows: List[int] = []

    def counted(batches):
        for batch in batches:
            rows.append(_valid_rows(batch))
            yield batch

    with harness.measured_trainer(cfg, warmup + steps + 2, num_workers) as trainer:
        pinned = set_attention_backends(trainer.dmp, [SDPBackend.MATH]) if attention == "math" else 0
        batches = counted(trainer.epoch_batches(0))
        trainer.dmp.train()
        started = None
        for i in range(warmup + steps):
            if i == warmup:
                dist.barrier()
                started = time.perf_counter()
            trainer.train_step(batches)
        wall = time.perf_counter() - started
    return {
        "rank": trainer.env.rank,
        "wall_s": wall,
        "steps": steps,
        "valid_rows_per_step": sum(rows) / len(rows),
        "attention_layers_pinned": pinned,
    }


def measure_loop(cfg: config.ExperimentConfig, warmup: int, steps: int, num_workers: int) -> dict:
    """The sharded model in a plain loop, timed per phase (harness.measure_training)."""
    out = harness.measure_training(cfg, warmup, steps, num_workers)
    return {
        "rank": out["rank"],
        "wall_s": out["wall_s"],
        "steps": steps,
        **{f"{k}_ms": out[f"{k}_ms"] for k in harness.PHASES},
    }


def plain_optimizers(task: torch.nn.Module, train: config.TrainConfig, total_steps: int):
    """train.py's optimizer recipe in ``torch.optim``: Adagrad on the tables at the embedding LR
    (element-wise; the row-wise variant is fbgemm's), AdamW on the dense layers with the same warm-up
    and decay. (optimizers, the dense LR schedule)."""
    from pinads_rec import parallel

    tables = {n: p for n, p in task.named_parameters() if any(k in n for k in parallel.EMBEDDING_PARAM)}
    dense = [p for n, p in task.named_parameters() if n not in tables]
    adamw = torch.optim.AdamW(dense, lr=train.lr, weight_decay=train.weight_decay)
    adagrad = torch.optim.Adagrad(list(tables.values()), lr=train.embedding_lr, eps=1e-8)
    return [adamw, adagrad], torch.optim.lr_scheduler.LambdaLR(adamw, parallel.lr_multiplier(train, total_steps))


def measure_plain(
    cfg: config.ExperimentConfig, warmup: int, steps: int, num_workers: int, evaluate: bool = False
) -> dict:
    """The plain-PyTorch baseline: unsharded model, no broadcasting, DDP, train.py's optimizer recipe
    in torch.optim (plain_optimizers), plain loop.
    ``evaluate``: then its AUC etc. on the eval split, as ``train.py`` evaluates (``eval`` rows)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from pinads_rec import parallel
    from pinads_rec.data.loader.dataset import LoaderSettings, make_loader
    from pinads_rec.models import build_model
    from pinads_rec.models.train_task import TrainTask
    from pinads_rec.training.epochs import EndTogether
    from pinads_rec.training.evaluation import evaluation_rows

    env = parallel.init_distributed()
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, broadcast=False))
    group = dist.new_group(backend="gloo") if env.world_size > 1 else None
    torch.manual_seed(cfg.train.seed)
    task = TrainTask(build_model(cfg.features, cfg.model))
    net = DistributedDataParallel(task) if env.world_size > 1 else task
    optimizers, schedule = plain_optimizers(task, cfg.train, warmup + steps)
    loader = make_loader(
        cfg.data.train_dir, LoaderSettings.of(cfg), env.rank, env.world_size, shuffle=True, num_workers=num_workers
    )
    batches = EndTogether(iter(loader), group)
    net.train()
    sums = dict.fromkeys(harness.PHASES, 0.0)
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
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        schedule.step()
        t4 = time.perf_counter()
        if i >= warmup:
            for k, dt in zip(harness.PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                sums[k] += dt
            rows += _valid_rows(batch)
    wall = time.perf_counter() - started
    return {
        "rank": env.rank,
        "wall_s": wall,
        "steps": steps,
        "valid_rows_per_step": rows / steps,
        **{f"{k}_ms": 1000.0 * v / steps for k, v in sums.items()},
        **({"eval": evaluation_rows(net, LoaderSettings.of(cfg), env, group)} if evaluate else {}),
    }


def measure_profile(cfg: config.ExperimentConfig, warmup: int, steps: int, num_workers: int) -> dict:
    """torch.profiler over ``steps`` plain-loop steps (forward, backward, optimizers: no pipeline) of
    the trainer ``train.py`` builds (harness.measured_trainer), after ``warmup``: the operators by
    self CPU time, as a table."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    with harness.measured_trainer(cfg, warmup + steps + 2, num_workers) as trainer:
        dmp, optimizer, batches = trainer.dmp, trainer.optimizer, trainer.epoch_batches(0)
        dmp.train()

        def step():
            loss, _ = dmp(next(batches))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        for _ in range(warmup):
            step()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            wall = time.perf_counter() - t0
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)
    return {"rank": trainer.env.rank, "wall_s": wall, "steps": steps, "table": table}


MEASURES = {"pipeline": measure_pipeline, "loop": measure_loop, "plain": measure_plain}


def dense_flops_per_example(cfg: config.ExperimentConfig, batches: int = 3) -> float:
    """Forward + backward FLOPs per valid row of the model's dense part (matmuls, attention:
    ``torch.utils.flop_counter``), request-level broadcasting on, as trained."""
    from torch.utils.flop_counter import FlopCounterMode

    from pinads_rec.data.loader.dataset import LoaderSettings, ParquetBatches
    from pinads_rec.models import build_model
    from pinads_rec.models.train_task import TrainTask

    torch.manual_seed(0)
    task = TrainTask(build_model(cfg.features, cfg.model))
    flops = rows = 0
    for i, batch in enumerate(ParquetBatches(cfg.data.train_dir, LoaderSettings.of(cfg), shuffle=False)):
        if i == batches:
            break
        counter = FlopCounterMode(display=False)
        with counter:
            loss, _ = task(batch)
            loss.backward()
        flops += counter.get_total_flops()
        rows += _valid_rows(batch)
    return flops / rows


def matmul_peak(dtype: torch.dtype, n: int = 2048, repeats: int = 5, budget_s: float = 20.0) -> float:
    """FLOP/s of one thread on an n x n matmul (the best of ``repeats``). On a CPU without BF16
    units a BF16 matmul of 2048^2 takes minutes: when a 256^2 one says the probe would outrun
    ``budget_s``, it measures at 256^2 instead (a rate either way)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        small = torch.randn(256, 256, dtype=dtype)
        t = time.perf_counter()
        torch.mm(small, small)
        if (time.perf_counter() - t) * (n / 256) ** 3 * (repeats + 1) > budget_s:
            n = 256
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        torch.mm(a, b)
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t)
        return 2.0 * n**3 / best
    finally:
        torch.set_num_threads(threads)


def loader_rate(cfg: config.ExperimentConfig, world: int, batches: int = 40, zero_fill: bool = False) -> dict:
    """Examples/s of one rank's batch building alone (rank 0 of ``world``, in this process, one
    thread): what a loader worker supplies. ``zero_fill``: the batch builder allocates its tensors
    with ``torch.zeros`` (``BatchBuilder.zero_fill``) -- the zero-filled allocations it avoids."""
    from pinads_rec.data.loader.dataset import LoaderSettings, ParquetBatches

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dataset = ParquetBatches(cfg.data.train_dir, LoaderSettings.of(cfg), 0, world, shuffle=True)
        dataset.builder.zero_fill = zero_fill
        it = iter(dataset)
        next(it)  # the first shuffle-buffer fill is not steady state
        rows = n = 0
        t0 = time.perf_counter()
        for batch in itertools.islice(it, batches):  # fewer when the data run out
            rows += _valid_rows(batch)
            n += 1
        wall = time.perf_counter() - t0
    finally:
        torch.set_num_threads(threads)
    return {"examples_per_s": rows / wall, "batch_ms": 1000.0 * wall / max(n, 1)}


def lookups_per_example(cfg: config.ExperimentConfig, batches: int = 5) -> float:
    """Embedding rows read per valid row as trained (pooled ids per row, plus each request's
    sequence and user-side ids once: request-level broadcasting)."""
    from pinads_rec.data.loader.dataset import LoaderSettings, ParquetBatches

    ids = rows = 0
    for i, b in enumerate(ParquetBatches(cfg.data.train_dir, LoaderSettings.of(cfg), shuffle=False)):
        if i == batches:
            break
        ids += b.sparse.values().numel() + b.user_sparse.values().numel() + b.sequences.values().numel()
        rows += _valid_rows(b)
    return ids / rows


def fbgemm_lookup_rate(cfg: config.ExperimentConfig, batches: int = 5, repeats: int = 5) -> float:
    """Embedding lookups/s of fbgemm's CPU table-batched kernel alone, one thread: forward + backward
    with the fused row-wise Adagrad update, on the model's own tables and a few real batches' ids
    (pooled features summed, sequence events unpooled), the best of ``repeats``."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    from pinads_rec.data.loader.dataset import LoaderSettings, ParquetBatches
    from pinads_rec.features import FeatureLayout

    tables = {t.name: t for t in cfg.features.tables}
    pooled = {f.name: f.table for f in cfg.features.sparse}
    events = {f"{g.name}.{f.name}": f.table for g in cfg.features.sequence_groups for f in g.features}
    events.update({config.CANDIDATE_PREFIX + k: pooled[k] for k in FeatureLayout.of(cfg.features).shared_keys})

    def tbe(kjt, feature_table, pooling):
        # One table per feature: fbgemm's CPU kernel rejects unpooled features sharing a table
        # (feature_table_map), and the rate is per lookup either way.
        op = SplitTableBatchedEmbeddingBagsCodegen(
            [
                (
                    tables[feature_table[k]].num_embeddings,
                    tables[feature_table[k]].embedding_dim,
                    EmbeddingLocation.HOST,
                    ComputeDevice.CPU,
                )
                for k in kjt.keys()
            ],
            optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            learning_rate=0.05,
            pooling_mode=pooling,
        )
        return op, kjt.values(), kjt.offsets().long()  # ids are in range: the contract checks hashed them

    work = []
    for i, b in enumerate(ParquetBatches(cfg.data.train_dir, LoaderSettings.of(cfg), shuffle=False)):
        if i == batches:
            break
        for kjt, ft, pooling in (
            (b.sparse, pooled, PoolingMode.SUM),
            (b.user_sparse, pooled, PoolingMode.SUM),
            (b.sequences, events, PoolingMode.NONE),
        ):
            if kjt.values().numel():
                work.append(tbe(kjt, ft, pooling))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            for op, ids, offsets in work:
                op(ids, offsets).sum().backward()
            best = min(best, time.perf_counter() - t)
    finally:
        torch.set_num_threads(threads)
    return sum(ids.numel() for _, ids, _ in work) / best


def run(
    name: str,
    cfg: config.ExperimentConfig,
    mode: str,
    ranks: int,
    warmup: int,
    steps: int,
    workers: int,
    out: Path,
    measure=None,
    label: str = "",
) -> dict:
    t0 = time.perf_counter()
    per_rank = harness.rank_results(
        measure or MEASURES[mode],
        ranks,
        out / "runs" / f"{name}-{mode}-r{ranks}",
        cfg,
        warmup,
        steps,
        workers,
        timeout_s=600,
    )
    wall = max(r["wall_s"] for r in per_rank)
    # The loop mode counts whole batches (harness.measure_training); the padding share is the pipeline's.
    valid = sum(r.get("valid_rows_per_step", cfg.data.batch_size) for r in per_rank)
    row = {
        "model": name,
        "switch": label,
        "mode": mode,
        "ranks": ranks,
        "batch_size": cfg.data.batch_size,
        "workers": workers,
        "precision": cfg.model.precision.train,
        "steps": steps,
        "step_ms": 1000.0 * wall / steps,
        "examples_per_s": valid * steps / wall,
        "run_s": time.perf_counter() - t0,
    }
    for k in harness.PHASES:
        if f"{k}_ms" in per_rank[0]:
            row[f"{k}_ms"] = sum(r[f"{k}_ms"] for r in per_rank) / len(per_rank)
    print(
        f"  {name + (', ' + label if label else ''):<24} {mode:<9} ranks {ranks}  {row['examples_per_s']:>9,.0f} ex/s  "
        f"step {row['step_ms']:7.1f} ms"
        + "".join(f"  {k} {row[k + '_ms']:6.1f}" for k in harness.PHASES if k + "_ms" in row),
        flush=True,
    )
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
    ap.add_argument("--switches", action="store_true", help="the training-efficiency ablation")
    ap.add_argument(
        "--profile", action="store_true", help="torch.profiler tables of each model (1 rank and the most --ranks)"
    )
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
    configs = {(m, ""): c for m, c in cfgs.items()}  # (model, switch) -> the config it trained
    print("reference models (examples/s: valid rows, all ranks; phases: ms per step, mean over ranks)")
    for name, cfg in cfgs.items():
        for ranks in args.ranks:
            for mode in ("pipeline", "loop", "plain"):
                rows.append(run(name, cfg, mode, ranks, args.warmup, args.steps, args.workers, out))
    if args.switches:
        ranks = max(args.ranks)
        print(f"training-efficiency switches ({ranks} ranks, pipeline mode; against the pipeline rows above)")
        for name in cfgs:
            for label, overrides, kwargs, workers, batch in switches(name):
                cfg = configs[(name, label)] = config.load(
                    args.config, common + REFERENCE[name] + overrides + batch_overrides(batch)
                )
                steps = max(8, args.steps * 512 // batch)
                measure = functools.partial(measure_pipeline, **kwargs) if kwargs else measure_pipeline
                row = run(
                    name,
                    cfg,
                    "pipeline",
                    ranks,
                    max(3, steps // 4),
                    steps,
                    args.workers if workers is None else workers,
                    out,
                    measure=measure,
                    label=label,
                )
                rows.append(row)
        if not torch.cuda.is_available():
            print("  (pinned memory: CUDA only -- train.py pins the loader's batches when it trains on a GPU)")
        print("the plain-PyTorch baseline at each model's fastest switch")
        for name in cfgs:
            best = max(
                (r for r in rows if (r["model"], r["mode"], r["ranks"]) == (name, "pipeline", ranks)),
                key=lambda r: r["examples_per_s"],
            )
            steps = max(8, args.steps * 512 // best["batch_size"])
            row = run(
                name,
                configs[(name, best["switch"])],
                "plain",
                ranks,
                max(3, steps // 4),
                steps,
                best["workers"],
                out,
                label=best["switch"],
            )
            rows.append(row)
            print(
                f"  {name}, {best['switch']}: pipeline / plain PyTorch "
                f"{best['examples_per_s'] / row['examples_per_s']:.2f}x"
            )

    def rate(model, mode, ranks):
        return next(
            (
                r["examples_per_s"]
                for r in rows
                if (r["model"], r.get("switch"), r["mode"], r["ranks"]) == (model, "", mode, ranks)
            ),
            None,
        )

    ranks = max(args.ranks)
    peaks = {name: ranks * matmul_peak(dt) for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    print(
        f"\nmachine limits ({ranks} x one thread): matmul (2048^2; 256^2 where too slow) "
        f"fp32 {peaks['fp32'] / 1e9:.1f} GFLOP/s, "
        f"bf16 {peaks['bf16'] / 1e9:.1f} GFLOP/s"
    )
    for name in cfgs:
        runs = [r for r in rows if (r["model"], r["mode"], r["ranks"]) == (name, "pipeline", ranks)]
        fastest = max(runs, key=lambda r: r["examples_per_s"])
        for r in [runs[0]] + ([fastest] if fastest is not runs[0] else []):  # the reference may be the fastest
            cfg = configs[(name, r["switch"])]
            flops, lookups = dense_flops_per_example(cfg), lookups_per_example(cfg)
            achieved, per_rank = flops * r["examples_per_s"], r["examples_per_s"] / ranks
            fbgemm = ranks * fbgemm_lookup_rate(cfg)
            # Alternated, best of two each: the first pass over the row groups also warms the page cache.
            passes = [loader_rate(cfg, ranks, zero_fill=z) for z in (False, True, False, True)]
            loader, zeroed = (max(passes[z::2], key=lambda p: p["examples_per_s"]) for z in (0, 1))
            print(
                f"  {name}, {r['switch'] or 'reference'} ({r['examples_per_s']:,.0f} ex/s): dense "
                f"{flops / 1e6:.2f} MFLOP/example -> {achieved / 1e9:.1f} GFLOP/s = "
                f"{100 * achieved / peaks['fp32']:.1f}% "
                f"of fp32 peak, {100 * achieved / peaks['bf16']:.1f}% of bf16; {lookups:.0f} lookups/example -> "
                f"{lookups * r['examples_per_s'] / 1e6:.2f} M/s = "
                f"{100 * lookups * r['examples_per_s'] / fbgemm:.1f}% of "
                f"fbgemm alone ({fbgemm / 1e6:.1f} M/s); loader {loader['examples_per_s']:,.0f} ex/s per worker = "
                f"{loader['examples_per_s'] / per_rank:.1f}x a rank's consumption ({per_rank:,.0f}); zero-filled "
                f"allocations {zeroed['examples_per_s']:,.0f} ex/s "
                f"({loader['examples_per_s'] / zeroed['examples_per_s']:.2f}x)",
                flush=True,
            )
            rows.append(
                {
                    "model": name,
                    "switch": r["switch"],
                    "mode": "utilization",
                    "ranks": ranks,
                    "batch_size": cfg.data.batch_size,
                    "examples_per_s": r["examples_per_s"],
                    "dense_flops_per_example": flops,
                    "achieved_flops": achieved,
                    "peak_fp32_flops": peaks["fp32"],
                    "peak_bf16_flops": peaks["bf16"],
                    "lookups_per_example": lookups,
                    "fbgemm_lookups_per_s": fbgemm,
                    "loader_examples_per_s": loader["examples_per_s"],
                    "loader_zero_fill_examples_per_s": zeroed["examples_per_s"],
                }
            )
    if args.profile:
        # 1 rank: the model's own hot spots; the most ranks: what the collectives add (rank 0's table)
        for name, cfg in cfgs.items():
            for ranks in sorted({1, max(args.ranks)}):
                suffix = "" if ranks == 1 else f"-r{ranks}"
                prof = harness.rank_results(
                    measure_profile,
                    ranks,
                    out / "runs" / f"{name}-profile{suffix}",
                    cfg,
                    args.warmup,
                    min(args.steps, 20),
                    args.workers,
                    timeout_s=600,
                )[0]
                path = out / f"profile-{name}{suffix}.txt"
                path.write_text(f"{prof['wall_s'] / prof['steps'] * 1e3:.1f} ms per profiled step\n" + prof["table"])
                print(
                    f"\nprofile, {name}, {ranks} rank(s), plain loop, rank 0 ({path}):\n"
                    + "\n".join(prof["table"].splitlines()[:16])
                )

    print("\nratios (same run):")
    for name in cfgs:
        for ranks in args.ranks:
            p, lo, pl = rate(name, "pipeline", ranks), rate(name, "loop", ranks), rate(name, "plain", ranks)
            print(
                f"  {name:<12} {ranks} rank(s): pipeline / plain PyTorch {p / pl:5.2f}x, pipeline / loop {p / lo:5.2f}x"
            )
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
