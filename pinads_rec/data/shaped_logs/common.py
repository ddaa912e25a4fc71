"""What the shaped-log generators share: Beijing wall-clock times, popularity weights, the
sigmoid, and the oracle's AUC (the summary each writes)."""

from __future__ import annotations

from datetime import datetime
from typing import Dict, Sequence
from zoneinfo import ZoneInfo

import numpy as np

BEIJING = ZoneInfo("Asia/Shanghai")


def beijing(year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0) -> int:
    """Epoch seconds of a Beijing wall-clock time (both datasets log Beijing time)."""
    return int(datetime(year, month, day, hour, minute, second, tzinfo=BEIJING).timestamp())


def zipf_weights(n: int, exponent: float, rng: np.random.Generator) -> np.ndarray:
    """Probabilities ~ 1 / rank^exponent over ``n`` items, the ranks shuffled (popularity is not id order)."""
    w = 1.0 / np.arange(1, n + 1) ** exponent
    return rng.permutation(w / w.sum())


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """ROC AUC by ranks (ties averaged); NaN when one class is absent."""
    labels = np.asarray(labels)
    pos = int(labels.sum())
    neg = len(labels) - pos
    if pos == 0 or neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = np.asarray(scores)[order]
    # Average ranks over ties.
    _, first, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    avg = first + (counts - 1) / 2.0 + 1.0
    ranks[order] = np.repeat(avg, counts)
    return float((ranks[labels == 1].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


def daily_oracle_auc(
    day: np.ndarray, surface: np.ndarray, names: Sequence[str], p: np.ndarray, label: np.ndarray
) -> Dict[str, Dict[str, float]]:
    """The oracle's AUC per day and surface: {day: {surface name: AUC}}."""
    out: Dict[str, Dict[str, float]] = {}
    for d in sorted(set(day.tolist())):
        on = day == d
        out[d] = {
            names[k]: round(auc(p[on & (surface == k)], label[on & (surface == k)]), 4) for k in range(len(names))
        }
    return out
