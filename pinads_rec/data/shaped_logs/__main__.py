"""``python -m pinads_rec.data.shaped_logs {taobao,kuairand,movielens} --out RAW``: write one dataset's raw
logs (and truth.csv, summary.json) into RAW."""

from __future__ import annotations

import argparse
import importlib
import json
import time
from pathlib import Path

from pinads_rec import arguments

DATASETS = ("taobao", "kuairand", "movielens")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pinads_rec.data.shaped_logs", description=__doc__)
    parser.add_argument("dataset", choices=DATASETS)
    parser.add_argument("--out", required=True, type=arguments.output_dir, help="directory to write the raw files into")
    parser.add_argument(
        "--users", type=arguments.positive_int, default=None, help="number of users (default: the generator's)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--avoided-genres",
        type=arguments.non_negative_int,
        default=0,
        help="movielens: genres per user rated harshly (default 0: none)",
    )
    args = parser.parse_args(argv)
    if args.avoided_genres and args.dataset != "movielens":
        parser.error("--avoided-genres is an option of the movielens generator")
    writer = importlib.import_module(f"pinads_rec.data.shaped_logs.{args.dataset}")
    kwargs = {"seed": args.seed} | ({"users": args.users} if args.users else {})
    kwargs |= {"avoided": args.avoided_genres} if args.avoided_genres else {}
    start = time.perf_counter()
    summary = writer.write(Path(args.out), **kwargs)
    print(json.dumps(summary, indent=2))
    print(f"wrote {args.out} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
