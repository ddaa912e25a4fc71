"""``python -m pinads_rec.reference --config X [--set KEY=VALUE ...] [--run DIR]``: the reference on
the config's data (data.train_dir, data.eval_dir), printed per surface x task; beside a finished
run's evaluation when ``--run`` (default: train.run_dir) holds one."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import List, Optional

from pinads_rec import arguments, config
from pinads_rec.data.loader.contract import ContractError
from pinads_rec.metrics import format_table
from pinads_rec.reference.fit import describe, fit
from pinads_rec.training.run_log import METRICS_FILE, read_run_log


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pinads_rec.reference", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="experiment YAML")
    config.add_overrides_flag(p, "override any config field, e.g. --set reference.max_train_rows=100000")
    p.add_argument("--run", default=None, help="a finished run's directory to compare with (default: train.run_dir)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = config.load(args.config, args.overrides)
        for key in ("data.train_dir", "data.eval_dir"):
            config.require(cfg, key)
        arguments.config_paths(cfg, inputs=("data.train_dir", "data.eval_dir"))
    except config.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    run_dir = args.run or cfg.train.run_dir
    model_rows = None
    if run_dir and (Path(run_dir) / METRICS_FILE).exists():
        finished = read_run_log(run_dir).summary
        model_rows = finished["eval"] if finished else None
    elif args.run:
        print(f"error: --run {args.run}: no {METRICS_FILE} there (not a run directory)", file=sys.stderr)
        return 2
    try:
        reference = fit(cfg).summary
    except ContractError as e:
        print(f"data error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:
        print(f"error: LightGBM is not installed ({e}); install the project's lock (make setup)", file=sys.stderr)
        return 2
    if model_rows is not None:
        print(f"the run in {run_dir} beside the reference:")
        print(format_table(model_rows, reference["eval"]))
        print(describe(reference, model_rows))
    else:
        print(format_table(reference["eval"]))
        print(describe(reference, []))
    return 0
