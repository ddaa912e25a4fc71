"""What the shaped-log generators share: Beijing wall-clock times, popularity weights, the
sigmoid, and the oracle's AUC per day (the summary each writes)."""

from __future__ import annotations

from datetime import datetime
from typing import Dict, Sequence
from zoneinfo import ZoneInfo

import numpy as np
import torch

from pinads_rec import metrics

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
    """ROC AUC of numpy arrays (``pinads_rec.metrics.auc``, the project's one)."""
    return metrics.auc(
        torch.from_numpy(np.asarray(scores, np.float64)), torch.from_numpy(np.asarray(labels, np.float64))
    )


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
