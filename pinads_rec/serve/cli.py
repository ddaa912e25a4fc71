"""Inference for a trained run: checkpoint -> unsharded CPU model -> probabilities; and export.

    python -m pinads_rec.serve score --run runs/demo [--data data/demo/eval] [--out predictions.parquet]
                                     [--precision auto|fp32|bf16|fp16] [--batch-size 4096]
    python -m pinads_rec.serve export --run runs/demo --out model.pt2 [--precision auto|bf16]
    python -m pinads_rec.serve export-ads --run runs/two_tower --data data/demo/eval --out ads.parquet

The command line only: each command is one call into scoring.py, export.py or ad_table.py. A run,
checkpoint or data error is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Optional, Sequence

from pinads_rec.data.contract import ContractError
from pinads_rec.modules.precision import PRECISIONS
from pinads_rec.serve.ad_table import export_ads
from pinads_rec.serve.export import export_run
from pinads_rec.serve.loading import ServeError
from pinads_rec.serve.scoring import Predictor, score_directory
from pinads_rec.training import checkpoint as ckpt_lib


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pinads_rec.serve", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    def common(s: argparse.ArgumentParser, precision: bool = True) -> None:
        s.add_argument("--run", required=True, help="a train.run_dir (holds checkpoints/ and config.json)")
        s.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
        if precision:
            s.add_argument(
                "--precision",
                choices=PRECISIONS,
                default=None,
                help="large layers' dtype; auto: bf16 on a CPU with AMX/avx512_bf16, else fp32 "
                "(default: the run's model.precision.inference, auto unless set)",
            )

    s = sub.add_parser("score", help="score a Parquet directory of requests, write predictions as Parquet")
    common(s)
    s.add_argument("--data", default=None, help="Parquet file or directory (default: the run's data.eval_dir)")
    s.add_argument(
        "--out",
        default="predictions.parquet",
        help="written whole or not at all: a temporary file beside it, renamed once every row is in",
    )
    s.add_argument(
        "--batch-size",
        type=int,
        default=4096,
        help="rows per batch, which bound its memory whatever the candidates per request (default 4096: "
        "BF16 pays off on large batches, docs/serving.md)",
    )
    s.add_argument(
        "--fp16-overflow",
        choices=["error", "bf16"],
        default=None,
        help="fp16 only: fail on overflow or redo the layer in bf16 (default: the run's setting)",
    )

    s = sub.add_parser("export", help="torch.export the model to a .pt2 archive")
    common(s)
    s.add_argument("--out", default="model.pt2")
    s.add_argument("--data", default=None, help="data for the example batch (default: the run's eval data)")

    s = sub.add_parser("export-ads", help="two-tower: write every item's ad-tower vectors to Parquet")
    common(s)
    s.add_argument("--data", default=None, help="Parquet file or directory of rows holding the items")
    s.add_argument("--out", default="ads.parquet")
    s.add_argument("--batch-size", type=int, default=None)
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s", force=True)
    logging.getLogger("pinads_rec").setLevel(logging.INFO)
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)  # TorchRec's is_fx_tracing notice
    try:
        if args.command == "score":
            predictor = Predictor.from_run(args.run, args.precision, args.step, args.fp16_overflow)
            data = args.data or predictor.cfg.data.eval_dir
            stats = score_directory(predictor, data, args.out, args.batch_size)
            print(
                f"scored {stats['rows']:,} rows of {data} in {stats['seconds']:.1f}s "
                f"({stats['rows_per_s']:,.0f} rows/s) -> {args.out}"
            )
        elif args.command == "export":
            started = time.perf_counter()
            out = export_run(args.run, args.out, args.data, args.precision)
            print(
                f"exported {args.run} -> {out} ({out.stat().st_size / 2**20:.1f} MiB, "
                f"{time.perf_counter() - started:.0f}s); reload with pinads_rec.serve.load_exported"
            )
        elif args.command == "export-ads":
            n = export_ads(args.run, args.data, args.out, args.precision, args.batch_size)
            print(f"wrote {n:,} ad embeddings -> {args.out}")
    except (ServeError, ContractError, ckpt_lib.IncompatibleCheckpoint) as e:
        print(f"serve error: {str(e).strip().splitlines()[-1]}", file=sys.stderr)
        return 2
    return 0
