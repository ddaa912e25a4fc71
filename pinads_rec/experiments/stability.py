"""Resilient Batch Norm fault experiment (sequence-modeling article, "Model Stability"): the same
model trained with every dense feature on plain ``batch_norm`` and on ``resilient_bn``, on data
whose newest day lost a feature, by the real trainer.

    python -m pinads_rec.experiments.stability [--config configs/stability.yaml] [--out docs/stability.md]
        [--nproc 1] [--set key=value ...]

1. Data: ``python -m pinads_rec.data.synth --config <config> --out <dir>`` (``dir``: the parent of
   ``data.train_dir``), skipped when ``<dir>/summary.json`` was written with the same ``synth``
   settings. The train files are consecutive time ranges: "days".
2. Incremental schedule, as a daily-updated production model: one pass over every day but the
   newest (phase 1) and an evaluation; then the trainer resumes from that checkpoint for one pass
   over the newest day (phase 2: the daily update) and evaluates again. One LR schedule spans both
   phases (``train.max_steps`` = both phases' steps). Each phase is one trainer process:
   ``python -m pinads_rec.train`` (``--nproc 1``) or ``torchrun --standalone --nproc_per_node N
   pinads_rec/train.py``, each variant in its own ``<train.run_dir>/<norm>``.
3. Report: each run's ``metrics.jsonl`` (loss, max |logit| and skipped non-finite batches per
   ``train.log_every`` window; the two evaluations), the dense norms' running statistics from the
   two checkpoints, and what they make of the held-out ``user_activity`` values. Writes ``--out``
   (markdown), ``<out dir>/stability/loss_logits.png`` and ``<out dir>/stability/metrics.csv``.

``--set`` applies to the generator and both runs (e.g. ``--set synth.train_requests=4000`` for a
smoke run; point ``--out``, ``data.*_dir`` and ``train.run_dir`` elsewhere then). ``--reuse-runs``
keeps a variant whose run finished (to complete an interrupted experiment); ``--report-only``
rewrites the report from the existing runs.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import pyarrow.parquet as pq
import torch
import yaml

from pinads_rec import config

REPO = Path(__file__).resolve().parents[2]
NORMS = ("batch_norm", "resilient_bn")
LABEL = {"batch_norm": "BatchNorm1d", "resilient_bn": "Resilient BN"}
COLOR = {"batch_norm": "tab:red", "resilient_bn": "tab:blue"}
SPIKE_RATIO = 1.5  # a logged window whose loss exceeds 1.5x the median of the previous 10


# --------------------------------------------------------------------------------------------
# Data and runs.
# --------------------------------------------------------------------------------------------


def ensure_data(cfg: config.ExperimentConfig, config_path: str, overrides: List[str]) -> Path:
    root = Path(cfg.data.train_dir).parent
    if Path(cfg.data.train_dir) != root / "train" or Path(cfg.data.eval_dir) != root / "eval":
        raise SystemExit(
            f"data.train_dir / data.eval_dir must be <dir>/train and <dir>/eval (the generator's "
            f"layout), got {cfg.data.train_dir} and {cfg.data.eval_dir}"
        )
    summary = root / "summary.json"
    wanted = json.loads(json.dumps(config.to_dict(cfg)["synth"]))
    if summary.exists() and json.loads(summary.read_text()).get("synth") == wanted:
        print(f"data: reusing {root} (same synth settings)")
        return root
    shutil.rmtree(root, ignore_errors=True)
    cmd = [sys.executable, "-m", "pinads_rec.data.synth", "--config", config_path, "--out", str(root)]
    for o in overrides:
        cmd += ["--set", o]
    print("data:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO)
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


def run_phase(cmd_prefix: List[str], config_path: str, sets: List[str], log: Path) -> float:
    cmd = cmd_prefix + ["--config", config_path]
    for s in sets:
        cmd += ["--set", s]
    print("  $", " ".join(c if len(c) < 120 else c[:117] + "..." for c in cmd), flush=True)
    started = time.perf_counter()
    with log.open("w") as out:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO).returncode
    if rc != 0:
        tail = log.read_text().strip().splitlines()[-15:]
        raise SystemExit(f"training failed (exit {rc}); last lines of {log}:\n" + "\n".join(tail))
    return time.perf_counter() - started


def train_variant(
    norm: str, cfg: config.ExperimentConfig, config_path: str, overrides: List[str], days: Dict[str, object], nproc: int
) -> Path:
    run_dir = Path(cfg.train.run_dir) / norm
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    per_step = cfg.data.batch_size * nproc
    max_steps = sum(rows // per_step for rows in days["rows"].values())
    if nproc == 1:
        prefix = [sys.executable, "-m", "pinads_rec.train"]
    else:
        prefix = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(nproc),
            "pinads_rec/train.py",
        ]
    common = overrides + [dense_override(cfg, norm), f"train.run_dir={run_dir}", f"train.max_steps={max_steps}"]
    print(f"{LABEL[norm]}:", flush=True)
    for phase, epochs in (("before", 1), ("newest", 2)):  # the resumed run's epoch 1 is the newest day
        seconds = run_phase(
            prefix,
            config_path,
            common + [f"data.train_dir={days['dirs'][phase]}", f"train.epochs={epochs}"],
            run_dir / f"{phase}.log",
        )
        print(f"  {phase}: {seconds:.0f} s", flush=True)
    return run_dir


# --------------------------------------------------------------------------------------------
# Reading the results.
# --------------------------------------------------------------------------------------------


def read_metrics(run_dir: Path) -> Dict[str, object]:
    steps, summaries = [], []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        (summaries if "eval" in rec else steps).append(rec)
    if len(summaries) != 2:
        raise SystemExit(f"{run_dir}/metrics.jsonl: expected 2 evaluation lines (one per phase), got {len(summaries)}")
    return {"steps": steps, "summaries": summaries, "boundary": summaries[0]["step"]}


def completed(run_dir: Path) -> bool:
    log = run_dir / "metrics.jsonl"
    return log.exists() and sum('"eval"' in line for line in log.read_text().splitlines()) == 2


def loss_spikes(losses: List[float], skip: int = 5) -> List[int]:
    out = []
    for i in range(max(skip, 10), len(losses)):
        base = statistics.median(losses[i - 10 : i])
        if math.isfinite(losses[i]) and losses[i] > SPIKE_RATIO * base:
            out.append(i)
    return out


def phase_stats(m: Dict[str, object]) -> Dict[str, Dict[str, float]]:
    steps, boundary = m["steps"], m["boundary"]
    losses = [r["loss"] for r in steps]
    spikes = set(loss_spikes(losses))
    out = {}
    for phase, keep in (("before", lambda s: s <= boundary), ("newest", lambda s: s > boundary)):
        idx = [i for i, r in enumerate(steps) if keep(r["step"])]
        rows = [steps[i] for i in idx]
        logits = [r.get("logit_abs_max", float("nan")) for r in rows]
        out[phase] = {
            "steps": boundary if phase == "before" else m["summaries"][1]["step"] - boundary,
            "loss_first": rows[0]["loss"] if rows else float("nan"),
            "loss_last": statistics.mean(r["loss"] for r in rows[-5:]) if rows else float("nan"),
            "loss_max": max((r["loss"] for r in rows), default=float("nan")),
            "spikes": sum(1 for i in idx if i in spikes),
            "logit_max": max(logits, default=float("nan")),
            "logit_median": statistics.median(logits) if logits else float("nan"),
            "skipped": rows[-1].get("nonfinite_skipped", 0) if rows else 0,
        }
    return out


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


def eval_normalized(stats: Dict[str, torch.Tensor], values: np.ndarray, eps: float) -> Dict[str, float]:
    """What the dense arch receives in eval for a one-column feature: gamma (x - mean)/sqrt(var+eps) + beta."""
    x = torch.from_numpy(values.astype(np.float64))
    y = (x - stats["running_mean"][0]) / torch.sqrt(stats["running_var"][0] + eps)
    y = y * stats["weight"][0] + stats["bias"][0]
    return {"median_abs": float(y.abs().median()), "max_abs": float(y.abs().max())}


def eval_rows(summary: dict, surface: str = "all") -> Dict[str, dict]:
    return {r["task"]: r for r in summary["eval"] if r["surface"] == surface}


# --------------------------------------------------------------------------------------------
# Outputs.
# --------------------------------------------------------------------------------------------


def plot(metrics: Dict[str, dict], path: Path, newest_label: str, task: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(9, 8.5), sharex=True, gridspec_kw={"height_ratios": [3, 3, 2]})
    for norm, m in metrics.items():
        steps = [r["step"] for r in m["steps"]]
        ax1.plot(steps, [r["loss"] for r in m["steps"]], color=COLOR[norm], label=LABEL[norm], lw=1.2)
        ax2.plot(steps, [r.get("logit_abs_max", float("nan")) for r in m["steps"]], color=COLOR[norm], lw=1.2)
        ev = [(sm["step"], eval_rows(sm)[task]["ne"]) for sm in m["summaries"]]
        ax3.plot(*zip(*ev), color=COLOR[norm], marker="o", lw=1.2)
        for x, ne in ev:
            ax3.annotate(
                f"{ne:.3g}",
                (x, ne),
                textcoords="offset points",
                ha="right",
                xytext=(-8, 6 if norm == "batch_norm" else -12),
                fontsize=8,
                color=COLOR[norm],
            )
    boundary = next(iter(metrics.values()))["boundary"]
    for ax in (ax1, ax2, ax3):
        ax.axvline(boundary, color="gray", ls="--", lw=1)
        ax.grid(alpha=0.3)
        ax.set_yscale("log")
    ax1.text(boundary, ax1.get_ylim()[1], f"  {newest_label}", va="top", fontsize=8, color="gray")
    ax1.set_ylabel("train loss\n(mean per window)")
    ax2.set_ylabel("train max |logit|\nper window")
    ax3.set_ylabel(f"held-out {task} NE\n(after each phase)")
    ax3.set_xlabel("step")
    ax1.legend()
    ax1.set_title("Training on faulted data: plain BatchNorm1d vs Resilient Batch Norm")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_csv(metrics: Dict[str, dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["norm", "step", "phase", "loss", "logit_abs_max", "nonfinite_skipped"])
        for norm, m in metrics.items():
            for r in m["steps"]:
                w.writerow(
                    [
                        norm,
                        r["step"],
                        "before" if r["step"] <= m["boundary"] else "newest",
                        f"{r['loss']:.6g}",
                        f"{r.get('logit_abs_max', float('nan')):.6g}",
                        r.get("nonfinite_skipped", ""),
                    ]
                )


def code_version() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "outside git"
    return f"commit {head}" + (" with uncommitted changes" if dirty else "")


def fmt(x: float, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a" if x is None or math.isnan(x) else ("inf" if x > 0 else "-inf")
    if abs(x) >= 1e4 or (x != 0 and abs(x) < 10 ** -(digits - 1)):
        return f"{x:.2e}"
    return f"{x:.{digits}g}" if abs(x) >= 1000 else f"{x:.{digits}f}"


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/stability.yaml")
    p.add_argument("--out", default="docs/stability.md")
    p.add_argument("--nproc", type=int, default=1, help="trainer processes per run (torchrun when > 1)")
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
    cfg = config.load(args.config, args.overrides)
    faults = cfg.synth.faults
    root = ensure_data(cfg, args.config, args.overrides)
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

    out = Path(args.out)
    asset_dir = out.parent / "stability"
    n_days = days["days"]
    newest_label = f"day {n_days}" + (f": {faults.zero_fill_column} = 0" if faults.zero_fill_column else "")
    plot(metrics, asset_dir / "loss_logits.png", newest_label, cfg.features.tasks[0].name)
    write_csv(metrics, asset_dir / "metrics.csv")

    stats = {norm: phase_stats(m) for norm, m in metrics.items()}
    feature = faults.zero_fill_column or cfg.features.dense[0].name
    eps = cfg.model.resilient_bn.eps
    eval_values = np.concatenate(
        [
            pq.read_table(f, columns=[next(d.column for d in cfg.features.dense if d.name == feature)])
            .column(0)
            .to_numpy()
            for f in sorted((root / "eval").glob("*.parquet"))
        ]
    )
    norms = {
        norm: norm_stats(run_dirs[norm], [m["boundary"], m["summaries"][1]["step"]], feature, norm)
        for norm, m in metrics.items()
    }
    report = render(cfg, args, days, metrics, stats, norms, eval_values, feature, eps, asset_dir, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)
    print(f"wrote {out}, {asset_dir}/loss_logits.png, {asset_dir}/metrics.csv ({time.perf_counter() - started:.0f} s)")
    return 0


def render(cfg, args, days, metrics, stats, norms, eval_values, feature, eps, asset_dir, out) -> str:
    f = cfg.synth.faults
    n = days["days"]
    before = f"days 1-{n - 1}" if n > 2 else "day 1"
    newest = f"day {n}"
    tasks = [t.name for t in cfg.features.tasks]
    bn, rbn = "batch_norm", "resilient_bn"
    rel = lambda p: os.path.relpath(p, out.parent)  # noqa: E731
    L: List[str] = []
    add = L.append
    add("# Model stability: Resilient Batch Norm under a feature outage\n")
    add(
        "Generated by `python -m pinads_rec.experiments.stability"
        + (f" --config {args.config}" if args.config != "configs/stability.yaml" else "")
        + (f" --nproc {args.nproc}" if args.nproc != 1 else "")
        + "".join(f" --set {o}" for o in args.overrides)
        + "` "
        f"(config [`{args.config}`]({rel(args.config)}); code {code_version()}). The module is "
        "`pinads_rec/modules/resilient_bn.py`; a dense feature uses it with `norm: resilient_bn`.\n"
    )

    add("## What breaks plain batch norm, exactly\n")
    add(
        "`nn.BatchNorm1d` normalizes a **training** batch with that batch's own mean and variance. A "
        "column that is all zeros (an absent feature filled with its default) gives (0 - 0)/sqrt(0 + eps) "
        "= 0: nothing explodes in training. Nor can a training batch produce a value beyond "
        "sqrt(B - 1) standard deviations (22.6 at B = 512), whatever its variance: the largest "
        "training-mode output comes from a low-coverage batch (almost all rows at the default, a few "
        "real values).\n"
    )
    add(
        "The explosion happens **after** the outage, with the running statistics. Every training batch "
        "of the outage pulls the running mean and variance towards the batch's (0, 0) with BatchNorm's "
        "momentum: after k such batches the running variance is 0.9^k of what it was, so a day of them "
        "takes it to about 0. The model is then evaluated or served -- BatchNorm switches to its running "
        "statistics -- on data where the feature is back: a value x becomes (x - ~0)/sqrt(~0 + eps), "
        "x times ~316 (eps = 1e-5), and the dense arch, which never saw such inputs, turns them into "
        "extreme logits. Stale (near-constant) stretches collapse the running variance the same way; "
        "a low-coverage shift adds the sqrt(B - 1) training outliers.\n"
    )
    add(
        "Resilient Batch Norm normalizes with the running statistics in training too, and leaves a "
        "column out of their update when its batch variance is at most `minimal_variance` or differs "
        "from the running variance by more than `variance_shift_threshold` either way, so the outage "
        "leaves them as they were.\n"
    )

    add("## The experiment\n")
    add(
        f"- **Data**: planted-truth synthetic data (`synth` in the config): {cfg.synth.train_requests:,} train "
        f'requests in {n} files, each a consecutive time range ("day"), then {cfg.synth.eval_requests:,} '
        f"held-out requests later in time. Rows: {before} {days['rows']['before']:,}, {newest} "
        f"{days['rows']['newest']:,}."
    )
    if f.zero_fill_column:
        a, b = f.zero_fill_window
        add(
            f"- **Fault**: `synth.faults.zero_fill_column: {f.zero_fill_column}`, window [{a}, {b}) of the "
            f"time span = exactly {newest}: every {newest} row has `{f.zero_fill_column} = 0.0` (an upstream "
            f"feature job failed and the default was filled in). The held-out data has the feature again. "
            f"Labels are untouched."
        )
    if f.shift_column:
        add(f"- **Shift**: `{f.shift_column}` x {f.shift_scale} + {f.shift_offset} from time {f.shift_after}.")
    if f.stale_fraction:
        add(f"- **Stale rows**: {f.stale_fraction:.0%} of rows copy their dense values from an earlier row.")
    add(
        f"- **Schedule** (a daily-updated model): one pass over {before}, evaluation; the trainer then resumes "
        f"from that checkpoint for one pass over {newest} (the daily update) and evaluates again. One LR "
        f"schedule spans both. Both runs use the same seed, data order, model and optimizer; only "
        f"`features.dense[*].norm` differs (`batch_norm` vs `resilient_bn`, momentum "
        f"{cfg.model.resilient_bn.momentum}, eps {eps} for both; `minimal_variance` "
        f"{cfg.model.resilient_bn.minimal_variance}, `variance_shift_threshold` "
        f"{cfg.model.resilient_bn.variance_shift_threshold}). `train.nonfinite: {cfg.train.nonfinite}`."
    )
    add(
        f"- The dense features are fed raw to the batch norms (no log / min-max first), so that they "
        f"are what is normalized. {args.nproc} trainer process(es) per run, batch {cfg.data.batch_size}. "
        f"Training time (both phases, evaluation excluded): "
        + ", ".join(f"{LABEL[n]} {sum(x['train_seconds'] for x in metrics[n]['summaries']):.0f} s" for n in (bn, rbn))
        + " ("
        + "; ".join(
            f"{LABEL[n]} " + " / ".join(f"{x['train_examples_per_s']:,.0f}" for x in metrics[n]["summaries"])
            for n in (bn, rbn)
        )
        + " examples/s in the two phases: the CPU was shared with other jobs).\n"
    )

    add("## Results\n")
    add(f"![loss and max |logit| per step]({rel(asset_dir / 'loss_logits.png')})\n")
    add(
        f"Per {cfg.train.log_every}-step window (`metrics.jsonl`; all points in "
        f"[`{rel(asset_dir / 'metrics.csv')}`]({rel(asset_dir / 'metrics.csv')})). A spike is a window "
        f"whose loss exceeds {SPIKE_RATIO}x the median of the 10 before it.\n"
    )
    add(
        "| run | phase | steps | loss (last 5 windows) | max loss | loss spikes | max \\|logit\\| | median "
        "window max \\|logit\\| | non-finite skipped |"
    )
    add("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for norm in (bn, rbn):
        for phase, name in (("before", before), ("newest", newest)):
            s = stats[norm][phase]
            add(
                f"| {LABEL[norm]} | {name} | {s['steps']} | {fmt(s['loss_last'])} | {fmt(s['loss_max'])} | "
                f"{s['spikes']} | {fmt(s['logit_max'], 3)} | {fmt(s['logit_median'], 3)} | {s['skipped']} |"
            )
    add("")

    add("**Held-out evaluation** (all surfaces; after each phase; oracle = the true probabilities):\n")
    add("| run | after | task | AUC | NE | log loss | calibration | oracle AUC | oracle NE |")
    add("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for norm in (bn, rbn):
        for i, name in enumerate((before, newest)):
            rows = eval_rows(metrics[norm]["summaries"][i])
            for t in tasks:
                r = rows[t]
                add(
                    f"| {LABEL[norm]} | {name} | {t} | {fmt(r['auc'])} | {fmt(r['ne'])} | {fmt(r['log_loss'])} | "
                    f"{fmt(r['calibration'], 3)} | {fmt(r.get('oracle_auc'))} | {fmt(r.get('oracle_ne'))} |"
                )
    add("")
    add("Per surface (click):\n")
    add("| run | after | surface | AUC | NE | calibration |")
    add("|---|---|---|---:|---:|---:|")
    for norm in (bn, rbn):
        for i, name in enumerate((before, newest)):
            for surface in cfg.features.surfaces:
                r = eval_rows(metrics[norm]["summaries"][i], surface)[tasks[0]]
                add(
                    f"| {LABEL[norm]} | {name} | {surface} | {fmt(r['auc'])} | {fmt(r['ne'])} | "
                    f"{fmt(r['calibration'], 3)} |"
                )
    add("")

    add(
        f"**`{feature}`'s running statistics** (read from each phase's checkpoint) and what they make of "
        f"the held-out `{feature}` values in eval (gamma (x - mean)/sqrt(var + eps) + beta; held-out "
        f"values: median {np.median(eval_values):.2f}, max {eval_values.max():.1f}):\n"
    )
    add(
        "| run | after | running mean | running var | batches left out | median \\|normalized\\| "
        "| max \\|normalized\\| |"
    )
    add("|---|---|---:|---:|---:|---:|---:|")
    for norm in (bn, rbn):
        for i, name in enumerate((before, newest)):
            s = norms[norm][i]
            y = eval_normalized(s, eval_values, eps)
            masked = "-" if s["num_masked"] is None else str(s["num_masked"])
            add(
                f"| {LABEL[norm]} | {name} | {fmt(float(s['running_mean'][0]))} | "
                f"{fmt(float(s['running_var'][0]))} | {masked} | {fmt(y['median_abs'], 3)} | {fmt(y['max_abs'], 3)} |"
            )
    add("")
    L += findings(cfg, days, metrics, stats, norms, eval_values, feature, eps, before, newest)
    return "\n".join(L) + "\n"


def findings(cfg, days, metrics, stats, norms, eval_values, feature, eps, before, newest) -> List[str]:
    """The conclusions, worded from the numbers of this run."""
    bn, rbn = "batch_norm", "resilient_bn"
    task = cfg.features.tasks[0].name
    ev = {n: [eval_rows(metrics[n]["summaries"][i])[task] for i in (0, 1)] for n in (bn, rbn)}
    y = {n: [eval_normalized(norms[n][i], eval_values, eps) for i in (0, 1)] for n in (bn, rbn)}
    s = stats
    newest_steps = s[bn]["newest"]["steps"]
    r0 = norms[rbn][0]
    outage_input = float(
        (0.0 - r0["running_mean"][0]) / torch.sqrt(r0["running_var"][0] + eps) * r0["weight"][0] + r0["bias"][0]
    )
    out = ["## Findings\n"]
    out.append(
        f"- **Training did not blow up, in either run.** Over {newest} (the outage) the max \\|logit\\| per "
        f"window peaked at {fmt(s[bn]['newest']['logit_max'], 3)} with BatchNorm1d and "
        f"{fmt(s[rbn]['newest']['logit_max'], 3)} with Resilient BN (over {before}: "
        f"{fmt(s[bn]['before']['logit_max'], 3)} and {fmt(s[rbn]['before']['logit_max'], 3)}); loss spikes over "
        f"{newest}: {s[bn]['newest']['spikes']} and "
        f"{s[rbn]['newest']['spikes']}; non-finite batches skipped: {s[bn]['newest']['skipped']} and "
        f"{s[rbn]['newest']['skipped']}. In training BatchNorm1d normalizes the zero column with the "
        f"batch's own statistics to exactly 0 (its bias beta); Resilient BN normalizes it with the "
        f"pre-outage statistics to a constant {outage_input:.2f}. Either way the column carries no "
        f"information for a day, and nothing explodes."
    )
    out.append(
        f"- **Evaluation after the update did blow up with BatchNorm1d** (the plot's last panel). Held-out {task} AUC "
        f"{fmt(ev[bn][0]['auc'])} -> {fmt(ev[bn][1]['auc'])}, NE {fmt(ev[bn][0]['ne'])} -> "
        f"{fmt(ev[bn][1]['ne'])}, calibration {fmt(ev[bn][0]['calibration'], 3)} -> "
        f"{fmt(ev[bn][1]['calibration'], 3)}. Resilient BN: AUC {fmt(ev[rbn][0]['auc'])} -> "
        f"{fmt(ev[rbn][1]['auc'])}, NE {fmt(ev[rbn][0]['ne'])} -> {fmt(ev[rbn][1]['ne'])}, calibration "
        f"{fmt(ev[rbn][0]['calibration'], 3)} -> {fmt(ev[rbn][1]['calibration'], 3)}."
        if ev[bn][1]["ne"] > 1.5 * ev[rbn][1]["ne"]
        else f"- **Evaluation after the update**: held-out {task} NE {fmt(ev[bn][1]['ne'])} with BatchNorm1d, "
        f"{fmt(ev[rbn][1]['ne'])} with Resilient BN (AUC {fmt(ev[bn][1]['auc'])} vs {fmt(ev[rbn][1]['auc'])}); "
        f"before the update {fmt(ev[bn][0]['ne'])} vs {fmt(ev[rbn][0]['ne'])}: no blow-up at this size."
    )
    out.append(
        f"- **Cause, measured**: the {newest_steps} zero-variance batches of {newest} took BatchNorm1d's "
        f"running variance of `{feature}` from {fmt(float(norms[bn][0]['running_var'][0]))} to "
        f"{fmt(float(norms[bn][1]['running_var'][0]))} (0.9^{newest_steps} = {0.9**newest_steps:.1e}) and its "
        f"running mean from {fmt(float(norms[bn][0]['running_mean'][0]))} to "
        f"{fmt(float(norms[bn][1]['running_mean'][0]))}. In eval, the returning values are divided by "
        f"sqrt({fmt(float(norms[bn][1]['running_var'][0]))} + eps): median \\|normalized\\| "
        f"{fmt(y[bn][1]['median_abs'], 3)}, max {fmt(y[bn][1]['max_abs'], 3)}, against "
        f"{fmt(y[bn][0]['median_abs'], 3)} / {fmt(y[bn][0]['max_abs'], 3)} before the outage. Resilient BN "
        f"left `{feature}` out of {norms[rbn][1]['num_masked'] - (norms[rbn][0]['num_masked'] or 0)} of its "
        f"{s[rbn]['newest']['steps']} {newest} batches (batch variance 0 <= minimal_variance) and kept its statistics "
        f"({fmt(float(norms[rbn][1]['running_mean'][0]))}, {fmt(float(norms[rbn][1]['running_var'][0]))}): "
        f"median \\|normalized\\| {fmt(y[rbn][1]['median_abs'], 3)}, max {fmt(y[rbn][1]['max_abs'], 3)}."
    )
    out.append(
        "- **When plain batch norm survives**: the collapse needs the outage's batches to be the last "
        "ones before the checkpoint that is evaluated or served. After k healthy batches the collapsed "
        "state weighs 0.9^k (10% after 22 batches), so an outage in the middle of a run, or one whose "
        "row groups the loader shuffles among healthy ones, heals before the end. Time-ordered "
        "incremental updates -- the production pattern this experiment follows -- are exactly the case "
        "where it does not."
    )
    out.append(
        "- **Limits of Resilient Batch Norm** (as the article defines it): the variance-ratio check freezes "
        "a column whose variance changes for good by more than `variance_shift_threshold` (it keeps "
        "normalizing with the old statistics; `tests/test_resilient_bn.py::test_variance_shift_mask_fires_both_ways`); "
        "a shift of the mean alone is followed like BatchNorm's; and under data parallelism each rank "
        "keeps its own running statistics, like `nn.BatchNorm1d` under DDP."
    )
    out.append("")
    return out


if __name__ == "__main__":
    sys.exit(main())
