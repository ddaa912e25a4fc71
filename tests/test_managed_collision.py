"""Managed-collision tables (pinads_rec/managed_collision.py): raw ids spread over the managed
modules' input range, the config's refusals, and -- on 2 gloo ranks -- TorchRec's managed-collision
collections sharded row-wise and pipelined, evicting, checkpointed; the TorchEasyRec #360 case
(trained on 2 ranks, warm-started and trained on 1, back on 2: training/managed_reshard.py), every
id keeping its row and its score; served and exported with the trainer's scores."""

import dataclasses
import json
import os

import numpy as np
import pytest
import torch
from conftest import REPO, checkpoint_tensors, load_tiny

from pinads_rec import config, parallel
from pinads_rec.experiments.harness import run_ranks
from pinads_rec.managed_collision import INPUT_RANGE, PLANNING_BUCKETS, spread_ids

# The item table (sequence EC and candidate ids) managed with LRU and few slots, so ids are evicted
# within a few steps; the advertiser table (per-row EBC) by LFU with an admission threshold; the
# user table (per-request EBC) by LRU. Every collection is then a managed one.
SLOTS = 400
MANAGED = [
    "features.tables.item.managed_collision.eviction=lru",
    "features.tables.item.managed_collision.eviction_interval=2",
    f"features.tables.item.num_embeddings={SLOTS}",
    "features.tables.advertiser.managed_collision.eviction=lfu",
    "features.tables.advertiser.managed_collision.eviction_interval=2",
    "features.tables.advertiser.managed_collision.admission.kind=min_count",
    "features.tables.advertiser.managed_collision.admission.min_count=2",
    "features.tables.user.hash=false",
    "features.tables.user.managed_collision.eviction=lru",
    "features.tables.user.managed_collision.eviction_interval=2",
]
STEPS = 8
ONE_RANK_STEPS = 4


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


def test_the_planner_reports_a_managed_tables_id_map_and_refuses_a_world_size_it_cannot_split(tmp_path):
    from pinads_rec.plan.planner import PlanSpec, plan
    from pinads_rec.plan.report import format_report

    cfg = config.load(os.path.join(REPO, "configs", "continuous_managed.yaml"))
    report = plan(cfg, PlanSpec(world_size=8, candidates_per_request=12.0))
    item = report["tables"]["item"]
    assert item["sharding_type"] == "row_wise" and report["tables"]["topic"]["sharding_type"] == "row_wise"
    assert item["managed_collision"] == {
        "eviction": "lru",
        "eviction_interval": 50,
        "admission": "all",
        "id_map_bytes": 500 * 8 * 3,  # raw id, slot, last access per slot
    }
    assert "Managed collision: item (lru, a round every 50 steps" in format_report(report)
    with pytest.raises(ValueError, match="world size 11: managed-collision tables"):
        plan(cfg, PlanSpec(world_size=11, candidates_per_request=12.0))


def _train(rank, world, result_dir, data_dir, run_dir):
    from pinads_rec.training.run_log import RunLog
    from pinads_rec.training.trainer import Trainer

    overrides = MANAGED + [f"train.run_dir={run_dir}", f"train.max_steps={STEPS}", "train.warmup_steps=2"]
    summary = Trainer(load_tiny(data_dir, overrides), parallel.init_distributed(), hooks=[RunLog()]).run()
    if rank == 0:
        keep = {k: summary[k] for k in ("eval", "pipelined_modules", "step")}
        with open(os.path.join(result_dir, "summary.json"), "w") as f:
            json.dump(keep, f, default=float)


def _warm_start(rank, world, result_dir, data_dir, source, run_dir, steps):
    """Warm-starts from ``source``, saves at once (step-0: what it loaded), then trains ``steps``."""
    from pinads_rec.training.trainer import Trainer

    overrides = MANAGED + [f"train.init_from={source}", f"train.run_dir={run_dir}", f"train.max_steps={steps}"]
    trainer = Trainer(load_tiny(data_dir, overrides + ["train.warmup_steps=1"]), parallel.init_distributed())
    trainer.setup()
    trainer.save()
    if steps:
        trainer.run()


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    """The TorchEasyRec #360 case: a 2-rank run with managed tables; warm-started from it on 1 rank
    and trained on; from that, warm-started on 2 ranks again."""
    data_dir = str(tiny_data[1])
    root = tmp_path_factory.mktemp("managed")
    result = run_ranks(_train, 2, str(root / "w-train"), data_dir, str(root / "source"), timeout_s=600)
    run_ranks(_warm_start, 1, str(root / "w-1"), data_dir, str(root / "source"), str(root / "warm1"), ONE_RANK_STEPS)
    trained_on_one = root / "warm1" / "checkpoints" / f"step-{ONE_RANK_STEPS}"
    run_ranks(_warm_start, 2, str(root / "w-2"), data_dir, str(trained_on_one), str(root / "warm2"), 0)
    return {"root": root, "data": data_dir, "summary": json.loads((result / "summary.json").read_text())}


