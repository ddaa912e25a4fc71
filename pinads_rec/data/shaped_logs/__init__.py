"""Raw logs in the exact layouts of the public datasets ``configs/datasets/`` reads, each from a
planted-truth world of its own, with the true probabilities kept aside (``truth.csv``): data the
project's model was not designed on, to measure it against the oracle and a simple reference
(``benchmarks/datasets.py``; docs/datasets.md).

``python -m pinads_rec.data.shaped_logs taobao --out RAW [--users N] [--seed S]`` (or ``kuairand``,
``movielens [--avoided-genres N]``).

``config_with_truth`` is the dataset's config (or, with ``config_path``, another config of the same
raw files, such as another history design) with ``truth.csv`` joined as one more side table, so
that every built split carries a ``true_<task>`` column and the evaluation reports the oracle
beside the model; the features, and so the training, are the config's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Sequence

from pinads_rec import config

REPO = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class ShapedDataset:
    config: str  # the dataset's config, relative to the repository root (as the TorchX component takes it)
    truth_key: Dict[str, str]  # truth.csv column -> SQL over the impression row
    truth: Dict[str, str]  # task -> truth.csv column


DATASETS = {
    "taobao": ShapedDataset(
        "configs/datasets/taobao_ad.yaml",
        {"user": "user", "time_stamp": "time_stamp", "adgroup_id": "adgroup_id", "pid": "pid"},
        {"click": "p_click"},
    ),
    "kuairand": ShapedDataset(
        "configs/datasets/kuairand.yaml",
        {"user_id": "user_id", "video_id": "video_id", "time_ms": "time_ms"},
        {"click": "p_click", "long_view": "p_long_view", "like": "p_like"},
    ),
    "movielens": ShapedDataset(
        "configs/datasets/movielens_100k.yaml",
        {"user_id": "user_id", "item_id": "item_id", "timestamp": "timestamp"},
        {"like": "p_like"},
    ),
}


def truth_column(task: str) -> str:
    """The built column holding a task's true probability."""
    return f"true_{task}"


def truth_overrides(name: str) -> list:
    """``--set`` overrides naming each task's true-probability column (metrics only: training reads
    labels, never this column)."""
    return [f"features.tasks.{t}.true_probability_column={truth_column(t)}" for t in DATASETS[name].truth]


def config_with_truth(
    name: str, overrides: Sequence[str] = (), config_path: Optional[str] = None
) -> config.ExperimentConfig:
    """The dataset's config, ``truth.csv`` joined as the side table ``truth`` and each task's true
    probability built into ``true_<task>`` and named as its ``true_probability_column``.
    ``config_path``: another config of the same raw files instead (a variant of the dataset's, e.g.
    another history design; relative to the repository root or absolute)."""
    ds = DATASETS[name]
    raw = config.read_yaml(REPO / (config_path or ds.config))  # extends: resolved
    raw["build"]["side_tables"].append({"name": "truth", "path": ["truth.csv"], "key": dict(ds.truth_key)})
    for task, column in ds.truth.items():
        raw["build"]["columns"][truth_column(task)] = f"truth.{column}"
    return config.from_dict(raw, truth_overrides(name) + list(overrides))
