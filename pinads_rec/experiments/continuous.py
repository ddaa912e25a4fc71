"""Continuous training: a new day of logs, yesterday's model, tomorrow's evaluation.

    python -m pinads_rec.experiments.continuous --config configs/continuous.yaml [--out runs/continuous]
        [--strategies incremental,window,frozen] [--window 5] [--ranks 2] [--report docs/continuous.md]
        [--raw] [--set synth.drift.days=14 ...]

The drifting world (``synth.drift``: docs/synthetic_data.md) is generated once, one directory a day
(``pinads_rec.data.synth.ensure``, skipped when present). With ``--raw`` the loop works as a team
on its own logs does: the world is generated as raw logs too, and each day's training data is
built from them the morning it is needed (``data.build``'s day build, ``build_days``: the same
step as ``python -m pinads_rec.data.build --day D``; equal to the generator's day, row for row),
into ``<out>/built/days/<date>/``. Then for each day d but the last, each
strategy makes the model it would publish on the morning after d, and that model scores day d + 1:

- ``incremental``: yesterday's (d - 1) model warm-started (``train.init_from``) and trained one
  epoch on day d alone; day 0 from scratch;
- ``window``: retrained from scratch on the last ``--window`` days (d - window + 1 .. d), one epoch;
- ``frozen``: day 0's model, never updated.

On day 0 the three are one model (day 0 from scratch), trained once.

Each training is one TorchX launch of ``pinads_rec/train.py`` (``harness.launch.torchx_train``), the
command a scheduler runs each morning (docs/continuous.md says how). Its trainer evaluates on day
d + 1 as ``data.eval_dir``; the loop evaluates every strategy's published model the same way, the
way serving scores it (``serve.Predictor`` on day d + 1's files): AUC, GAUC, NE and calibration per
surface x task over every row, over the rows of ads launched on d + 1 (never seen in training: the
ids no earlier day holds) and over the rest. The first strategy named is the one the loop
publishes: each of its new models is exported for serving (``serve.export_run``:
``<out>/<strategy>/<date>/model.pt2``); the others are the references it is compared with. One
row per day and strategy goes to ``<out>/continuous.json``; the report (``continuous_report.py``)
tabulates and charts them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

from pinads_rec import arguments, config
from pinads_rec.data import synth
from pinads_rec.data.build import build_days, day_dir
from pinads_rec.experiments.continuous_report import metric_value, write_report
from pinads_rec.experiments.harness import finished_runs, launch

STRATEGIES = ("incremental", "window", "frozen")
RESULTS_FILE = "continuous.json"
# Where the model a strategy publishes after day d was trained (frozen publishes day 0's forever).
TRAINED_BY = {"incremental": "incremental", "window": "window", "frozen": "incremental"}


@dataclasses.dataclass
class Loop:
    """One loop's settings: the config (with ``synth.drift``), where it works, what it compares."""

    config_path: str
    overrides: List[str]
    out: Path
    strategies: Sequence[str] = STRATEGIES
    window: int = 5
    ranks: int = 2
    timeout_s: float = 3600.0
    raw: bool = False  # build each day from the raw logs (``build_day``) instead of the generator's files
    publish: bool = True  # export the first strategy's new models for serving (a comparison alone needs none)

    @property
    def cfg(self) -> config.ExperimentConfig:
        return config.load(self.config_path, self.overrides)

    def day_dirs(self) -> List[Path]:
        """Each day's training data: the generator's, or (``raw``) where its day build writes it."""
        names = synth.day_names(self.cfg.synth)
        if self.raw:
            return [day_dir(str(self.out / "built"), name) for name in names]
        return [self.out / "data" / "days" / name for name in names]


def ensure_days(loop: Loop) -> List[Path]:
    """The drifting world's day directories, generated once (the cache skips a finished one)."""
    cfg = loop.cfg
    if cfg.synth.drift is None:
        raise config.ConfigError(f"{loop.config_path}: the loop needs synth.drift (a world that drifts by day)")
    if cfg.synth.drift.days < 3:
        raise config.ConfigError("synth.drift.days: the loop needs at least 3 days (train, then two next days)")
    ids = synth.num_item_ids(cfg.synth)  # every day launches ads with new ids, above the earlier ones
    mapped = {v.table for v in cfg.build.vocabularies}  # raw ids mapped into the table by the build
    for sparse in cfg.features.sparse:
        table = cfg.features.table(sparse.table)
        fits = table.hash or table.managed_collision is not None or table.name in mapped
        if sparse.column == cfg.features.columns.item_id and not fits and table.num_embeddings < ids:
            raise config.ConfigError(
                f"table {table.name!r}: num_embeddings {table.num_embeddings:,} is below the {ids:,} item ids "
                f"{cfg.synth.drift.days} drifting days launch; raise it, or set hash: true or managed_collision"
            )
    if cfg.build.vocabularies and not loop.raw:
        raise config.ConfigError(
            f"{loop.config_path}: build.vocabularies needs --raw: the vocabularies map raw ids as each day is built "
            "from the raw logs (the generator's days hold the ids unmapped)"
        )
    synth.ensure(cfg, loop.out / "data", raw=loop.raw, echo=lambda m: print(m, flush=True))
    return loop.day_dirs()


