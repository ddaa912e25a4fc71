"""The reference fitted and scored: LightGBM on ``features.PointInTimeFeatures`` of (a sample of)
the training split, one classifier per task, scored on the eval split and measured by the model's
own ``MetricAccumulator`` (AUC, NE, GAUC per surface x task), so the two sit in one table."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np
import torch

from pinads_rec import config
from pinads_rec.metrics import MetricAccumulator, auc_standard_error
from pinads_rec.reference.features import PointInTimeFeatures, Split, light_train_columns

log = logging.getLogger("pinads_rec.reference")

NAME = "LightGBM"


@dataclass
class Fitted:
    """A fitted reference: its summary (what metrics.jsonl and the table get), and for callers that
    compare further (benchmarks/datasets.py) the feature map, the eval split, its feature matrix and
    scores ([rows, tasks]), and the training rows' features and labels."""

    summary: dict
    features: PointInTimeFeatures
    eval_split: Split
    x_train: np.ndarray
    y_train: np.ndarray
    x_eval: np.ndarray
    scores: np.ndarray
    keep_eval: np.ndarray  # the eval rows measured (data.row_filter)


def lightgbm_classifier(settings: config.ReferenceConfig):
    import lightgbm

    # One thread: on a shared machine LightGBM's OpenMP threads spin-wait (several times slower),
    # and when a run ends its other ranks may still be exiting.
    return lightgbm.LGBMClassifier(
        n_estimators=settings.trees,
        learning_rate=settings.learning_rate,
        num_leaves=settings.leaves,
        min_child_samples=50,
        max_bin=63,
        subsample_freq=0,
        random_state=settings.seed,
        n_jobs=1,
        verbose=-1,
    )


def _row_filter(split: Split, data: config.DataConfig) -> np.ndarray:
    """The rows data.row_filter keeps (all without one), as the model's loader does."""
    rule = data.row_filter
    if rule is None:
        return np.ones(split.n, bool)
    return np.isin(split.row_values(rule.column), np.asarray(rule.values))


def fit(cfg: config.ExperimentConfig, settings: Optional[config.ReferenceConfig] = None) -> Fitted:
    """Fits the reference on cfg.data.train_dir and scores cfg.data.eval_dir (settings: cfg.reference)."""
    settings = settings or cfg.reference
    f, data = cfg.features, cfg.data
    if not data.train_dir or not data.eval_dir:
        raise config.ConfigError("the reference needs data.train_dir and data.eval_dir")
    start = time.perf_counter()
    columns = PointInTimeFeatures.columns(f)
    whole_train = Split.read(data.train_dir, f, light_train_columns(f))
    train = Split.read(data.train_dir, f, columns, settings.max_train_rows, settings.seed)
    evaluated = Split.read(data.eval_dir, f, columns, settings.max_eval_rows, settings.seed)
    features = PointInTimeFeatures(f, whole_train, [train, evaluated])
    keep_train, keep_eval = _row_filter(train, data), _row_filter(evaluated, data)
    x_train = features.transform(train, train_rows=True)[keep_train]
    x_eval = features.transform(evaluated)[keep_eval]
    y_train = train.labels(f)[keep_train]
    featured = time.perf_counter()
    scores = np.zeros((len(x_eval), len(f.tasks)))
    for t in range(len(f.tasks)):
        y = (y_train[:, t] > 0.5).astype(np.int64)
        if y.min(initial=0) == y.max(initial=0):  # one class: the rate is all there is
            scores[:, t] = float(y.mean()) if len(y) else 0.5
            continue
        scores[:, t] = lightgbm_classifier(settings).fit(x_train, y).predict_proba(x_eval)[:, 1]
    summary = {
        "model": NAME,
        "features": len(features.names()),
        "train_rows": int(len(x_train)),
        "train_split_rows": int(whole_train.n),
        "eval_rows": int(len(x_eval)),
        "eval_split_rows": int(evaluated.total_rows),
        "feature_s": round(featured - start, 1),
        "fit_s": round(time.perf_counter() - featured, 1),
        "eval": measure(cfg, evaluated, keep_eval, scores),
    }
    return Fitted(summary, features, evaluated, x_train, y_train, x_eval, scores, keep_eval)


def measure(cfg: config.ExperimentConfig, split: Split, keep: np.ndarray, scores: np.ndarray) -> List[Dict]:
    """AUC / NE / GAUC ... per surface x task of ``scores`` (the kept rows of ``split``), as the model's."""
    f = cfg.features
    users = f.columns.user_id if split.has(f.columns.user_id) else None
    acc = MetricAccumulator([t.name for t in f.tasks], f.surfaces, has_oracle=False, has_users=users is not None)
    acc.update(
        torch.from_numpy(scores),
        torch.from_numpy(split.labels(f)[keep]),
        torch.from_numpy(split.surface_index(f)[keep]),
        users=torch.from_numpy(split.row_values(users)[keep].astype(np.int64)) if users is not None else None,
    )
    return acc.compute(gather=False)  # rank 0 alone: the other ranks may have left


def reference_summary(cfg: config.ExperimentConfig) -> dict:
    """``fit(cfg).summary``, or {"model", "error"} when it cannot be fitted: a finished run's result
    must not be lost to its reference (the error is logged and printed with the table)."""
    try:
        return fit(cfg).summary
    except ImportError as e:
        message = f"LightGBM is not installed ({e}); install the project's lock (make setup)"
    except (config.ConfigError, ValueError, OSError, MemoryError) as e:
        message = str(e).strip() or type(e).__name__
    log.warning("reference not fitted: %s", message)
    return {"model": NAME, "error": message}


def describe(reference: dict, model_rows: List[Dict]) -> str:
    """The lines under the final table: what the reference is, and per surface the model's margin on
    the main task (the first) against the AUC's standard error."""
    if "error" in reference:
        return f"reference ({reference['model']}): not fitted: {reference['error']}"
    sampled = reference["train_rows"] < reference["train_split_rows"]
    lines = [
        f"reference: {reference['model']} on {reference['features']} point-in-time features "
        f"(pinads_rec.reference), fitted on {reference['train_rows']:,} "
        + (
            f"of {reference['train_split_rows']:,} training rows (whole requests sampled; reference.max_train_rows)"
            if sampled
            else "training rows"
        )
        + f", scored on {reference['eval_rows']:,} eval rows; {reference['feature_s'] + reference['fit_s']:.0f} s. "
        "vs ref: the model's AUC minus the reference's; AUC se: the model's AUC's standard error."
    ]
    ref = {(r["surface"], r["task"]): r for r in reference["eval"]}
    main = model_rows[0]["task"] if model_rows else None
    verdicts = []
    for r in model_rows:
        other = ref.get((r["surface"], r["task"]))
        if r["task"] != main or other is None or r["auc"] is None or other["auc"] is None:
            continue
        se = auc_standard_error(r["auc"], int(r["positives"]), int(r["examples"]) - int(r["positives"]))
        if se is None:
            continue
        margin = r["auc"] - other["auc"]
        word = "ahead" if margin > se else "behind" if margin < -se else "level (within one se)"
        verdicts.append(f"{r['surface']} {word} ({margin:+.4f}, se {se:.4f})")
    if verdicts:
        lines.append(f"{main}, the model against the reference: " + "; ".join(verdicts))
    return "\n".join(lines)
