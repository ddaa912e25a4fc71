"""The stability experiment's outputs: the markdown report (docs/stability.md), the loss / max |logit|
/ NE plot and the per-window CSV, from what the two runs left (``Outcome``).

The report is a list of sections, each a small function of the outcome returning its lines:
``header``, ``why_batch_norm_breaks`` (fixed text), ``the_experiment``, ``results`` (its tables one
function each) and ``findings`` (worded from this run's numbers).
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
import statistics
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import torch

from pinads_rec import config
from pinads_rec.experiments.harness.provenance import code_version
from pinads_rec.experiments.markdown import table

REPO = Path(__file__).resolve().parents[2]
BN, RBN = "batch_norm", "resilient_bn"
NORMS = (BN, RBN)
LABEL = {BN: "BatchNorm1d", RBN: "Resilient BN"}
COLOR = {BN: "tab:red", RBN: "tab:blue"}
SPIKE_RATIO = 1.5  # a logged window whose loss exceeds 1.5x the median of the previous 10


@dataclasses.dataclass
class Outcome:
    """What the experiment produced. ``metrics[norm]``: {"steps": the run's step records, "summaries":
    its two evaluation lines, "boundary": the last step of phase 1}; ``norms[norm]``: the feature's
    dense-norm tensors after each phase (running_mean, running_var, weight, bias; num_masked or None);
    ``days``: stability.split_days' {"rows": per phase, "days": train files}; ``eval_values``: the
    feature's held-out values."""

    cfg: config.ExperimentConfig
    config_path: str
    nproc: int
    overrides: List[str]
    days: Dict[str, object]
    metrics: Dict[str, dict]
    norms: Dict[str, List[Dict[str, torch.Tensor]]]
    eval_values: np.ndarray
    feature: str
    out: Path

    @property
    def asset_dir(self) -> Path:
        return self.out.parent / "stability"

    @property
    def eps(self) -> float:
        return self.cfg.model.resilient_bn.eps

    @property
    def before(self) -> str:
        n = self.days["days"]
        return f"days 1-{n - 1}" if n > 2 else "day 1"

    @property
    def newest(self) -> str:
        return f"day {self.days['days']}"

    @property
    def tasks(self) -> List[str]:
        return [t.name for t in self.cfg.features.tasks]

    def rel(self, path) -> str:
        return os.path.relpath(path, self.out.parent)

    def stats(self, norm: str) -> Dict[str, Dict[str, float]]:
        return phase_stats(self.metrics[norm])

    def evaluation(self, norm: str, phase: int, surface: str = "all") -> Dict[str, dict]:
        return eval_rows(self.metrics[norm]["summaries"][phase], surface)

    def normalized(self, norm: str, phase: int) -> Dict[str, float]:
        return eval_normalized(self.norms[norm][phase], self.eval_values, self.eps)


# --------------------------------------------------------------------------------------------
# Numbers.
# --------------------------------------------------------------------------------------------


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


def eval_normalized(stats: Dict[str, torch.Tensor], values: np.ndarray, eps: float) -> Dict[str, float]:
    """What the dense arch receives in eval for a one-column feature: gamma (x - mean)/sqrt(var+eps) + beta."""
    x = torch.from_numpy(values.astype(np.float64))
    y = (x - stats["running_mean"][0]) / torch.sqrt(stats["running_var"][0] + eps)
    y = y * stats["weight"][0] + stats["bias"][0]
    return {"median_abs": float(y.abs().median()), "max_abs": float(y.abs().max())}


def eval_rows(summary: dict, surface: str = "all") -> Dict[str, dict]:
    return {r["task"]: r for r in summary["eval"] if r["surface"] == surface}