VOCABULARY_FIT = "vocabulary-fit"  # <out>/built/vocabulary-fit/: the build of day 0 that fits build.vocabularies


def fit_vocabularies(loop: Loop) -> Optional[Path]:
    """With ``build.vocabularies``: the build of the first day alone that fits them (each one's
    fit_split is that day), made once; every day's build then maps its ids through them, so an id
    first seen later is out of vocabulary -- a vocabulary fitted once, as a team that fits it on its
    first training split has. None without vocabularies."""
    from pinads_rec.data.build import build
    from pinads_rec.data.build_output import MANIFEST

    cfg = loop.cfg
    if not cfg.build.vocabularies:
        return None
    out = loop.out / "built" / VOCABULARY_FIT
    if not (out / MANIFEST).is_file():
        days = synth.days_build_config(cfg.build, cfg.synth)
        first = days.splits[0]
        vocabularies = [dataclasses.replace(v, fit_split=first.name) for v in days.vocabularies]
        days = dataclasses.replace(days, splits=[first], vocabularies=vocabularies)
        build(dataclasses.replace(cfg, build=days), str(loop.out / "data" / "raw"), str(out))
    return out


def build_day(loop: Loop, day: Path) -> float:
    """Builds ``day`` (one of ``loop.day_dirs()``) from the raw logs unless it is built already,
    its ids mapped through ``fit_vocabularies`` when the config has vocabularies; returns the build's
    seconds (0 when it was there)."""
    from pinads_rec.data.build_output import MANIFEST

    if not loop.raw or (day / MANIFEST).is_file():  # a day build is swapped in whole: a manifest is complete
        return 0.0
    cfg = loop.cfg
    started = time.perf_counter()
    vocabularies = fit_vocabularies(loop)
    cfg = dataclasses.replace(cfg, build=synth.days_build_config(cfg.build, cfg.synth))
    build_days(cfg, str(loop.out / "data" / "raw"), str(day.parents[1]), [day.name], vocabularies=vocabularies)
    return time.perf_counter() - started


def window_dir(days: Sequence[Path], into: Path) -> Path:
    """A directory of links to every file of ``days`` (in day order, each named after its day: the
    loader reads files in name order, and the calibration holdout is the latest row groups)."""
    shutil.rmtree(into, ignore_errors=True)
    into.mkdir(parents=True)
    for day in days:
        for f in sorted(day.rglob("*.parquet")):
            (into / f"{day.name}-{f.name}").symlink_to(f.resolve())
    return into


def train_day(loop: Loop, strategy: str, d: int, days: Sequence[Path]) -> Dict[str, object]:
    """The model ``strategy`` trains after day ``d`` (one TorchX launch), evaluated by its trainer on
    day d + 1; returns its run directory, the rows it trained and the launch's seconds."""
    run_dir = loop.out / strategy / days[d].name
    if strategy == "incremental":
        train_dir = days[d]
        init = [f"train.init_from={loop.out / strategy / days[d - 1].name}"] if d > 0 else []
    else:
        train_dir = window_dir(days[max(0, d - loop.window + 1) : d + 1], loop.out / "windows" / days[d].name)
        init = []
    finished = _trained(run_dir)
    if finished is None:
        shutil.rmtree(run_dir, ignore_errors=True)
        overrides = loop.overrides + init + [f"data.train_dir={train_dir}", f"data.eval_dir={days[d + 1]}"]
        overrides += [f"train.run_dir={run_dir}", "train.epochs=1", "train.max_steps=0"]
        started = time.perf_counter()
        rc = launch.torchx_train(
            loop.config_path, overrides, f"1x{loop.ranks}", run_dir / "train.log", timeout_s=loop.timeout_s
        )
        if rc == 0:  # what the launch cost, beside the run it made
            (run_dir / "launch.json").write_text(json.dumps({"seconds": time.perf_counter() - started}))
        finished = _trained(run_dir)
        if finished is None:
            tail = (run_dir / "train.log").read_text().strip().splitlines()[-15:]
            raise RuntimeError(f"{strategy} day {days[d].name}: train.py failed (exit {rc}):\n" + "\n".join(tail))
    return finished


