"""Writing the data: each split's files and row groups (``split_files``), written in parallel, each
file generating the blocks it overlaps; with ``raw``, the raw logs the same data build from
(``write_raw``; what they need of the config: ``check_raw``); then ``summary.json``
(``generate``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pinads_rec.config import ConfigError, ExperimentConfig, SynthConfig
from pinads_rec.data.synth.blocks import GROUP_COLUMNS, Block, faults_enabled, sample_block, sequence_caps, slice_block
from pinads_rec.data.synth.checks import check_synth_config
from pinads_rec.data.synth.summary import split_summary
from pinads_rec.data.synth.tables import (
    IMPRESSION_SCHEMA,
    contract_schema,
    contract_table,
    impression_table,
    items_table,
    log_table,
)
from pinads_rec.data.synth.timeline import SPLITS, SplitPlan, Timeline, make_timeline, plan_split
from pinads_rec.data.synth.truth import BLOCK_REQUESTS, TASKS
from pinads_rec.data.synth.world import World, make_world


def split_files(plan: SplitPlan) -> List[List[Tuple[int, int]]]:
    """Per file, its row groups as request-id ranges [a, b): whole requests, <= row_group_size rows
    each (a single request larger than that is a row group of its own)."""
    s = plan.synth
    if plan.name == "train":
        n_files = s.num_files
    else:  # eval, calibration: in proportion to its size, at least 2
        n_files = min(max(2, math.ceil(s.num_files * plan.num_requests / s.train_requests)), max(s.num_files, 2))
    n_files = max(1, min(n_files, plan.num_requests))
    bounds = (np.arange(n_files + 1) * plan.num_requests) // n_files
    off = plan.row_offsets
    files = []
    for f in range(n_files):
        a, end = int(bounds[f]), int(bounds[f + 1])
        groups = []
        while a < end:
            b = int(np.searchsorted(off, off[a] + s.row_group_size, side="right")) - 1
            b = min(max(b, a + 1), end)
            groups.append((plan.first_request + a, plan.first_request + b))
            a = b
        files.append(groups)
    return files


# zstd finds the sequences repeated on the rows of a request (adjacent in a page); no dictionaries
# or statistics: they cost write time and the loader does not use them.
PARQUET_OPTIONS = dict(compression="lz4", use_dictionary=False, write_statistics=False)


def _write_file(world: World, tl: Timeline, plan: SplitPlan, groups, path: Path, raw_path: Optional[Path]) -> dict:
    """Write one file's row groups (and, with raw_path, the same impressions as raw log rows);
    generates the blocks it overlaps (deterministic per block)."""
    s = plan.synth
    sch = contract_schema(s)
    first, last = groups[0][0], groups[-1][1]
    surf, labels, probs = [], {t: [] for t in TASKS}, {t: [] for t in TASKS}
    blind: List[np.ndarray] = []  # long histories: the click logit without the dormant term
    blk: Optional[Block] = None
    raw_writer = pq.ParquetWriter(raw_path, IMPRESSION_SCHEMA, **PARQUET_OPTIONS) if raw_path else None
    try:
        with pq.ParquetWriter(path, sch, **PARQUET_OPTIONS) as writer:
            for a, b in groups:
                pieces = []
                while a < b:
                    if blk is None or blk.hi <= a:
                        full = sample_block(world, tl, s, a // BLOCK_REQUESTS)
                        blk = slice_block(full, max(full.lo, first), min(full.hi, last))
                        surf.append(np.repeat(blk.surface, blk.num_candidates))
                        for t in TASKS:
                            labels[t].append(blk.rows[t].astype(np.int8))
                            probs[t].append(blk.rows[f"true_p_{t}"])
                        if s.long_history.enabled:
                            lat = blk.latent
                            blind.append(lat["logit_click"] - s.long_history.dormant_coef * lat["dormant_match"])
                    y = min(b, blk.hi)
                    part = slice_block(blk, a, y)
                    pieces.append(contract_table(part, sch))
                    if raw_writer is not None:
                        raw_writer.write_table(impression_table(part))
                    a = y
                rg = pa.concat_tables(pieces) if len(pieces) > 1 else pieces[0]
                writer.write_table(rg, row_group_size=max(rg.num_rows, 1))
    finally:
        if raw_writer is not None:
            raw_writer.close()
    return {
        "path": str(path),
        "bytes": path.stat().st_size,
        "row_groups": len(groups),
        "rows": int(tl.cand_offsets[last] - tl.cand_offsets[first]),
        "requests": last - first,
        "_surface": np.concatenate(surf),
        "_labels": {t: np.concatenate(v) for t, v in labels.items()},
        "_probs": {t: np.concatenate(v) for t, v in probs.items()},
        "_blind": np.concatenate(blind) if blind else None,
    }


def generate(cfg: ExperimentConfig, out_dir: str | Path, num_threads: int = 0, raw: bool = False) -> dict:
    """Write ``out_dir/{train,eval}/part-*.parquet`` (and ``calibration/`` when
    synth.calibration_requests > 0) and ``out_dir/summary.json``; return the summary. With ``raw``,
    also the raw logs the same data build from (``out_dir/raw/``, see write_raw).

    ``num_threads``: files written in parallel (0: one per CPU core). The bytes do not depend on it.
    """
    s = cfg.synth
    out = Path(out_dir)
    check_synth_config(s)  # config.load leaves the synth section to the generator
    if raw:
        check_raw(cfg)
    t_start = time.perf_counter()
    world = make_world(s)
    tl = make_timeline(world, s)
    t_world = time.perf_counter() - t_start
    jobs = []
    plans = {name: plan_split(s, tl, name) for name in SPLITS if name != "calibration" or s.calibration_requests}
    for name in SPLITS:  # no stale files of an earlier, larger or calibration-split run
        for old in (out / name).glob("part-*.parquet"):
            old.unlink()
    raw_dir = out / "raw"
    if raw:
        for old in (raw_dir / "impressions").glob("*.parquet"):
            old.unlink()
        (raw_dir / "impressions").mkdir(parents=True, exist_ok=True)
    for name, plan in plans.items():
        d = out / name
        d.mkdir(parents=True, exist_ok=True)
        for f, groups in enumerate(split_files(plan)):
            raw_path = raw_dir / "impressions" / f"{name}-{f:05d}.parquet" if raw else None
            jobs.append((plan, groups, d / f"part-{f:05d}.parquet", raw_path))
    # Files are independent (each regenerates the blocks it overlaps) and Parquet encoding releases
    # the GIL: one thread per core roughly doubles throughput on 2 cores.
    workers = max(1, min(num_threads or len(os.sched_getaffinity(0)), len(jobs)))
    with ThreadPoolExecutor(workers) as pool:
        pending = pool.submit(write_raw, world, tl, s, raw_dir) if raw else None
        done = list(pool.map(lambda job: _write_file(world, tl, *job), jobs))
        raw_info = pending.result() if pending is not None else None
    splits = {
        name: split_summary(tl, plan, [f for job, f in zip(jobs, done) if job[0] is plan])
        for name, plan in plans.items()
    }
    seconds = time.perf_counter() - t_start
    rows = sum(v["rows"] for v in splits.values())
    summary = {
        "seed": s.seed,
        "out_dir": str(out),
        "rows": rows,
        "requests": sum(v["requests"] for v in splits.values()),
        "users": int(len(np.unique(tl.user))),
        "bytes": sum(v["bytes"] for v in splits.values()),
        "seconds": round(seconds, 3),
        "world_seconds": round(t_world, 3),
        "rows_per_second": round(rows / seconds, 1),
        "threads": workers,
        "synth": dataclasses.asdict(s),
        "splits": splits,
    }
    if raw_info is not None:
        summary["raw"] = raw_info
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


# The raw logs: what a logging system would have recorded (out/raw/).
RAW_LOGS = {"pins": "pin_events", "ads": "ad_events", "queries": "search_events"}


def write_raw(world: World, tl: Timeline, s: SynthConfig, raw_dir: Path) -> dict:
    """The behaviour logs (one per sequence group) and the items side table; the impression log is
    written beside the contract files (raw/impressions/<split>-<file>.parquet)."""
    raw_dir.mkdir(parents=True, exist_ok=True)
    info = {}
    for group, name in RAW_LOGS.items():
        path = raw_dir / f"{name}.parquet"
        table = log_table(world, getattr(tl, group), group)
        pq.write_table(table, path, row_group_size=1 << 20, **PARQUET_OPTIONS)
        info[name] = {"rows": table.num_rows, "bytes": path.stat().st_size}
    path = raw_dir / "items.parquet"
    pq.write_table(items_table(world), path, **PARQUET_OPTIONS)
    info["items"] = {"rows": len(world.item_topic), "bytes": path.stat().st_size}
    return info


def check_raw(cfg: ExperimentConfig) -> None:
    """What --raw needs: fault-free data (faults have no raw form), and sequence groups capped as
    the generator caps them (else a build from the raw logs would not reproduce the contract)."""
    s = cfg.synth
    if faults_enabled(s):
        raise ConfigError("synth.faults: feature faults have no raw-log form; turn them off with --raw")
    caps = sequence_caps(s)
    for g in cfg.features.sequence_groups:
        for group, (ts_col, _) in GROUP_COLUMNS.items():
            if g.timestamp_column == ts_col and g.max_length != caps[group]:
                source = (
                    f"synth.long_history.max_length={s.long_history.max_length}"
                    if group == "pins" and s.long_history.enabled
                    else f"synth.sequence_length={s.sequence_length}"
                )
                raise ConfigError(
                    f"features.sequence_groups[{g.name}].max_length: {g.max_length}, but the generator caps that "
                    f"group at {caps[group]} (from {source}): a build of the raw logs would not equal the contract "
                    "output"
                )
