"""Scaling experiments: real multi-process gloo runs over a sweep, plus the planner's GPU projection.

    python -m pinads_rec.experiments.scaling --config configs/demo.yaml --sweep ranks=1,2 \\
        --sweep batch_size=256,512,1024 --sweep sequence_length=25,50,100 \\
        --sweep table_rows=10000,100000,1000000 [--grid] [--steps N --warmup N --out runs/scaling]

Sweep dimensions (``--sweep NAME=v1,v2,...``):

- ``ranks``: gloo processes, one torch thread each (so 1 vs 2 ranks compares like for like); the
  per-rank batch stays ``batch_size`` (weak scaling: the global batch grows with the ranks).
- ``batch_size``: rows per rank per step (``data.batch_size``).
- ``sequence_length``: ``synth.sequence_length``; every sequence group's ``max_length`` is scaled by
  the same factor (the demo's pins/ads/queries 100/50/50 at length 100 become 25/12/12 at 25).
- ``table_rows``: rows of the big tables (``--scale-tables``, default: the tables the generator's
  ``num_users`` / ``num_items`` index, user and item); the data is generated with as many users and
  items, so the ids really spread over the whole table.

By default one dimension varies at a time around a base point (each dimension's base is the
config's own value when it is among the listed values, else the first listed; ``--base
NAME=VALUE`` picks another); ``--grid`` runs the full product. The base run is shared.
``--set key=value`` applies to every run (e.g. ``--set train.sharding_types=[table_wise]``).

Run length: the loader's cost comes in bursts (a row group read, checked, and the shuffle buffer
compacted, every ``max(data.shuffle_buffer_rows, synth.row_group_size)`` rows: a few hundred ms
once every 8-64 steps), so by default the warmup covers the first buffer fill and the measured
window 4 such periods (``--steps`` / ``--warmup`` fix the counts instead). On a shared machine,
``--quiet-wait S`` waits up to S seconds before each run for other processes to go quiet,
``--repeats N`` runs every point N times (interleaved) and the table and plots keep the fastest;
each row records the CPU other processes used during the run (``other_load_cores``).

Every run is a fresh set of processes (``torch.multiprocessing`` spawn, FILE rendezvous in a temp
directory, a deadline; the ranks die with the sweep process), building the model exactly as
``train.py`` does (planner + DMP + fused embedding optimizer + AdamW) and timing a plain loop with
``time.perf_counter`` (the data loader runs in the trainer process unless ``--num-workers``):

- data: time in ``next(batches)`` (the loader, in the trainer's process by default, and
  ``EndTogether``'s one-element all_reduce, as in ``train.py``);
- forward: ``loss, _ = dmp(batch)`` (embedding input/output all-to-alls included);
- backward: ``loss.backward()``: dense gradients, the DDP all_reduce of dense gradients (overlapped,
  waited at the end), the embedding gradients' all-to-all AND the fused embedding optimizer
  (row-wise Adagrad updates the tables inside backward, so their update cost lands here);
- optimizer: ``optimizer.step(); optimizer.zero_grad()`` plus the LR schedule: the dense AdamW only.

Comms, best effort: every ``torch.distributed`` collective called from Python (TorchRec's
all-to-alls of ids, lengths, pooled and sequence embeddings and their gradients; EndTogether's flag)
is wrapped so that the time the trainer thread spends inside the call and in its ``Work.wait()`` is
attributed to the phase it happens in (``comms_fwd_ms``, ``comms_bwd_ms``, ``comms_data_ms``). That is
critical-path time: it includes waiting for a slower peer to arrive. DDP's gradient all_reduce runs
in C++; a comm hook identical to DDP's default one records its wall time from enqueue to completion
(``ddp_allreduce_ms``): it overlaps backward compute, so it is not part of the sum. Each rank's
JSON (``runs/<point>-<repeat>/rank-N.json``) also has the per-step phase times and the calls and
ms per step of every collective, by phase.

Memory: each rank's peak RSS (``VmHWM``) at the end, and its RSS before the model is built (the
torch/torchrec import baseline, ~0.4 GiB per process).

Outputs under ``--out``: ``scaling.csv`` (one row per run), ``projection.csv``, ``scaling_<dim>.png``
(examples/s, stacked step-time breakdown and peak memory vs each swept dimension),
``projection.png``, per-run JSON under ``runs/``, generated data under ``data/`` (cached: reused when
its generator settings match and it holds enough rows).

Planner projection: ``EmbeddingShardingPlanner`` runs offline for 8..128 GPUs (H100-class
topology: compute_device cuda, 80 GiB HBM, 8 GPUs per host) on the base model built on the meta
device, with the ids per example of every feature measured on the generated data as pooling
factors; it reports the critical path (max over ranks of the summed ``perf.total`` of that rank's
shards) per step at the per-rank batch size, and the embedding-only examples/s it implies. This is
TorchRec's cost model (embedding lookups and their comms only; no dense compute, no data loading).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import dataclasses
import datetime
import itertools
import json
import logging
import math
import os
import resource
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from pinads_rec import config

log = logging.getLogger("pinads_rec.experiments.scaling")

DIMENSIONS = ("ranks", "batch_size", "sequence_length", "table_rows")
DEFAULT_GPUS = (8, 16, 32, 64, 128)
HBM_CAP = 80 * 2**30
PHASES = ("data", "forward", "backward", "optimizer")

# CSV columns, in order: the sweep values, then what was measured.
COLUMNS = [
    "run",
    "ranks",
    "batch_size",
    "sequence_length",
    "table_rows",
    "global_batch",
    "steps",
    "warmup",
    "examples_per_s",
    "examples_per_s_per_rank",
    "step_ms",
    "data_ms",
    "forward_ms",
    "backward_ms",
    "optimizer_ms",
    "data_p50_ms",
    "data_max_ms",
    "comms_ms",
    "comms_fwd_ms",
    "comms_bwd_ms",
    "comms_data_ms",
    "ddp_allreduce_ms",
    "peak_rss_mib",
    "peak_rss_mib_total",
    "base_rss_mib",
    "ids_per_example",
    "requests_per_batch",
    "embedding_rows",
    "embedding_mib",
    "wall_s",
    "run_seconds",
    "repeat",
    "other_load_cores",
    "best",
    "plan",
]
PROJECTION_COLUMNS = [
    "gpus",
    "table_rows",
    "batch_size_per_rank",
    "critical_path_ms",
    "critical_rank",
    "fwd_compute_ms",
    "fwd_comms_ms",
    "bwd_compute_ms",
    "bwd_comms_ms",
    "input_dist_ms",
    "mean_rank_ms",
    "embedding_examples_per_s",
    "hbm_gib_max",
    "sharding",
]


# --------------------------------------------------------------------------------------------
# The sweep.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Point:
    ranks: int
    batch_size: int
    sequence_length: int
    table_rows: Optional[int]  # None: the config's own table sizes

    @property
    def name(self) -> str:
        rows = "cfg" if self.table_rows is None else str(self.table_rows)
        return f"r{self.ranks}-b{self.batch_size}-L{self.sequence_length}-T{rows}"


def parse_sweeps(items: Sequence[str]) -> Dict[str, List[int]]:
    """``["ranks=1,2", "batch_size=256,512"]`` -> {"ranks": [1, 2], ...}; names checked, values > 0."""
    out: Dict[str, List[int]] = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--sweep {item!r}: expected NAME=v1,v2,... with NAME one of {list(DIMENSIONS)}")
        name, text = item.split("=", 1)
        name = name.strip()
        if name not in DIMENSIONS:
            raise ValueError(f"--sweep {item!r}: unknown dimension {name!r} (one of {list(DIMENSIONS)})")
        try:
            values = [int(v.replace("_", "")) for v in text.split(",") if v.strip()]
        except ValueError:
            raise ValueError(f"--sweep {item!r}: values must be integers") from None
        if not values or any(v <= 0 for v in values):
            raise ValueError(f"--sweep {item!r}: need one or more values > 0")
        out.setdefault(name, [])
        out[name] += [v for v in values if v not in out[name]]
    return out


def scaled_table_names(cfg: config.ExperimentConfig, names: Optional[Sequence[str]]) -> List[str]:
    """The tables ``table_rows`` resizes. Default: those the generator's user/item ids index."""
    if names is None:
        f = cfg.features
        columns = {f.columns.user_id, f.columns.item_id}
        used = [s.table for s in f.sparse if s.column in columns]
        names = sorted(set(used), key=[t.name for t in f.tables].index)
    known = {t.name for t in cfg.features.tables}
    missing = [n for n in names if n not in known]
    if missing:
        raise ValueError(f"--scale-tables: no table named {missing} in the config (tables: {sorted(known)})")
    return list(names)