def _trained(run_dir: Path) -> Optional[Dict[str, object]]:
    """A finished training run's figures (None when it has not finished: ``harness.finished_runs``)."""
    log = finished_runs.finished_run(run_dir)
    launched = run_dir / "launch.json"
    if log is None or not launched.exists():
        return None
    return {
        "run_dir": str(run_dir),
        "rows_trained": sum(e["rows_trained"] for e in log.epochs),
        "train_seconds": log.summary["train_seconds"],
        "launch_seconds": json.loads(launched.read_text())["seconds"],
    }


def seen_items(days: Sequence[Path], item_column: str) -> np.ndarray:
    """Every item id of ``days`` (sorted, unique): the ads a model trained on them has seen."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from pinads_rec.data.loader.reader import open_parquet

    ids = []
    for day in days:
        for f in sorted(day.rglob("*.parquet")):
            column = open_parquet(str(f)).read(columns=[item_column]).column(item_column).combine_chunks()
            if pa.types.is_list(column.type):  # one row per request: the candidates' ids as a list
                column = pc.list_flatten(column)
            ids.append(np.unique(column.to_numpy(zero_copy_only=False)))
    return np.unique(np.concatenate(ids)) if ids else np.zeros(0, np.int64)


def evaluate_day(
    run_dir: Path, day: Path, raw_day: Path, before: np.ndarray, today: np.ndarray
) -> Dict[str, List[dict]]:
    """The published model of ``run_dir`` on ``day``, scored as serving scores it: metrics rows per
    surface x task over all rows, the ads new that day (ids no training day held), the others, and
    of those the ads first seen on the last training day (``recent``: ``today`` minus ``before``,
    younger than a day when the model was published) and the ones seen before it (``older``).
    The rows' raw item ids come from ``raw_day``, the generator's files of the same day, row for row
    the same (``day`` may hold them mapped through a vocabulary)."""
    import torch

    from pinads_rec.data.loader.reader import AS_READ_PREFIX
    from pinads_rec.metrics import MetricAccumulator
    from pinads_rec.serve.batching import ScoringBatches
    from pinads_rec.serve.scoring import Predictor

    predictor = Predictor.from_run(run_dir)
    cfg = predictor.cfg
    f = cfg.features
    tasks = [t.name for t in f.tasks]
    oracle = all(t.true_probability_column for t in f.tasks)
    names = ("all", "new", "old", "recent", "older")
    slices = {name: MetricAccumulator(tasks, f.surfaces, oracle, has_users=True) for name in names}
    raw_items, raw_requests = _rows(raw_day, f.columns.item_id, f.columns.request_id)
    at = 0
    for table, batch in ScoringBatches(cfg, str(day)):
        valid = batch.valid
        probs = predictor.score_batch(batch)[valid]
        requests = table.column(AS_READ_PREFIX + f.columns.request_id).to_numpy()
        if not np.array_equal(requests, raw_requests[at : at + len(requests)]):
            raise RuntimeError(f"{day}: its rows are not {raw_day}'s, row for row (request ids differ near row {at})")
        items = raw_items[at : at + len(requests)]
        at += len(requests)
        known_before, known_today = np.isin(items, before), np.isin(items, today)
        masks = {
            "new": ~(known_before | known_today),
            "old": known_before | known_today,
            "recent": known_today & ~known_before,
            "older": known_before,
        }
        rows = [probs, batch.labels[valid], batch.surface[valid]]
        true, users = batch.true_probs[valid] if oracle else None, batch.user_id[valid]
        slices["all"].update(*rows, true, users=users)
        for name, keep in masks.items():
            mask = torch.from_numpy(keep)
            if mask.any():
                slices[name].update(*(r[mask] for r in rows), None if true is None else true[mask], users=users[mask])
    return {name: acc.compute() for name, acc in slices.items()}


def _rows(day: Path, item: str, request: str) -> List[np.ndarray]:
    """(item id, request id) of every candidate row of a day's contract files, files in name order."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from pinads_rec.data.loader.reader import open_parquet

    items, requests = [], []
    for path in sorted(day.rglob("*.parquet")):
        table = open_parquet(str(path)).read(columns=[item, request])
        ids = table.column(item).combine_chunks()
        if pa.types.is_list(ids.type):  # one row per request: the candidates' ids as a list
            counts = pc.list_value_length(ids).to_numpy(zero_copy_only=False)
            requests.append(np.repeat(table.column(request).to_numpy(), counts))
            ids = pc.list_flatten(ids)
        else:
            requests.append(table.column(request).to_numpy())
        items.append(ids.to_numpy(zero_copy_only=False))
    return [np.concatenate(x) if x else np.zeros(0, np.int64) for x in (items, requests)]


