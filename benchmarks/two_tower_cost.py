"""Scoring cost of one request: the full ranker vs the two-tower with precomputed ad embeddings.

    python benchmarks/two_tower_cost.py [--ranker-config configs/demo.yaml]
        [--two-tower-config configs/two_tower.yaml] [--candidates 1 8 32 128 1024] [--requests 300]
        [--threads 1] [--clock cpu] [--precision fp32] [--two-tower-set model.sequence.num_layers=1 ...]
    python benchmarks/two_tower_cost.py --auc runs/demo runs/two_tower [more runs]

Cost (the default mode): both models are built with random weights (cost does not depend on them)
and put in eval mode. The two-tower's ad vectors of every item of the eval data are exported first
(``export_ad_embeddings``, the offline step; its time is printed) and loaded once
(``load_ad_table``). Then, side by side in one process, interleaved repeat by repeat:

- ranker: ``UnifiedRanker(batch)`` -- sequence encoders once per request, then the dense arch
  (DCNv2 + MMoE + target attention) once per candidate;
- two-tower, precomputed: ``score_with_ad_table`` -- the user tower once, then per candidate a table
  lookup and one dot product per task (+ bias, calibration);
- two-tower, both towers live: ``TwoTowerRanker.scores`` (what the precomputation saves).

Requests: one request of N candidates for N in ``--candidates`` (the first N rows of the eval data
relabelled as one request: the user side comes from the first row; 1024 is where early-stage
ranking lives), and the eval data's real requests one at a time (``--requests`` of them, their own
N). Times are per request, the best over repeats (the least disturbed estimate, as timeit advises),
in one thread (``--threads``; serving runs many requests in parallel, one per core), measured by
default as the CPU time of the scoring thread (``--clock cpu``: on a shared machine, time spent
descheduled is not counted; ``--clock wall`` for wall time, the same on an idle machine with one
thread). The printed ratio is ranker / two-tower(precomputed).

AUC (``--auc REFERENCE OTHER...``): reads the summary of finished pinads_rec/train.py runs (each
given as its run directory or its ``metrics.jsonl``; ``run_log.read_run_log``) and prints the per
surface x task table (AUC, its difference to the first run, NE, calibration) side by side, in
Markdown.
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import pyarrow as pa
import torch

from pinads_rec import config
from pinads_rec.data.loader.batch import Batch
from pinads_rec.data.loader.dataset import LoaderSettings, ParquetBatches
from pinads_rec.experiments import markdown
from pinads_rec.models import build_model
from pinads_rec.modules.precision import set_precision
from pinads_rec.serve.ad_table import export_ad_embeddings, load_ad_table, score_with_ad_table
from pinads_rec.training.run_log import METRICS_FILE, read_run_log

REPO = Path(__file__).resolve().parents[1]


def eval_table(dataset: ParquetBatches, max_rows: int) -> pa.Table:
    """The first row groups of the eval data (checked, ids hashed), at least max_rows rows."""
    tables, rows = [], 0
    for group in dataset.row_groups:
        tables.append(dataset.reader.read(group))
        rows += tables[-1].num_rows
        if rows >= max_rows:
            break
    return pa.concat_tables(tables)


def as_one_request(dataset: ParquetBatches, table: pa.Table) -> Batch:
    """All rows of ``table`` as the candidates of one request (the first row's user side)."""
    col = dataset.layout.features.columns.request_id
    table = table.set_column(
        table.schema.get_field_index(col),
        col,
        pa.array(np.full(table.num_rows, table.column(col)[0].as_py()), pa.int64()),
    )
    return dataset.builder.build(table)


def real_requests(dataset: ParquetBatches, table: pa.Table, count: int) -> List[Batch]:
    req = table.column(dataset.layout.features.columns.request_id).to_numpy()
    starts = np.flatnonzero(np.concatenate([[True], req[1:] != req[:-1]]))
    ends = np.append(starts[1:], len(req))
    return [dataset.builder.build(table.slice(s, e - s)) for s, e in list(zip(starts, ends))[:count]]


CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}
clock = CLOCKS["cpu"]


def timed(fn: Callable[[], object]) -> float:
    start = clock()
    fn()
    return clock() - start