def config_values(cfg: config.ExperimentConfig, tables: Sequence[str]) -> Dict[str, Optional[int]]:
    """Each dimension's value in the config itself."""
    rows = {cfg.features.table(t).num_embeddings for t in tables}
    return {
        "ranks": None,
        "batch_size": cfg.data.batch_size,
        "sequence_length": cfg.synth.sequence_length,
        "table_rows": rows.pop() if len(rows) == 1 else None,
    }


def base_point(
    cfg: config.ExperimentConfig,
    sweeps: Dict[str, List[int]],
    tables: Sequence[str],
    base: Optional[Dict[str, int]] = None,
) -> Point:
    """Per dimension: --base, else the config's value if the sweep lists it, else the first listed
    value; a dimension not swept keeps the config's value (1 rank, the config's table sizes)."""
    own = config_values(cfg, tables)
    values = {}
    for dim in DIMENSIONS:
        listed = sweeps.get(dim)
        if base and dim in base:
            values[dim] = base[dim]
        elif listed:
            values[dim] = own[dim] if own[dim] in listed else listed[0]
        else:
            values[dim] = own[dim] if own[dim] is not None or dim == "table_rows" else 1
    if "table_rows" not in sweeps and not (base and "table_rows" in base):
        values["table_rows"] = None
    return Point(**values)


def sweep_points(sweeps: Dict[str, List[int]], base: Point, grid: bool = False) -> List[Point]:
    """One dimension at a time around ``base`` (the base run once), or the full product."""
    if grid:
        axes = [sweeps.get(d, [getattr(base, d)]) for d in DIMENSIONS]
        return [Point(*values) for values in itertools.product(*axes)]
    points = [base]
    for dim in DIMENSIONS:
        for v in sweeps.get(dim, []):
            p = dataclasses.replace(base, **{dim: v})
            if p not in points:
                points.append(p)
    return points


def point_config(
    cfg: config.ExperimentConfig, p: Point, tables: Sequence[str], data_dir: Optional[Path] = None
) -> config.ExperimentConfig:
    """The config of one run: batch, sequence lengths, table sizes (and the data they index)."""
    cfg = copy.deepcopy(cfg)
    scale = p.sequence_length / cfg.synth.sequence_length
    groups = [
        dataclasses.replace(g, max_length=max(1, round(g.max_length * scale))) for g in cfg.features.sequence_groups
    ]
    synth = dataclasses.replace(cfg.synth, sequence_length=p.sequence_length)
    features_tables = cfg.features.tables
    if p.table_rows is not None:
        features_tables = [
            dataclasses.replace(t, num_embeddings=p.table_rows) if t.name in tables else t for t in cfg.features.tables
        ]
        synth = dataclasses.replace(synth, num_users=p.table_rows, num_items=p.table_rows)
    features = dataclasses.replace(cfg.features, tables=features_tables, sequence_groups=groups)
    data = dataclasses.replace(cfg.data, batch_size=p.batch_size)
    if data_dir is not None:
        data = dataclasses.replace(data, train_dir=str(data_dir / "train"), eval_dir=str(data_dir / "eval"))
    out = dataclasses.replace(cfg, features=features, synth=synth, data=data)
    config.from_dict(config.to_dict(out))  # the same checks a YAML config gets
    return out


# --------------------------------------------------------------------------------------------
# Data: one small generated set per (sequence length, table rows), cached.
# --------------------------------------------------------------------------------------------


def loader_period_rows(cfg: config.ExperimentConfig) -> int:
    """Rows between two of the loader's expensive moments (read + check a row group, reshuffle and
    compact the buffer): its data wait comes in bursts this far apart, not evenly per batch."""
    return max(cfg.data.shuffle_buffer_rows, cfg.synth.row_group_size)


def point_steps(cfg: config.ExperimentConfig, p: Point, warmup: Optional[int], steps: Optional[int]) -> Tuple[int, int]:
    """(warmup, measured) steps of a run. Given counts are used as they are. By default the warmup
    covers the loader's first buffer fill and the measured window 4 loader periods (at least 20
    steps), so the bursty data wait is sampled in proportion, not by luck."""
    period = loader_period_rows(cfg)
    w = warmup if warmup is not None else max(5, math.ceil(period / p.batch_size) + 2)
    n = steps if steps is not None else max(20, math.ceil(4 * period / p.batch_size))
    return w, n


def data_key(p: Point) -> Tuple[int, Optional[int]]:
    return p.sequence_length, p.table_rows


