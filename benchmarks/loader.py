"""Loader benchmark: throughput over the demo data, and memory flatness over a long stream.

    python benchmarks/loader.py [--config configs/demo.yaml] [--data data/demo/train]
                                [--workers 0 1 2] [--scale 10]

1. Throughput: ``make_loader`` (shuffled, real ``Batch``es) over ``--data`` for each worker count
   (0 = in the main process). Reports batches/s, examples/s and MB/s of Parquet read (compressed
   column-chunk bytes of the columns the contract reads, per second), plus the first-batch latency.
   When ``--data`` does not exist, the config's demo data are generated into a temporary directory.
2. Memory flatness: generates a dataset ``--scale`` x larger than ``data.shuffle_buffer_rows`` (in a
   spawned child, so the generator's own allocations do not pollute this process), then streams it
   end to end in this process (``ParquetBatches``, no DataLoader workers) sampling the resident set
   every ``--sample-every`` batches (/proc/self/status VmRSS, VmHWM reset through clear_refs when the
   kernel allows; else the sampled maximum). Prints the peak RSS after 10%, 50% and 100% of the rows
   and the ratio peak(100%) / peak(10%): ~1.0 means memory is bounded by the buffer, not the data.

Defaults run in well under 2 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import resource
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from pinads_rec import config
from pinads_rec.data.loader.dataset import LoaderSettings, ParquetBatches, make_loader
from pinads_rec.experiments.harness import meters, peak_rss_mib, rss_mib

REPO = Path(__file__).resolve().parents[1]

MB = 2**20


# --------------------------------------------------------------------------------------------
# Memory probes.
# --------------------------------------------------------------------------------------------


# RSS and peak RSS (VmRSS, VmHWM) in MiB: harness.rss_mib / peak_rss_mib.


def max_rss_mb() -> float:
    """The lifetime maximum RSS (ru_maxrss), which VmHWM's reset does not touch."""
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return kb / 1024


# --------------------------------------------------------------------------------------------
# Data.
# --------------------------------------------------------------------------------------------


def _generate(config_path: str, overrides: List[str], out: str) -> None:
    from pinads_rec.data.synth import generate  # child process: only the generator is needed

    generate(config.load(config_path, overrides), out)


def generate_in_child(config_path: str, overrides: List[str], out: str) -> float:
    t = time.perf_counter()
    proc = mp.get_context("spawn").Process(target=_generate, args=(config_path, overrides, out))
    proc.start()
    proc.join()
    if proc.exitcode != 0:
        raise SystemExit(f"data generation failed (exit code {proc.exitcode})")
    return time.perf_counter() - t


def parquet_bytes(ds: ParquetBatches) -> Dict[str, int]:
    """Compressed / uncompressed bytes of the contract's column chunks over the dataset's row groups."""
    wanted = set(ds.reader.columns)
    out = {"compressed": 0, "uncompressed": 0}
    meta: Dict[str, pq.FileMetaData] = {}
    for g in ds.row_groups:
        md = meta.setdefault(g.path, pq.ParquetFile(g.path).metadata)
        rg = md.row_group(g.index)
        for j in range(rg.num_columns):
            cc = rg.column(j)
            if cc.path_in_schema.split(".")[0] in wanted:
                out["compressed"] += cc.total_compressed_size
                out["uncompressed"] += cc.total_uncompressed_size
    return out


# --------------------------------------------------------------------------------------------
# 1. Throughput.
# --------------------------------------------------------------------------------------------


def throughput(cfg, data_dir: str, workers: int, max_batches: int) -> dict:
    probe = ParquetBatches(data_dir, LoaderSettings.of(cfg), shuffle=True)
    nbytes = parquet_bytes(probe)
    total_rows = probe.num_rows
    del probe
    t0 = time.perf_counter()
    loader = make_loader(data_dir, LoaderSettings.of(cfg), shuffle=True, num_workers=workers)
    first = None
    batches = examples = 0
    for batch in loader:
        if first is None:
            first = time.perf_counter() - t0
        batches += 1
        examples += int(batch.valid.sum())
        if max_batches and batches >= max_batches:
            break
    seconds = time.perf_counter() - t0
    frac = examples / total_rows if total_rows else 0.0  # share of the epoch read (for MB/s)
    return {
        "workers": workers,
        "batches": batches,
        "examples": examples,
        "seconds": seconds,
        "first_batch_s": first or 0.0,
        "batches_per_s": batches / seconds,
        "examples_per_s": examples / seconds,
        "mb_per_s": nbytes["compressed"] * frac / MB / seconds,
        "raw_mb_per_s": nbytes["uncompressed"] * frac / MB / seconds,
        "epoch_mb": nbytes["compressed"] / MB,
    }


