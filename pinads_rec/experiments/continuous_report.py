"""The continuous-training report: next-day click AUC per day and strategy (all rows, the ads new
that day, the others), GAUC, what each day's training cost, and the figures the comparison rests on
(the frozen model's fall over the days, incremental against the window retrain), with a chart."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Dict, List, Optional

from pinads_rec.experiments.harness.provenance import code_version
from pinads_rec.experiments.markdown import table


def metric_value(rows: List[dict], metric: str, task: str = "click", surface: str = "all") -> Optional[float]:
    """One metric of the evaluation rows' (surface, task) row (None when absent or not finite)."""
    for r in rows:
        if r["surface"] == surface and r["task"] == task:
            v = r.get(metric)
            return float(v) if v is not None and v == v else None
    return None


def _f(x: Optional[float], spec: str = ".4f") -> str:
    return "-" if x is None else format(x, spec)


def by_strategy(results: List[dict]) -> Dict[str, List[dict]]:
    out: Dict[str, List[dict]] = {}
    for r in results:
        out.setdefault(r["strategy"], []).append(r)
    return out


def findings(results: List[dict]) -> Dict[str, Optional[float]]:
    """The comparison's figures: the frozen model's click AUC fall from its first next day to the
    7th (or the last, when fewer), the mean next-day AUC gap incremental - window, both strategies'
    rows trained per day (means), and their ratio."""
    s = by_strategy(results)
    out: Dict[str, Optional[float]] = {}
    frozen = [metric_value(r["eval"]["all"], "auc") for r in s.get("frozen", [])]
    oracle = [metric_value(r["eval"]["all"], "oracle_auc") for r in s.get("frozen", [])]
    if len(frozen) >= 2 and None not in frozen:
        last = min(len(frozen), 8) - 1  # the first next day, then 7 days on
        out["frozen_first"], out["frozen_last"] = frozen[0], frozen[last]
        out["frozen_fall"] = frozen[0] - frozen[last]
        out["frozen_fall_days"] = float(last)
        if None not in oracle:  # the days differ in how predictable they are: the gap to the oracle too
            out["frozen_gap_growth"] = (oracle[last] - frozen[last]) - (oracle[0] - frozen[0])
    inc = {r["day"]: r for r in s.get("incremental", [])}
    win = {r["day"]: r for r in s.get("window", [])}
    common = sorted(set(inc) & set(win) - {0})  # day 0: both are the same kind of model on one day
    gaps = [metric_value(inc[d]["eval"]["all"], "auc") - metric_value(win[d]["eval"]["all"], "auc") for d in common]
    if common and None not in gaps:
        out["incremental_minus_window"] = statistics.mean(gaps)
        rows_inc = statistics.mean(inc[d]["rows_trained"] for d in common)
        rows_win = statistics.mean(win[d]["rows_trained"] for d in common)
        out["rows_incremental"], out["rows_window"] = rows_inc, rows_win
        out["rows_ratio"] = rows_inc / rows_win if rows_win else None
        out["seconds_incremental"] = statistics.mean(inc[d]["train_seconds"] for d in common)
        out["seconds_window"] = statistics.mean(win[d]["train_seconds"] for d in common)
    return out


def plot(results: List[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharex=True)
    for strategy, rows in by_strategy(results).items():
        x = [r["day"] + 1 for r in rows]
        axes[0].plot(x, [metric_value(r["eval"]["all"], "auc") for r in rows], marker="o", label=strategy)
        axes[1].plot(x, [metric_value(r["eval"]["new"], "auc") for r in rows], marker="o", label=strategy)
    oracle = [metric_value(r["eval"]["all"], "oracle_auc") for r in by_strategy(results).get("incremental", [])]
    if oracle and None not in oracle:
        axes[0].plot([r["day"] + 1 for r in by_strategy(results)["incremental"]], oracle, "k:", label="oracle")
    axes[0].set_title("next-day click AUC, every row")
    axes[1].set_title("next-day click AUC, ads launched that day")
    for ax in axes:
        ax.set_xlabel("day evaluated")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


START, END = "<!-- continuous results: start -->", "<!-- continuous results: end -->"


def write_report(results: List[dict], loop, out: Path) -> Path:
    """The measured part of ``out`` (markdown) and its chart beside it (``<stem>/auc_by_day.png``):
    between the ``START`` / ``END`` marks when ``out`` has them (the prose around stays), else a new
    file of the measurement alone. ``loop``: the ``continuous.Loop`` that made ``results`` (its
    config, overrides, window and ranks name the command)."""
    version = code_version()  # before the chart is rewritten: it would count as an uncommitted change
    chart = out.parent / out.stem / "auc_by_day.png"
    plot(results, chart)
    header = ["day trained", "evaluated on", "strategy", "click AUC", "GAUC", "new ads AUC", "other ads AUC"]
    header += ["oracle AUC", "new-ad rows", "rows trained", "train s"]
    body = []
    for r in sorted(results, key=lambda r: (r["day"], r["strategy"])):
        ev = r["eval"]
        new_rows = metric_value(ev["new"], "examples")
        body.append(
            [r["date"], r["evaluated_on"], r["strategy"]]
            + [_f(metric_value(ev["all"], "auc")), _f(metric_value(ev["all"], "gauc"))]
            + [_f(metric_value(ev["new"], "auc")), _f(metric_value(ev["old"], "auc"))]
            + [_f(metric_value(ev["all"], "oracle_auc"))]
            + [_f(new_rows, ",.0f"), f"{r['rows_trained']:,}", f"{r['train_seconds']:.0f}"]
        )
    found = findings(results)
    lines = [
        f"Generated by `python -m pinads_rec.experiments.continuous --config {loop.config_path}"
        + "".join(f" --set {o}" for o in loop.overrides)
        + f" --window {loop.window} --ranks {loop.ranks} --report {out}` (code {version}).",
        "",
    ]
    if "frozen_fall" in found:
        gap = found.get("frozen_gap_growth")
        lines.append(
            f"- The frozen model (trained on day 0, never updated): next-day click AUC {found['frozen_first']:.4f} "
            f"on its first next day, {found['frozen_last']:.4f} {found['frozen_fall_days']:.0f} days later "
            f"(a fall of {found['frozen_fall']:+.4f}"
            + ("" if gap is None else f"; its gap to the oracle grew by {gap:+.4f}")
            + ")."
        )
    if "incremental_minus_window" in found:
        lines.append(
            f"- Incremental training (one day, warm-started from yesterday's model) minus the {loop.window}-day "
            f"window retrain: {found['incremental_minus_window']:+.4f} next-day click AUC on average, at "
            f"{found['rows_ratio']:.2f} of its training rows per day ({found['rows_incremental']:,.0f} vs "
            f"{found['rows_window']:,.0f}) and {found['seconds_incremental']:.0f} s vs "
            f"{found['seconds_window']:.0f} s of training."
        )
    lines += ["", f"![next-day AUC by day]({chart.relative_to(out.parent)})", ""]
    lines += table(header, body, align="lllrrrrrrrr")
    measured = "\n".join(lines)
    text = out.read_text() if out.exists() else ""
    if START in text and END in text:
        text = text[: text.index(START) + len(START)] + "\n" + measured + "\n" + text[text.index(END) :]
    else:
        text = f"# Continuous training: measured\n\n{START}\n{measured}\n{END}\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return out
