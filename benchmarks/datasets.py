"""A public dataset's config on raw logs of its exact shape with a planted truth: the project's
model, the same model without its sequences, a simple reference and the oracle, side by side.

    python benchmarks/datasets.py --dataset taobao|kuairand|movielens [--users N] [--seed S] [--work DIR]
        [--config PATH] [--generate KEY=VALUE ...] [--set KEY=VALUE ...] [--timeout-s S]

Why: on data it was not designed on, a model's AUC alone says little -- is 0.56 poor, or all there
is? Against the oracle (the true probabilities the labels were drawn from) and a reference any
analyst would fit in an afternoon, it says how much of the attainable signal the model learned.

1. **Generates** the raw files (``pinads_rec.data.shaped_logs.<dataset>.write``) under
   ``WORK/raw``, with ``truth.csv`` (the true probability of every impression) beside them.
2. **Builds** them with the dataset's config (``pinads_rec.data.build.build``) into ``WORK/data``,
   ``truth.csv`` joined as one more side table (keyed by the impression's own columns): every split
   carries ``true_<task>``, each task's ``true_probability_column`` (an override that only adds
   oracle metrics: the contract refuses the column as an input). A missing truth row fails the
   build (a null in a contract column).
3. **Trains** the project's model as docs/datasets.md documents it, ``torchx run -s local_cwd
   components/train.py:train -j 1x2 --gpu 0 --config <dataset config>`` with only the data
   directories, the run directory and the oracle columns overridden (plus ``--set``), into
   ``WORK/runs/model``; then the same with ``features.sequence_groups=[]`` (``WORK/runs/no_sequence``:
   the candidate features of the sequence tables are then pooled per row). Each run's final
   evaluation summary (metrics.jsonl) gives its AUC and the oracle's per surface x task.
4. **Fits the references** on ``WORK/data/train``, evaluated on ``eval``: the project's reference
   (``pinads_rec.reference``: LightGBM, here on every training row rather than the run's sample),
   and logistic regressions on the same point-in-time features of each row, read off the built
   files, generic over the config (``pinads_rec/reference/features.py`` says how):

   A second logistic regression leaves the match features out ("LR without history"): the
   reference's counterpart of the model without sequences, so the history's worth shows twice.

5. **Reports** AUC per surface x task for the model, the model without sequences, the references
   and the oracle (the true probability column, on the eval rows), each with its lift ``(AUC -
   0.5) / (oracle AUC - 0.5)``: one table on stdout, ``WORK/report.json`` and ``WORK/report.md``,
   with each stage's wall time and peak RSS (in-process stages: this process's, its high-water mark
   reset per stage where Linux allows; launches: the largest of the launched processes).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import yaml

# A sibling script: ``python benchmarks/datasets.py`` puts benchmarks/ on sys.path.
from seeds import verdict

from pinads_rec import config, metrics
from pinads_rec.data.build import build
from pinads_rec.data.shaped_logs import DATASETS, config_with_truth, truth_overrides
from pinads_rec.data.shaped_logs.common import auc
from pinads_rec.experiments import markdown
from pinads_rec.experiments.harness import launch, meters
from pinads_rec.experiments.harness.provenance import code_state
from pinads_rec.metrics import auc_standard_error, oracle_lift
from pinads_rec.reference import fit as reference
from pinads_rec.reference.features import Split
from pinads_rec.training.run_log import read_run_log

REPO = Path(__file__).resolve().parents[1]


SPLITS = ("train", "calibration", "eval")
RECENT = (5, 20)  # the newest events counted, besides all of them
NO_MATCH_S = 90 * 86400.0  # the recency feature of a row with no match
RATE_PRIOR = 20.0  # pseudo-impressions at the mean rate in the smoothed rates
FOLDS = 5
CHUNK_ROWS = 50_000  # rows per chunk of the match features (bounds their [rows, events] arrays)


# --------------------------------------------------------------------------------------------
# Stages: wall time and peak memory.
# --------------------------------------------------------------------------------------------


class Stage:
    """``with Stage(name, stages):`` records the block's wall time and this process's peak RSS over
    it (the high-water mark reset first through /proc/self/clear_refs, Linux >= 4.0; where that
    fails, the peak since the process started, flagged)."""

    def __init__(self, name: str, record: Dict[str, dict]):
        self.name, self.record = name, record

    def __enter__(self) -> "Stage":
        self.reset = meters.reset_peak_rss()
        self.t0 = time.perf_counter()
        print(f"== {self.name}", flush=True)
        return self

    def __exit__(self, *exc) -> None:
        entry = {"wall_s": round(time.perf_counter() - self.t0, 1), "peak_rss_mib": round(meters.peak_rss_mib(), 1)}
        if not self.reset:
            entry["peak_since_start"] = True
        self.record[self.name] = entry
        print(f"   {self.name}: {entry['wall_s']} s, peak RSS {entry['peak_rss_mib']} MiB", flush=True)


# --------------------------------------------------------------------------------------------
# 1-2. Raw logs and the build.
# --------------------------------------------------------------------------------------------


def data_overrides(data: Path) -> List[str]:
    return [f"data.{s}_dir={data / s}" for s in SPLITS]


# --------------------------------------------------------------------------------------------
# 3. Training through TorchX.
# --------------------------------------------------------------------------------------------


def torchx_train(config_path: str, overrides: Sequence[str], run_dir: Path, timeout_s: float) -> dict:
    """docs/datasets.md's command (``harness.launch.torchx_train``: ``torchx run -s local_cwd
    components/train.py:train -j 1x2 --gpu 0 --config config_path``) with ``overrides`` and
    ``train.run_dir=run_dir``, its output in ``run_dir/torchx.log``: the run's final evaluation
    summary and the launch's wall time and peak RSS. A failed launch raises with the end of its output."""
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "torchx.log"
    peak = meters.TreePeak()
    start = time.perf_counter()
    rc = launch.torchx_train(
        config_path, list(overrides) + [f"train.run_dir={run_dir}"], "1x2", log_path, timeout_s, peak
    )
    tail = "\n".join(log_path.read_text().splitlines()[-30:])
    if rc != 0 or not (run_dir / "metrics.jsonl").exists():
        raise RuntimeError(f"torchx launch failed ({rc}); end of {log_path}:\n{tail}")
    summary = read_run_log(run_dir).summary
    if summary is None:
        raise RuntimeError(f"{run_dir}/metrics.jsonl holds no evaluation summary:\n{tail}")
    return {
        "summary": summary,
        "wall_s": round(time.perf_counter() - start, 1),
        "peak_rss_mib": round(peak.peak, 1),
        "command": log_path.read_text().splitlines()[0],
    }


