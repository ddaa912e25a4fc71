"""Ablations: train variants of one model on the same data and seed, write the comparison.

    python -m pinads_rec.experiments.ablate --config configs/ablations/calibration.yaml [--quick] [--ranks 2]
        [--report-only]

An ablation file names a base experiment config, overrides for every variant, and the variants
(each a list of ``--set`` overrides), what to report and where:

    title: Surface-specific calibration
    description: one markdown paragraph: what is compared and why
    base: configs/demo.yaml
    overrides: [train.max_steps=1500]          # every variant
    quick: [synth.train_requests=4000, ...]    # added by --quick: a CI-sized run
    metrics: [auc, ne, calibration, ece]       # columns of the per-surface table
    chart: {metric: calibration, task: click}  # the PNG: this metric per surface, per variant
    out: docs/calibration.md
    variants:
      - {name: surface calibration, overrides: [model.calibration=surface]}
      - {name: no calibration, overrides: [model.calibration=none]}
      # evaluate another variant's trained model under other settings (no training):
      - {name: unified on shopping ads, eval_of: unified, overrides: ["data.row_filter={column: ad_type, values: [1]}"]}

Every variant is a real training run of ``pinads_rec/train.py`` under torchrun (gloo on CPU), in
a run directory named by a hash of its full config and of the package's source code
(``runs/ablations/<hash>``), on data generated
once for the base config (``pinads_rec.data.synth.ensure``: skipped when present). A finished
run of the same config and code is reused (``harness.finished_runs``) -- by an interrupted ablation
resuming, or by another ablation that needs the same model (the unified model of the segmentation
table is the calibration table's).
``--report-only`` trains nothing: it rewrites the report from finished runs of the variants'
exact configs found under ``--runs``, whatever code trained them (after editing a description or
the ``findings``, the reading of a run written under the tables).

The report (``ablate_report.py``) has the chart's metric per surface and variant, a cost table
(training examples/s, the ranks' peak memory, parameter counts and, when asked, serving latency and
the mean history length), every metric per surface x task (with the oracle from the generator's
true probabilities), and a PNG chart (two with ``cost_chart``).

What a variant costs, besides its training examples/s (every key optional):

    serving: {candidates: 100, requests: 30}   # latency of one request, 1 user x 100 candidates
    history_group: pins                        # mean actual history length of this group
    cost_chart: {x: history_length, y: [examples_per_s, peak_rss_mb, serving_ms]}
    variants:
      - {name: padded 4000, series: padded Transformer, cost_only: true, overrides: [train.max_steps=20]}

- peak memory (``peak_rss_mb``, always): the largest peak RSS (VmHWM) among a run's rank processes
  (torchrun's children; their loader workers not counted), polled from ``/proc`` while it runs
  (``harness.meters.RankMemory``; not ``getrusage(RUSAGE_CHILDREN)``: that is the maximum over every child this
  process ever reaped, and a rank inherits its launcher's high-water mark across fork + exec);
- ``serving``: the trained model loaded by the serving code (``serve.Predictor.from_run``, its
  inference precision) scores one request at a time on 1 thread: each of the eval split's first
  ``warmup`` + ``requests`` requests (its own user, user features and histories) with its own
  candidate rows repeated in order to ``candidates`` rows (synthetic requests have ~12); median and
  p90 ms of ``Predictor.score_request`` (batching and the contract's checks included) after
  ``warmup`` untimed ones;
- ``history_group``: the mean over the eval split's requests of min(the group's history length as
  stored, the variant's ``max_length`` for it): the events a request actually brings;
- a ``cost_only`` variant trains with its own overrides (e.g. a few steps) to measure the costs
  alone: its metrics are shown as "cost only", never compared;
- ``cost_chart``: a second PNG, each ``y`` cost against ``x`` (``history_length`` or another cost),
  one line per variant ``series`` (variants without one are left out). Costs:
  ``examples_per_s``, ``peak_rss_mb``, ``serving_ms`` (median), ``serving_p90_ms``,
  ``history_length``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from pinads_rec import arguments, config
from pinads_rec.data import synth
from pinads_rec.experiments.ablate_report import COST_NAMES, METRIC_NAMES, slug, write_report
from pinads_rec.experiments.harness import finished_runs, launch
from pinads_rec.training.run_log import METRICS_FILE


@dataclasses.dataclass
class Variant:
    name: str
    overrides: List[str] = dataclasses.field(default_factory=list)
    eval_of: Optional[str] = None
    cost_only: bool = False  # trained to measure its costs only: its metrics are not shown
    series: Optional[str] = None  # its line in the cost chart (e.g. the architecture)


@dataclasses.dataclass
class Serving:
    candidates: int = 100
    requests: int = 30
    warmup: int = 3


@dataclasses.dataclass
class Ablation:
    title: str
    base: str
    variants: List[Variant]
    description: str = ""
    overrides: List[str] = dataclasses.field(default_factory=list)
    quick: List[str] = dataclasses.field(default_factory=list)
    metrics: List[str] = dataclasses.field(default_factory=lambda: ["auc", "ne", "calibration"])
    chart: Dict[str, str] = dataclasses.field(default_factory=lambda: {"metric": "auc", "task": "click"})
    out: str = "docs/ablations.md"
    serving: Optional[Serving] = None
    history_group: Optional[str] = None
    cost_chart: Optional[Dict[str, object]] = None
    # What the last run's numbers say (markdown), written under the tables: the reading of a
    # specific run, so it names its figures; --report-only rewrites the report after editing it.
    findings: str = ""


def load_ablation(path: str) -> Ablation:
    raw = config.read_yaml(path)  # a file not there, a directory, not YAML: a ConfigError naming it
    try:
        raw["variants"] = [Variant(**v) for v in raw.get("variants") or []]
        if raw.get("serving") is not None:
            raw["serving"] = Serving(**raw["serving"])
        ab = Ablation(**raw)
    except TypeError as e:  # unknown or missing keys
        raise config.ConfigError(f"{path}: {e}") from None
    names = [v.name for v in ab.variants]
    if not names or len(set(names)) != len(names):
        raise config.ConfigError(f"{path}: variants need distinct names, got {names}")
    for v in ab.variants:
        if v.eval_of is not None and v.eval_of not in names[: names.index(v.name)]:
            raise config.ConfigError(f"{path}: variant {v.name!r}: eval_of {v.eval_of!r} is not an earlier variant")
    for m in ab.metrics + [ab.chart.get("metric")]:
        if m not in METRIC_NAMES:
            raise config.ConfigError(f"{path}: metric {m!r} is not one of {sorted(METRIC_NAMES)}")
    for v in ab.variants:
        if v.cost_only and v.eval_of is not None:
            raise config.ConfigError(f"{path}: variant {v.name!r}: cost_only and eval_of exclude each other")
    if ab.serving is not None:
        for key in ("candidates", "requests"):
            if not isinstance(getattr(ab.serving, key), int) or getattr(ab.serving, key) < 1:
                raise config.ConfigError(f"{path}: serving.{key} must be a positive integer")
        if not isinstance(ab.serving.warmup, int) or ab.serving.warmup < 0:
            raise config.ConfigError(f"{path}: serving.warmup must be an integer >= 0")
    if ab.cost_chart is not None:
        _check_cost_chart(ab, path)
    return ab


def _check_cost_chart(ab: Ablation, path: str) -> None:
    chart = ab.cost_chart
    if not isinstance(chart, dict) or set(chart) - {"x", "y"} or "y" not in chart:
        raise config.ConfigError(f"{path}: cost_chart takes x and y, e.g. {{x: history_length, y: [examples_per_s]}}")
    ys = chart["y"] if isinstance(chart["y"], list) else [chart["y"]]
    x = chart.setdefault("x", "history_length")
    for key in [x] + ys:
        if key not in COST_NAMES:
            raise config.ConfigError(f"{path}: cost_chart: {key!r} is not one of {sorted(COST_NAMES)}")
        if key == "history_length" and ab.history_group is None:
            raise config.ConfigError(f"{path}: cost_chart: {key} needs history_group (the group to measure)")
        if key.startswith("serving") and ab.serving is None:
            raise config.ConfigError(f"{path}: cost_chart: {key} needs serving (how to time a request)")
    chart["y"] = ys
    if not any(v.series for v in ab.variants):
        raise config.ConfigError(f"{path}: cost_chart draws one line per variant `series`; no variant has one")


def _param_counts(cfg: config.ExperimentConfig) -> Dict[str, int]:
    import torch
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    from pinads_rec.models import build_model

    model = build_model(cfg.features, cfg.model, device=torch.device("meta"))
    tables = {n for n, m in model.named_modules() if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection))}
    emb = sum(p.numel() for n, p in model.named_parameters() if any(n.startswith(t + ".") for t in tables))
    return {"dense": sum(p.numel() for p in model.parameters()) - emb, "embedding": emb}


def run_dir_for(ab: Ablation, overrides: List[str], runs: Path, ranks: int, source: Optional[str]) -> Path:
    """runs/<hash of the variant's whole config, its rank count, the run it evaluates and the code>."""
    cfg = config.to_dict(config.load(ab.base, overrides + ["train.run_dir=unset"]))
    return finished_runs.keyed_run_dir(runs, cfg, ranks, source)