def _id_maps(state: dict) -> dict:
    """Per managed table: raw id -> slot, from a checkpoint's MC buffers (TorchRec's empty slots out)."""
    out = {}
    for key, raw in state.items():
        if key.endswith("._mch_sorted_raw_ids"):
            slots = state[key.replace("_mch_sorted_raw_ids", "_mch_remapped_ids_mapping")]
            used = raw != torch.iinfo(torch.int64).max
            out[key.split(".")[-2]] = dict(zip(raw[used].tolist(), slots[used].tolist()))
    return out


def _state(runs, run, step):
    path = runs["root"] / run / "checkpoints" / f"step-{step}"
    return checkpoint_tensors(path, runs["root"] / f"{run}-{step}.pt")


def _rows_by_id(state: dict) -> dict:
    """Per managed table: raw id -> its row of the table (where the checkpoint's map puts it)."""
    weights = {k.split(".")[-2]: v for k, v in state.items() if k.startswith("model.") and k.endswith(".weight")}
    return {table: {i: weights[table][slot] for i, slot in ids.items()} for table, ids in _id_maps(state).items()}


def _set_to_zero(batch, features, chosen) -> None:
    """Rewrites ``batch`` in place: the managed ids ``chosen(table, ids)`` (a bool mask) become id
    0, which no table here has a slot for (so it reads block 0's unknown row)."""
    from pinads_rec.config import CANDIDATE_PREFIX

    table_of = {s.name: s.table for s in features.sparse}
    table_of.update({CANDIDATE_PREFIX + s.name: s.table for s in features.sparse})
    table_of.update({f"{g.name}.{f.name}": f.table for g in features.sequence_groups for f in g.features})
    for kjt in (batch.sparse, batch.user_sparse, batch.sequences):
        for key in kjt.keys():
            if table_of[key] in {t.name for t in features.tables if t.managed_collision is not None}:
                values = kjt[key].values()  # a view of the KJT's values
                values[chosen(table_of[key], values)] = 0


def _scores_agree(runs, a, b, chosen=None) -> int:
    """Scores of runs ``a`` and ``b`` (run dir, step) on the eval files equal (``chosen``: with
    those ids set to 0 first, ``_set_to_zero``); returns the rows compared."""
    from pinads_rec.serve.batching import ScoringBatches
    from pinads_rec.serve.scoring import Predictor

    first = Predictor.from_run(runs["root"] / a[0], precision="fp32", step=a[1])
    second = Predictor.from_run(runs["root"] / b[0], precision="fp32", step=b[1])
    rows = 0
    for _, batch in ScoringBatches(first.cfg, os.path.join(runs["data"], "eval")):
        if chosen is not None:
            _set_to_zero(batch, first.cfg.features, chosen)
        x, y = first.score_batch(batch)[batch.valid], second.score_batch(batch)[batch.valid]
        assert torch.allclose(x, y, atol=1e-6), float((x - y).abs().max())
        rows += len(x)
    return rows


def _isin(ids) -> callable:
    return lambda table, values: torch.from_numpy(np.isin(values.numpy(), list(ids[table])))


