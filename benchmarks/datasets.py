"""A public dataset's config on raw logs of its exact shape with a planted truth: the project's
model, the same model without its sequences, a simple reference and the oracle, side by side.

    python benchmarks/datasets.py --dataset taobao|kuairand [--users N] [--seed S] [--work DIR]
        [--set KEY=VALUE ...] [--timeout-s S]

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
4. **Fits the reference** on ``WORK/data/train``, evaluated on ``eval``: a logistic regression
   (scikit-learn) and gradient-boosted trees (LightGBM, when installed) on hand-computed point-in-
   time features of each row, read off the built files, generic over the config:

   - for every candidate feature that shares a table with a sequence feature (the config's table
     sharing, ``FeatureLayout.shared_keys``), and every group holding a feature of that table: the
     matches of the candidate's id among the newest 5, 20 and all events (log1p) and the log
     seconds since the newest match;
   - when the item feature itself is such a feature (KuaiRand's ``video_id``): the same counts for
     each candidate attribute that is a function of the item (author, tags, ...; the map read off
     the built rows), the events' items mapped to it -- "an earlier click was by this author";
   - the item's and the user's label rate per task on the training split (smoothed towards the
     mean; out of fold on the training rows themselves);
   - the config's dense features (signed log where the config says ``norm: log``) and the surface,
     one-hot.

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
import importlib
import json
import math
import os
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pinads_rec import config, metrics
from pinads_rec.data import storage_layout
from pinads_rec.data.build import build
from pinads_rec.data.shaped_logs import DATASETS, config_with_truth, truth_overrides
from pinads_rec.data.shaped_logs.common import auc
from pinads_rec.experiments import markdown
from pinads_rec.experiments.harness import launch, meters
from pinads_rec.experiments.harness.provenance import code_state
from pinads_rec.features import FeatureLayout
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


def _padded(arr: pa.Array, fill: int = -1) -> np.ndarray:
    """A list<int> array as [n, longest] int64, ``fill`` past each list's end."""
    arr = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
    lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy().astype(np.int64)
    values = pc.list_flatten(arr).to_numpy(zero_copy_only=False).astype(np.int64)
    out = np.full((len(lengths), max(int(lengths.max(initial=0)), 1)), fill, dtype=np.int64)
    starts = np.cumsum(lengths) - lengths
    rows = np.repeat(np.arange(len(lengths)), lengths)
    out[rows, np.arange(len(values)) - starts[rows]] = values
    return out


class Split:
    """One built split in memory: candidate columns one value per row, request-level ones once per
    request, ``req`` the request of each row."""

    def __init__(self, path: Path, features: config.FeaturesConfig, columns: Sequence[str]):
        files = sorted(path.glob("*.parquet"))
        schema = pq.read_schema(files[0])
        self.request_level = storage_layout.stored_request_level(schema, features)
        table = pa.concat_tables(pq.read_table(f, columns=list(dict.fromkeys(columns))) for f in files)
        self.table = table
        counts = storage_layout.candidate_counts(table, features)
        self.req = np.repeat(np.arange(len(counts)), counts)
        self.n = len(self.req)

    def row_values(self, column: str) -> np.ndarray:
        """A scalar column, one value per row."""
        col = self.table.column(column).combine_chunks()
        if column in self.request_level:
            return col.to_numpy(zero_copy_only=False)[self.req]
        return pc.list_flatten(col).to_numpy(zero_copy_only=False)

    def row_lists(self, column: str) -> np.ndarray:
        """An id column as [rows, k] (single ids: k = 1), -1 padded."""
        col = self.table.column(column).combine_chunks()
        if column in self.request_level:
            one = col if pa.types.is_list(col.type) else pa.array([[x] for x in col.to_pylist()])
            return _padded(one)[self.req]
        flat = pc.list_flatten(col)
        return _padded(flat) if pa.types.is_list(flat.type) else flat.to_numpy(zero_copy_only=False)[:, None]

    def request_padded(self, column: str) -> np.ndarray:
        """A request-level list column as [requests, L]; a list of bags (a multi-valued event
        attribute) as [requests, L, K]; -1 padded."""
        col = self.table.column(column).combine_chunks()
        if not pa.types.is_list(col.type.value_type):
            return _padded(col)
        events = _padded(pc.list_flatten(col))  # [all events, K]
        lengths = pc.fill_null(pc.list_value_length(col), 0).to_numpy().astype(np.int64)
        out = np.full((len(lengths), max(int(lengths.max(initial=0)), 1), events.shape[1]), -1, dtype=np.int64)
        starts = np.cumsum(lengths) - lengths
        rows = np.repeat(np.arange(len(lengths)), lengths)
        out[rows, np.arange(len(events)) - starts[rows]] = events
        return out


