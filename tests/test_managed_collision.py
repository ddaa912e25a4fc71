"""Managed-collision tables (pinads_rec/managed_collision.py): raw ids spread over the managed
modules' input range, the config's refusals, and -- on 2 gloo ranks -- TorchRec's managed-collision
collections sharded row-wise and pipelined, evicting, checkpointed, warm-started on 1 rank (the
id -> slot map and rows as trained), refused on more ranks with a clear error, and served and
exported with the trainer's scores."""

import dataclasses
import json
import os

import numpy as np
import pytest
import torch
from conftest import checkpoint_tensors, load_tiny

from pinads_rec import config, parallel
from pinads_rec.experiments.harness import run_ranks
from pinads_rec.managed_collision import INPUT_RANGE, PLANNING_BUCKETS, spread_ids
from pinads_rec.training import checkpoint

# The item table (sequence EC and candidate ids) managed with LRU and few slots, so ids are evicted
# within a few steps; the advertiser table (per-row EBC) by LFU with an admission threshold; the
# user table (per-request EBC) by LRU. Every collection is then a managed one.
SLOTS = 400
MANAGED = [
    "features.tables.item.managed_collision.eviction=lru",
    "features.tables.item.managed_collision.eviction_interval=2",
    f"features.tables.item.num_embeddings={SLOTS}",
    "features.tables.advertiser.managed_collision.eviction=lfu",
    "features.tables.advertiser.managed_collision.admission.kind=min_count",
    "features.tables.advertiser.managed_collision.admission.min_count=2",
    "features.tables.user.hash=false",
    "features.tables.user.managed_collision.eviction=lru",
]
STEPS = 8