def export_model(run_dir: Path, day: Path) -> Path:
    """The serving artifact of a run (``serve.export_run``), traced on ``day``'s first rows."""
    from pinads_rec.serve.export import export_run

    out = Path(run_dir) / "model.pt2"
    if not out.exists():
        export_run(run_dir, out, data_dir=str(day))
    return out


def run_loop(loop: Loop, echo=print) -> List[dict]:
    """Every day's row per strategy (also kept in ``<out>/continuous.json``, resumable: finished
    runs are reused)."""
    days = ensure_days(loop)
    generated = [loop.out / "data" / "days" / day.name for day in days]
    cfg = loop.cfg
    results: List[dict] = []
    for d in range(len(days) - 1):
        build_seconds = build_day(loop, days[d]) + build_day(loop, days[d + 1])  # today's data, tomorrow's
        # The ads a model trained through day d has seen, by raw id (the generator's days hold them).
        item = cfg.features.columns.item_id
        before, today = seen_items(generated[:d], item), seen_items(generated[d : d + 1], item)
        trained: Dict[str, Dict[str, object]] = {}
        scored: Dict[Path, Dict[str, List[dict]]] = {}  # by run: day 0's one model is scored once for every strategy
        for strategy in loop.strategies:
            # Day 0: every strategy's model is the same (day 0 from scratch): trained once.
            source = TRAINED_BY[strategy] if d > 0 else "incremental"
            if strategy == "frozen" and d > 0:
                run = {"run_dir": str(loop.out / source / days[0].name), "rows_trained": 0, "train_seconds": 0.0}
                run["launch_seconds"] = 0.0
            else:
                run = trained.get(source) or train_day(loop, source, d, days)
                trained[source] = run
            run_dir = Path(run["run_dir"])
            if loop.publish and strategy == loop.strategies[0] and (strategy != "frozen" or d == 0):
                export_model(run_dir, days[d + 1])  # what the loop publishes; the others are references
            if run_dir not in scored:
                scored[run_dir] = evaluate_day(run_dir, days[d + 1], generated[d + 1], before, today)
            rows = scored[run_dir]
            result = {
                "day": d,
                "date": days[d].name,
                "evaluated_on": days[d + 1].name,
                "strategy": strategy,
                **{k: run[k] for k in ("run_dir", "rows_trained", "train_seconds", "launch_seconds")},
                "build_seconds": build_seconds,
                "eval": rows,
            }
            results.append(result)
            echo(summary_line(result))
        (loop.out / RESULTS_FILE).write_text(json.dumps(results, indent=1, default=float))
    return results


def summary_line(result: dict) -> str:
    ev = result["eval"]

    def f(x: Optional[float]) -> str:
        return "-" if x is None else f"{x:.4f}"

    return (
        f"{result['date']} -> {result['evaluated_on']}  {result['strategy']:<11}"
        f"  click AUC {f(metric_value(ev['all'], 'auc'))}  GAUC {f(metric_value(ev['all'], 'gauc'))}"
        f"  new ads {f(metric_value(ev['new'], 'auc'))}  other ads {f(metric_value(ev['old'], 'auc'))}"
        f"  trained {result['rows_trained']:,} rows in {result['train_seconds']:.0f} s"
        + (f" (days built in {result['build_seconds']:.0f} s)" if result.get("build_seconds") else "")
    )


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/continuous.yaml")
    config.add_overrides_flag(p, "an override of every day's training (e.g. synth.drift.days=4)")
    p.add_argument(
        "--out",
        default="runs/continuous",
        type=arguments.output_dir,
        help="data, runs and continuous.json (default: %(default)s)",
    )
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated subset of %(default)s")
    p.add_argument(
        "--window", type=arguments.positive_int, default=5, help="days the window strategy retrains on (default: 5)"
    )
    p.add_argument(
        "--ranks", type=arguments.positive_int, default=2, help="gloo ranks of each training launch (default: 2)"
    )
    p.add_argument(
        "--raw", action="store_true", help="build each day from the generated raw logs (data.build --day) as it comes"
    )
    p.add_argument(
        "--report",
        default=None,
        type=arguments.output_file,
        help="write the markdown report here (e.g. docs/continuous.md)",
    )
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = sorted(set(strategies) - set(STRATEGIES))
    if unknown or not strategies:
        print(
            f"--strategies: {', '.join(unknown) or 'none given'}; choose from {', '.join(STRATEGIES)}", file=sys.stderr
        )
        return 2
    loop = Loop(args.config, args.overrides, Path(args.out))
    loop = dataclasses.replace(loop, strategies=strategies, window=args.window, ranks=args.ranks, raw=args.raw)
    try:
        results = run_loop(loop)
    except config.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.report:
        print(f"wrote {write_report(results, loop, Path(args.report))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
