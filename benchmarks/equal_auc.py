"""The training pipeline against the plain-PyTorch baseline at equal training: AUC and examples/s.

    python benchmarks/equal_auc.py --steps 1000 [--config configs/demo.yaml] [--models full no_sequence]
        [--ranks 2] [--set KEY=VALUE ...] [--out runs/equal_auc]

``benchmarks/train_throughput.py`` compares the two on speed; this asks whether the speed is had at
equal AUC. Per reference model (train_throughput.REFERENCE), both train ``--steps`` steps on the
same data, batches and seed, then evaluate on the config's eval split:

- ``train.py`` itself under torchrun: sharded tables with the fused row-wise Adagrad, dense AdamW with
  warm-up and decay, TrainPipelineSparseDist, request-level broadcasting;
- the plain baseline (train_throughput.measure_plain): the same model unsharded, no broadcasting,
  DDP over every parameter, the same optimizer recipe in ``torch.optim`` (Adagrad on the tables,
  AdamW with the warm-up and decay on the dense layers), a plain loop.

Output: click AUC per surface and examples/s of each, the ratios, and ``equal_auc.json`` under
``--out``.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

# A sibling script: ``python benchmarks/equal_auc.py`` puts benchmarks/ on sys.path.
from train_throughput import REFERENCE, measure_plain

from pinads_rec import config
from pinads_rec.experiments import ablate, harness

REPO = Path(__file__).resolve().parents[1]


def train_py(config_path: str, overrides: List[str], run_dir: Path, ranks: int) -> dict:
    """``train.py`` under torchrun (the ablation runner's launch): its summary (examples/s, eval rows)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    return ablate.train_run(config_path, overrides, run_dir, ranks)


def plain(cfg: config.ExperimentConfig, steps: int, ranks: int, run_dir: Path) -> dict:
    """The plain baseline trained ``steps`` steps and evaluated: examples/s and eval rows."""
    # Timed as train.py times itself: the first step (the loader's start) is trained, not timed.
    per_rank = harness.rank_results(
        functools.partial(measure_plain, evaluate=True),
        ranks,
        run_dir,
        cfg,
        1,
        steps - 1,
        cfg.data.num_workers,
        timeout_s=6 * 3600.0,
    )
    rows = sum(r["valid_rows_per_step"] for r in per_rank) * (steps - 1)
    return {"train_examples_per_s": rows / max(r["wall_s"] for r in per_rank), "eval": per_rank[0]["eval"]}


def first_task_aucs(eval_rows: List[dict]) -> Dict[str, float]:
    """AUC per surface (and "all") of the config's first task (click in the demo config)."""
    task = eval_rows[0]["task"]
    return {r["surface"]: r["auc"] for r in eval_rows if r["task"] == task}


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "demo.yaml"))
    ap.add_argument("--steps", type=int, required=True, help="training steps of each (rows: steps x batch x ranks)")
    ap.add_argument("--models", nargs="+", default=list(REFERENCE), choices=list(REFERENCE))
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default="runs/equal_auc")
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error(f"--steps {args.steps}: at least 2 (the first step of each trainer is not timed)")
    out = Path(args.out)
    try:
        overrides = {m: list(args.set) + REFERENCE[m] + [f"train.max_steps={args.steps}"] for m in args.models}
        cfgs = {m: config.load(args.config, o) for m, o in overrides.items()}
    except config.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2

    results = []
    for name, cfg in cfgs.items():
        print(
            f"{name}: {args.steps} steps x {cfg.data.batch_size} rows x {args.ranks} ranks of {cfg.data.train_dir}, "
            f"evaluated on {cfg.data.eval_dir}",
            flush=True,
        )
        runs = {
            "train.py": train_py(args.config, overrides[name], out / f"{name}-train_py", args.ranks),
            "plain": plain(cfg, args.steps, args.ranks, out / f"{name}-plain"),
        }
        for label, summary in runs.items():
            aucs = first_task_aucs(summary["eval"])
            print(
                f"  {label:<9} AUC ({cfg.features.tasks[0].name}) "
                + "  ".join(f"{s} {a:.4f}" for s, a in aucs.items())
                + f"   {summary['train_examples_per_s']:,.0f} examples/s",
                flush=True,
            )
            results.append(
                {
                    "model": name,
                    "trainer": label,
                    "steps": args.steps,
                    "batch_size": cfg.data.batch_size,
                    "ranks": args.ranks,
                    "examples_per_s": summary["train_examples_per_s"],
                    **{f"auc_{s}": a for s, a in aucs.items()},
                }
            )
        speed = runs["train.py"]["train_examples_per_s"] / runs["plain"]["train_examples_per_s"]
        gap = first_task_aucs(runs["train.py"]["eval"])["all"] - first_task_aucs(runs["plain"]["eval"])["all"]
        print(f"  train.py / plain: {speed:.2f}x examples/s at {gap:+.4f} AUC (all surfaces)", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "equal_auc.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out / 'equal_auc.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