def data_synth(cfg: config.ExperimentConfig, rows_needed: int, max_ranks: int, max_batch: int) -> config.SynthConfig:
    """Generator settings holding ``rows_needed`` training rows in enough row groups that every rank
    gets its share (row groups are dealt to ranks round-robin)."""
    s = cfg.synth
    # The config's row groups (the loader's cost per batch depends on them: it reads, shuffles and
    # compacts its buffer once per row group), unless a rank would get fewer than about 3.
    rg = int(min(s.row_group_size, max(256, math.ceil(rows_needed / max_ranks / 3))))
    rows = rows_needed + 2 * max_ranks * rg  # uneven row-group split, partial batches dropped
    requests = math.ceil(rows / s.candidates_per_request)
    return dataclasses.replace(
        s, train_requests=requests, eval_requests=64, row_group_size=rg, num_files=max(2, 2 * max_ranks)
    )


def _cache_ok(summary_path: Path, synth: config.SynthConfig) -> bool:
    try:
        old = json.loads(summary_path.read_text())["synth"]
    except (OSError, ValueError, KeyError):
        return False
    want = dataclasses.asdict(synth)
    same = {k: v for k, v in want.items() if k not in ("train_requests", "eval_requests")}
    return all(old.get(k) == v for k, v in same.items()) and old.get("train_requests", 0) >= want["train_requests"]


def prepare_data(
    cfg: config.ExperimentConfig,
    points: Sequence[Point],
    tables: Sequence[str],
    out: Path,
    warmup: Optional[int],
    steps: Optional[int],
) -> Dict[Tuple[int, Optional[int]], Path]:
    from pinads_rec.data.synth import generate

    dirs = {}
    for key in dict.fromkeys(data_key(p) for p in points):
        users = [p for p in points if data_key(p) == key]
        rows = max(p.ranks * (sum(point_steps(cfg, p, warmup, steps)) + 2) * p.batch_size for p in users)
        pcfg = point_config(cfg, users[0], tables)
        synth = data_synth(pcfg, int(rows * 1.15), max(p.ranks for p in users), max(p.batch_size for p in users))
        d = out / "data" / f"L{key[0]}-T{'cfg' if key[1] is None else key[1]}"
        if _cache_ok(d / "summary.json", synth):
            log.info("data %s: cached", d)
        else:
            t0 = time.perf_counter()
            if d.exists():
                shutil.rmtree(d)
            generate(dataclasses.replace(pcfg, synth=synth), d)
            log.info("data %s: generated %d requests in %.1f s", d, synth.train_requests, time.perf_counter() - t0)
        dirs[key] = d
    return dirs


# --------------------------------------------------------------------------------------------
# Inside each rank: the instrumented training loop.
# --------------------------------------------------------------------------------------------


class CommsTimer:
    """Attributes the trainer thread's time inside ``torch.distributed`` collectives (the call and
    its ``Work.wait()``) to the current phase; DDP's all_reduce wall time comes from a comm hook."""

    PATCHED = (
        "all_to_all_single",
        "all_to_all",
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "broadcast",
        "barrier",
    )

    def __init__(self):
        self.phase = "data"
        self.seconds: Dict[str, float] = {}
        self.ddp_seconds = 0.0
        self.calls = 0
        self.depth = 0
        # "<phase> <op>" -> [calls, seconds]; a wait is named after the collective that made its Work
        self.ops: Dict[str, List[float]] = {}
        self._work_op: Dict[int, str] = {}
        self._orig: Dict[str, object] = {}

    def add(self, dt: float, op: str = "") -> None:
        self.seconds[self.phase] = self.seconds.get(self.phase, 0.0) + dt
        entry = self.ops.setdefault(f"{self.phase} {op}", [0, 0.0])
        entry[0] += 1
        entry[1] += dt

    def reset(self) -> None:
        self.seconds, self.ddp_seconds, self.ops = {}, 0.0, {}

    def install(self, dmp=None) -> "CommsTimer":
        import torch.distributed as dist

        timer = self

        def wrap(fn, name):
            def timed(*args, **kwargs):
                if timer.depth:  # e.g. a blocking all_reduce waits on its Work: count it once
                    return fn(*args, **kwargs)
                timer.calls += 1
                timer.depth += 1
                op = name
                if name == "wait" and args:
                    op = "wait " + timer._work_op.pop(id(args[0]), "?")
                t0 = time.perf_counter()
                try:
                    out = fn(*args, **kwargs)
                finally:
                    timer.add(time.perf_counter() - t0, op)
                    timer.depth -= 1
                if name != "wait" and isinstance(out, dist.Work):
                    timer._work_op[id(out)] = name
                return out

            timed.__wrapped__ = fn
            return timed

        # TorchRec checks isinstance(work, dist.Work): the Work class's wait is timed, not a proxy.
        if "Work.wait" not in self._orig:
            self._orig["Work.wait"] = dist.Work.wait
            dist.Work.wait = wrap(self._orig["Work.wait"], "wait")
        for name in self.PATCHED:
            if hasattr(dist, name) and name not in self._orig:
                self._orig[name] = getattr(dist, name)
                setattr(dist, name, wrap(self._orig[name], name))

        ddp = getattr(dmp, "_dmp_wrapped_module", None) if dmp is not None else None
        if isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            all_reduce = self._orig.get("all_reduce", dist.all_reduce)

            def hook(group, bucket):  # DDP's default allreduce_hook, timed
                t0 = time.perf_counter()
                pg = group or dist.group.WORLD
                tensor = bucket.buffer().div_(pg.size())
                fut = all_reduce(tensor, group=pg, async_op=True).get_future()

                def done(f):
                    timer.ddp_seconds += time.perf_counter() - t0
                    return f.value()[0]

                return fut.then(done)

            ddp.register_comm_hook(None, hook)
        return self

    def uninstall(self) -> None:
        import torch.distributed as dist

        for name, fn in self._orig.items():
            if name == "Work.wait":
                dist.Work.wait = fn
            else:
                setattr(dist, name, fn)
        self._orig.clear()


def _rss_mib(field: str = "VmRSS") -> float:
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


def plan_summary(dmp) -> str:
    """``table:sharding_type@ranks`` for every sharded table, e.g. ``user:table_wise@0``."""
    parts = []
    for module_plan in dmp.plan.plan.values():
        for table, ps in sorted(module_plan.items()):
            ranks = "+".join(str(r) for r in (ps.ranks or []))
            parts.append(f"{table}:{ps.sharding_type}@{ranks}")
    return " ".join(parts)


