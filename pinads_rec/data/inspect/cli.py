"""Scan a dataset against a config: every contract problem with its count and first place, and the
statistics a user needs to size a config -- or draft a ``features:`` section from the data itself.

    python -m pinads_rec.data.inspect --config X.yaml [--data DIR] [--json OUT.json]
    python -m pinads_rec.data.inspect --data DIR --draft-config OUT.yaml
    python -m pinads_rec.data.inspect --verify DIR   # the bytes: sha256 against the manifest, page checksums

The command line only: the scan is scan.py, the printed and JSON report report.py, the draft
draft.py.

Exit code: 0 no problem, 1 problems (each listed), 2 a usage error (bad config, no data). ``--verify``
(verify.py): 0 every file intact, 2 not (one line per bad file on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

import duckdb

from pinads_rec import arguments
from pinads_rec import config as config_lib
from pinads_rec.data.inspect.draft import draft_config
from pinads_rec.data.inspect.report import format_report, report_json
from pinads_rec.data.inspect.scan import scan_dataset
from pinads_rec.data.inspect.verify import verify_bytes
from pinads_rec.data.loader.contract import ContractError


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pinads_rec.data.inspect", description=__doc__.split("\n")[0])
    ap.add_argument("--config", help="experiment config (YAML); its features: section is checked")
    ap.add_argument(
        "--data",
        type=arguments.existing_path,
        help="a directory (searched recursively) or file of Parquet; default data.train_dir",
    )
    ap.add_argument("--json", type=arguments.output_file, help="also write the report as JSON here")
    ap.add_argument(
        "--draft-config",
        type=arguments.output_file,
        help="write a draft config guessed from the data here, then check the data with it",
    )
    ap.add_argument("--memory-limit", help="DuckDB's memory cap, e.g. 2GB (it spills to disk beyond it)")
    ap.add_argument(
        "--verify",
        metavar="PATH",
        help="only check the bytes of a build (or a split, or any Parquet): each file's sha256 against the "
        "manifest, every page's checksum",
    )
    config_lib.add_overrides_flag(ap, "config override, e.g. data.overlong_sequence=error (repeatable)")
    args = ap.parse_args(argv)
    if args.verify:
        if args.config or args.data or args.draft_config or args.json:
            ap.error("--verify takes its path alone (no --config, --data, --draft-config or --json)")
        return _verify(args.verify)
    if not args.config and not args.draft_config:
        ap.error("give --config, or --data with --draft-config")
    if args.draft_config and not args.config and not args.data:
        ap.error("--draft-config needs --data (or --config for its data.train_dir)")
    try:
        cfg = config_lib.load(args.config, args.overrides) if args.config else None
        if args.draft_config:
            text = draft_config(args.data or config_lib.require(cfg, "data.train_dir"))
            Path(args.draft_config).parent.mkdir(parents=True, exist_ok=True)
            with open(args.draft_config, "w") as f:
                f.write(text)
            print(f"wrote a draft config to {args.draft_config}; checking the data with it\n")
            if cfg is None:
                cfg = config_lib.load(args.draft_config, args.overrides)
        data = args.data or config_lib.require(cfg, "data.train_dir")
        report = scan_dataset(cfg.features, cfg.data, data, args.memory_limit)
    except (config_lib.ConfigError, ContractError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except duckdb.Error as e:
        print(f"error: the data cannot be read: {e}", file=sys.stderr)
        return 2
    print(format_report(report, cfg.features), end="")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report_json(report), f, indent=2, default=str)
    return 1 if report.problems else 0


def _verify(path: str) -> int:
    try:
        verdict = verify_bytes(path)
    except ContractError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for line in verdict.problems:
        print(line, file=sys.stderr)
    print(verdict.summary(path))
    return 2 if verdict.problems else 0