# --------------------------------------------------------------------------------------------
# 4. The reference: point-in-time features from the built files.
# --------------------------------------------------------------------------------------------


def fit_references(cfg: config.ExperimentConfig, data: Path, work: Path) -> Dict[str, dict]:
    """The references' eval predictions: {name: {"scores": [rows, tasks]}} plus the eval rows' labels,
    surfaces and true probabilities under "eval". LightGBM is the run's own reference
    (pinads_rec.reference) fitted here on every training row; the logistic regressions take the same
    features."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    f = cfg.features
    t0 = time.perf_counter()
    fitted = reference.fit(cfg, dataclasses.replace(cfg.reference, max_train_rows=0))
    names = fitted.features.names()
    print(
        f"   reference features: {len(names)} on {len(fitted.x_train):,} training rows, {len(fitted.x_eval):,} "
        f"eval rows; LightGBM fitted ({time.perf_counter() - t0:.0f} s)",
        flush=True,
    )
    (work / "reference_features.json").write_text(json.dumps(names, indent=1) + "\n")
    ev, keep = fitted.eval_split, fitted.keep_eval
    truth_columns = [t.true_probability_column for t in f.tasks]
    truth_split = Split.read(str(data / "eval"), f, [f.tasks[0].label_column] + truth_columns)
    truth = np.stack([truth_split.row_values(c) for c in truth_columns], 1).astype(np.float64)[keep]
    labels = ev.labels(f)[keep]
    surface = ev.row_values(f.columns.surface)[keep]

    def logistic():
        return make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000))

    history = fitted.features.history()  # the match features: what the sequences tell
    out = {"eval": {"labels": labels, "truth": truth, "surface": surface}}
    for name, use in (("logistic regression", np.arange(len(names))), ("LR without history", np.flatnonzero(~history))):
        t0 = time.perf_counter()
        scores = np.zeros_like(labels)
        for t in range(len(f.tasks)):
            y = (fitted.y_train[:, t] > 0.5).astype(np.int64)
            scores[:, t] = logistic().fit(fitted.x_train[:, use], y).predict_proba(fitted.x_eval[:, use])[:, 1]
        out[name] = {"scores": scores}
        print(f"   {name}: fitted in {time.perf_counter() - t0:.0f} s", flush=True)
    out["LightGBM"] = {"scores": fitted.scores}
    return out


# --------------------------------------------------------------------------------------------
# 5. The report.
# --------------------------------------------------------------------------------------------


def report_rows(cfg: config.ExperimentConfig, runs: Dict[str, dict], refs: Dict[str, dict]) -> List[dict]:
    """One row per surface (with eval rows) and "all", x task: examples, positives, each AUC, lifts."""
    f = cfg.features
    ev = refs["eval"]
    by_run = {name: {(r["surface"], r["task"]): r for r in run["summary"]["eval"]} for name, run in runs.items()}
    rows = []
    for surface in list(f.surfaces) + [metrics.ALL_SURFACES]:
        on = np.ones(len(ev["surface"]), bool) if surface == metrics.ALL_SURFACES else ev["surface"] == surface
        if not on.any():
            continue
        for t, task in enumerate(f.tasks):
            y = ev["labels"][on, t]
            row = {"surface": surface, "task": task.name, "examples": int(on.sum()), "positives": int(y.sum())}
            row["oracle"] = auc(ev["truth"][on, t], y)
            for name, run in by_run.items():
                r = run.get((surface, task.name), {})
                row[name] = r.get("auc")
                row[f"{name} oracle (run)"] = r.get("oracle_auc")
            for name, ref in refs.items():
                if name != "eval":
                    row[name] = auc(ref["scores"][on, t], y)
            rows.append(row)
    return rows


MIN_CLASS = 100  # a table row needs this many positives and negatives (report.json keeps every cell)


def format_table(rows: List[dict], models: Sequence[str]) -> str:
    def cell(x, spec=".4f"):
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)

    head = ["surface", "task", "rows", "positives"] + [f"{m} AUC (lift)" for m in models] + ["oracle AUC"]
    shown = [r for r in rows if min(r["positives"], r["examples"] - r["positives"]) >= MIN_CLASS]
    body = []
    for r in shown or rows:
        cells = [r["surface"], r["task"], f"{r['examples']:,}", f"{r['positives']:,}"]
        cells += [
            f"{cell(r.get(m))} ({cell(metrics.oracle_lift({'auc': r.get(m), 'oracle_auc': r['oracle']}), '.2f')})"
            for m in models
        ]
        body.append(cells + [cell(r["oracle"])])
    lines = markdown.table(head, body)
    if shown and len(shown) < len(rows):
        lines.append(
            f"\n({len(rows) - len(shown)} surface x task cells with < {MIN_CLASS} positives or negatives left out)"
        )
    return "\n".join(lines)


def run_seed(args, seed: int, work: Path) -> dict:
    """Steps 1-5 for one seed (the generator's, the trainings' and the references'), in ``work``:
    its report.md / report.json, and the result."""
    ds = DATASETS[args.dataset]
    raw, data = work / "raw", work / "data"
    work.mkdir(parents=True, exist_ok=True)
    stages: Dict[str, dict] = {}
    start = time.perf_counter()

    with Stage("generate", stages):
        writer = importlib.import_module(f"pinads_rec.data.shaped_logs.{args.dataset}")
        options = {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in args.generate)}
        generated = writer.write(raw, **({"users": args.users} if args.users else {}), seed=seed, **options)
    seeded = [f"train.seed={seed}", f"reference.seed={seed}"] + list(args.overrides)
    overrides = data_overrides(data) + truth_overrides(args.dataset) + seeded
    with Stage("build", stages):
        cfg = config_with_truth(args.dataset, data_overrides(data) + seeded, args.config)
        built = build(cfg, str(raw), str(data), threads=min(os.cpu_count() or 1, 4))
    runs = {}
    for name, extra in (("model", []), ("no sequences", ["features.sequence_groups=[]"])):
        print(f"== train: {name}", flush=True)
        run_dir = work / "runs" / name.replace(" ", "_")
        runs[name] = run = torchx_train(args.config or ds.config, overrides + extra, run_dir, args.timeout_s)
        stages[f"train: {name}"] = {"wall_s": run["wall_s"], "peak_rss_mib": run["peak_rss_mib"]}
        print(f"   train: {name}: {run['wall_s']} s, peak RSS {run['peak_rss_mib']} MiB (the launch's largest process)")
    with Stage("reference", stages):
        refs = fit_references(cfg, data, work)

    rows = report_rows(cfg, runs, refs)
    models = list(runs) + [n for n in refs if n != "eval"]
    table = format_table(rows, models)
    # The runs' own oracle AUC (their metrics) must be the one computed here on the same rows.
    gaps = [abs(r[f"{m} oracle (run)"] - r["oracle"]) for r in rows for m in runs if r.get(f"{m} oracle (run)")]
    check = f"runs' oracle AUC vs this script's on the eval rows: max |difference| {max(gaps, default=0.0):.2e}"
    timing = "\n".join(
        f"| {name} | {s['wall_s']} | {s['peak_rss_mib']} |" + (" (since start)" if s.get("peak_since_start") else "")
        for name, s in stages.items()
    )
    users = generated.get("users", args.users)
    title = f"{args.dataset}: {users} users, seed {seed} ({args.config or ds.config})" + (
        f", --set {' '.join(args.overrides)}" if args.overrides else ""
    )
    sizes = {s: {k: built["splits"][s][k] for k in ("requests", "rows")} for s in built["splits"]}
    text = (
        f"# {title}\n\nAUC on the eval split (lift = (AUC - 0.5) / (oracle AUC - 0.5))\n\n{table}\n\n{check}\n\n"
        f"| stage | wall s | peak RSS MiB |\n|---|---|---|\n{timing}\n"
    )
    print("\n" + text)
    print(f"seed {seed}: {time.perf_counter() - start:.0f} s; report in {work}/report.md and report.json")
    (work / "report.md").write_text(text)
    result = {
        "dataset": args.dataset,
        "users": args.users,
        "seed": seed,
        "overrides": list(args.overrides),
        "models": models,
        "rows": rows,
        "stages": stages,
        "generated": generated,
        "build": {"splits": sizes, "join_misses": built["join_misses"], "seconds": built["seconds"]},
        "commands": {name: run["command"] for name, run in runs.items()},
        "code": code_state(),
        "runs": {name: str(work / "runs" / name.replace(" ", "_")) for name in runs},
    }
    (work / "report.json").write_text(json.dumps(result, indent=1, default=float) + "\n")
    return result


# --------------------------------------------------------------------------------------------
# 6. Over the seeds: the mean and spread, and the model's margin over LightGBM.
# --------------------------------------------------------------------------------------------


def seed_rows(results: Sequence[dict]) -> List[dict]:
    """Per surface x task (the cells every seed has): each model's mean AUC and sd over the seeds, the
    oracle's, the model's margin over LightGBM (per seed; mean, and its standard error over the
    seeds), the model's AUC standard error (Hanley & McNeil, mean over the seeds), the margin in it,
    the verdict (seeds.verdict) and the model's oracle lift (mean, lowest seed)."""
    models = results[0]["models"]
    per_seed = [{(r["surface"], r["task"]): r for r in res["rows"]} for res in results]
    out = []
    for key in [k for k in per_seed[0] if all(k in s for s in per_seed)]:
        rs = [s[key] for s in per_seed]
        row = {"surface": key[0], "task": key[1], "seeds": len(rs)}
        row["examples"] = statistics.mean(r["examples"] for r in rs)
        row["positives"] = statistics.mean(r["positives"] for r in rs)
        for m in models + ["oracle"]:
            xs = [r[m] for r in rs]
            row[m], row[f"{m} sd"] = _mean(xs), _sd(xs)
        nan = float("nan")
        margins = [nan if None in (r["model"], r["LightGBM"]) else r["model"] - r["LightGBM"] for r in rs]
        ses = [auc_standard_error(r["model"], r["positives"], r["examples"] - r["positives"]) for r in rs]
        lifts = [oracle_lift({"auc": r["model"], "oracle_auc": r["oracle"]}) for r in rs]
        lifts = [nan if x is None else x for x in lifts]
        row["margin"] = _mean(margins)
        row["margin se (seeds)"] = _sd(margins) / math.sqrt(len(rs)) if len(rs) > 1 else float("nan")
        row["auc se"] = _mean([x if x is not None else float("nan") for x in ses])
        row["margin in se"] = row["margin"] / row["auc se"] if row["auc se"] else float("nan")
        row["verdict"] = verdict(row["margin"], row["auc se"])
        row["lift"], row["lift min"] = _mean(lifts), (nan if math.isnan(_mean(lifts)) else min(lifts))
        out.append(row)
    return out


def _mean(xs: Sequence[Optional[float]]) -> float:
    """The mean; nan where a seed's value is undefined (a cell of one class: no AUC)."""
    if any(x is None or math.isnan(x) for x in xs):
        return float("nan")
    return statistics.mean(xs)


def _sd(xs: Sequence[Optional[float]]) -> float:
    if len(xs) < 2 or any(x is None or math.isnan(x) for x in xs):
        return float("nan")
    return statistics.stdev(xs)


def format_seed_table(rows: Sequence[dict], models: Sequence[str]) -> str:
    def cell(x, spec=".4f"):
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)

    head = ["surface", "task", "positives"] + [f"{m} AUC (sd)" for m in models] + ["oracle AUC"]
    head += ["model - LightGBM", "± seeds", "AUC se", "in se", "verdict", "model lift (min)"]
    shown = [r for r in rows if min(r["positives"], r["examples"] - r["positives"]) >= MIN_CLASS] or rows
    body = [
        [r["surface"], r["task"], f"{r['positives']:,.0f}"]
        + [f"{cell(r[m])} ({cell(r[f'{m} sd'])})" for m in models]
        + [cell(r["oracle"]), cell(r["margin"], "+.4f"), cell(r["margin se (seeds)"]), cell(r["auc se"])]
        + [cell(r["margin in se"], "+.1f"), r["verdict"], f"{cell(r['lift'], '.3f')} ({cell(r['lift min'], '.3f')})"]
        for r in shown
    ]
    return "\n".join(markdown.table(head, body))


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", required=True, choices=sorted(DATASETS))
    p.add_argument("--users", type=int, default=None, help="users of the generated logs (default: the generator's)")
    p.add_argument(
        "--seeds", type=int, nargs="+", default=[0, 1, 2], help="each a generator, training and reference seed"
    )
    p.add_argument("--work", default=None, help="working directory (default: runs/datasets_benchmark/<dataset>)")
    config.add_overrides_flag(p, "an override for the build and both trainings (e.g. train.max_steps=20)")
    p.add_argument("--timeout-s", type=float, default=4 * 3600.0, help="limit of each training launch")
    p.add_argument("--config", default=None, help="another config of the dataset's raw files (default: its own)")
    p.add_argument("--generate", action="append", default=[], metavar="KEY=VALUE", help="a generator option")
    args = p.parse_args(argv)
    work = Path(args.work or REPO / "runs" / "datasets_benchmark" / args.dataset).resolve()
    start = time.perf_counter()
    results = [run_seed(args, seed, work / f"seed-{seed}") for seed in args.seeds]
    rows = seed_rows(results)
    models = results[0]["models"]
    title = f"{args.dataset}: seeds {' '.join(map(str, args.seeds))} ({args.config or DATASETS[args.dataset].config})"
    title += f", --set {' '.join(args.overrides)}" if args.overrides else ""
    text = (
        f"# {title}\n\nAUC on the eval split: the mean over the seeds (sd); the model's margin over LightGBM, "
        f"its standard error over the seeds, the model's AUC se (Hanley & McNeil) and the margin in it "
        f"(ahead / behind: beyond one AUC se)\n\n{format_seed_table(rows, models)}\n\n"
        + "\n".join(f"- seed {seed}: {work / f'seed-{seed}' / 'report.md'}" for seed in args.seeds)
        + "\n"
    )
    print("\n" + text)
    print(f"total {time.perf_counter() - start:.0f} s; report in {work}/report.md and report.json")
    (work / "report.md").write_text(text)
    summary = {"dataset": args.dataset, "seeds": args.seeds, "models": models, "rows": rows}
    summary["per_seed"] = {r["seed"]: str(work / f"seed-{r['seed']}" / "report.json") for r in results}
    (work / "report.json").write_text(json.dumps(summary, indent=1, default=float) + "\n")


if __name__ == "__main__":
    main()
