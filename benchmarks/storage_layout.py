"""Storage layout benchmark: the same data per row and per request, side by side.

    python benchmarks/storage_layout.py [--config configs/demo.yaml] [--train-requests 300000]
                                        [--repeats 3] [--max-batches 0] [--out DIR] [--set key=value ...]

1. Generates the config's synthetic training split (``pinads_rec.data.synth.generate``) with
   ``--train-requests`` requests, rewrites it per row (``data.layout.to_per_row``: one row per
   candidate, request-level columns repeated), and that per request again the way the builder
   writes (``data.layout.to_per_request``: one row per request, candidate columns as lists), row
   group by row group (the same requests in each row group), with synth's Parquet settings
   (``synth.PARQUET_OPTIONS``).
2. Bytes on disk of both, and the compressed bytes of the sequence columns vs the rest.
3. Loader throughput: candidate rows/s through ``ParquetBatches`` (shuffled, real ``Batch``es,
   one process, no DataLoader workers), the two layouts alternating, ``--repeats`` times each;
   plus the Arrow bytes one row group takes in memory as the loader holds it. The first batches of
   both (file order) are checked equal.

Prints the figures and the ratios (per request / per row) and writes ``results.json`` to ``--out``
(default: a temporary directory, removed).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import pyarrow.parquet as pq
import torch

from pinads_rec import config
from pinads_rec.data import synth
from pinads_rec.data.loader.dataset import LoaderSettings, ParquetBatches
from pinads_rec.data.loader.layout_rewrite import rewrite_per_request, rewrite_per_row
from pinads_rec.data.loader.reader import list_files

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = ("per_row", "per_request")
MB = 2**20


def generate(cfg: config.ExperimentConfig, out: Path) -> float:
    """The per-row split under out/per_row (synth's train split, rewritten per row); seconds."""
    t = time.perf_counter()
    synth.generate(cfg, out / "synth")
    (out / "per_row").mkdir(parents=True)
    for path in list_files(str(out / "synth" / "train")):
        rewrite_per_row(path, str(out / "per_row" / Path(path).name), cfg.features, **synth.PARQUET_OPTIONS)
    shutil.rmtree(out / "synth")
    return time.perf_counter() - t


def rewrite(cfg: config.ExperimentConfig, src: Path, dst: Path) -> float:
    """Every file of ``src`` rewritten per request into ``dst``: one row group per source row group."""
    t = time.perf_counter()
    dst.mkdir(parents=True)
    for path in list_files(str(src)):
        rewrite_per_request(path, str(dst / Path(path).name), cfg.features, **synth.PARQUET_OPTIONS)
    return time.perf_counter() - t


def disk_bytes(cfg: config.ExperimentConfig, directory: Path) -> Dict[str, int]:
    """Bytes of the files, and the compressed column-chunk bytes of the sequence columns and the rest."""
    sequence = {
        c
        for g in cfg.features.sequence_groups
        for c in [g.timestamp_column, g.embedding_column] + [f.column for f in g.features]
        if c
    }
    out = {"files": 0, "sequences": 0, "other": 0}
    for path in list_files(str(directory)):
        out["files"] += Path(path).stat().st_size
        md = pq.ParquetFile(path).metadata
        for i in range(md.num_row_groups):
            rg = md.row_group(i)
            for j in range(rg.num_columns):
                cc = rg.column(j)
                key = "sequences" if cc.path_in_schema.split(".")[0] in sequence else "other"
                out[key] += cc.total_compressed_size
    return out


def throughput(cfg: config.ExperimentConfig, directory: Path, max_batches: int) -> dict:
    """One shuffled pass of ParquetBatches (one process): candidate rows/s and batches."""
    ds = ParquetBatches(str(directory), LoaderSettings.of(cfg), shuffle=True)
    rows = batches = 0
    t = time.perf_counter()
    for batch in ds:
        rows += int(batch.valid.sum())
        batches += 1
        if max_batches and batches >= max_batches:
            break
    seconds = time.perf_counter() - t
    return {"rows": rows, "batches": batches, "seconds": seconds, "rows_per_s": rows / seconds}


def memory_per_row_group(cfg: config.ExperimentConfig, directory: Path) -> dict:
    """Arrow bytes of the first row group as the loader holds it (``Requests``: request-level
    columns once per request), and as one table per candidate."""
    ds = ParquetBatches(str(directory), LoaderSettings.of(cfg), shuffle=False)
    group = ds.row_groups[0]
    block = ds.reader.read_requests(group)
    return {"held_bytes": block.nbytes, "per_row_table_bytes": ds.reader.read(group).nbytes, "rows": block.num_rows}


def first_batches_equal(cfg: config.ExperimentConfig, dirs: Dict[str, Path], n: int = 3) -> bool:
    """The first ``n`` batches in file order of both layouts hold the same tensors."""
    it = {k: iter(ParquetBatches(str(d), LoaderSettings.of(cfg), shuffle=False)) for k, d in dirs.items()}
    for _ in range(n):
        a, b = (next(it[k], None) for k in LAYOUTS)
        if a is None or b is None:
            return a is b
        for name in ("dense", "labels", "surface", "request_index", "valid"):
            if not torch.equal(getattr(a, name), getattr(b, name)):
                return False
        for name in ("sparse", "user_sparse", "sequences"):
            x, y = getattr(a, name), getattr(b, name)
            if (
                x.keys() != y.keys()
                or not torch.equal(x.values(), y.values())
                or not torch.equal(x.lengths(), y.lengths())
            ):
                return False
        for name in ("sequence_time_deltas", "sequence_embeddings"):
            x, y = getattr(a, name), getattr(b, name)
            if x.keys() != y.keys() or not all(torch.equal(x[k], y[k]) for k in x):
                return False
    return True


def run(args: argparse.Namespace) -> dict:
    overrides = list(args.set) + [
        f"synth.train_requests={args.train_requests}",
        f"synth.eval_requests={args.eval_requests}",
        "synth.calibration_requests=0",
        "data.calibration_holdout=0.0",
    ]
    cfg = config.load(args.config, overrides)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="storage_layout-"))
    out.mkdir(parents=True, exist_ok=True)
    for name in LAYOUTS:
        shutil.rmtree(out / name, ignore_errors=True)
    shutil.rmtree(out / "synth", ignore_errors=True)
    try:
        gen_s = generate(cfg, out)
        dirs = {name: out / name for name in LAYOUTS}
        rewrite_s = rewrite(cfg, dirs["per_row"], dirs["per_request"])
        result: dict = {
            "config": str(args.config),
            "train_requests": args.train_requests,
            "rows": ParquetBatches(str(dirs["per_row"]), LoaderSettings.of(cfg), shuffle=False).num_rows,
            "generate_s": gen_s,
            "rewrite_s": rewrite_s,
            "parquet_options": {k: str(v) for k, v in synth.PARQUET_OPTIONS.items()},
            "first_batches_equal": first_batches_equal(cfg, dirs),
            "disk": {k: disk_bytes(cfg, d) for k, d in dirs.items()},
            "memory": {k: memory_per_row_group(cfg, d) for k, d in dirs.items()},
            "throughput": {k: [] for k in LAYOUTS},
        }
        for r in range(args.repeats):  # alternating, the order flipped each repeat
            for name in LAYOUTS if r % 2 == 0 else LAYOUTS[::-1]:
                result["throughput"][name].append(throughput(cfg, dirs[name], args.max_batches))
        return result
    finally:
        if not args.out:
            shutil.rmtree(out, ignore_errors=True)