def _signed_log(x: np.ndarray) -> np.ndarray:
    return np.sign(x) * np.log1p(np.abs(x))


def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-6, 1 - 1e-6)
    return np.log(p / (1 - p))


class Reference:
    """The reference's feature map (module docstring, step 4), fitted on the training split."""

    def __init__(self, cfg: config.ExperimentConfig, splits: Dict[str, Split]):
        f = cfg.features
        self.features, self.layout = f, FeatureLayout.of(f)
        self.tasks = [t.label_column for t in f.tasks]
        sparse = {s.name: s for s in f.sparse}
        # (candidate feature, group, event column) for each table shared with a sequence feature.
        self.matches = []
        for key in self.layout.shared_keys:
            s = sparse[key]
            if s.user_side:
                continue
            for g in f.sequence_groups:
                for e in g.features:
                    if e.table == s.table:
                        self.matches.append((s.column, g, e.column))
        # The item's attributes, through the events' items: when the item feature is shared.
        item = next((s for s in f.sparse if s.column == f.columns.item_id and not s.user_side), None)
        self.attributes = []  # (attribute column, group, event column, item -> [k] ids)
        if item is not None and item.name in self.layout.shared_keys:
            for s in f.sparse:
                if s.user_side or s.name == item.name or s.table in self.layout.sequence_tables:
                    continue
                of_item = self._attribute_map(splits, f.columns.item_id, s.column)
                if of_item is None:
                    continue
                for column, g, e in self.matches:
                    if column == item.column:
                        self.attributes.append((s.column, g, e, of_item))
        # Label rates on the training split: (sum, count) per item and per user, each task.
        train = splits["train"]
        self.item, self.user = train.row_values(f.columns.item_id), train.row_values(f.columns.user_id)
        self.labels = np.stack([train.row_values(t) for t in self.tasks], 1).astype(np.float64)
        self.prior = self.labels.mean(0)
        self.fold = train.req % FOLDS
        self.rates = {
            "item": self._rate_tables(self.item, self.labels),
            "user": self._rate_tables(self.user, self.labels),
        }

    @staticmethod
    def _attribute_map(splits: Dict[str, Split], item_column: str, column: str) -> Optional[np.ndarray]:
        """item id -> its ``column`` ids ([items, k], -1 padded) when every item has one value in
        every split's rows (an item attribute); None otherwise. The unknown item (0) has none."""
        items = np.concatenate([s.row_values(item_column) for s in splits.values()]).astype(np.int64)
        lists = [s.row_lists(column) for s in splits.values()]
        k = max(x.shape[1] for x in lists)
        values = np.concatenate([np.pad(x, ((0, 0), (0, k - x.shape[1])), constant_values=-1) for x in lists])
        known = items > 0
        items, values = items[known], values[known]
        out = np.full((int(items.max(initial=0)) + 1, k), -2, dtype=np.int64)
        out[items] = values
        if not (out[items] == values).all():  # an item with two values: not an attribute
            return None
        out[out == -2] = -1
        return out

    @staticmethod
    def _rate_tables(ids: np.ndarray, labels: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        ids = ids.astype(np.int64)
        size = int(ids.max()) + 1
        counts = np.bincount(ids, minlength=size).astype(np.float64)
        sums = np.stack([np.bincount(ids, weights=labels[:, t], minlength=size) for t in range(labels.shape[1])], 1)
        return sums, counts

    def _rates(self, which: str, ids: np.ndarray, train_rows: bool) -> np.ndarray:
        """Smoothed label rates (logit) of ``ids`` per task; out of fold for the training rows."""
        sums, counts = self.rates[which]
        ids = ids.astype(np.int64)
        known = ids < len(counts)
        safe = np.where(known, ids, 0)
        s = np.where(known[:, None], sums[safe], 0.0)
        c = np.where(known, counts[safe], 0.0)
        if train_rows:  # minus the row's own fold
            base = self.user if which == "user" else self.item
            for k in range(FOLDS):
                on = self.fold == k
                fold_s, fold_c = self._rate_tables(base[on], self.labels[on])
                pad = len(counts) - len(fold_c)
                fold_s = np.pad(fold_s, ((0, pad), (0, 0)))
                fold_c = np.pad(fold_c, (0, pad))
                s[on] -= fold_s[safe[on]]
                c[on] -= fold_c[safe[on]]
        return _logit((s + RATE_PRIOR * self.prior) / (c + RATE_PRIOR)[:, None])

    def names(self) -> List[str]:
        out = []
        for column, _, e in self.matches:
            out += [f"{column}~{e}: newest {k}" for k in RECENT] + [f"{column}~{e}: all", f"{column}~{e}: log s since"]
        for column, _, e, _ in self.attributes:
            out += [f"{column}~{e}.{column}: newest {k}" for k in RECENT]
            out += [f"{column}~{e}.{column}: all", f"{column}~{e}.{column}: log s since"]
        out += [f"{w} rate {t}" for w in ("item", "user") for t in self.tasks]
        out += [d.name for d in self.features.dense if d.dim == 1]
        out += [f"surface {s}" for s in self.features.surfaces]
        return out

    def transform(self, split: Split, train_rows: bool = False) -> np.ndarray:
        f = self.features
        t_req = split.table.column(f.columns.timestamp).combine_chunks().to_numpy().astype(np.float64)
        blocks = []
        for column, g, e in self.matches:
            cand = split.row_lists(column)
            blocks.append(self._match_features(split, cand, split.request_padded(e), g, t_req, None))
        for column, g, e, of_item in self.attributes:
            cand = split.row_lists(column)
            blocks.append(self._match_features(split, cand, split.request_padded(e), g, t_req, of_item))
        blocks.append(self._rates("item", split.row_values(f.columns.item_id), train_rows))
        blocks.append(self._rates("user", split.row_values(f.columns.user_id), train_rows))
        for d in f.dense:
            if d.dim == 1:
                x = split.row_values(d.column).astype(np.float64)
                blocks.append((_signed_log(x) if d.norm == "log" else x)[:, None])
        surface = split.row_values(f.columns.surface)
        blocks.append(np.stack([surface == s for s in f.surfaces], 1).astype(np.float64))
        return np.concatenate(blocks, 1).astype(np.float32)

    @staticmethod
    def _match_features(split, cand, events, g, t_req, of_item) -> np.ndarray:
        """Per row: matches of the candidate's ids (0 = unknown, never a match) among the newest
        5 / 20 / all events (log1p), and log1p(seconds since the newest match). ``of_item``: the
        events are items, compared through this attribute map. Events of bags ([U, L, K]: a
        multi-valued attribute) match when a bag holds one of the candidate's ids."""
        ts = split.request_padded(g.timestamp_column)
        out = np.empty((split.n, len(RECENT) + 2))
        for lo in range(0, split.n, CHUNK_ROWS):
            rows = slice(lo, min(lo + CHUNK_ROWS, split.n))
            req = split.req[rows]
            ev = events[req]  # [r, L]
            c = np.where(cand[rows] > 0, cand[rows], -3)  # [r, k]
            if of_item is not None:
                known = (ev >= 0) & (ev < len(of_item))
                ev_attr = np.where(known[:, :, None], of_item[np.where(known, ev, 0)], -1)  # [r, L, k']
                hit = (ev_attr[:, :, :, None] == c[:, None, None, :]).any((2, 3))
            elif ev.ndim == 3:
                hit = (ev[:, :, :, None] == c[:, None, None, :]).any((2, 3))
            else:
                hit = (ev[:, :, None] == c[:, None, :]).any(2)
            for i, k in enumerate(RECENT):
                out[rows, i] = np.log1p(hit[:, :k].sum(1))
            out[rows, len(RECENT)] = np.log1p(hit.sum(1))
            first = hit.argmax(1)
            any_hit = hit.any(1)
            age = t_req[req] - ts[req, first].astype(np.float64)
            out[rows, len(RECENT) + 1] = np.log1p(np.where(any_hit, np.maximum(age, 0.0), NO_MATCH_S))
        return out


def fit_references(cfg: config.ExperimentConfig, data: Path, work: Path) -> Dict[str, dict]:
    """The references' eval predictions: {name: {"scores": [rows, tasks]}} plus the eval rows' labels,
    surfaces and true probabilities under "eval"."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    f = cfg.features
    columns = [f.columns.timestamp, f.columns.user_id, f.columns.item_id, f.columns.surface]
    columns += [t.label_column for t in f.tasks] + [t.true_probability_column for t in f.tasks]
    columns += [s.column for s in f.sparse if not s.user_side]
    columns += [c for g in f.sequence_groups for c in [g.timestamp_column] + [e.column for e in g.features]]
    columns += [d.column for d in f.dense]
    splits = {s: Split(data / s, f, columns) for s in ("train", "eval")}
    t0 = time.perf_counter()
    ref = Reference(cfg, splits)
    names = ref.names()
    x_train = ref.transform(splits["train"], train_rows=True)
    x_eval = ref.transform(splits["eval"])
    print(
        f"   reference features: {len(names)} on {len(x_train):,} training rows, {len(x_eval):,} eval rows "
        f"({time.perf_counter() - t0:.0f} s)",
        flush=True,
    )
    (work / "reference_features.json").write_text(json.dumps(names, indent=1) + "\n")
    ev = splits["eval"]
    labels = np.stack([ev.row_values(t.label_column) for t in f.tasks], 1).astype(np.float64)
    truth = np.stack([ev.row_values(t.true_probability_column) for t in f.tasks], 1).astype(np.float64)
    surface = ev.row_values(f.columns.surface)

    def logistic():
        return make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000))

    everything = np.arange(len(names))
    history = np.array(["~" in n for n in names])  # the match features: what the sequences tell
    models = {"logistic regression": (logistic, everything), "LR without history": (logistic, np.flatnonzero(~history))}
    try:
        import lightgbm

        # One thread: on a shared machine LightGBM's OpenMP threads spin-wait (several times slower).
        models["LightGBM"] = (
            lambda: lightgbm.LGBMClassifier(
                n_estimators=200,
                learning_rate=0.1,
                num_leaves=31,
                min_child_samples=50,
                max_bin=63,
                n_jobs=1,
                verbose=-1,
            ),
            everything,
        )
    except ImportError:
        print("   LightGBM not installed: the logistic regression only")
    out = {"eval": {"labels": labels, "truth": truth, "surface": surface}}
    for name, (make, use) in models.items():
        t0 = time.perf_counter()
        scores = np.zeros_like(labels)
        for t, task in enumerate(f.tasks):
            y = splits["train"].row_values(task.label_column).astype(np.int64)
            scores[:, t] = make().fit(x_train[:, use], y).predict_proba(x_eval[:, use])[:, 1]
        out[name] = {"scores": scores}
        print(f"   {name}: fitted in {time.perf_counter() - t0:.0f} s", flush=True)
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


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", required=True, choices=sorted(DATASETS))
    p.add_argument("--users", type=int, default=None, help="users of the generated logs (default: the generator's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default=None, help="working directory (default: runs/datasets_benchmark/<dataset>)")
    config.add_overrides_flag(p, "an override for the build and both trainings (e.g. train.max_steps=20)")
    p.add_argument("--timeout-s", type=float, default=4 * 3600.0, help="limit of each training launch")
    args = p.parse_args(argv)
    ds = DATASETS[args.dataset]
    work = Path(args.work or REPO / "runs" / "datasets_benchmark" / args.dataset).resolve()
    raw, data = work / "raw", work / "data"
    work.mkdir(parents=True, exist_ok=True)
    stages: Dict[str, dict] = {}
    start = time.perf_counter()

    with Stage("generate", stages):
        writer = importlib.import_module(f"pinads_rec.data.shaped_logs.{args.dataset}")
        generated = writer.write(raw, **({"users": args.users} if args.users else {}), seed=args.seed)
    overrides = data_overrides(data) + truth_overrides(args.dataset) + list(args.overrides)
    with Stage("build", stages):
        cfg = config_with_truth(args.dataset, data_overrides(data) + list(args.overrides))
        built = build(cfg, str(raw), str(data), threads=min(os.cpu_count() or 1, 4))
    runs = {}
    for name, extra in (("model", []), ("no sequences", ["features.sequence_groups=[]"])):
        print(f"== train: {name}", flush=True)
        run_dir = work / "runs" / name.replace(" ", "_")
        runs[name] = run = torchx_train(ds.config, overrides + extra, run_dir, args.timeout_s)
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
    title = f"{args.dataset}: {users} users, seed {args.seed} ({ds.config})" + (
        f", --set {' '.join(args.overrides)}" if args.overrides else ""
    )
    sizes = {s: {k: built["splits"][s][k] for k in ("requests", "rows")} for s in built["splits"]}
    text = (
        f"# {title}\n\nAUC on the eval split (lift = (AUC - 0.5) / (oracle AUC - 0.5))\n\n{table}\n\n{check}\n\n"
        f"| stage | wall s | peak RSS MiB |\n|---|---|---|\n{timing}\n"
    )
    print("\n" + text)
    print(f"total {time.perf_counter() - start:.0f} s; report in {work}/report.md and report.json")
    (work / "report.md").write_text(text)
    result = {
        "dataset": args.dataset,
        "users": args.users,
        "seed": args.seed,
        "overrides": list(args.overrides),
        "rows": rows,
        "stages": stages,
        "generated": generated,
        "build": {"splits": sizes, "join_misses": built["join_misses"], "seconds": built["seconds"]},
        "commands": {name: run["command"] for name, run in runs.items()},
        "code": code_state(),
        "runs": {name: str(work / "runs" / name.replace(" ", "_")) for name in runs},
    }
    (work / "report.json").write_text(json.dumps(result, indent=1, default=float) + "\n")


if __name__ == "__main__":
    main()