def measure_rank(cfg: config.ExperimentConfig, warmup: int, steps: int, num_workers: int) -> dict:
    """Builds the model as train.py does and times ``warmup + steps`` plain training steps."""
    import torch.distributed as dist

    from pinads_rec import parallel
    from pinads_rec.data.loader import make_loader
    from pinads_rec.train import EndTogether, build

    base_rss = _rss_mib()
    env = parallel.init_distributed()
    data_group = dist.new_group(backend="gloo") if env.world_size > 1 else None
    dmp = build(cfg, env)
    optimizer, schedule = parallel.make_optimizer(dmp, cfg.train, warmup + steps)
    embedding_rows = embedding_numel = 0
    for name, t in dmp.state_dict().items():
        if ".embedding_bags." in name or ".embeddings." in name:
            # Sharded tables hold their local shards; data-parallel ones a full replica.
            local = [s.tensor for s in t.local_shards()] if hasattr(t, "local_shards") else [t]
            embedding_rows += sum(x.shape[0] for x in local)
            embedding_numel += sum(x.numel() for x in local)
    timer = CommsTimer().install(dmp)
    loader = make_loader(cfg, cfg.data.train_dir, env.rank, env.world_size, shuffle=True, num_workers=num_workers)
    batches = EndTogether(iter(loader), data_group)
    dmp.train()

    sums = {k: 0.0 for k in PHASES}
    per_step: Dict[str, List[float]] = {k: [] for k in PHASES}  # ms, kept in the rank's JSON
    comms: Dict[str, float] = {}
    ddp = ids = requests = 0.0
    started = None
    for i in range(warmup + steps):
        if i == warmup:
            dist.barrier()  # every rank starts the measured window together
            started = time.perf_counter()
            timer.reset()
        timer.phase = "data"
        t0 = time.perf_counter()
        try:
            batch = next(batches)
        except StopIteration:
            raise RuntimeError(f"rank {env.rank}: the data ran out after {i} of {warmup + steps} steps") from None
        t1 = time.perf_counter()
        timer.phase = "forward"
        loss, _ = dmp(batch)
        t2 = time.perf_counter()
        timer.phase = "backward"
        loss.backward()
        t3 = time.perf_counter()
        timer.phase = "optimizer"
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        t4 = time.perf_counter()
        if i >= warmup:
            for k, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                sums[k] += dt
                per_step[k].append(round(1000.0 * dt, 3))
            ids += (batch.sparse.values().numel() + batch.sequences.values().numel()) / batch.batch_size
            requests += batch.num_requests
            if not math.isfinite(float(loss.detach())):
                raise RuntimeError(f"rank {env.rank}: loss is {float(loss.detach())} at step {i}")
    wall = time.perf_counter() - started
    comms, ddp = dict(timer.seconds), timer.ddp_seconds
    ops = {k: [v[0] / steps, round(1000.0 * v[1] / steps, 3)] for k, v in sorted(timer.ops.items())}
    timer.uninstall()
    ms = lambda s: 1000.0 * s / steps  # noqa: E731
    data_sorted = sorted(per_step["data"])
    return {
        "rank": env.rank,
        "world_size": env.world_size,
        "steps": steps,
        "wall_s": wall,
        "batch_rows": batch.batch_size,
        **{f"{k}_ms": ms(v) for k, v in sums.items()},
        "data_p50_ms": data_sorted[len(data_sorted) // 2],
        "data_max_ms": data_sorted[-1],
        "comms_fwd_ms": ms(comms.get("forward", 0.0)),
        "comms_bwd_ms": ms(comms.get("backward", 0.0)),
        "comms_data_ms": ms(comms.get("data", 0.0)),
        "comms_opt_ms": ms(comms.get("optimizer", 0.0)),
        "ddp_allreduce_ms": ms(ddp),
        "peak_rss_mib": _rss_mib("VmHWM"),
        "base_rss_mib": base_rss,
        "ids_per_example": ids / steps,
        "requests_per_batch": requests / steps,
        "embedding_rows": embedding_rows,
        "embedding_mib": embedding_numel * 4 / 2**20,
        "plan": plan_summary(dmp),
        "per_step_ms": per_step,
        "comms_per_step": ops,  # "<phase> <op>": [calls per step, ms per step]
    }


def _die_with_parent() -> None:
    """Linux: the rank gets SIGKILL if the sweep process dies (no orphan left in a collective)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _quiet_logs() -> None:
    for noisy in ("torchrec", "torch", "fbgemm_gpu"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    logging.getLogger().setLevel(logging.ERROR)  # fbgemm's "Successfully loaded" INFO lines
    log.setLevel(logging.INFO)


def _rank_entry(
    rank: int,
    world: int,
    rdzv_file: str,
    result_dir: str,
    cfg: config.ExperimentConfig,
    warmup: int,
    steps: int,
    num_workers: int,
    timeout_s: float,
    measure=None,
) -> None:
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    _die_with_parent()
    # A spawned child inherits "spawn" as its start method; torchrun's ranks fork their DataLoader
    # workers: measure what training does.
    import multiprocessing

    multiprocessing.set_start_method("fork", force=True)
    torch.set_num_threads(1)
    _quiet_logs()
    warnings.simplefilter("ignore")  # TorchRec/fbgemm deprecation chatter, once per rank and run
    dist.init_process_group(
        "gloo",
        init_method=f"file://{rdzv_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        result = (measure or measure_rank)(cfg, warmup, steps, num_workers)
        with open(os.path.join(result_dir, f"rank-{rank}.json"), "w") as f:
            json.dump(result, f)
    except BaseException:
        with open(os.path.join(result_dir, f"error-{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


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


def launch(
    cfg: config.ExperimentConfig,
    world: int,
    warmup: int,
    steps: int,
    result_dir: Path,
    num_workers: int = 0,
    timeout_s: float = 600.0,
    measure=None,
) -> List[dict]:
    """Runs ``measure`` (default ``measure_rank``; a module-level function with its signature) on
    ``world`` fresh gloo processes (file rendezvous); returns per-rank results. Past the deadline,
    or when a rank fails, the survivors are killed and the first error is raised."""
    import torch.multiprocessing as mp

    result_dir.mkdir(parents=True, exist_ok=True)
    for old in list(result_dir.glob("rank-*.json")) + list(result_dir.glob("error-*.txt")):
        old.unlink()
    tmp = tempfile.mkdtemp(prefix="pinads_scaling_rdzv_")
    rdzv = os.path.join(tmp, "rdzv")
    # A fixed string-hash seed in the ranks: the planner's choice between equal-cost proposals
    # otherwise follows set iteration order, and the plan (hence the comms) changes from run to run.
    saved = os.environ.get("PYTHONHASHSEED")
    os.environ["PYTHONHASHSEED"] = saved or "0"
    try:
        ctx = mp.start_processes(
            _rank_entry,
            args=(world, rdzv, str(result_dir), cfg, warmup, steps, num_workers, timeout_s, measure),
            nprocs=world,
            join=False,
            start_method="spawn",
        )
    finally:
        if saved is None:
            del os.environ["PYTHONHASHSEED"]
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world}-rank run exceeded {timeout_s:.0f} s")
    except Exception as e:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        for p in ctx.processes:
            p.join(5)
        errors = [f.read_text() for f in sorted(result_dir.glob("error-*.txt"))]
        raise RuntimeError(f"run in {result_dir} failed: {errors[0] if errors else e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [json.loads((result_dir / f"rank-{r}.json").read_text()) for r in range(world)]


def aggregate(
    p: Point, ranks: List[dict], warmup: int, seconds: float, repeat: int = 0, load: Optional[Dict[str, float]] = None
) -> dict:
    """One CSV row: global examples/s over the slowest rank's measured window; phases averaged over
    ranks; memory: the largest rank and the sum."""
    mean = lambda k: sum(r[k] for r in ranks) / len(ranks)  # noqa: E731
    steps = ranks[0]["steps"]
    wall = max(r["wall_s"] for r in ranks)
    global_batch = p.batch_size * p.ranks
    row = {
        "run": p.name,
        "ranks": p.ranks,
        "batch_size": p.batch_size,
        "sequence_length": p.sequence_length,
        "table_rows": p.table_rows if p.table_rows is not None else "",
        "global_batch": global_batch,
        "steps": steps,
        "warmup": warmup,
        "examples_per_s": global_batch * steps / wall,
        "examples_per_s_per_rank": p.batch_size * steps / wall,
        "step_ms": 1000.0 * wall / steps,
        **{f"{k}_ms": mean(f"{k}_ms") for k in PHASES},
        "data_p50_ms": mean("data_p50_ms"),
        "data_max_ms": max(r["data_max_ms"] for r in ranks),
        "comms_fwd_ms": mean("comms_fwd_ms"),
        "comms_bwd_ms": mean("comms_bwd_ms"),
        "comms_data_ms": mean("comms_data_ms"),
        "ddp_allreduce_ms": mean("ddp_allreduce_ms"),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in ranks),
        "peak_rss_mib_total": sum(r["peak_rss_mib"] for r in ranks),
        "base_rss_mib": mean("base_rss_mib"),
        "ids_per_example": mean("ids_per_example"),
        "requests_per_batch": mean("requests_per_batch"),
        "embedding_rows": sum(r["embedding_rows"] for r in ranks),
        "embedding_mib": sum(r["embedding_mib"] for r in ranks),
        "wall_s": wall,
        "run_seconds": seconds,
        "plan": ranks[0]["plan"],
        "repeat": repeat,
        "other_load_cores": (load or {}).get("other_cores", float("nan")),
    }
    row["comms_ms"] = row["comms_fwd_ms"] + row["comms_bwd_ms"]
    return row


# --------------------------------------------------------------------------------------------
# Planner projection for GPUs.
# --------------------------------------------------------------------------------------------


def measured_pooling(cfg: config.ExperimentConfig, batches: int = 2) -> Dict[str, Tuple[float, float]]:
    """Per KJT key: (ids per input row, input rows per batch row), measured on the first batches of
    the training data. Pooled features have one input row per batch row; the EmbeddingCollection's
    input has one row per request (a sequence feature is looked up once per request)."""
    from pinads_rec.data.loader import ParquetBatches

    ids: Dict[str, float] = {}
    strides: Dict[str, float] = {}
    rows = 0
    for i, batch in enumerate(ParquetBatches(cfg, cfg.data.train_dir, shuffle=False)):
        for kjt in (batch.sparse, batch.sequences):
            for key, n in zip(kjt.keys(), kjt.length_per_key()):
                ids[key] = ids.get(key, 0.0) + n
                strides[key] = strides.get(key, 0.0) + kjt.stride()
        rows += batch.batch_size
        if i + 1 >= batches:
            break
    return {k: (ids[k] / max(strides[k], 1.0), strides[k] / max(rows, 1)) for k in ids}


class _BestPlan:
    """A planner Stats that keeps the chosen sharding options (instead of logging a table)."""

    def __init__(self):
        self.best_plan = None

    def log(
        self,
        sharding_plan,
        topology,
        batch_size,
        storage_reservation,
        num_proposals,
        num_plans,
        run_time,
        best_plan,
        *args,
        **kwargs,
    ) -> None:
        self.best_plan = best_plan


@contextlib.contextmanager
def _quiet_planner():
    """Offline planning warns about things that do not apply (a Topology built directly, the
    storage reservation's dry-run estimate, data-parallel tables without a sharding spec)."""
    saved = [(lg, lg.level) for lg in (logging.getLogger(), logging.getLogger("torchrec"))]
    for lg, _ in saved:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in saved:
            lg.setLevel(level)


def project(
    cfg: config.ExperimentConfig,
    gpus: Iterable[int],
    pooling: Optional[Dict[str, float]] = None,
    table_rows: Optional[int] = None,
) -> List[dict]:
    """Per GPU count: TorchRec's planner estimate of one step's critical path at the per-rank batch."""
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

    from pinads_rec import parallel
    from pinads_rec.models import build_model
    from pinads_rec.models.ranker import embedding_bag_configs, embedding_configs
    from pinads_rec.models.train_task import TrainTask

    batch = cfg.data.batch_size
    constraints = parallel.constraints(cfg, "cuda")
    if pooling:
        tables = (
            embedding_bag_configs(cfg.features)
            + embedding_bag_configs(cfg.features, user_side=True)
            + embedding_configs(cfg.features)
        )
        for table in tables:
            measured = [pooling.get(name, (1.0, 1.0)) for name in table.feature_names]
            constraints[table.name] = dataclasses.replace(
                constraints[table.name],
                pooling_factors=[max(f, 1e-3) for f, _ in measured],
                batch_sizes=[max(1, round(batch * r)) for _, r in measured],
            )
    out = []
    for n in gpus:
        model = build_model(cfg.features, cfg.model, device=torch.device("meta"))
        parallel.attach_embedding_optimizer(model, cfg.train, torch.device("cuda"))
        stats = _BestPlan()
        with _quiet_planner():
            topology = Topology(world_size=n, compute_device="cuda", hbm_cap=HBM_CAP, local_world_size=min(8, n))
            planner = EmbeddingShardingPlanner(
                topology=topology,
                batch_size=batch,
                constraints=constraints,
                enumerator=parallel.ordered_enumerator(topology, batch, constraints),
                stats=stats,
            )
            planner.plan(TrainTask(model), parallel.sharders())
        per_rank = [
            dict(total=0.0, fwd_compute=0.0, fwd_comms=0.0, bwd_compute=0.0, bwd_comms=0.0, input_dist=0.0, hbm=0.0)
            for _ in range(n)
        ]
        kinds: Dict[str, List[str]] = {}
        for option in stats.best_plan or []:
            kinds.setdefault(option.sharding_type, []).append(option.name)
            for shard in option.shards:
                r = per_rank[shard.rank]
                perf = shard.perf
                r["total"] += perf.total
                r["fwd_compute"] += perf.fwd_compute
                r["fwd_comms"] += perf.fwd_comms
                r["bwd_compute"] += perf.bwd_compute
                r["bwd_comms"] += perf.bwd_comms
                r["input_dist"] += perf.input_dist_comms
                r["hbm"] += shard.storage.hbm
        critical = max(range(n), key=lambda i: per_rank[i]["total"])
        c = per_rank[critical]
        out.append(
            {
                "gpus": n,
                "table_rows": table_rows if table_rows is not None else "",
                "batch_size_per_rank": batch,
                "critical_path_ms": c["total"],
                "critical_rank": critical,
                "fwd_compute_ms": c["fwd_compute"],
                "fwd_comms_ms": c["fwd_comms"],
                "bwd_compute_ms": c["bwd_compute"],
                "bwd_comms_ms": c["bwd_comms"],
                "input_dist_ms": c["input_dist"],
                "mean_rank_ms": sum(r["total"] for r in per_rank) / n,
                "embedding_examples_per_s": n * batch / (c["total"] / 1000.0) if c["total"] > 0 else float("inf"),
                "hbm_gib_max": max(r["hbm"] for r in per_rank) / 2**30,
                "sharding": " ".join(f"{k}:{'+'.join(sorted(v))}" for k, v in sorted(kinds.items())),
            }
        )
    return out


# --------------------------------------------------------------------------------------------
# Output: CSV, plots, table.
# --------------------------------------------------------------------------------------------


def write_csv(path: Path, rows: List[dict], columns: List[str]) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for row in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})


