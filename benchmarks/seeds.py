"""One config trained over several seeds, each run beside the reference fitted in it: the mean and
spread of every surface x task's AUC, the reference's, the margin between them and the oracle's
lift -- what a claim of "ahead" rests on. One run's margin moves with the seed about as much as
with a change of model (two demo runs of one config and seed on two machines differed by 0.018
home-feed AUC), so a verdict is made on the mean over seeds.

    python benchmarks/seeds.py --config configs/demo.yaml [--seeds 0 1 2] [--ranks 2] [--work DIR]
        [--set KEY=VALUE ...] [--out FILE.md]

Each seed is a real training run of ``pinads_rec/train.py`` under torchrun (``harness.launch.train_py``,
gloo on CPU) with ``train.seed`` and ``reference.seed`` set to it (the model's initialization, the
row-group deal and shuffle; the reference's row sample and LightGBM's seed), every other setting
the config's (and ``--set``'s), in ``WORK/seed-<s>``; a finished run of the same config there is
kept (``harness.finished_runs``). Data the config's ``synth`` makes is generated once when missing
(``synth.ensure``).

Per surface x task the table gives the model's AUC (mean and sd over the seeds), the reference's,
the margin (model - reference, per seed; its mean, and its standard error over the seeds, sd /
sqrt(n)), the model's AUC standard error (Hanley & McNeil: the eval sample's own noise, the
``AUC se`` of a run's table; its mean over the seeds) and the oracle lift (mean, lowest seed). The
verdict on each surface's main task (the config's first): "ahead" when the mean margin is over one
AUC se, "behind" when under minus one, else "level", with the margin in AUC se. Written as a text
table, ``WORK/seeds.json`` and, with ``--out``, markdown.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from pinads_rec import arguments, config
from pinads_rec.data import synth
from pinads_rec.experiments import markdown
from pinads_rec.experiments.harness import launch
from pinads_rec.experiments.harness.finished_runs import comparable_config, finished_run, same_config
from pinads_rec.metrics import auc_standard_error, oracle_lift
from pinads_rec.text_table import format_table

REPO = Path(__file__).resolve().parent.parent

Cell = Tuple[str, str]  # (surface, task)


def seed_overrides(overrides: Sequence[str], seed: int, run_dir: Path) -> List[str]:
    return list(overrides) + [f"train.seed={seed}", f"reference.seed={seed}", f"train.run_dir={run_dir}"]


def train_seed(config_path: str, overrides: Sequence[str], seed: int, work: Path, ranks: int) -> dict:
    """The finished run's summary for ``seed``: trained now, or the one already in its directory."""
    run_dir = work / f"seed-{seed}"
    wanted = seed_overrides(overrides, seed, run_dir)
    cfg = config.load(config_path, wanted)
    if finished_run(run_dir) is not None and same_config(run_dir, comparable_config(cfg)):
        print(f"seed {seed}: keeping the finished run {run_dir}", flush=True)
    else:
        print(f"seed {seed}: training into {run_dir}", flush=True)
        launch.train_py(config_path, wanted, ranks, work / f"seed-{seed}.log", echo=print)
    summary = finished_run(run_dir).summary
    if "error" in summary.get("reference", {}) or "eval" not in summary.get("reference", {}):
        raise SystemExit(f"seed {seed}: the run has no reference ({summary.get('reference')}); see {run_dir}")
    return summary


def cells(summaries: Sequence[dict]) -> Dict[Cell, dict]:
    """Per surface x task, the seeds' figures as lists (one entry per seed, in seed order)."""
    out: Dict[Cell, dict] = {}
    for s in summaries:
        ref = {(r["surface"], r["task"]): r for r in s["reference"]["eval"]}
        for r in s["eval"]:
            key = (r["surface"], r["task"])
            c = out.setdefault(key, {k: [] for k in ("auc", "ref_auc", "margin", "se", "lift")})
            c["auc"].append(r["auc"])
            c["ref_auc"].append(ref[key]["auc"])
            c["margin"].append(r["auc"] - ref[key]["auc"])
            se = auc_standard_error(r["auc"], r["positives"], r["examples"] - r["positives"])
            c["se"].append(se if se is not None else float("nan"))
            if r.get("oracle_auc") is not None:
                c["lift"].append(oracle_lift(r))
    return out


