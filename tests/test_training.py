"""The training path on 2 gloo ranks: sharded == unsharded, the pipeline really pipelines, the loss
falls, and resuming from a checkpoint continues exactly like an uninterrupted run.

All checks share one 2-process launch (each process pays the torchrec import once)."""

import json
import os
import shutil

import pytest
import torch
from conftest import load_tiny

from pinads_rec.experiments.harness import run_ranks

pytestmark = pytest.mark.slow


def copy_full_weights(dmp, full_state):
    """Writes an unsharded model's weights into a sharded one, shard by shard."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    with torch.no_grad():
        for name, value in dmp.state_dict().items():
            full = full_state[name]
            if isinstance(value, ShardedTensor):
                for shard in value.local_shards():
                    (r, c), (h, w) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                    shard.tensor.copy_(full[r : r + h, c : c + w])
            else:
                value.copy_(full)


def read_losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _checks(rank, world, result_dir, data_dir, run_root):
    import torch.distributed as dist

    from pinads_rec import parallel, train
    from pinads_rec.data.loader import ParquetBatches
    from pinads_rec.models.ranker import UnifiedRanker
    from pinads_rec.models.train_task import TrainTask

    env = parallel.init_distributed()
    out = {}

    # 1. Sharded logits equal the unsharded model's with the same weights, under several plans, and
    #    without request-level broadcasting (the sharded model fed per-row user data).
    for plan in ("default", "table_wise", "row_wise", "column_wise", "broadcast_off"):
        extra = {"default": [], "broadcast_off": ["model.broadcast=false"]}.get(
            plan, [f"train.sharding_types=[{plan}]"]
        )
        cfg = load_tiny(data_dir, extra)
        torch.manual_seed(0)
        full = TrainTask(UnifiedRanker(cfg.features, cfg.model))
        dmp = train.build(cfg, env)
        copy_full_weights(dmp, full.state_dict())
        batch = next(iter(ParquetBatches(cfg, cfg.data.eval_dir, rank, world, shuffle=False)))
        if plan == "broadcast_off":  # the reference sees the same rows deduplicated into requests
            assert batch.num_requests == batch.batch_size
            reference_cfg = load_tiny(data_dir)
            reference_batch = next(iter(ParquetBatches(reference_cfg, cfg.data.eval_dir, rank, world, shuffle=False)))
            assert reference_batch.num_requests < batch.num_requests
        else:
            reference_batch = batch
        dmp.eval()
        full.eval()
        with torch.no_grad():
            sharded = dmp(batch)[1][1]
            reference = full(reference_batch)[1][1]
        out[f"logit_diff_{plan}"] = float((sharded - reference).abs().max())

    # 2. Training: pipelined modules, falling loss.
    cfg = load_tiny(
        data_dir,
        [
            f"train.run_dir={run_root}/long",
            "train.epochs=3",
            "train.log_every=1",
            "train.lr=0.003",
            "train.warmup_steps=5",
        ],
    )
    summary = train.train(cfg, env)
    out["pipelined"] = summary["pipelined_modules"]
    out["eval_rows"] = len(summary["eval"])

    # 3. Resume: an uninterrupted run vs one restarted from its step-4 checkpoint.
    base = ["train.max_steps=8", "train.log_every=1", "train.checkpoint_every=4"]
    train.train(load_tiny(data_dir, base + [f"train.run_dir={run_root}/a"]), env)
    if rank == 0:
        shutil.copytree(f"{run_root}/a/checkpoints/step-4", f"{run_root}/b/checkpoints/step-4")
    dist.barrier()
    train.train(load_tiny(data_dir, base + [f"train.run_dir={run_root}/b"]), env)

    if rank == 0:
        with open(os.path.join(result_dir, "checks.json"), "w") as f:
            json.dump(out, f)


@pytest.fixture(scope="module")
def two_rank_run(tiny_data, tmp_path_factory):
    _, data_dir = tiny_data
    tmp = tmp_path_factory.mktemp("two_rank_training")
    run_root = str(tmp / "runs")
    result_dir = run_ranks(_checks, 2, str(tmp), str(data_dir), run_root, timeout_s=400)
    with open(os.path.join(result_dir, "checks.json")) as f:
        return json.load(f), run_root


@pytest.mark.parametrize("plan", ["default", "table_wise", "row_wise", "column_wise", "broadcast_off"])
def test_sharded_logits_equal_unsharded(two_rank_run, plan):
    checks, _ = two_rank_run
    assert checks[f"logit_diff_{plan}"] < 1e-5


def test_pipeline_overlaps_both_sharded_collections(two_rank_run):
    checks, _ = two_rank_run
    assert sorted(name.rsplit(".", 1)[-1] for name in checks["pipelined"]) == ["ebc", "ec", "user_ebc"]


def test_training_lowers_the_loss(two_rank_run):
    checks, run_root = two_rank_run
    losses = read_losses(f"{run_root}/long")
    steps = sorted(losses)
    assert len(steps) >= 20
    first = sum(losses[s] for s in steps[:5]) / 5
    last = sum(losses[s] for s in steps[-5:]) / 5
    assert last < 0.8 * first, (first, last)
    assert checks["eval_rows"] == 4 * 3  # (3 surfaces + all) x 3 tasks


def test_resume_continues_like_an_uninterrupted_run(two_rank_run):
    _, run_root = two_rank_run
    a, b = read_losses(f"{run_root}/a"), read_losses(f"{run_root}/b")
    assert sorted(b) == [5, 6, 7, 8], "the resumed run starts after the checkpoint's step"
    for step in (5, 6, 7, 8):
        assert b[step] == pytest.approx(a[step], abs=1e-6), step