def _along(rows: List[dict], dim: str, base: Point) -> List[dict]:
    """The runs that differ from the base point in ``dim`` only, ordered by it."""

    def key(v):
        return "" if v is None else v

    others = [d for d in DIMENSIONS if d != dim]
    sel = [r for r in rows if all(str(r[d]) == str(key(getattr(base, d))) for d in others)]
    return sorted(sel, key=lambda r: r[dim])


def plot(
    rows: List[dict], sweeps: Dict[str, List[int]], base: Point, out: Path, projection: Optional[List[dict]] = None
) -> List[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    parts = [
        ("data loading", "data_ms", "comms_data_ms"),
        ("wait for other ranks", "comms_data_ms", None),
        ("fwd compute", "forward_ms", "comms_fwd_ms"),
        ("fwd comms", "comms_fwd_ms", None),
        ("bwd compute + emb. update", "backward_ms", "comms_bwd_ms"),
        ("bwd comms", "comms_bwd_ms", None),
        ("dense optimizer", "optimizer_ms", None),
    ]
    colors = ["#9e9e9e", "#d9d9d9", "#1f77b4", "#aec7e8", "#d62728", "#ff9896", "#2ca02c"]
    for dim in DIMENSIONS:
        sel = _along(rows, dim, base)
        if dim not in sweeps or len(sel) < 2:
            continue
        xs = [str(r[dim]) for r in sel]
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
        ax = axes[0]
        ax.plot(xs, [r["examples_per_s"] for r in sel], "o-", label="global")
        ax.plot(xs, [r["examples_per_s_per_rank"] for r in sel], "s--", label="per rank")
        ax.set_title("throughput")
        ax.set_ylabel("examples / s")
        ax.set_ylim(0, 1.25 * max(r["examples_per_s"] for r in sel))
        ax.legend(loc="upper left", fontsize=8)
        ax = axes[1]
        bottom = [0.0] * len(sel)
        for (label, key, minus), color in zip(parts, colors):
            h = [max(r[key] - (r[minus] if minus else 0.0), 0.0) for r in sel]
            ax.bar(xs, h, bottom=bottom, label=label, color=color)
            bottom = [b + v for b, v in zip(bottom, h)]
        ax.set_title("step time per rank (mean of measured steps)")
        ax.set_ylabel("ms / step")
        ax.set_ylim(0, 1.6 * max(bottom))
        ax.legend(loc="upper left", fontsize=7, ncol=2)
        ax = axes[2]
        ax.plot(xs, [r["peak_rss_mib"] for r in sel], "o-", label="peak RSS, largest rank")
        ax.plot(xs, [r["base_rss_mib"] for r in sel], "s--", label="RSS after imports")
        ax.set_title("memory per rank")
        ax.set_ylabel("MiB")
        ax.set_ylim(0, 1.3 * max(r["peak_rss_mib"] for r in sel))
        ax.legend(loc="upper left", fontsize=8)
        for ax in axes:
            ax.set_xlabel(dim)
        fixed = ", ".join(
            f"{d}={getattr(base, d) if getattr(base, d) is not None else 'cfg'}" for d in DIMENSIONS if d != dim
        )
        fig.suptitle(f"{dim} sweep ({fixed})")
        fig.tight_layout()
        path = out / f"scaling_{dim}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    ratios = rank_ratios(rows)
    for dim in DIMENSIONS[1:]:
        # Grid sweeps: the rank ratio along another dimension (others at the base point).
        sel = [
            q
            for q in ratios
            if all(
                q["at"][d] == str(getattr(base, d) if getattr(base, d) is not None else "")
                for d in DIMENSIONS[1:]
                if d != dim
            )
        ]
        if len({q["at"][dim] for q in sel}) < 2:
            continue
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        ranks_values = sorted({r["ranks"] for r in rows})
        for n in ranks_values:
            rs = sorted(
                [
                    r
                    for r in rows
                    if r["ranks"] == n
                    and all(
                        str(r[d]) == str(getattr(base, d) if getattr(base, d) is not None else "")
                        for d in DIMENSIONS[1:]
                        if d != dim
                    )
                ],
                key=lambda r: r[dim],
            )
            axes[0].plot([str(r[dim]) for r in rs], [r["examples_per_s"] for r in rs], "o-", label=f"{n} rank(s)")
        sel = sorted(sel, key=lambda q: int(q["at"][dim]))
        for n in sorted({q["ranks"] for q in sel}):
            qs = [q for q in sel if q["ranks"] == n]
            axes[1].plot(
                [q["at"][dim] for q in qs], [q["ratio"] for q in qs], "o-", label=f"{n} vs {qs[0]['base_ranks']} ranks"
            )
            axes[1].axhline(qs[0]["ideal"], color="gray", ls=":", lw=1)
        axes[0].set_title("throughput (global)")
        axes[0].set_ylabel("examples / s")
        axes[0].set_ylim(bottom=0)
        axes[1].set_title("weak-scaling speed-up (same batch per rank)")
        axes[1].set_ylabel("examples/s ratio")
        axes[1].set_ylim(0, max(q["ideal"] for q in sel) * 1.1)
        for ax in axes:
            ax.set_xlabel(dim)
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"scaling_ranks_vs_{dim}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    if projection:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        series: Dict[str, List[dict]] = {}
        for r in projection:
            series.setdefault(str(r["table_rows"]) or "cfg", []).append(r)
        for label, rs in series.items():
            rs = sorted(rs, key=lambda r: r["gpus"])
            g = [r["gpus"] for r in rs]
            axes[0].plot(g, [r["critical_path_ms"] for r in rs], "o-", label=f"table_rows={label}")
            axes[1].plot(g, [r["embedding_examples_per_s"] for r in rs], "o-", label=f"table_rows={label}")
        axes[0].set_title("planner critical path per step")
        axes[0].set_ylabel("ms / step (embedding fwd+bwd incl. comms)")
        axes[1].set_title("implied embedding-only throughput")
        axes[1].set_ylabel("examples / s")
        gpus = sorted({r["gpus"] for r in projection})
        for ax in axes:
            ax.set_xscale("log", base=2)
            ax.set_xticks(gpus, [str(g) for g in gpus])
            ax.minorticks_off()
            ax.set_ylim(bottom=0)
            ax.set_xlabel("GPUs (80 GiB HBM, 8 per host)")
            ax.legend(fontsize=8)
        fig.suptitle(f"TorchRec planner projection at batch {projection[0]['batch_size_per_rank']} per GPU")
        fig.tight_layout()
        path = out / "projection.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


def format_table(rows: List[dict]) -> str:
    head = (
        f"{'ranks':>5} {'batch':>6} {'seq':>4} {'rows':>8} | {'ex/s':>8} {'ex/s/rk':>8} {'step':>7} | "
        f"{'data':>6} {'d p50':>6} {'fwd':>6} {'bwd':>6} {'opt':>6} | "
        f"{'a2a f':>6} {'a2a b':>6} {'ddp':>5} | {'peak MiB':>8} {'other':>5}"
    )
    lines = [
        "ms per step, mean over the measured steps and ranks (d p50: median data wait; a2a f/b: "
        "collectives in forward/backward; ddp: dense all_reduce wall, overlapped; other: cores used by "
        "other processes during the run)",
        head,
        "-" * len(head),
    ]
    for r in rows:
        lines.append(
            f"{r['ranks']:>5} {r['batch_size']:>6} {r['sequence_length']:>4} {str(r['table_rows'] or 'cfg'):>8} | "
            f"{r['examples_per_s']:>8,.0f} {r['examples_per_s_per_rank']:>8,.0f} {r['step_ms']:>7.1f} | "
            f"{r['data_ms']:>6.1f} {r['data_p50_ms']:>6.1f} {r['forward_ms']:>6.1f} {r['backward_ms']:>6.1f} "
            f"{r['optimizer_ms']:>6.1f} | "
            f"{r['comms_fwd_ms']:>6.1f} {r['comms_bwd_ms']:>6.1f} {r['ddp_allreduce_ms']:>5.1f} | "
            f"{r['peak_rss_mib']:>8,.0f} {r['other_load_cores']:>5.2f}"
        )
    return "\n".join(lines)


def format_projection(rows: List[dict]) -> str:
    head = (
        f"{'GPUs':>5} {'rows':>8} | {'critical ms':>11} {'fwd cmp':>8} {'fwd com':>8} {'bwd cmp':>8} "
        f"{'bwd com':>8} | {'emb ex/s':>12} | sharding"
    )
    lines = ["planner projection (TorchRec cost model, per step at the per-GPU batch)", head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['gpus']:>5} {str(r['table_rows'] or 'cfg'):>8} | {r['critical_path_ms']:>11.3f} "
            f"{r['fwd_compute_ms']:>8.3f} {r['fwd_comms_ms']:>8.3f} {r['bwd_compute_ms']:>8.3f} "
            f"{r['bwd_comms_ms']:>8.3f} | {r['embedding_examples_per_s']:>12,.0f} | {r['sharding']}"
        )
    return "\n".join(lines)