def compare(fns: Dict[str, Callable[[Batch], object]], batches: List[Batch], repeats: int) -> Dict[str, float]:
    """Best (minimum) over repeats of the mean per-request seconds; the variants interleaved each repeat."""
    for fn in fns.values():  # warm-up
        for b in batches[:3]:
            fn(b)
    samples: Dict[str, List[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            samples[name].append(sum(timed(functools.partial(fn, b)) for b in batches) / len(batches))
    return {k: min(v) for k, v in samples.items()}


def cost(args: argparse.Namespace) -> None:
    global clock
    clock = CLOCKS[args.clock]
    if args.clock == "cpu" and args.threads != 1:
        raise SystemExit("--clock cpu measures the calling thread only: use --threads 1 or --clock wall")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rcfg = config.load(args.ranker_config, args.set)
    tcfg = config.load(args.two_tower_config, args.set + args.two_tower_set)
    if tcfg.model.kind != "two_tower":
        raise SystemExit(f"{args.two_tower_config}: model.kind is {tcfg.model.kind!r}, expected two_tower")
    ranker, two_tower = build_model(rcfg.features, rcfg.model), build_model(tcfg.features, tcfg.model)
    for m in (ranker, two_tower):
        m.eval()
        if args.precision != "fp32":
            set_precision(m, args.precision, cast_weights=True)
    rdata = ParquetBatches(rcfg.data.eval_dir, LoaderSettings.of(rcfg), shuffle=False)
    tdata = ParquetBatches(tcfg.data.eval_dir, LoaderSettings.of(tcfg), shuffle=False)

    with torch.inference_mode(), tempfile.TemporaryDirectory() as tmp:
        # Offline step: every eval item's ad vectors, once.
        start = time.perf_counter()
        items = export_ad_embeddings(
            two_tower,
            ParquetBatches(tcfg.data.eval_dir, LoaderSettings.of(tcfg), shuffle=False),
            Path(tmp) / "ads.parquet",
        )
        export_s = time.perf_counter() - start
        ads = load_ad_table(Path(tmp) / "ads.parquet")

        fns = {
            "ranker": lambda b: ranker(b[0]),
            "two_tower_precomputed": lambda b: score_with_ad_table(two_tower, b[1], ads),
            "two_tower_live": lambda b: two_tower.scores(b[1]),
        }
        need = max(args.candidates)
        rtable, ttable = eval_table(rdata, need + 1), eval_table(tdata, need + 1)
        rows = []
        for n in args.candidates:
            pair = [(as_one_request(rdata, rtable.slice(0, n)), as_one_request(tdata, ttable.slice(0, n)))]
            rows.append((str(n), n, compare(fns, pair, args.repeats)))
        pairs = list(zip(real_requests(rdata, rtable, args.requests), real_requests(tdata, ttable, args.requests)))
        mean_n = float(np.mean([b.batch_size for b, _ in pairs]))
        rows.append((f"real ({len(pairs)} req.)", mean_n, compare(fns, pairs, max(1, args.repeats // 4))))

    print(
        f"\nscoring cost per request ({args.clock} time), {args.threads} thread(s), {args.precision}, random weights; "
        f"two-tower overrides: {args.two_tower_set or 'none'}; ad export: {items} items in {export_s:.2f} s "
        f"(offline)\n"
    )
    header = (
        f"| {'candidates N':<18} | {'ranker ms':>9} | {'two-tower ms (precomputed ads)':>30} | "
        f"{'ratio ranker/two-tower':>22} | {'two-tower ms (both towers live)':>31} |"
    )
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for label, n, t in rows:
        n_text = f"{label}, mean N {n:.1f}" if label.startswith("real") else label
        r, p, live = t["ranker"] * 1e3, t["two_tower_precomputed"] * 1e3, t["two_tower_live"] * 1e3
        print(f"| {n_text:<18} | {r:9.3f} | {p:30.3f} | {r / p:21.1f}x | {live:31.3f} |")


def auc_table(paths: List[str]) -> None:
    """Per surface x task: AUC of every run (the first is the reference), its AUC difference to the
    reference, NE and calibration (predicted / observed positives) of every run, the oracle AUC."""

    def last_eval(path: str) -> dict:
        run_dir = Path(path).parent if Path(path).name == METRICS_FILE else Path(path)
        summary = read_run_log(run_dir).summary
        if summary is None:
            raise SystemExit(f"{path}: no eval record (a finished train.py run appends one)")
        return summary

    runs = [last_eval(p) for p in paths]
    names = [f"run{i}" for i in range(len(paths))]
    for name, path, run in zip(names, paths, runs):
        print(f"{name}: {path} ({run['step']} steps)")
    rows = [{(r["surface"], r["task"]): r for r in run["eval"]} for run in runs]
    head = (
        ["surface", "task"]
        + [f"AUC {n}" for n in names]
        + [f"ΔAUC {n}" for n in names[1:]]
        + [f"NE {n}" for n in names]
        + [f"calib. {n}" for n in names]
        + ["oracle AUC"]
    )
    out_rows = []
    for key, ref in rows[0].items():
        if not all(key in r for r in rows[1:]):
            continue
        cells = [r[key] for r in rows]
        oracle = ref.get("oracle_auc")
        line = (
            [key[0], key[1]]
            + [f"{c['auc']:.4f}" for c in cells]
            + [f"{c['auc'] - ref['auc']:+.4f}" for c in cells[1:]]
            + [f"{c['ne']:.4f}" for c in cells]
            + [f"{c['calibration']:.3f}" for c in cells]
            + ["-" if oracle is None else f"{oracle:.4f}"]
        )
        out_rows.append(line)
    print("\n" + "\n".join(markdown.table(head, out_rows)))


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranker-config", default=str(REPO / "configs" / "demo.yaml"))
    p.add_argument("--two-tower-config", default=str(REPO / "configs" / "two_tower.yaml"))
    p.add_argument("--candidates", type=int, nargs="+", default=[1, 8, 32, 128, 1024])
    p.add_argument("--requests", type=int, default=300, help="real eval requests timed one at a time")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="cpu",
        help="cpu: the scoring thread's CPU time (robust on a shared machine); wall: wall time",
    )
    p.add_argument(
        "--precision",
        choices=["fp32", "bf16"],
        default="fp32",
        help="large layers of both models (weights cast, as in serving)",
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override both configs")
    p.add_argument(
        "--two-tower-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override the two-tower config only (e.g. model.sequence.num_layers=1)",
    )
    p.add_argument(
        "--auc",
        nargs="+",
        metavar="RUN",
        help="print the AUC comparison of finished runs (run directories or their metrics.jsonl) instead "
        "(the first is the reference)",
    )
    args = p.parse_args(argv)
    if args.auc:
        auc_table(args.auc)
    else:
        cost(args)


if __name__ == "__main__":
    main()