# --------------------------------------------------------------------------------------------
# 2. Memory flatness.
# --------------------------------------------------------------------------------------------


def memory_stream(cfg, data_dir: str, sample_every: int) -> dict:
    ds = ParquetBatches(data_dir, LoaderSettings.of(cfg), shuffle=True)
    total = ds.num_rows
    # The documented bound: shuffle_buffer_rows + one row group (+ one batch being cut), in Arrow bytes.
    sample = ds.reader.read(ds.row_groups[0])
    bytes_per_row = sample.nbytes / max(sample.num_rows, 1)
    del sample
    largest = max(g.num_rows for g in ds.row_groups)
    bound_mb = bytes_per_row * (max(cfg.data.shuffle_buffer_rows, ds.batch_size) + largest + ds.batch_size) / MB
    # Count the row groups still referenced (by the shuffle pool or a pending batch).
    alive: set = set()
    read = ds.reader.read_requests

    def tracked_read(group):
        requests = read(group)
        key = (group.path, group.index)
        alive.add(key)
        weakref.finalize(requests, alive.discard, key)
        return requests

    ds.reader.read_requests = tracked_read
    max_alive = 0
    can_reset = meters.reset_peak_rss()
    baseline = rss_mib()
    marks = {0.1: None, 0.5: None, 1.0: None}
    peak_sampled = baseline
    peak_arrow = pa.total_allocated_bytes() / MB
    rows = batches = 0
    t0 = time.perf_counter()

    def peak() -> float:
        return max(peak_sampled, peak_rss_mib()) if can_reset else peak_sampled

    for batch in ds:
        rows += int(batch.valid.sum())
        batches += 1
        max_alive = max(max_alive, len(alive))
        if batches % sample_every == 0 or rows >= total:
            peak_sampled = max(peak_sampled, rss_mib())
            peak_arrow = max(peak_arrow, pa.total_allocated_bytes() / MB)
        for m in marks:
            if marks[m] is None and rows >= m * total:
                peak_sampled = max(peak_sampled, rss_mib())
                marks[m] = (peak(), peak_arrow, rows)
        del batch
    seconds = time.perf_counter() - t0
    if marks[1.0] is None:
        marks[1.0] = (peak(), peak_arrow, rows)
    return {
        "rows": rows,
        "total_rows": total,
        "batches": batches,
        "seconds": seconds,
        "baseline_mb": baseline,
        "marks": marks,
        "hwm_reset": can_reset,
        "ru_maxrss_mb": max_rss_mb(),
        "buffer_rows": cfg.data.shuffle_buffer_rows,
        "row_groups": len(ds.row_groups),
        "repairs": dict(ds.reader.checker.repairs),
        "max_alive_row_groups": max_alive,
        "row_group_mb": bytes_per_row * largest / MB,
        "bound_mb": bound_mb,
    }