def test_spread_ids_is_a_bijection_that_balances_the_ranks_blocks():
    ids = np.arange(200_000, dtype=np.int64)  # small, consecutive ids, as a log's new ads come
    out = spread_ids(ids)
    assert out.dtype == np.int64 and out.min() >= 0 and out.max() < INPUT_RANGE
    assert len(np.unique(out)) == len(ids)
    big = np.array([2**62 + 7, 2**63 - 2, 12345678901234], dtype=np.int64)
    assert len(np.unique(spread_ids(np.concatenate([ids, big])))) == len(ids) + 3
    for ranks in (2, 8):  # row-wise routing: rank = id // ceil(range / ranks)
        share = np.bincount(out // -(-INPUT_RANGE // ranks), minlength=ranks) / len(ids)
        assert np.abs(share - 1 / ranks).max() < 0.01, share


def test_config_refuses_hash_with_managed_collision_and_a_table_without_an_unknown_slot(tmp_path):
    with pytest.raises(config.ConfigError, match=r"features.tables\[0\]: hash and managed_collision"):
        load_tiny(tmp_path, ["features.tables.user.managed_collision.eviction=lru"])
    with pytest.raises(config.ConfigError, match=r"num_embeddings: a managed table needs 2 slots"):
        load_tiny(
            tmp_path,
            ["features.tables.ad_type.managed_collision.eviction=lru", "features.tables.ad_type.num_embeddings=1"],
        )
    with pytest.raises(config.ConfigError, match="eviction_interval"):
        load_tiny(tmp_path, ["features.tables.item.managed_collision.eviction_interval=0"])


def test_managed_collections_plan_row_wise_and_world_sizes_must_divide_the_buckets(tmp_path):
    cfg = load_tiny(tmp_path, MANAGED)
    allowed = parallel.constraints(cfg.features, cfg.train, "cpu")
    # Every table of a managed collection is row-wise (the action and topic tables pass ids through).
    for name in ("item", "action", "topic", "advertiser", "ad_type", "user", "query_token"):
        assert allowed[name].sharding_types == ["row_wise"] and allowed[name].compute_kernels == ["fused"], name
    plain = parallel.constraints(load_tiny(tmp_path).features, cfg.train, "cpu")
    assert plain["item"].sharding_types == ["table_wise"]  # unchanged without managed collision
    with pytest.raises(ValueError, match="managed_collision on"):
        parallel.constraints(cfg.features, dataclasses.replace(cfg.train, sharding_types=["table_wise"]), "cpu")
    assert PLANNING_BUCKETS % 8 == 0
    with pytest.raises(ValueError, match="world size 11: managed-collision tables"):
        parallel.check_managed_world_size(cfg.features, 11)


def _train(rank, world, result_dir, data_dir, run_dir):
    from pinads_rec.training.run_log import RunLog
    from pinads_rec.training.trainer import Trainer

    overrides = MANAGED + [f"train.run_dir={run_dir}", f"train.max_steps={STEPS}", "train.warmup_steps=2"]
    summary = Trainer(load_tiny(data_dir, overrides), parallel.init_distributed(), hooks=[RunLog()]).run()
    if rank == 0:
        keep = {k: summary[k] for k in ("eval", "pipelined_modules", "step")}
        with open(os.path.join(result_dir, "summary.json"), "w") as f:
            json.dump(keep, f, default=float)


def _warm_start(rank, world, result_dir, data_dir, source, run_dir):
    """Warm-starts from ``source`` and saves at once (step-0: what it loaded); on 2 ranks the
    refusal's message instead."""
    from pinads_rec.training.trainer import Trainer

    overrides = MANAGED + [f"train.init_from={source}", f"train.run_dir={run_dir}", "train.max_steps=2"]
    trainer = Trainer(load_tiny(data_dir, overrides), parallel.init_distributed())
    try:
        trainer.setup()
    except checkpoint.UnreshardableCheckpoint as e:
        if rank == 0:
            with open(os.path.join(result_dir, "refused.txt"), "w") as f:
                f.write(str(e))
        return
    trainer.save()


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    """A 2-rank run with managed tables; warm-started from it on 1 rank; and, from that 1-rank
    checkpoint, a warm start on 2 ranks (refused)."""
    data_dir = str(tiny_data[1])
    root = tmp_path_factory.mktemp("managed")
    result = run_ranks(_train, 2, str(root / "w-train"), data_dir, str(root / "source"), timeout_s=600)
    run_ranks(_warm_start, 1, str(root / "w-1"), data_dir, str(root / "source"), str(root / "warm1"))
    step0 = root / "warm1" / "checkpoints" / "step-0"
    grown = run_ranks(_warm_start, 2, str(root / "w-2"), data_dir, str(step0), str(root / "warm2"))
    return {
        "root": root,
        "data": data_dir,
        "summary": json.loads((result / "summary.json").read_text()),
        "refused": (grown / "refused.txt").read_text(),
    }


def _id_maps(state: dict) -> dict:
    """Per managed table: raw id -> slot, from a checkpoint's MC buffers (TorchRec's empty slots out)."""
    out = {}
    for key, raw in state.items():
        if key.endswith("._mch_sorted_raw_ids"):
            slots = state[key.replace("_mch_sorted_raw_ids", "_mch_remapped_ids_mapping")]
            used = raw != torch.iinfo(torch.int64).max
            out[key.split(".")[-2]] = dict(zip(raw[used].tolist(), slots[used].tolist()))
    return out


@pytest.mark.slow
def test_every_managed_collection_is_pipelined_and_its_tables_evict(runs):
    summary = runs["summary"]
    assert summary["step"] == STEPS
    names = {m.rsplit(".", 1)[-1] for m in summary["pipelined_modules"]}
    assert names == {"ebc", "user_ebc", "ec"}  # the input all-to-alls still overlap the step
    state = checkpoint_tensors(runs["root"] / "source" / "checkpoints" / f"step-{STEPS}", runs["root"] / "source.pt")
    maps = _id_maps(state)
    assert set(maps) == {"item", "advertiser", "user"}
    # More items than slots went through: the item table is full (one unknown row per rank) and its
    # ids are raw ids' images, not rows.
    assert len(maps["item"]) == SLOTS - 2
    assert max(maps["item"]) > SLOTS and all(0 <= s < SLOTS for s in maps["item"].values())
    assert not {SLOTS // 2 - 1, SLOTS - 1} & set(maps["item"].values())  # each rank's unknown row stays its own
    assert all(r["ne"] == r["ne"] for r in summary["eval"])


@pytest.mark.slow
def test_a_warm_start_on_one_rank_keeps_the_id_map_and_rows_and_scores_the_same(runs):
    from pinads_rec.serve.batching import ScoringBatches
    from pinads_rec.serve.scoring import Predictor

    root = runs["root"]
    source = checkpoint_tensors(root / "source" / "checkpoints" / f"step-{STEPS}", root / "source.pt")
    loaded = checkpoint_tensors(root / "warm1" / "checkpoints" / "step-0", root / "warm1.pt")
    assert _id_maps(loaded) == _id_maps(source)
    for key, value in source.items():
        if key.startswith("model.") and key.endswith(".weight"):
            assert torch.equal(value, loaded[key]), key
    a = Predictor.from_run(root / "source", precision="fp32")
    b = Predictor.from_run(root / "warm1", precision="fp32", step=0)
    for _, batch in ScoringBatches(a.cfg, os.path.join(runs["data"], "eval")):
        assert torch.allclose(a.score_batch(batch), b.score_batch(batch), atol=1e-6)


@pytest.mark.slow
def test_a_warm_start_on_more_ranks_is_refused_naming_the_table(runs):
    assert "managed-collision table 'user' was trained on 1 rank(s) and cannot be loaded on 2" in runs["refused"]
    assert "TorchEasyRec" not in runs["refused"] and "resume on 1 rank(s)" in runs["refused"]


@pytest.mark.slow
def test_served_and_exported_scores_equal_the_trainers(runs):
    from pinads_rec.metrics import MetricAccumulator
    from pinads_rec.serve import load_exported
    from pinads_rec.serve.batching import ScoringBatches
    from pinads_rec.serve.export import export_run
    from pinads_rec.serve.scoring import Predictor

    predictor = Predictor.from_run(runs["root"] / "source", precision="fp32")
    f = predictor.cfg.features
    acc = MetricAccumulator([t.name for t in f.tasks], f.surfaces, has_oracle=False)
    batches = list(ScoringBatches(predictor.cfg, os.path.join(runs["data"], "eval")))
    for _, batch in batches:
        acc.update(predictor.score_batch(batch)[batch.valid], batch.labels[batch.valid], batch.surface[batch.valid])
    for mine, theirs in zip(acc.compute(), runs["summary"]["eval"]):
        assert (mine["surface"], mine["task"]) == (theirs["surface"], theirs["task"])
        assert mine["log_loss"] == pytest.approx(theirs["log_loss"], rel=1e-5), mine
    path = export_run(
        runs["root"] / "source", runs["root"] / "model.pt2", os.path.join(runs["data"], "eval"), precision="fp32"
    )
    scorer = load_exported(str(path))
    _, batch = batches[0]
    assert torch.allclose(scorer.score_batch(batch), predictor.score_batch(batch), atol=1e-5)