def fmt(x: float, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a" if x is None or math.isnan(x) else ("inf" if x > 0 else "-inf")
    if abs(x) >= 1e4 or (x != 0 and abs(x) < 10 ** -(digits - 1)):
        return f"{x:.2e}"
    return f"{x:.{digits}g}" if abs(x) >= 1000 else f"{x:.{digits}f}"


# --------------------------------------------------------------------------------------------
# The plot and the CSV.
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


# --------------------------------------------------------------------------------------------
# The markdown, section by section.
# --------------------------------------------------------------------------------------------


def header(o: Outcome) -> List[str]:
    command = "python -m pinads_rec.experiments.stability"
    if o.config_path != "configs/stability.yaml":
        command += f" --config {o.config_path}"
    if o.nproc != 1:
        command += f" --nproc {o.nproc}"
    command += "".join(f" --set {s}" for s in o.overrides)
    return [
        "# Model stability: Resilient Batch Norm under a feature outage\n",
        f"Generated by `{command}` (config [`{o.config_path}`]({o.rel(o.config_path)}); code {code_version()}). "
        "The module is `pinads_rec/modules/resilient_bn.py`; a dense feature uses it with `norm: resilient_bn`.\n",
    ]


WHY_BATCH_NORM_BREAKS = [
    "## What breaks plain batch norm, exactly\n",
    "`nn.BatchNorm1d` normalizes a **training** batch with that batch's own mean and variance. A "
    "column that is all zeros (an absent feature filled with its default) gives (0 - 0)/sqrt(0 + eps) "
    "= 0: nothing explodes in training. Nor can a training batch produce a value beyond "
    "sqrt(B - 1) standard deviations (22.6 at B = 512), whatever its variance: the largest "
    "training-mode output comes from a low-coverage batch (almost all rows at the default, a few "
    "real values).\n",
    "The explosion happens **after** the outage, with the running statistics. Every training batch "
    "of the outage pulls the running mean and variance towards the batch's (0, 0) with BatchNorm's "
    "momentum: after k such batches the running variance is 0.9^k of what it was, so a day of them "
    "takes it to about 0. The model is then evaluated or served -- BatchNorm switches to its running "
    "statistics -- on data where the feature is back: a value x becomes (x - ~0)/sqrt(~0 + eps), "
    "x times ~316 (eps = 1e-5), and the dense arch, which never saw such inputs, turns them into "
    "extreme logits. Stale (near-constant) stretches collapse the running variance the same way; "
    "a low-coverage shift adds the sqrt(B - 1) training outliers.\n",
    "Resilient Batch Norm normalizes with the running statistics in training too, and leaves a "
    "column out of their update when its batch variance is at most `minimal_variance` or differs "
    "from the running variance by more than `variance_shift_threshold` either way, so the outage "
    "leaves them as they were.\n",
]


def _data_and_faults(o: Outcome) -> List[str]:
    s, f = o.cfg.synth, o.cfg.synth.faults
    lines = [
        f"- **Data**: planted-truth synthetic data (`synth` in the config): {s.train_requests:,} train "
        f'requests in {o.days["days"]} files, each a consecutive time range ("day"), then {s.eval_requests:,} '
        f"held-out requests later in time. Rows: {o.before} {o.days['rows']['before']:,}, {o.newest} "
        f"{o.days['rows']['newest']:,}."
    ]
    if f.zero_fill_column:
        a, b = f.zero_fill_window
        lines.append(
            f"- **Fault**: `synth.faults.zero_fill_column: {f.zero_fill_column}`, window [{a}, {b}) of the "
            f"time span = exactly {o.newest}: every {o.newest} row has `{f.zero_fill_column} = 0.0` (an upstream "
            f"feature job failed and the default was filled in). The held-out data has the feature again. "
            f"Labels are untouched."
        )
    if f.shift_column:
        lines.append(f"- **Shift**: `{f.shift_column}` x {f.shift_scale} + {f.shift_offset} from time {f.shift_after}.")
    if f.stale_fraction:
        lines.append(f"- **Stale rows**: {f.stale_fraction:.0%} of rows copy their dense values from an earlier row.")
    return lines


def _schedule(o: Outcome) -> str:
    r = o.cfg.model.resilient_bn
    return (
        f"- **Schedule** (a daily-updated model): one pass over {o.before}, evaluation; the trainer then resumes "
        f"from that checkpoint for one pass over {o.newest} (the daily update) and evaluates again. One LR "
        f"schedule spans both. Both runs use the same seed, data order, model and optimizer; only "
        f"`features.dense[*].norm` differs (`batch_norm` vs `resilient_bn`, momentum {r.momentum}, eps {o.eps} "
        f"for both; `minimal_variance` {r.minimal_variance}, `variance_shift_threshold` "
        f"{r.variance_shift_threshold}). `train.nonfinite: {o.cfg.train.nonfinite}`."
    )


def _runs(o: Outcome) -> str:
    seconds = ", ".join(f"{LABEL[n]} {sum(x['train_seconds'] for x in o.metrics[n]['summaries']):.0f} s" for n in NORMS)
    rates = "; ".join(
        f"{LABEL[n]} " + " / ".join(f"{x['train_examples_per_s']:,.0f}" for x in o.metrics[n]["summaries"])
        for n in NORMS
    )
    return (
        f"- The dense features are fed raw to the batch norms (no log / min-max first), so that they "
        f"are what is normalized. {o.nproc} trainer process(es) per run, batch {o.cfg.data.batch_size}. "
        f"Training time (both phases, evaluation excluded): {seconds} ({rates} examples/s in the two "
        f"phases: the CPU was shared with other jobs).\n"
    )


def the_experiment(o: Outcome) -> List[str]:
    return ["## The experiment\n"] + _data_and_faults(o) + [_schedule(o), _runs(o)]


def _phase_table(o: Outcome) -> List[str]:
    rows = []
    for norm in NORMS:
        stats = o.stats(norm)
        for phase, name in (("before", o.before), ("newest", o.newest)):
            s = stats[phase]
            rows.append(
                [
                    LABEL[norm],
                    name,
                    s["steps"],
                    fmt(s["loss_last"]),
                    fmt(s["loss_max"]),
                    s["spikes"],
                    fmt(s["logit_max"], 3),
                    fmt(s["logit_median"], 3),
                    s["skipped"],
                ]
            )
    head = ["run", "phase", "steps", "loss (last 5 windows)", "max loss", "loss spikes", "max \\|logit\\|"]
    head += ["median window max \\|logit\\|", "non-finite skipped"]
    return table(head, rows, "llrrrrrrr") + [""]


def _evaluation_table(o: Outcome) -> List[str]:
    rows = []
    for norm in NORMS:
        for i, name in enumerate((o.before, o.newest)):
            evaluation = o.evaluation(norm, i)
            for t in o.tasks:
                r = evaluation[t]
                rows.append(
                    [LABEL[norm], name, t, fmt(r["auc"]), fmt(r["ne"]), fmt(r["log_loss"]), fmt(r["calibration"], 3)]
                    + [fmt(r.get("oracle_auc")), fmt(r.get("oracle_ne"))]
                )
    head = ["run", "after", "task", "AUC", "NE", "log loss", "calibration", "oracle AUC", "oracle NE"]
    intro = "**Held-out evaluation** (all surfaces; after each phase; oracle = the true probabilities):\n"
    return [intro] + table(head, rows, "lllrrrrrr") + [""]


def _surface_table(o: Outcome) -> List[str]:
    rows = []
    for norm in NORMS:
        for i, name in enumerate((o.before, o.newest)):
            for surface in o.cfg.features.surfaces:
                r = o.evaluation(norm, i, surface)[o.tasks[0]]
                rows.append([LABEL[norm], name, surface, fmt(r["auc"]), fmt(r["ne"]), fmt(r["calibration"], 3)])
    head = ["run", "after", "surface", "AUC", "NE", "calibration"]
    return ["Per surface (click):\n"] + table(head, rows, "lllrrr") + [""]


def _running_stats_table(o: Outcome) -> List[str]:
    rows = []
    for norm in NORMS:
        for i, name in enumerate((o.before, o.newest)):
            s, y = o.norms[norm][i], o.normalized(norm, i)
            masked = "-" if s["num_masked"] is None else str(s["num_masked"])
            rows.append(
                [LABEL[norm], name, fmt(float(s["running_mean"][0])), fmt(float(s["running_var"][0])), masked]
                + [fmt(y["median_abs"], 3), fmt(y["max_abs"], 3)]
            )
    intro = (
        f"**`{o.feature}`'s running statistics** (read from each phase's checkpoint) and what they make of "
        f"the held-out `{o.feature}` values in eval (gamma (x - mean)/sqrt(var + eps) + beta; held-out "
        f"values: median {np.median(o.eval_values):.2f}, max {o.eval_values.max():.1f}):\n"
    )
    head = ["run", "after", "running mean", "running var", "batches left out", "median \\|normalized\\|"]
    head += ["max \\|normalized\\|"]
    return [intro] + table(head, rows, "llrrrrr") + [""]


def results(o: Outcome) -> List[str]:
    csv_path = o.rel(o.asset_dir / "metrics.csv")
    return (
        [
            "## Results\n",
            f"![loss and max |logit| per step]({o.rel(o.asset_dir / 'loss_logits.png')})\n",
            f"Per {o.cfg.train.log_every}-step window (`metrics.jsonl`; all points in [`{csv_path}`]({csv_path})). "
            f"A spike is a window whose loss exceeds {SPIKE_RATIO}x the median of the 10 before it.\n",
        ]
        + _phase_table(o)
        + _evaluation_table(o)
        + _surface_table(o)
        + _running_stats_table(o)
    )


def _finding_training(o: Outcome) -> str:
    s = {n: o.stats(n) for n in NORMS}
    r0 = o.norms[RBN][0]
    outage_input = float(
        (0.0 - r0["running_mean"][0]) / torch.sqrt(r0["running_var"][0] + o.eps) * r0["weight"][0] + r0["bias"][0]
    )
    return (
        f"- **Training did not blow up, in either run.** Over {o.newest} (the outage) the max \\|logit\\| per "
        f"window peaked at {fmt(s[BN]['newest']['logit_max'], 3)} with BatchNorm1d and "
        f"{fmt(s[RBN]['newest']['logit_max'], 3)} with Resilient BN (over {o.before}: "
        f"{fmt(s[BN]['before']['logit_max'], 3)} and {fmt(s[RBN]['before']['logit_max'], 3)}); loss spikes over "
        f"{o.newest}: {s[BN]['newest']['spikes']} and {s[RBN]['newest']['spikes']}; non-finite batches skipped: "
        f"{s[BN]['newest']['skipped']} and {s[RBN]['newest']['skipped']}. In training BatchNorm1d normalizes the "
        f"zero column with the batch's own statistics to exactly 0 (its bias beta); Resilient BN normalizes it "
        f"with the pre-outage statistics to a constant {outage_input:.2f}. Either way the column carries no "
        f"information for a day, and nothing explodes."
    )


def _finding_evaluation(o: Outcome) -> str:
    task = o.tasks[0]
    ev = {n: [o.evaluation(n, i)[task] for i in (0, 1)] for n in NORMS}
    if ev[BN][1]["ne"] > 1.5 * ev[RBN][1]["ne"]:
        return (
            f"- **Evaluation after the update did blow up with BatchNorm1d** (the plot's last panel). Held-out "
            f"{task} AUC {fmt(ev[BN][0]['auc'])} -> {fmt(ev[BN][1]['auc'])}, NE {fmt(ev[BN][0]['ne'])} -> "
            f"{fmt(ev[BN][1]['ne'])}, calibration {fmt(ev[BN][0]['calibration'], 3)} -> "
            f"{fmt(ev[BN][1]['calibration'], 3)}. Resilient BN: AUC {fmt(ev[RBN][0]['auc'])} -> "
            f"{fmt(ev[RBN][1]['auc'])}, NE {fmt(ev[RBN][0]['ne'])} -> {fmt(ev[RBN][1]['ne'])}, calibration "
            f"{fmt(ev[RBN][0]['calibration'], 3)} -> {fmt(ev[RBN][1]['calibration'], 3)}."
        )
    return (
        f"- **Evaluation after the update**: held-out {task} NE {fmt(ev[BN][1]['ne'])} with BatchNorm1d, "
        f"{fmt(ev[RBN][1]['ne'])} with Resilient BN (AUC {fmt(ev[BN][1]['auc'])} vs {fmt(ev[RBN][1]['auc'])}); "
        f"before the update {fmt(ev[BN][0]['ne'])} vs {fmt(ev[RBN][0]['ne'])}: no blow-up at this size."
    )


def _finding_cause(o: Outcome) -> str:
    bn, rbn = o.norms[BN], o.norms[RBN]
    y = {n: [o.normalized(n, i) for i in (0, 1)] for n in NORMS}
    k = o.stats(BN)["newest"]["steps"]
    left_out = rbn[1]["num_masked"] - (rbn[0]["num_masked"] or 0)
    return (
        f"- **Cause, measured**: the {k} zero-variance batches of {o.newest} took BatchNorm1d's "
        f"running variance of `{o.feature}` from {fmt(float(bn[0]['running_var'][0]))} to "
        f"{fmt(float(bn[1]['running_var'][0]))} (0.9^{k} = {0.9**k:.1e}) and its running mean from "
        f"{fmt(float(bn[0]['running_mean'][0]))} to {fmt(float(bn[1]['running_mean'][0]))}. In eval, the "
        f"returning values are divided by sqrt({fmt(float(bn[1]['running_var'][0]))} + eps): median "
        f"\\|normalized\\| {fmt(y[BN][1]['median_abs'], 3)}, max {fmt(y[BN][1]['max_abs'], 3)}, against "
        f"{fmt(y[BN][0]['median_abs'], 3)} / {fmt(y[BN][0]['max_abs'], 3)} before the outage. Resilient BN "
        f"left `{o.feature}` out of {left_out} of its {o.stats(RBN)['newest']['steps']} {o.newest} batches "
        f"(batch variance 0 <= minimal_variance) and kept its statistics ({fmt(float(rbn[1]['running_mean'][0]))}, "
        f"{fmt(float(rbn[1]['running_var'][0]))}): median \\|normalized\\| {fmt(y[RBN][1]['median_abs'], 3)}, "
        f"max {fmt(y[RBN][1]['max_abs'], 3)}."
    )


WHEN_BATCH_NORM_SURVIVES = (
    "- **When plain batch norm survives**: the collapse needs the outage's batches to be the last "
    "ones before the checkpoint that is evaluated or served. After k healthy batches the collapsed "
    "state weighs 0.9^k (10% after 22 batches), so an outage in the middle of a run, or one whose "
    "row groups the loader shuffles among healthy ones, heals before the end. Time-ordered "
    "incremental updates -- the production pattern this experiment follows -- are exactly the case "
    "where it does not."
)
LIMITS = (
    "- **Limits of Resilient Batch Norm** (as the article defines it): the variance-ratio check freezes "
    "a column whose variance changes for good by more than `variance_shift_threshold` (it keeps "
    "normalizing with the old statistics; `tests/test_resilient_bn.py::test_variance_shift_mask_fires_both_ways`); "
    "a shift of the mean alone is followed like BatchNorm's; and under data parallelism each rank "
    "keeps its own running statistics, like `nn.BatchNorm1d` under DDP."
)


def findings(o: Outcome) -> List[str]:
    """The conclusions, worded from the numbers of this run."""
    return [
        "## Findings\n",
        _finding_training(o),
        _finding_evaluation(o),
        _finding_cause(o),
        WHEN_BATCH_NORM_SURVIVES,
        LIMITS,
        "",
    ]


def render(o: Outcome) -> str:
    sections = [header(o), WHY_BATCH_NORM_BREAKS, the_experiment(o), results(o), findings(o)]
    return "\n".join(line for section in sections for line in section) + "\n"


def write(o: Outcome, newest_label: Optional[str] = None) -> List[Path]:
    """The report, the plot and the CSV; their paths."""
    label = newest_label or o.newest
    png, csv_path = o.asset_dir / "loss_logits.png", o.asset_dir / "metrics.csv"
    plot(o.metrics, png, label, o.tasks[0])
    write_csv(o.metrics, csv_path)
    o.out.parent.mkdir(parents=True, exist_ok=True)
    o.out.write_text(render(o))
    return [o.out, png, csv_path]
