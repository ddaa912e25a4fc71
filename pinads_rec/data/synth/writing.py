"""Writing the data: each split's files and row groups (``split_files``), written in parallel, each
file generating the blocks it overlaps; with ``raw``, the raw logs the same data build from
(``write_raw``; what they need of the config: ``check_raw``); then ``summary.json``
(``generate``). A drifting world (synth.drift) writes a directory a day instead of the splits, and
its raw logs a directory a day (``days_build_config``: the build section that reads them).
"""

from __future__ import annotations

import copy
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

from pinads_rec.config import BuildConfig, ConfigError, ExperimentConfig, FeaturesConfig, SplitConfig, SynthConfig
from pinads_rec.data import page_checksums
from pinads_rec.data.synth.blocks import GROUP_COLUMNS, Block, faults_enabled, sample_block, sequence_caps, slice_block
from pinads_rec.data.synth.checks import check_synth_config
from pinads_rec.data.synth.drift import day_names
from pinads_rec.data.synth.summary import day_summary, drift_summary, split_summary
from pinads_rec.data.synth.tables import (
    IMPRESSION_SCHEMA,
    contract_schema,
    contract_table,
    impression_table,
    items_table,
    log_table,
)
from pinads_rec.data.synth.timeline import SPLITS, SplitPlan, Timeline, make_timeline, output_names, plan_split
from pinads_rec.data.synth.truth import BLOCK_REQUESTS, DAY_S, T0, TASKS
from pinads_rec.data.synth.world import World, make_world


def split_files(plan: SplitPlan) -> List[List[Tuple[int, int]]]:
    """Per file, its row groups as request-id ranges [a, b): whole requests, <= row_group_size rows
    each (a single request larger than that is a row group of its own)."""
    s = plan.synth
    if plan.name == "train" or s.drift is not None:  # a drifting world's days: num_files each
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


# lz4: the loader decompresses every page each epoch, and lz4 decodes fastest; no dictionaries
# or statistics: they cost write time and the loader does not use them. Page checksums: readers
# verify them (data/page_checksums.py).
PARQUET_OPTIONS = dict(compression="lz4", use_dictionary=False, write_statistics=False, **page_checksums.WRITE)


def _write_file(world: World, tl: Timeline, plan: SplitPlan, groups, path: Path, raw_path: Optional[Path]) -> dict:
    """Write one file's row groups (and, with raw_path, the same impressions as raw log rows);
    generates the blocks it overlaps (deterministic per block)."""
    s = plan.synth
    sch = contract_schema(s)
    first, last = groups[0][0], groups[-1][1]
    surf, labels, probs = [], {t: [] for t in TASKS}, {t: [] for t in TASKS}
    blind: List[np.ndarray] = []  # long histories: the click logit without the dormant term
    stale: List[np.ndarray] = []  # a drifting world: the click logits of the earlier days' truths
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
                        if "stale_logit" in blk.latent:
                            stale.append(blk.latent["stale_logit"].astype(np.float32))
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
        "_stale": np.concatenate(stale) if stale else None,
    }


def generate(cfg: ExperimentConfig, out_dir: str | Path, num_threads: int = 0, raw: bool = False) -> dict:
    """Write ``out_dir/{train,eval}/part-*.parquet`` (and ``calibration/`` when
    synth.calibration_requests > 0) and ``out_dir/summary.json``; return the summary. With ``raw``,
    also the raw logs the same data build from (``out_dir/raw/``, see write_raw). A drifting world
    (synth.drift) writes ``out_dir/days/<YYYY-MM-DD>/part-*.parquet`` instead of the splits.

    ``num_threads``: files written in parallel (0: one per CPU core). The bytes do not depend on it.
    """
    s = cfg.synth
    out = Path(out_dir)
    check_synth_config(s)  # config.load leaves the synth section to the generator
    if raw:
        check_raw(cfg.features, cfg.synth)
    t_start = time.perf_counter()
    world = make_world(s)
    tl = make_timeline(world, s)
    t_world = time.perf_counter() - t_start
    jobs = []
    plans = {name: plan_split(s, tl, name) for name in output_names(s)}
    raw_dir = out / "raw"
    drifting = s.drift is not None
    # No files of an earlier run left to be read with these (a larger one, one with a calibration split
    # or more days: a build globbing raw/days/* must not find another world's days).
    if drifting:
        old = list((out / "days").glob("*/part-*.parquet"))
        if raw:
            old += [
                p
                for pattern in ("days/*/*.parquet", "days/*/impressions/*.parquet", "history/*.parquet")
                for p in raw_dir.glob(pattern)
            ]
    else:
        old = [p for name in SPLITS for p in (out / name).glob("part-*.parquet")]
        old += list((raw_dir / "impressions").glob("*.parquet")) if raw else []
    for p in old:
        p.unlink()
    for name, plan in plans.items():
        d = out / "days" / name if drifting else out / name
        d.mkdir(parents=True, exist_ok=True)
        impressions = raw_dir / "days" / name / "impressions" if drifting else raw_dir / "impressions"
        if raw:
            impressions.mkdir(parents=True, exist_ok=True)
        for f, groups in enumerate(split_files(plan)):
            raw_path = (
                impressions / (f"part-{f:05d}.parquet" if drifting else f"{name}-{f:05d}.parquet") if raw else None
            )
            jobs.append((plan, groups, d / f"part-{f:05d}.parquet", raw_path))
    # Files are independent (each regenerates the blocks it overlaps) and Parquet encoding releases
    # the GIL: one thread per core roughly doubles throughput on 2 cores.
    workers = max(1, min(num_threads or len(os.sched_getaffinity(0)), len(jobs)))
    with ThreadPoolExecutor(workers) as pool:
        pending = pool.submit(write_raw, world, tl, s, raw_dir) if raw else None
        done = list(pool.map(lambda job: _write_file(world, tl, *job), jobs))
        raw_info = pending.result() if pending is not None else None
    parts = {name: [f for job, f in zip(jobs, done) if job[0] is plan] for name, plan in plans.items()}
    if drifting:
        splits = {
            name: day_summary(world, tl, plan, parts[name], day) for day, (name, plan) in enumerate(plans.items())
        }
    else:
        splits = {name: split_summary(tl, plan, parts[name]) for name, plan in plans.items()}
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
        "days" if drifting else "splits": splits,
    }
    if drifting:
        summary["num_item_ids"] = len(world.item_topic)
        summary["drift"] = drift_summary(splits)
    if raw_info is not None:
        summary["raw"] = raw_info
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