def report(result: dict) -> str:
    disk, mem, tp = result["disk"], result["memory"], result["throughput"]
    rate = {k: statistics.median(x["rows_per_s"] for x in tp[k]) for k in LAYOUTS}
    lines = [
        f"storage layout: {result['train_requests']} requests, {result['rows']} candidate rows "
        f"({result['config']}; Parquet {result['parquet_options']})",
        f"generated in {result['generate_s']:.1f} s, rewritten per request in {result['rewrite_s']:.1f} s; "
        f"first batches equal: {result['first_batches_equal']}",
        "",
        f"{'':28}{'per row':>14}{'per request':>14}{'ratio':>9}",
    ]

    def line(label: str, a: float, b: float, fmt: str = "{:,.1f}") -> None:
        lines.append(f"{label:28}{fmt.format(a):>14}{fmt.format(b):>14}{b / a if a else float('nan'):>8.3f}x")

    line("disk MB", disk["per_row"]["files"] / MB, disk["per_request"]["files"] / MB)
    line("  sequence columns MB", disk["per_row"]["sequences"] / MB, disk["per_request"]["sequences"] / MB)
    line("  other columns MB", disk["per_row"]["other"] / MB, disk["per_request"]["other"] / MB)
    line("held per row group MB", mem["per_row"]["held_bytes"] / MB, mem["per_request"]["held_bytes"] / MB)
    lines.append(
        f"  (one table per candidate, as the loader held a row group before: "
        f"{mem['per_row']['per_row_table_bytes'] / MB:,.1f} MB)"
    )
    line("loader rows/s (median)", rate["per_row"], rate["per_request"], "{:,.0f}")
    for k in LAYOUTS:
        lines.append(f"  {k} rows/s per repeat: " + ", ".join(f"{x['rows_per_s']:,.0f}" for x in tp[k]))
    return "\n".join(lines)


def main(argv: List[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(REPO / "configs" / "demo.yaml"))
    p.add_argument("--train-requests", type=int, default=60000)
    p.add_argument("--eval-requests", type=int, default=200, help="the eval split synth also writes (unused)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-batches", type=int, default=0, help="stop each pass after this many batches (0: all)")
    p.add_argument("--out", default=None, help="keep the data and results.json here")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    args = p.parse_args(argv)
    result = run(args)
    print(report(result))
    if args.out:
        (Path(args.out) / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