# --------------------------------------------------------------------------------------------
# Main.
# --------------------------------------------------------------------------------------------


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "demo.yaml"))
    ap.add_argument("--data", default="data/demo/train", help="Parquet directory for the throughput test")
    ap.add_argument(
        "--workers",
        type=int,
        nargs="+",
        default=[0, 1],
        help="DataLoader worker counts to measure (0 = in the main process)",
    )
    ap.add_argument(
        "--scale", type=float, default=10.0, help="memory test: dataset rows as a multiple of data.shuffle_buffer_rows"
    )
    ap.add_argument("--max-batches", type=int, default=0, help="throughput: stop after N batches (0 = epoch)")
    ap.add_argument("--sample-every", type=int, default=1, help="memory test: sample RSS every N batches")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-memory", action="store_true")
    args = ap.parse_args(argv)

    cfg = config.load(args.config, args.set)
    cores = len(os.sched_getaffinity(0))
    print(
        f"loader benchmark: config {args.config}, batch_size {cfg.data.batch_size}, "
        f"shuffle_buffer_rows {cfg.data.shuffle_buffer_rows}, {cores} cores, torch threads "
        f"{__import__('torch').get_num_threads()}, arrow pool {pa.default_memory_pool().backend_name}"
    )

    with tempfile.TemporaryDirectory(prefix="loader_bench_") as tmp:
        # 2 first: this process has read nothing yet, so its baseline is not inflated by phase 1.
        if not args.skip_memory:
            buffer = max(cfg.data.shuffle_buffer_rows, cfg.data.batch_size)
            target_rows = int(args.scale * buffer)
            requests = max(1, math.ceil(target_rows / cfg.synth.candidates_per_request))
            n_files = max(1, min(cfg.synth.num_files, requests))
            overrides = list(args.set) + [
                f"synth.train_requests={requests}",
                "synth.eval_requests=64",
                f"synth.num_files={n_files}",
            ]
            out = os.path.join(tmp, "memory")
            gen_s = generate_in_child(args.config, overrides, out)
            mcfg = config.load(args.config, overrides)
            m = memory_stream(mcfg, os.path.join(out, "train"), max(1, args.sample_every))
            print(
                f"\n[memory] generated {m['total_rows']:,} rows ({m['total_rows'] / buffer:.1f}x the "
                f"{buffer:,}-row shuffle buffer, {m['row_groups']} row groups) in {gen_s:.1f} s; streamed "
                f"{m['batches']} batches in {m['seconds']:.1f} s ({m['rows'] / m['seconds']:,.0f} rows/s)"
            )
            print(
                f"peak = {'VmHWM (reset before the stream)' if m['hwm_reset'] else 'max sampled VmRSS'}; "
                f"baseline RSS before the stream {m['baseline_mb']:.0f} MiB"
            )
            head = f"{'stream':>7} {'rows':>9} {'peak RSS MiB':>13} {'vs 10%':>7} {'arrow peak MiB':>15}"
            print(head)
            print("-" * len(head))
            ref = m["marks"][0.1][0]
            for frac, (peak, arrow, rows) in m["marks"].items():
                print(f"{frac:>7.0%} {rows:>9,} {peak:>13.0f} {peak / ref:>7.3f} {arrow:>15.0f}")
            end = m["marks"][1.0][0]
            print(
                f"flatness: peak(100%) / peak(10%) = {end / ref:.3f}  "
                f"(+{end - ref:.0f} MiB over the last 90% of the stream); ru_maxrss {m['ru_maxrss_mb']:.0f} MiB"
            )
            print(
                f"row-group tables alive at once: max {m['max_alive_row_groups']} of {m['row_groups']} "
                f"(~{m['row_group_mb']:.0f} MiB each in Arrow); documented bound (buffer + one row group + "
                f"one batch) ~{m['bound_mb']:.0f} MiB of Arrow data vs arrow peak {m['marks'][1.0][1]:.0f} MiB"
            )
            if m["repairs"]:
                print(f"repairs: {m['repairs']}")

        if not args.skip_throughput:
            data = args.data
            if not os.path.isdir(data):
                out = os.path.join(tmp, "demo")
                gen_s = generate_in_child(args.config, list(args.set), out)
                data = os.path.join(out, "train")
                print(
                    f"\n[throughput] {args.data} does not exist: generated the config's demo data in "
                    f"{gen_s:.1f} s into a temporary directory"
                )
            print(f"\n[throughput] {data}")
            head = (
                f"{'workers':>7} {'batches':>7} {'examples':>9} {'seconds':>7} {'first s':>7} "
                f"{'batches/s':>9} {'examples/s':>10} {'MB/s pq':>8} {'MB/s raw':>8}"
            )
            print(head)
            print("-" * len(head))
            for w in args.workers:
                r = throughput(cfg, data, w, args.max_batches)
                print(
                    f"{r['workers']:>7} {r['batches']:>7} {r['examples']:>9,} {r['seconds']:>7.2f} "
                    f"{r['first_batch_s']:>7.2f} {r['batches_per_s']:>9.1f} {r['examples_per_s']:>10,.0f} "
                    f"{r['mb_per_s']:>8.1f} {r['raw_mb_per_s']:>8.1f}"
                )
            print(
                "MB/s pq: compressed Parquet column chunks read per second (the contract's columns); "
                "raw: their uncompressed size"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
