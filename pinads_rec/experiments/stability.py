"""Resilient Batch Norm fault experiment (sequence-modeling article, "Model Stability"): the same
model trained with every dense feature on plain ``batch_norm`` and on ``resilient_bn``, on data
whose newest day lost a feature, by the real trainer.

    python -m pinads_rec.experiments.stability [--config configs/stability.yaml] [--out docs/stability.md]
        [--nproc 1] [--set key=value ...]

1. Data: ``pinads_rec.data.synth.ensure`` into ``<dir>``, the parent of ``data.train_dir`` (skipped
   when ``<dir>/summary.json`` was written with the same ``synth`` settings). The train files are
   consecutive time ranges: "days".
2. Incremental schedule, as a daily-updated production model: one pass over every day but the
   newest (phase 1) and an evaluation; then the trainer resumes from that checkpoint for one pass
   over the newest day (phase 2: the daily update) and evaluates again. One LR schedule spans both
   phases (``train.max_steps`` = both phases' steps). Each phase is one trainer process:
   ``python -m pinads_rec.train`` (``--nproc 1``) or ``torchrun --standalone --nproc_per_node N
   pinads_rec/train.py``, each variant in its own ``<train.run_dir>/<norm>``.
3. Report: each run's ``metrics.jsonl`` (loss, max |logit| and skipped non-finite batches per
   ``train.log_every`` window; the two evaluations), the dense norms' running statistics from the
   two checkpoints, and what they make of the held-out ``user_activity`` values
   (``stability_report``). Writes ``--out`` (markdown), ``<out dir>/stability/loss_logits.png`` and
   ``<out dir>/stability/metrics.csv``.

``--set`` applies to the generator and both runs (e.g. ``--set synth.train_requests=4000`` for a
smoke run; point ``--out``, ``data.*_dir`` and ``train.run_dir`` elsewhere then). ``--reuse-runs``
keeps a variant whose run finished (to complete an interrupted experiment); ``--report-only``
rewrites the report from the existing runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import pyarrow as pa
import torch
import yaml

from pinads_rec import arguments, config
from pinads_rec.data import synth
from pinads_rec.data.loader.reader import open_parquet
from pinads_rec.experiments import stability_report as report
from pinads_rec.experiments.harness import finished_runs, launch
from pinads_rec.experiments.stability_report import LABEL, NORMS
from pinads_rec.training.run_log import read_run_log

REPO = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------------------------
# Data and runs.
# --------------------------------------------------------------------------------------------


def ensure_data(cfg: config.ExperimentConfig) -> Path:
    root = Path(cfg.data.train_dir).parent
    if Path(cfg.data.train_dir) != root / "train" or Path(cfg.data.eval_dir) != root / "eval":
        raise config.ConfigError(
            f"data.train_dir / data.eval_dir must be <dir>/train and <dir>/eval (the generator's "
            f"layout), got {cfg.data.train_dir} and {cfg.data.eval_dir}"
        )
    synth.ensure(cfg, root, echo=print)
    return root


def split_days(root: Path) -> Dict[str, object]:
    """Phase directories of symlinks: every train file but the newest, and the newest."""
    files = json.loads((root / "summary.json").read_text())["splits"]["train"]["files"]
    files = sorted(files, key=lambda f: f["path"])
    if len(files) < 2:
        raise SystemExit("the experiment needs synth.num_files >= 2 (older days, then the newest day)")
    phases = {"before": files[:-1], "newest": files[-1:]}
    for name, part in phases.items():
        d = root / "phases" / name
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        for f in part:
            src = root / "train" / Path(f["path"]).name
            (d / src.name).symlink_to(os.path.relpath(src, d))
    return {
        "dirs": {n: root / "phases" / n for n in phases},
        "rows": {n: sum(f["rows"] for f in p) for n, p in phases.items()},
        "days": len(files),
    }


def dense_override(cfg: config.ExperimentConfig, norm: str) -> str:
    dense = [dict(dataclasses.asdict(f), norm=norm) for f in cfg.features.dense]
    return "features.dense=" + yaml.safe_dump(dense, default_flow_style=True, width=1 << 20).strip()


def train_variant(
    norm: str, cfg: config.ExperimentConfig, config_path: str, overrides: List[str], days: Dict[str, object], nproc: int
) -> Path:
    run_dir = Path(cfg.train.run_dir) / norm
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    per_step = cfg.data.batch_size * nproc
    max_steps = sum(rows // per_step for rows in days["rows"].values())
    common = overrides + [dense_override(cfg, norm), f"train.run_dir={run_dir}", f"train.max_steps={max_steps}"]
    print(f"{LABEL[norm]}:", flush=True)
    for phase, epochs in (("before", 1), ("newest", 2)):  # the resumed run's epoch 1 is the newest day
        try:
            seconds = launch.train_py(
                config_path,
                common + [f"data.train_dir={days['dirs'][phase]}", f"train.epochs={epochs}"],
                nproc,
                run_dir / f"{phase}.log",
                echo=lambda line: print(line, flush=True),
            )["seconds"]
        except launch.TrainFailed as e:
            raise SystemExit(str(e)) from None
        print(f"  {phase}: {seconds:.0f} s", flush=True)
    return run_dir


# --------------------------------------------------------------------------------------------
# Reading the results.
# --------------------------------------------------------------------------------------------


def read_metrics(run_dir: Path) -> Dict[str, object]:
    """The run's step records, its two evaluation lines (one per phase) and the last step of phase 1."""
    log = read_run_log(run_dir)
    summaries = log.summaries  # NOT IN THE CONTRACT YET: every evaluation line, oldest first
    if len(summaries) != 2:
        raise SystemExit(f"{run_dir}/metrics.jsonl: expected 2 evaluation lines (one per phase), got {len(summaries)}")
    return {"steps": log.steps, "summaries": summaries, "boundary": summaries[0]["step"]}