@pytest.mark.slow
def test_every_managed_collection_is_pipelined_and_its_tables_evict(runs):
    summary = runs["summary"]
    assert summary["step"] == STEPS
    names = {m.rsplit(".", 1)[-1] for m in summary["pipelined_modules"]}
    assert names == {"ebc", "user_ebc", "ec"}  # the input all-to-alls still overlap the step
    state = checkpoint_tensors(runs["root"] / "source" / "checkpoints" / f"step-{STEPS}", runs["root"] / "source.pt")
    maps = _id_maps(state)
    assert set(maps) == {"item", "advertiser", "user"} and all(maps.values())
    # More items than slots went through: the item table is full (one unknown row per rank) and its
    # ids are raw ids' images, not rows.
    assert len(maps["item"]) == SLOTS - 2
    assert max(maps["item"]) > SLOTS and all(0 <= s < SLOTS for s in maps["item"].values())
    assert not {SLOTS // 2 - 1, SLOTS - 1} & set(maps["item"].values())  # each rank's unknown row stays its own
    assert all(r["ne"] == r["ne"] for r in summary["eval"])


@pytest.mark.slow
def test_a_warm_start_on_one_rank_keeps_every_id_its_row_and_score(runs):
    source, loaded = _state(runs, "source", STEPS), _state(runs, "warm1", 0)
    before, after = _rows_by_id(source), _rows_by_id(loaded)
    assert set(before) == set(after) == {"item", "advertiser", "user"}
    for table in before:
        assert before[table].keys() == after[table].keys(), table  # 399 slots hold both ranks' 2 x 199
        assert all(torch.equal(before[table][i], after[table][i]) for i in before[table]), table
    # One unknown row on 1 rank, block 0's: ids of block 1 without a slot are the rows that may differ.
    maps = _id_maps(source)

    def block_one_misses(table, values):
        return ~_isin(maps)(table, values) & (values >= -(-INPUT_RANGE // 2))

    assert _scores_agree(runs, ("source", STEPS), ("warm1", 0), block_one_misses) > 1000


@pytest.mark.slow
def test_back_on_two_ranks_after_training_on_one_each_rank_keeps_its_blocks_ids_rows_and_scores(runs):
    trained, loaded = _state(runs, "warm1", ONE_RANK_STEPS), _state(runs, "warm2", 0)
    before, after = _rows_by_id(trained), _rows_by_id(loaded)
    half = -(-INPUT_RANGE // 2)
    dropped = {}
    for table in before:
        rows = load_tiny(runs["data"], MANAGED).features.table(table).num_embeddings
        capacity = -(-rows // 2) - 1  # a rank's slots, less its unknown row
        for block in (0, 1):
            ids = {i for i in before[table] if (i >= half) == block}
            kept = {i for i in after[table] if (i >= half) == block}
            # The 1-rank pool put ids in any slot; now each is on its block's rank, as many as fit.
            assert kept <= ids and len(kept) == min(len(ids), capacity), (table, block)
            assert all((slot >= capacity + 1) == block for i, slot in _id_maps(loaded)[table].items() if i in kept)
            if ids - kept:  # the least recently seen ids made way
                key = next(k for k in trained if k.endswith(f".{table}._mch_last_access_iter"))
                raw = next(k for k in trained if k.endswith(f".{table}._mch_sorted_raw_ids"))
                seen = dict(zip(trained[raw].tolist(), trained[key].tolist()))
                assert min(seen[i] for i in kept) >= max(seen[i] for i in ids - kept), (table, block)
        assert all(torch.equal(before[table][i], after[table][i]) for i in after[table]), table
        dropped[table] = set(before[table]) - set(after[table])
    assert any(dropped.values())  # the 1-rank pool's blocks were uneven: the case that needs a re-layout
    # Each rank's unknown row starts as the 1-rank run's: every row scores the same once the ids
    # that lost their slot (reading the unknown row now) are set to a miss on both sides.
    assert _scores_agree(runs, ("warm1", ONE_RANK_STEPS), ("warm2", 0), _isin(dropped)) > 1000


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


def test_a_plan_files_kernel_is_kept_or_replaced_with_one_warning_naming_the_table(tmp_path, caplog):
    """train.plan_file is an explicit request: a managed table keeps its planned kernel; a GPU plan on
    CPU runs fused, and rank 0 says so once (table, kernel planned, kernel run, why); a kernel a
    managed table cannot run is refused, naming it."""
    from pinads_rec.training.task import meta_train_task

    cfg = load_tiny(tmp_path, MANAGED)
    row_wise = {"sharding_type": "row_wise", "ranks": [0]}
    plan = {
        "tables": {
            "item": dict(row_wise, compute_kernel="fused_uvm_caching"),
            "user": dict(row_wise, compute_kernel="fused"),
        }
    }
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, plan_file=str(path)))
    assert parallel.constraints(cfg.features, cfg.train, "cuda")["item"].compute_kernels == ["fused_uvm_caching"]
    assert parallel.constraints(cfg.features, cfg.train, "cpu")["item"].compute_kernels == ["fused"]
    assert parallel.plan_kernel_changes(cfg.features, cfg.train, "cuda") == ""
    env = parallel.Distributed(0, 1, 0, torch.device("cpu"), "gloo")
    with caplog.at_level("WARNING", logger="pinads_rec.parallel"):
        sharding = parallel.plan_sharding(meta_train_task(cfg.features, cfg.model, cfg.train), cfg, env)
    warned = [r.getMessage() for r in caplog.records if "train.plan_file" in r.getMessage()]
    assert len(warned) == 1 and "\n" not in warned[0], warned
    assert f"train.plan_file {path}: 1 table(s)" in warned[0] and "(item fused_uvm_caching -> fused)" in warned[0]
    assert "UVM kernels need CUDA" in warned[0]
    kernels = {name: p.compute_kernel for params in sharding.plan.values() for name, p in params.items()}
    assert kernels["item"] == kernels["user"] == "fused"
    plan["tables"]["item"]["compute_kernel"] = "dense"
    path.write_text(json.dumps(plan))
    with pytest.raises(ValueError, match="table 'item' is planned with the dense kernel, but it is in a managed"):
        parallel.constraints(cfg.features, cfg.train, "cpu")