def finished_summary(run_dir: Path) -> dict:
    """A finished run's summary with the peak memory its training measured (``MEMORY_FILE``)."""
    memory = run_dir / MEMORY_FILE
    summary = finished_runs.finished_run(run_dir).summary
    return dict(summary, **(json.loads(memory.read_text()) if memory.exists() else {}))


def report_only_run(ab: Ablation, v: Variant, overrides: List[str], runs: Path) -> Path:
    """--report-only: the newest finished run under ``runs`` of the variant's exact config, whatever
    code trained it (ConfigError when there is none)."""
    wanted = finished_runs.comparable_config(config.load(ab.base, overrides))
    found = finished_runs.newest_finished_run(runs, wanted)
    if found is None:
        raise config.ConfigError(f"variant {v.name!r}: no finished run of its config under {runs} (train it first)")
    return found


def run_variant(
    ab: Ablation, v: Variant, overrides: List[str], run_dir: Path, ranks: int, finished: Dict[str, dict]
) -> dict:
    wanted = finished_runs.comparable_config(config.load(ab.base, overrides))
    if finished_runs.finished_run(run_dir) is not None and finished_runs.same_config(run_dir, wanted):
        print(f"[{v.name}] reusing the finished run in {run_dir}", flush=True)
        return finished_summary(run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    extra = []
    if v.eval_of is not None:  # evaluate the source's final model: resume it at its last step
        source = finished[v.eval_of]
        src_dir = Path(source["run_dir"]) / "checkpoints"
        latest = max(src_dir.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
        shutil.copytree(latest, run_dir / "checkpoints" / latest.name)
        extra = [f"train.max_steps={source['step']}"]
    print(f"[{v.name}] {'evaluating ' + v.eval_of if v.eval_of else 'training'} -> {run_dir}", flush=True)
    started = time.time()
    try:
        summary = train_run(ab.base, overrides + extra, run_dir, ranks)
    except RuntimeError as e:
        raise RuntimeError(f"variant {v.name!r}: {e}") from None
    print(f"[{v.name}] done in {time.time() - started:.0f} s", flush=True)
    return summary


def train_run(base: str, overrides: List[str], run_dir: Path, ranks: int) -> dict:
    """``pinads_rec/train.py`` on ``ranks`` gloo processes (``harness.launch.train_py``) into
    ``run_dir`` (its output in ``train.log``): the run's summary with the ranks' peak memory, kept in
    ``run_dir/peak_memory.json`` for a later reuse of the run. A failed run raises with the end of
    its log."""
    measured = launch.train_py(base, overrides + [f"train.run_dir={run_dir}"], ranks, run_dir / "train.log")
    log = finished_runs.finished_run(run_dir)
    if log is None:
        raise RuntimeError(f"train.py wrote no final evaluation to {run_dir}/{METRICS_FILE}")
    summary = log.summary
    memory = {k: measured[k] for k in ("peak_rss_mb", "rank_peak_rss_mb")}
    (run_dir / MEMORY_FILE).write_text(json.dumps(memory) + "\n")
    return dict(summary, **memory)


MEMORY_FILE = "peak_memory.json"


def request_tables(features: config.FeaturesConfig, data_dir: str, candidates: int, count: int) -> list:
    """The first ``count`` requests of ``data_dir`` (file order, either storage layout), each as one
    request of exactly ``candidates`` candidate rows: its own rows repeated in order (or its first
    ``candidates``), the user side as stored. Per-request files give per-request rows (one row each,
    the layout ``Predictor.score_request`` reads in one piece), per-row files per-row tables."""
    import pyarrow as pa

    from pinads_rec.data.loader.reader import list_files, open_parquet
    from pinads_rec.data.loader.storage_layout import (
        is_per_request,
        request_starts,
        stored_request_level,
        to_per_request,
        to_per_row,
    )

    def widened(rows: pa.Table, stored) -> pa.Table:
        rows = rows.take(pa.array(np.arange(candidates) % rows.num_rows))
        return rows if stored is None else to_per_request(rows, features, stored)

    out = []
    for path in list_files(data_dir):
        pf = open_parquet(path)
        for group in range(pf.num_row_groups):
            table = pf.read_row_group(group)
            if is_per_request(table.schema, features):
                stored = stored_request_level(table.schema, features)
                pieces = [(to_per_row(table.slice(i, 1), features), stored) for i in range(table.num_rows)]
            else:
                starts = request_starts(table.column(features.columns.request_id).to_numpy())
                ends = np.append(starts[1:], table.num_rows)
                pieces = [(table.slice(a, b - a), None) for a, b in zip(starts, ends)]
            for rows, stored in pieces[: count - len(out)]:
                out.append(widened(rows, stored))
            if len(out) == count:
                return out
    raise config.ConfigError(f"serving: {data_dir} holds {len(out)} requests, fewer than the {count} to time")


def serving_latency(run_dir: Path, data_dir: str, serving: Serving) -> dict:
    """Milliseconds per ``Predictor.score_request`` of one request of ``serving.candidates`` rows
    (``request_tables``), the trained model loaded by the serving code, 1 thread: median and p90
    over ``serving.requests`` requests after ``serving.warmup`` untimed ones."""
    import torch

    from pinads_rec.serve.scoring import Predictor

    predictor = Predictor.from_run(run_dir)
    tables = request_tables(predictor.cfg.features, data_dir, serving.candidates, serving.warmup + serving.requests)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = []
        for i, table in enumerate(tables):
            started = time.perf_counter()
            probs = predictor.score_request(table)
            if i >= serving.warmup:
                times.append(1000.0 * (time.perf_counter() - started))
            if probs.shape[0] != serving.candidates:
                raise RuntimeError(f"serving: {serving.candidates} candidates scored as {probs.shape[0]} rows")
    finally:
        torch.set_num_threads(threads)
    return {
        "median_ms": float(np.median(times)),
        "p90_ms": float(np.percentile(times, 90)),
        "requests": serving.requests,
        "candidates": serving.candidates,
        "precision": predictor.cfg.model.precision.inference,
    }


def mean_history_length(cfg: config.ExperimentConfig, group: str, data_dir: Optional[str] = None) -> float:
    """The mean over ``data_dir``'s (default: the eval split's) requests of min(the group's stored
    history length, its ``max_length`` in ``cfg``): the events a request brings to the model. Read
    from the list lengths of the group's timestamp column, once per request in either layout."""
    import pyarrow.compute as pc

    from pinads_rec.data.loader.reader import list_files, open_parquet
    from pinads_rec.data.loader.storage_layout import is_per_request, request_starts

    features = cfg.features
    g = next((g for g in features.sequence_groups if g.name == group), None)
    if g is None:
        names = [g.name for g in features.sequence_groups]
        raise config.ConfigError(f"history_group: no sequence group {group!r} in this config (groups: {names})")
    lengths = []
    for path in list_files(data_dir or cfg.data.eval_dir):
        pf = open_parquet(path)
        if is_per_request(pf.schema_arrow, features):
            column = pf.read(columns=[g.timestamp_column]).column(0)
        else:
            table = pf.read(columns=[features.columns.request_id, g.timestamp_column])
            starts = request_starts(table.column(0).to_numpy())
            column = table.column(1).take(starts)
        lengths.append(pc.list_value_length(column).fill_null(0).to_numpy(zero_copy_only=False))
    return float(np.minimum(np.concatenate(lengths), g.max_length).mean())


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="ablation YAML (configs/ablations/*.yaml)")
    p.add_argument("--quick", action="store_true", help="CI-sized data and steps (the file's `quick` overrides)")
    p.add_argument(
        "--ranks", type=arguments.positive_int, default=2, help="gloo processes per training run (default 2)"
    )
    p.add_argument(
        "--out",
        default=None,
        type=arguments.output_file,
        help="report path (default: the file's `out`; --quick: under runs/)",
    )
    p.add_argument(
        "--runs", default="runs/ablations", type=arguments.output_dir, help="where the variants' run directories go"
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="rewrite the report from finished runs of the same configs (any code version), training nothing",
    )
    args = p.parse_args(argv)
    try:
        ab = load_ablation(args.config)
        common = ab.overrides + (ab.quick if args.quick else [])
        base_cfg = config.load(ab.base, common)
        for v in ab.variants:
            cfg = config.load(ab.base, common + v.overrides)  # every variant's config is valid before any run
            groups = [g.name for g in cfg.features.sequence_groups]
            if ab.history_group is not None and ab.history_group not in groups:
                raise config.ConfigError(
                    f"{args.config}: history_group {ab.history_group!r} is not a sequence group of variant "
                    f"{v.name!r} (its groups: {groups})"
                )
    except config.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    tag = slug(ab.title) + ("-quick" if args.quick else "")
    out = Path(args.out or (f"runs/ablations/{tag}.md" if args.quick else ab.out))
    synth.ensure(base_cfg, Path(base_cfg.data.train_dir).parent, echo=lambda m: print(m, flush=True))
    results, params = {}, {}
    for v in ab.variants:
        overrides = common + v.overrides
        cfg = config.load(ab.base, overrides)
        source = results[v.eval_of]["run_dir"] if v.eval_of else None
        if args.report_only:
            try:
                run_dir = report_only_run(ab, v, overrides, Path(args.runs))
            except config.ConfigError as e:
                print(f"config error: {e}", file=sys.stderr)
                return 2
            summary = finished_summary(run_dir)
            print(f"[{v.name}] report from {run_dir}", flush=True)
        else:
            run_dir = run_dir_for(ab, overrides, Path(args.runs), args.ranks, source)
            summary = run_variant(ab, v, overrides, run_dir, args.ranks, results)
        results[v.name] = dict(summary, run_dir=str(run_dir), cost_only=v.cost_only, series=v.series)
        if ab.history_group is not None:
            results[v.name]["history_length"] = mean_history_length(cfg, ab.history_group)
        if v.eval_of is None:
            params[v.name] = _param_counts(cfg)
            if ab.serving is not None:
                results[v.name]["serving"] = serving_latency(run_dir, cfg.data.eval_dir, ab.serving)
                print(
                    f"[{v.name}] serving 1 x {ab.serving.candidates} candidates: "
                    f"median {results[v.name]['serving']['median_ms']:.1f} ms, "
                    f"p90 {results[v.name]['serving']['p90_ms']:.1f} ms",
                    flush=True,
                )
        else:  # the same trained model: its size and serving cost are its source's
            params[v.name] = params[v.eval_of]
            if "serving" in results[v.eval_of]:
                results[v.name]["serving"] = results[v.eval_of]["serving"]
    command = f"python -m pinads_rec.experiments.ablate --config {args.config}" + (" --quick" if args.quick else "")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_report(ab, results, params, out, command, base_cfg)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
