"""Inference for a trained run: checkpoint -> unsharded CPU model -> probabilities; and export.

    python -m pinads_rec.serve score --run runs/demo [--data data/demo/eval] [--out predictions.parquet]
                                     [--precision auto|fp32|bf16|fp16] [--batch-size 4096]
    python -m pinads_rec.serve export --run runs/demo --out model.pt2 [--precision auto|bf16]
    python -m pinads_rec.serve guard --run runs/demo [--dtypes fp16 int8 int4] [--tolerance 0.001] [--write F]
    python -m pinads_rec.serve export-ads --run runs/two_tower --data data/demo/eval --out ads.parquet
    python -m pinads_rec.serve online --run runs/demo --raw data/demo/raw [--vocabularies BUILD] [--address RAY]
    python -m pinads_rec.serve requests --run runs/demo --raw data/demo/raw --split eval --out requests.jsonl
    python -m pinads_rec.serve kuberay --run /models/demo --raw /data/raw --image IMAGE --out rayservice.yaml

The command line only: each command is one call into scoring.py, export.py, guard.py, ad_table.py,
online.py or kuberay.py. ``score``, ``export`` and ``online`` take ``--set`` for serve.* settings: the
tables' dtypes (``--set embedding_dtype=int8``, ``--set table_dtypes.user=fp32``; serve/quantize.py). A run,
checkpoint or data error is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from pinads_rec import arguments, config
from pinads_rec.data.build.live import RequestError
from pinads_rec.data.loader.contract import ContractError
from pinads_rec.modules.precision import PRECISIONS
from pinads_rec.serve import guard
from pinads_rec.serve.ad_table import export_ads
from pinads_rec.serve.export import export_run
from pinads_rec.serve.loading import ServeError
from pinads_rec.serve.online import serve_settings
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

    def settings(s: argparse.ArgumentParser) -> None:
        s.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="a serve.* setting over the run's: embedding_dtype=fp32|fp16|int8|int4, table_dtypes.<table>=<dtype>",
        )

    s = sub.add_parser("score", help="score a Parquet directory of requests, write predictions as Parquet")
    common(s)
    settings(s)
    s.add_argument(
        "--data",
        default=None,
        type=arguments.existing_path,
        help="Parquet file or directory (default: the run's data.eval_dir)",
    )
    s.add_argument(
        "--out",
        default="predictions.parquet",
        type=arguments.output_file,
        help="written whole or not at all: a temporary file beside it, renamed once every row is in",
    )
    s.add_argument(
        "--batch-size",
        type=arguments.positive_int,
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
    settings(s)
    s.add_argument("--out", default="model.pt2", type=arguments.output_file)
    s.add_argument(
        "--data",
        default=None,
        type=arguments.existing_path,
        help="data for the example batch (default: the run's eval data)",
    )

    s = sub.add_parser("guard", help="each table's AUC cost at each dtype; the smallest within a tolerance")
    common(s)
    s.add_argument("--data", default=None, type=arguments.existing_path, help="default: the run's data.eval_dir")
    s.add_argument("--dtypes", nargs="+", choices=["fp16", "int8", "int4"], default=["fp16", "int8", "int4"])
    s.add_argument("--tolerance", type=float, default=0.001, help="largest |AUC delta| on any surface x task")
    s.add_argument(
        "--calibration-tolerance", type=float, default=0.005, help="largest relative calibration change (0.005: 0.5%%)"
    )
    s.add_argument("--batch-size", type=arguments.positive_int, default=4096)
    s.add_argument("--write", default=None, type=arguments.output_file, help="save the choice as a serve: section")
    s.add_argument("--json", default=None, type=arguments.output_file, help="save every measurement as JSON")

    s = sub.add_parser("export-ads", help="two-tower: write every item's ad-tower vectors to Parquet")
    common(s)
    s.add_argument(
        "--data", default=None, type=arguments.existing_path, help="Parquet file or directory of rows holding the items"
    )
    s.add_argument("--out", default="ads.parquet", type=arguments.output_file)
    s.add_argument("--batch-size", type=arguments.positive_int, default=None)

    def live(s: argparse.ArgumentParser) -> None:
        s.add_argument(
            "--raw",
            required=True,
            type=arguments.existing_dir,
            help="the raw logs the run's data was built from (build.* paths)",
        )
        s.add_argument(
            "--vocabularies",
            default=None,
            type=arguments.existing_dir,
            help="the build that fitted build.vocabularies (when the config has any)",
        )
        s.add_argument(
            "--precision", choices=["auto", "fp32", "bf16"], default=None, help="default: the run's inference precision"
        )
        s.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="a serve.* setting for this launch (e.g. --set port=8001 --set replicas=2)",
        )

    s = sub.add_parser("online", help="serve raw ad requests over HTTP on Ray Serve (docs/serving.md)")
    common(s, precision=False)
    live(s)
    s.add_argument("--address", default=None, help="a running Ray cluster (ray start --head); default: start one here")

    s = sub.add_parser("requests", help="the raw impression log's requests as live requests (JSON lines)")
    common(s, precision=False)
    live(s)
    s.add_argument("--split", default=None, help="a build split's window (default: the whole log)")
    s.add_argument("--limit", type=arguments.positive_int, default=100)
    s.add_argument("--out", default="-", type=arguments.output_file, help="a .jsonl file, or - for stdout")

    s = sub.add_parser("kuberay", help="write the KubeRay RayService manifest serving the run on Kubernetes")
    common(s, precision=False)
    live(s)
    s.add_argument("--image", required=True, help="a container image with the project installed (Dockerfile)")
    s.add_argument("--workers", type=arguments.positive_int, default=1, help="Ray worker pods")
    s.add_argument("--out", default="rayservice.yaml", type=arguments.output_file)
    return p.parse_args(argv)


def _spec(args: argparse.Namespace):
    from pinads_rec.serve.online import ServiceSpec, serve_settings

    return ServiceSpec(args.run, args.raw, args.vocabularies, args.step, args.precision, serve_settings(args.set))


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s", force=True)
    logging.getLogger("pinads_rec").setLevel(logging.INFO)
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)  # TorchRec's is_fx_tracing notice
    try:
        if args.command == "score":
            tables = serve_settings(args.set)
            predictor = Predictor.from_run(args.run, args.precision, args.step, args.fp16_overflow, serve=tables)
            data = args.data or predictor.cfg.data.eval_dir
            stats = score_directory(predictor, data, args.out, args.batch_size)
            print(
                f"scored {stats['rows']:,} rows of {data} in {stats['seconds']:.1f}s "
                f"({stats['rows_per_s']:,.0f} rows/s) -> {args.out}"
            )
        elif args.command == "export":
            started = time.perf_counter()
            out = export_run(args.run, args.out, args.data, args.precision, serve=serve_settings(args.set))
            print(
                f"exported {args.run} -> {out} ({out.stat().st_size / 2**20:.1f} MiB, "
                f"{time.perf_counter() - started:.0f}s); reload with pinads_rec.serve.load_exported"
            )
        elif args.command == "guard":
            result = guard.guard(
                args.run,
                args.data,
                args.dtypes,
                args.tolerance,
                args.calibration_tolerance,
                args.batch_size,
                args.precision,
                args.step,
            )
            print(guard.report(result))
            if args.write:
                print(f"wrote {guard.write_choice(result['choice'], args.write)}")
            print(f"serve with: {guard.set_flags(result['choice']) or '(every table fp32)'}")
            if args.json:
                Path(args.json).write_text(json.dumps(guard.as_json(result), indent=1) + "\n")
        elif args.command == "export-ads":
            n = export_ads(args.run, args.data, args.out, args.precision, args.batch_size)
            print(f"wrote {n:,} ad embeddings -> {args.out}")
        elif args.command == "online":
            from pinads_rec.serve.online import start

            start(_spec(args), address=args.address)
        elif args.command == "requests":
            from pinads_rec.serve.online import write_requests

            n = write_requests(_spec(args), args.split, args.limit, args.out)
            print(f"wrote {n:,} requests -> {args.out}", file=sys.stderr)
        elif args.command == "kuberay":
            from pinads_rec.serve.kuberay import write_manifest

            out = write_manifest(_spec(args), args.image, args.workers, args.out)
            print(f"wrote {out}: kubectl apply -f {out} (KubeRay's operator installed)")
    except (ServeError, ContractError, ckpt_lib.IncompatibleCheckpoint, config.ConfigError, RequestError) as e:
        print(f"serve error: {str(e).strip()}", file=sys.stderr)  # whole: its first line says what and where
        return 2
    return 0