def completed(run_dir: Path) -> bool:
    """Whether the run finished both phases (two evaluations logged: ``harness.finished_runs``)."""
    log = finished_runs.finished_run(run_dir)
    return log is not None and len(log.summaries) == 2


def checkpoint_state(ckpt: Path) -> Dict[str, torch.Tensor]:
    """The dense-norm tensors of a torch.distributed.checkpoint directory (read offline)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(ckpt), f"{tmp}/state.pt")
        state = torch.load(f"{tmp}/state.pt", weights_only=False)
    flat: Dict[str, torch.Tensor] = {}

    def walk(prefix: str, node) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(node, torch.Tensor) and ".dense_norm." in f".{prefix}":
            flat[prefix.split("dense_norm.", 1)[1]] = node

    walk("", state)
    return flat


def norm_stats(run_dir: Path, steps: List[int], feature: str, norm: str) -> List[Dict[str, float]]:
    key = f"{'batch_norms' if norm == 'batch_norm' else 'resilient_bns'}.{feature}"
    out = []
    for step in steps:
        s = checkpoint_state(run_dir / "checkpoints" / f"step-{step}")
        rec = {k: s[f"{key}.{k}"].double() for k in ("running_mean", "running_var", "weight", "bias")}
        rec["num_masked"] = int(s[f"{key}.num_masked"].sum()) if f"{key}.num_masked" in s else None
        out.append(rec)
    return out


def held_out_values(cfg: config.ExperimentConfig, root: Path, feature: str) -> np.ndarray:
    """The feature's values in the eval split (one dense column)."""
    column = next(d.column for d in cfg.features.dense if d.name == feature)
    files = sorted((root / "eval").glob("*.parquet"))
    values = [open_parquet(str(f)).read(columns=[column]).column(0).combine_chunks() for f in files]
    # Per-request files hold a list of the candidates' values per request.
    values = [v.flatten() if pa.types.is_list(v.type) else v for v in values]
    return np.concatenate([v.to_numpy(zero_copy_only=False) for v in values])


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/stability.yaml")
    p.add_argument("--out", default="docs/stability.md", type=arguments.output_file)
    p.add_argument(
        "--nproc", type=arguments.positive_int, default=1, help="trainer processes per run (torchrun when > 1)"
    )
    config.add_overrides_flag(p, help="config override for the generator and both runs (repeatable)")
    p.add_argument(
        "--reuse-runs",
        action="store_true",
        help="keep a variant's completed run (both evaluations logged) instead of retraining it, "
        "e.g. to finish an interrupted experiment",
    )
    p.add_argument("--report-only", action="store_true", help="rewrite the report from the existing runs")
    args = p.parse_args(argv)
    started = time.perf_counter()
    try:
        cfg = config.load(args.config, args.overrides)
        root = ensure_data(cfg)
    except config.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    faults = cfg.synth.faults
    days = split_days(root)

    run_dirs = {}
    for norm in NORMS:
        run_dir = Path(cfg.train.run_dir) / norm
        if args.report_only or (args.reuse_runs and completed(run_dir)):
            print(f"{LABEL[norm]}: reusing {run_dir}")
            run_dirs[norm] = run_dir
        else:
            run_dirs[norm] = train_variant(norm, cfg, args.config, args.overrides, days, args.nproc)
    metrics = {norm: read_metrics(d) for norm, d in run_dirs.items()}

    feature = faults.zero_fill_column or cfg.features.dense[0].name
    outcome = report.Outcome(
        cfg=cfg,
        config_path=args.config,
        nproc=args.nproc,
        overrides=args.overrides,
        days=days,
        metrics=metrics,
        norms={
            norm: norm_stats(run_dirs[norm], [m["boundary"], m["summaries"][1]["step"]], feature, norm)
            for norm, m in metrics.items()
        },
        eval_values=held_out_values(cfg, root, feature),
        feature=feature,
        out=Path(args.out),
    )
    newest_label = f"day {days['days']}" + (f": {faults.zero_fill_column} = 0" if faults.zero_fill_column else "")
    written = report.write(outcome, newest_label)
    print(f"wrote {', '.join(str(w) for w in written)} ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
