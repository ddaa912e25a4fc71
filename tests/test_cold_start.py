"""Cold start: ids a build's vocabulary never kept -- users and items new since its fitting split --
all map to 0. The training batches' id dropout trains that row (build.vocabularies[].dropout), the
build's summary counts the unknown ids per split and table, and the final evaluation reports the
known and the new users apart (docs/data_build.md, "Cold start")."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import checkpoint_tensors, train_tiny

from pinads_rec import config
from pinads_rec.data.build import build
from pinads_rec.data.loader.dataset import LoaderSettings, ParquetBatches
from pinads_rec.data.shaped_logs import DATASETS, movielens
from pinads_rec.features import FeatureLayout
from pinads_rec.training.evaluation import format_slices, unknown_id_features
from pinads_rec.training.run_log import read_run_log

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / DATASETS["movielens"].config
USERS = 60  # ~5,500 ratings: written and built in seconds; most eval users first rate after the train cut
USER_TABLE = "model.model.user_ebc.embedding_bags.user.weight"
OVERRIDES = ["data.batch_size=64", "data.num_workers=0", "train.tensorboard=false"]


@pytest.fixture(scope="module")
def cold_start_run(tmp_path_factory):
    """(config, build summary, run directory) of MovieLens-shaped logs built with a user vocabulary (the
    default id dropout) and the config trained 8 steps on 2 ranks (checkpoints at 4 and 8)."""
    tmp = tmp_path_factory.mktemp("cold_start")
    movielens.write(tmp / "raw", users=USERS)
    overrides = [f"data.{s}_dir={tmp / 'out' / s}" for s in ("train", "calibration", "eval")] + OVERRIDES
    overrides.append("build.vocabularies=[{table: occupation}, {table: user}]")  # the default dropout
    cfg = config.load(CONFIG, overrides)
    summary = build(cfg, str(tmp / "raw"), str(tmp / "out"))
    return cfg, summary, train_tiny(tmp, CONFIG, overrides)


def test_the_unknown_row_is_trained(cold_start_run, tmp_path):
    _, summary, run = cold_start_run
    # The data: no training id is unknown (every training user is in the vocabulary fitted on the
    # training split), and the eval split holds new users: only the dropout can train row 0.
    shares = summary["unknown_ids"]
    assert shares["train"]["user"]["impressions"]["unknown"] == 0
    assert shares["eval"]["user"]["impressions"]["share"] >= 0.15, shares["eval"]
    four = checkpoint_tensors(run / "checkpoints" / "step-4", tmp_path / "4.pt")
    eight = checkpoint_tensors(run / "checkpoints" / "step-8", tmp_path / "8.pt")
    # Row-wise Adagrad: a row's accumulated squared gradient is 0 until a batch looks it up.
    adagrad = eight[f"optimizer.state.sparse.{USER_TABLE[len('model.') :]}.user.momentum1"]
    assert float(adagrad[0]) > 0, "the unknown user row received no gradient"
    assert not torch.equal(four[USER_TABLE][0], eight[USER_TABLE][0]), "the unknown user row did not move"


def test_the_final_evaluation_reports_known_and_new_users(cold_start_run):
    _, summary, run = cold_start_run
    result = read_run_log(run).summary
    eval_users = summary["unknown_ids"]["eval"]["user"]["impressions"]
    rows = {(r["slice"], r["surface"]): r for r in result["slices"]}
    assert {s for s, _ in rows} == {"known users", "new users"}  # no new item in eval: no item slices
    new, known = rows["new users", "all"], rows["known users", "all"]
    # The scoring pass drops no id: its new users are exactly the build's unknown ids.
    assert new["examples"] == eval_users["unknown"]
    assert new["examples"] + known["examples"] == eval_users["ids"]
    assert new["gauc"] is None and known["gauc"] is not None  # new users share one id: no per-user AUC
    assert 0.0 <= new["auc"] <= 1.0 and 0.0 <= known["auc"] <= 1.0
    table = format_slices(result["slices"])
    assert "new users" in table and f"{new['examples'] / eval_users['ids']:.1%}" in table, table


def test_slices_only_where_a_vocabulary_maps_the_ids():
    cfg = config.load(CONFIG)  # the shipped config: raw user ids, only occupation through a vocabulary
    layout = FeatureLayout.of(cfg.features)
    assert unknown_id_features(layout, [v.table for v in cfg.build.vocabularies]) == {}
    assert unknown_id_features(layout, ["user", "movie"]) == {"users": "user_id", "items": "item"}
    assert format_slices([]) == ""


def test_id_dropout_only_in_training_batches(cold_start_run):
    """The training loader (shuffled) sets ids of a table with a dropout rate to 0 at that rate; a
    scoring pass's (never shuffled) and the other tables' ids are left as read."""
    cfg, _, _ = cold_start_run
    settings = LoaderSettings.of(config.load(CONFIG, [*OVERRIDES, "build.vocabularies=[{table: user, dropout: 0.2}]"]))
    assert settings.id_dropout == (("user", 0.2),)

    def zeros(shuffle: bool, key: str) -> float:
        batches = ParquetBatches(cfg.data.train_dir, settings, shuffle=shuffle, drop_last=False)
        ids = torch.cat([b.user_sparse[key].values() for b in batches])
        return float((ids == 0).float().mean())

    assert zeros(False, "user_id") == 0.0  # every training user is in the vocabulary
    assert 0.15 < zeros(True, "user_id") < 0.25
    assert zeros(True, "occupation") == 0.0