def rank_ratios(rows: List[dict]) -> List[dict]:
    """Examples/s of every rank count against the fewest ranks, at each point where the other
    dimensions are equal: {"at": {...}, "ranks": n, "base_ranks": m, "ratio": x, "ideal": n / m}."""
    groups: Dict[tuple, List[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(str(r[d]) for d in DIMENSIONS if d != "ranks"), []).append(r)
    out = []
    for key, rs in groups.items():
        rs = sorted(rs, key=lambda r: r["ranks"])
        for r in rs[1:]:
            out.append(
                {
                    "at": dict(zip([d for d in DIMENSIONS if d != "ranks"], key)),
                    "ranks": r["ranks"],
                    "base_ranks": rs[0]["ranks"],
                    "ratio": r["examples_per_s"] / rs[0]["examples_per_s"],
                    "ideal": r["ranks"] / rs[0]["ranks"],
                }
            )
    return out


def ratio_line(rows: List[dict]) -> Optional[str]:
    """``2 vs 1 ranks: 1.73x examples/s (ideal 2x)`` for every point measured at several rank counts."""
    lines = []
    for q in rank_ratios(rows):
        at = ", ".join(f"{k}={v or 'cfg'}" for k, v in q["at"].items())
        lines.append(
            f"{q['ranks']} vs {q['base_ranks']} ranks: {q['ratio']:.2f}x examples/s (ideal {q['ideal']:.0f}x) at {at}"
        )
    return "\n".join(lines) or None


# --------------------------------------------------------------------------------------------
# The command.
# --------------------------------------------------------------------------------------------


def mark_best(rows: List[dict]) -> List[dict]:
    """Per sweep point, flags the repeat with the highest examples/s (other users' load on a shared
    machine only ever slows a run down) and returns those rows in sweep order."""
    best: Dict[str, dict] = {}
    for r in rows:
        if r["run"] not in best or r["examples_per_s"] > best[r["run"]]["examples_per_s"]:
            best[r["run"]] = r
    for r in rows:
        r["best"] = int(best[r["run"]] is r)
    return list(best.values())


def run_sweep(
    cfg: config.ExperimentConfig,
    sweeps: Dict[str, List[int]],
    out: Path,
    warmup: Optional[int] = None,
    steps: Optional[int] = None,
    grid: bool = False,
    base: Optional[Dict[str, int]] = None,
    gpus: Sequence[int] = DEFAULT_GPUS,
    scale_tables: Optional[Sequence[str]] = None,
    num_workers: int = 0,
    timeout_s: float = 900.0,
    repeats: int = 1,
    quiet_wait_s: float = 0.0,
    echo=print,
) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    tables = scaled_table_names(cfg, scale_tables)
    bp = base_point(cfg, sweeps, tables, base)
    points = sweep_points(sweeps, bp, grid)
    echo(f"base point: {bp.name}; {len(points)} point(s) x {repeats} repeat(s): {', '.join(p.name for p in points)}")
    data_dirs = prepare_data(cfg, points, tables, out, warmup, steps)
    (out / "sweep.json").write_text(json.dumps({"sweeps": sweeps, "base": dataclasses.asdict(bp), "grid": grid}))

    rows: List[dict] = []
    order = [(rep, p) for rep in range(repeats) for p in points]  # repeats interleaved: drift spreads out
    for i, (rep, p) in enumerate(order):
        if quiet_wait_s > 0:
            wait_quiet(quiet_wait_s, echo=echo)
        pcfg = point_config(cfg, p, tables, data_dirs[data_key(p)])
        w, n = point_steps(pcfg, p, warmup, steps)
        meter = CpuMeter()
        ranks = launch(pcfg, p.ranks, w, n, out / "runs" / f"{p.name}-{rep}", num_workers, timeout_s)
        load = meter.stop()
        row = aggregate(p, ranks, w, load["seconds"], rep, load)
        rows.append(row)
        echo(
            f"[{i + 1}/{len(order)}] {p.name} #{rep}: {row['examples_per_s']:,.0f} examples/s, "
            f"{row['step_ms']:.1f} ms/step, peak {row['peak_rss_mib']:,.0f} MiB, "
            f"other load {load['other_cores']:.2f} cores ({load['seconds']:.0f} s)"
        )
        mark_best(rows)
        write_csv(out / "scaling.csv", rows, COLUMNS)  # after every run: a partial sweep is kept
    best = mark_best(rows)
    write_csv(out / "scaling.csv", rows, COLUMNS)

    projection = []
    if gpus:
        bcfg = point_config(cfg, bp, tables, data_dirs[data_key(bp)])
        pooling = measured_pooling(bcfg)
        rows_values = sweeps.get("table_rows") or [bp.table_rows]
        for tr in rows_values:
            pcfg = point_config(cfg, dataclasses.replace(bp, table_rows=tr), tables)
            projection += project(pcfg, gpus, pooling, tr)
        write_csv(out / "projection.csv", projection, PROJECTION_COLUMNS)
    pngs = plot(best, sweeps, bp, out, projection)
    report(best, projection, repeats, out, pngs, echo)
    return {"base": bp, "points": points, "rows": rows, "best": best, "projection": projection, "plots": pngs}


def report(
    best: List[dict],
    projection: List[dict],
    repeats: int,
    out: Path,
    pngs: List[Path],
    echo=print,
    replotted: bool = False,
) -> None:
    echo("")
    if repeats > 1:
        echo(f"best of {repeats} repeats per point (highest examples/s); every repeat is in scaling.csv")
    echo(format_table(best))
    ratio = ratio_line(best)
    if ratio:
        echo(ratio)
    if projection:
        echo("")
        echo(format_projection(projection))
    written = [] if replotted else [out / "scaling.csv"] + ([out / "projection.csv"] if projection else [])
    echo("\nwrote " + ", ".join(str(p) for p in written + list(pngs)))


def read_csv(path: Path) -> List[dict]:
    """Rows of a scaling.csv / projection.csv with their numbers as numbers."""
    ints = {"run", "plan", "sharding"}
    out = []
    with path.open() as f:
        for row in csv.DictReader(f):
            for k, v in row.items():
                if k in ints or v == "":
                    continue
                x = float(v)
                row[k] = int(x) if x.is_integer() and "." not in v and "e" not in v else x
            out.append(row)
    return out


def replot(out: Path, echo=print) -> List[Path]:
    """Plots and table again from ``out``'s CSVs and sweep.json (no runs)."""
    meta = json.loads((out / "sweep.json").read_text())
    rows = read_csv(out / "scaling.csv")
    projection = read_csv(out / "projection.csv") if (out / "projection.csv").exists() else []
    best = mark_best(rows)
    pngs = plot(best, meta["sweeps"], Point(**meta["base"]), out, projection)
    report(best, projection, max(r["repeat"] for r in rows) + 1, out, pngs, echo, replotted=True)
    return pngs


def _parse_ints(text: str, what: str) -> List[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what}: comma-separated integers, got {text!r}") from None
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{what}: values must be > 0, got {text!r}")
    return values


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pinads_rec.experiments.scaling", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/demo.yaml")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override applied before the sweep (repeatable)",
    )
    p.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="NAME=V1,V2,...",
        help=f"a dimension and its values; NAME one of {', '.join(DIMENSIONS)} (repeatable)",
    )
    p.add_argument("--grid", action="store_true", help="full product of the sweeps (default: one at a time)")
    p.add_argument(
        "--base",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="base-point value of a dimension (default: the config's if listed, else the first)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="measured steps per run (default: 4 loader periods of max(data.shuffle_buffer_rows, "
        "synth.row_group_size) rows, at least 20)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed steps first (default: the loader's first buffer fill, at least 5)",
    )
    p.add_argument("--out", default="runs/scaling")
    p.add_argument(
        "--gpus",
        type=lambda s: _parse_ints(s, "--gpus") if s else [],
        default=list(DEFAULT_GPUS),
        help="GPU counts for the planner projection ('' to skip)",
    )
    p.add_argument(
        "--scale-tables",
        type=lambda s: [t for t in s.split(",") if t],
        default=None,
        help="tables that table_rows resizes (default: the user and item id tables)",
    )
    p.add_argument(
        "--num-workers",
        type=int,
        default=0,
        help="DataLoader workers per rank (default 0: the loader runs in the trainer process, "
        "so each rank is exactly one process on one thread)",
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run before its ranks are killed")
    p.add_argument(
        "--replot",
        action="store_true",
        help="no runs: redraw the plots and the table from --out's scaling.csv and sweep.json",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per point, interleaved; the table and plots keep the fastest (default 1)",
    )
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before each run, wait up to this long for other processes to use < 0.25 cores",
    )
    args = p.parse_args(argv)
    if (args.steps is not None and args.steps < 1) or (args.warmup is not None and args.warmup < 1) or args.repeats < 1:
        p.error("--steps, --warmup and --repeats must be >= 1")
    try:
        args.sweeps = parse_sweeps(args.sweep)
        args.base_values = parse_sweeps(args.base) if args.base else {}
    except ValueError as e:
        p.error(str(e))
    if any(len(v) != 1 for v in args.base_values.values()):
        p.error("--base takes one value per dimension")
    args.base_values = {k: v[0] for k, v in args.base_values.items()}
    if not args.sweeps and not args.replot:
        p.error("give at least one --sweep NAME=v1,v2,...")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    log.setLevel(logging.INFO)
    _quiet_logs()
    if args.replot:
        try:
            replot(Path(args.out))
        except (OSError, ValueError, KeyError) as e:
            print(f"error: --replot {args.out}: {e}", file=sys.stderr)
            return 2
        return 0
    try:
        cfg = config.load(args.config, args.overrides)
        run_sweep(
            cfg,
            args.sweeps,
            Path(args.out),
            args.warmup,
            args.steps,
            args.grid,
            args.base_values,
            args.gpus,
            args.scale_tables,
            args.num_workers,
            args.timeout,
            args.repeats,
            args.quiet_wait,
        )
    except (config.ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # a rank failed or ran past --timeout: its traceback is in the message
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