# The raw logs: what a logging system would have recorded (out/raw/).
RAW_LOGS = {"pins": "pin_events", "ads": "ad_events", "queries": "search_events"}


def write_raw(world: World, tl: Timeline, s: SynthConfig, raw_dir: Path) -> dict:
    """The behaviour logs (one per sequence group) and the items side table; the impression log is
    written beside the contract files (raw/impressions/<split>-<file>.parquet). A drifting world's
    are cut by day (``_write_raw_days``)."""
    raw_dir.mkdir(parents=True, exist_ok=True)
    if s.drift is not None:
        return _write_raw_days(world, tl, s, raw_dir)
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


def _write_raw_days(world: World, tl: Timeline, s: SynthConfig, raw_dir: Path) -> dict:
    """A drifting world's raw logs, a directory a day in the fixed world's layout:
    raw/days/<YYYY-MM-DD>/ holds the day's behaviour events (times in the day; the last day also any
    moved past its end by the tie-break), the ads launched that day (items.parquet; the first day:
    its whole catalogue) and, written beside the contract files, its impressions
    (impressions/part-<file>.parquet); raw/history/ the behaviour events before the first day."""
    names = day_names(s)
    dirs = [raw_dir / "history"] + [raw_dir / "days" / name for name in names]
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    info: dict = {"history": {}, "days": {name: {} for name in names}}
    where = [info["history"]] + [info["days"][name] for name in names]
    starts = T0 + DAY_S * np.arange(len(names))  # piece 0: before the first day; piece d + 1: day d
    for group, name in RAW_LOGS.items():
        log = getattr(tl, group)
        order = np.argsort(log.time, kind="stable")
        for piece, idx in enumerate(np.split(order, np.searchsorted(log.time[order], starts))):
            path = dirs[piece] / f"{name}.parquet"
            table = log_table(world, log, group, idx)
            pq.write_table(table, path, row_group_size=1 << 20, **PARQUET_OPTIONS)
            where[piece][name] = {"rows": table.num_rows, "bytes": path.stat().st_size}
    for day, name in enumerate(names):
        ids = np.flatnonzero(np.maximum(world.drift.launch, 0) == day)
        path = raw_dir / "days" / name / "items.parquet"
        pq.write_table(items_table(world, ids), path, **PARQUET_OPTIONS)
        info["days"][name]["items"] = {"rows": len(ids), "bytes": path.stat().st_size}
    return info


def days_build_config(build: BuildConfig, s: SynthConfig) -> BuildConfig:
    """``build`` (the fixed world's raw layout, as configs/demo.yaml states it) pointed at a
    drifting world's raw logs (``--raw <out>/raw``): every day's impressions, the behaviour events of
    raw/history/ and of every day, every day's launched ads, and one split a day named by its date.
    A build of it writes ``<built>/<YYYY-MM-DD>/``, equal to the generator's ``days/<YYYY-MM-DD>/``;
    a build of one day (the build's ``--day``) reads the same paths."""
    names = day_names(s)
    b = copy.deepcopy(build)
    b.impressions.path = [f"days/*/{p}" for p in b.impressions.path]
    for src in b.sequences:
        if src.path:  # a source without a path reads the impression log itself
            src.path = [x for p in src.path for x in (f"history/{p}", f"days/*/{p}")]
    for side in b.side_tables:
        side.path = [f"days/*/{p}" for p in side.path]
    ends = names[1:] + [time.strftime("%Y-%m-%d", time.gmtime(T0 + len(names) * DAY_S))]
    b.splits = [SplitConfig(name, start=name, end=end) for name, end in zip(names, ends)]
    return b


def check_raw(features: FeaturesConfig, s: SynthConfig) -> None:
    """What --raw needs: fault-free data (faults have no raw form), and sequence groups capped as
    the generator caps them (else a build from the raw logs would not reproduce the contract)."""
    if faults_enabled(s):
        raise ConfigError("synth.faults: feature faults have no raw-log form; turn them off with --raw")
    caps = sequence_caps(s)
    for g in features.sequence_groups:
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