def _sd(xs: Sequence[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else float("nan")


def verdict(margin: float, se: float) -> str:
    if margin > se:
        return "ahead"
    return "behind" if margin < -se else "level"


def rows_of(by_cell: Dict[Cell, dict]) -> List[dict]:
    rows = []
    for (surface, task), c in by_cell.items():
        n = len(c["auc"])
        margin, se = statistics.mean(c["margin"]), statistics.mean(c["se"])
        rows.append(
            {
                "surface": surface,
                "task": task,
                "seeds": n,
                "auc": statistics.mean(c["auc"]),
                "auc_sd": _sd(c["auc"]),
                "ref_auc": statistics.mean(c["ref_auc"]),
                "ref_auc_sd": _sd(c["ref_auc"]),
                "margin": margin,
                "margin_se_seeds": _sd(c["margin"]) / math.sqrt(n) if n > 1 else float("nan"),
                "auc_se": se,
                "margin_in_se": margin / se if se else float("nan"),
                "lift": statistics.mean(c["lift"]) if c["lift"] else None,
                "lift_min": min(c["lift"]) if c["lift"] else None,
            }
        )
    return rows


HEADERS = ["surface", "task", "AUC", "sd", "ref AUC", "sd", "vs ref", "±seeds", "AUC se", "in se", "lift", "min"]


def table_rows(rows: Sequence[dict]) -> List[List[str]]:
    def f(x, spec="{:.4f}"):
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else spec.format(x)

    return [
        [
            r["surface"],
            r["task"],
            f(r["auc"]),
            f(r["auc_sd"]),
            f(r["ref_auc"]),
            f(r["ref_auc_sd"]),
            f(r["margin"], "{:+.4f}"),
            f(r["margin_se_seeds"]),
            f(r["auc_se"]),
            f(r["margin_in_se"], "{:+.1f}"),
            f(r["lift"], "{:.3f}"),
            f(r["lift_min"], "{:.3f}"),
        ]
        for r in rows
    ]


def verdicts(rows: Sequence[dict], main_task: str) -> List[str]:
    return [
        f"{r['surface']} {main_task}: {verdict(r['margin'], r['auc_se'])} ({r['margin']:+.4f}, "
        f"{r['margin_in_se']:+.1f} AUC se; over the seeds ±{r['margin_se_seeds']:.4f})"
        for r in rows
        if r["task"] == main_task
    ]


def main(argv: Sequence[str] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(REPO / "configs" / "demo.yaml"), type=arguments.existing_path)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--ranks", type=arguments.positive_int, default=2)
    p.add_argument("--work", default=None, help="run directories (default: runs/seeds/<config name>)")
    p.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE")
    p.add_argument("--out", default=None, help="also write the table as markdown here")
    args = p.parse_args(argv)
    work = Path(args.work or REPO / "runs" / "seeds" / Path(args.config).stem)
    work.mkdir(parents=True, exist_ok=True)
    try:
        cfg = config.load(args.config, args.overrides)
    except config.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if not Path(cfg.data.train_dir).exists():
        synth.ensure(cfg, Path(cfg.data.train_dir).parent, echo=print)
    summaries = [train_seed(args.config, args.overrides, s, work, args.ranks) for s in args.seeds]
    rows = rows_of(cells(summaries))
    main_task = cfg.features.tasks[0].name
    text = format_table(HEADERS, table_rows(rows))
    lines = verdicts(rows, main_task)
    print(f"\n{args.config}, seeds {args.seeds} ({args.ranks} ranks), the reference fitted in each run:\n")
    print(text)
    print("\n" + "\n".join(lines))
    (work / "seeds.json").write_text(json.dumps({"config": args.config, "seeds": args.seeds, "rows": rows}, indent=1))
    if args.out:
        md = markdown.table(HEADERS, table_rows(rows))
        Path(args.out).write_text("\n".join(md) + "\n\n" + "\n".join(f"- {v}" for v in lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
