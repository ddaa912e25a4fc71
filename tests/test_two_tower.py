"""The two-tower ranker (models/two_tower.py): shapes, request-level broadcasting, and training on 2
gloo ranks through the real trainer (its precomputed ad table: test_ad_table.py)."""

import dataclasses
import json
import os

import pytest
import torch
from conftest import REPO, tiny_overrides

from pinads_rec import config
from pinads_rec.data.loader.dataset import LoaderSettings, ParquetBatches
from pinads_rec.experiments.harness import run_ranks
from pinads_rec.models import build_model
from pinads_rec.models.two_tower import TwoTowerRanker
from pinads_rec.modules.precision import set_precision
from pinads_rec.training.run_log import read_run_log

TWO_TOWER = os.path.join(REPO, "configs", "two_tower.yaml")


def load(data_dir, extra=()):
    return config.load(TWO_TOWER, tiny_overrides(data_dir) + list(extra))


def eval_batches(cfg, limit=None):
    batches = []
    for b in ParquetBatches(cfg.data.eval_dir, LoaderSettings.of(cfg), shuffle=False):
        batches.append(b)
        if limit and len(batches) == limit:
            break
    return batches


def test_config_is_the_demo_with_request_features_in_the_user_tower():
    """configs/two_tower.yaml copies the demo's features/data/synth (no reference): keep them in step."""
    demo, tt = config.load(os.path.join(REPO, "configs", "demo.yaml")), config.load(TWO_TOWER)
    assert config.to_dict(tt)["data"] == config.to_dict(demo)["data"]
    assert config.to_dict(tt)["synth"] == config.to_dict(demo)["synth"]
    moved = {"context_topic", "user_activity"}
    for kind in ("sparse", "dense"):
        for a, b in zip(getattr(demo.features, kind), getattr(tt.features, kind), strict=True):
            assert dataclasses.replace(b, user_side=a.user_side) == a
            assert b.user_side == (a.user_side or a.name in moved), a.name

    def strip(f):
        return {
            k: v
            for k, v in config.to_dict(config.ExperimentConfig(features=f))["features"].items()
            if k not in ("sparse", "dense")
        }

    assert strip(tt.features) == strip(demo.features)
    assert tt.model.kind == "two_tower" and tt.train.run_dir == "runs/two_tower"


@pytest.fixture(scope="module")
def model_and_cfg(tiny_data):
    _, data_dir = tiny_data
    cfg = load(data_dir)
    torch.manual_seed(0)
    model = build_model(cfg.features, cfg.model)
    model.eval()
    return model, cfg


def test_shapes_and_bf16(model_and_cfg):
    model, cfg = model_and_cfg
    assert isinstance(model, TwoTowerRanker)
    batch = eval_batches(cfg, 1)[0]
    B, U, T, E = batch.batch_size, batch.num_requests, len(cfg.features.tasks), cfg.model.two_tower.embedding_dim
    assert U < B  # the tiny data has several candidates per request
    with torch.no_grad():
        raw, calibrated = model.scores(batch)
        users, ads = model.user_embeddings(batch), model.ad_embeddings(batch)
        forward = model(batch)
        set_precision(model, "bf16")
        bf16 = model(batch)
        set_precision(model, "fp32")
    assert raw.shape == calibrated.shape == (B, T)
    assert users.shape == (U, T, E) and ads.shape == (B, T, E)
    assert torch.equal(forward, calibrated)
    assert torch.isfinite(raw).all()
    assert bf16.dtype == torch.float32 and torch.isfinite(bf16).all()
    assert (bf16 - calibrated).abs().max() < 0.1  # BF16 large layers: close, not equal
    loss = model.loss(raw, calibrated, batch)
    assert loss.ndim == 0 and torch.isfinite(loss)


def test_user_tower_once_per_request_equals_once_per_row(model_and_cfg, tiny_data):
    model, cfg = model_and_cfg
    per_row_cfg = load(tiny_data[1], ["model.broadcast=false"])  # loader: every row its own request slot
    shared = eval_batches(cfg, 1)[0]
    per_row = eval_batches(per_row_cfg, 1)[0]
    assert per_row.num_requests == per_row.batch_size and shared.num_requests < shared.batch_size
    with torch.no_grad():
        users_shared = model.user_embeddings(shared)
        users_per_row = model.user_embeddings(per_row)
        a, b = model.scores(shared)[1], model.scores(per_row)[1]
    assert torch.allclose(users_shared.index_select(0, shared.request_index), users_per_row, atol=1e-5)
    assert torch.allclose(a, b, atol=1e-5), float((a - b).abs().max())


@pytest.mark.parametrize(
    "sequence",
    [[], ["model.sequence.num_layers=1", "model.sequence.poolings=[summary,mean]"]],
    ids=["light_pooling", "transformer"],
)
def test_pipeline_tracer_sees_each_collection_fed_from_the_batch(tiny_data, sequence):
    """TrainPipelineSparseDist traces the train task with every child holding no sharded table as a
    leaf; it pipelines a collection only when its input is a plain attribute of the batch."""
    from torchrec.distributed.train_pipeline.tracing import Tracer

    from pinads_rec.models.train_task import TrainTask

    cfg = load(tiny_data[1], sequence)
    task = TrainTask(build_model(cfg.features, cfg.model))
    leaves = [f"model.{name}" for name, _ in task.model.named_children()]
    graph = Tracer(leaf_modules=leaves).trace(task)
    inputs = {
        n.target: n.args[0]
        for n in graph.nodes
        if n.op == "call_module" and n.target in ("model.ebc", "model.user_ebc", "model.ec")
    }
    assert {k: (v.op, v.target) for k, v in inputs.items()} == {
        "model.ebc": ("call_function", getattr),
        "model.user_ebc": ("call_function", getattr),
        "model.ec": ("call_function", getattr),
    }
    assert {k: v.args[1] for k, v in inputs.items()} == {
        "model.ebc": "sparse",
        "model.user_ebc": "user_sparse",
        "model.ec": "sequences",
    }


def _train_two_tower(rank, world, result_dir, data_dir, run_dir):
    from pinads_rec import parallel
    from pinads_rec.training.run_log import RunLog
    from pinads_rec.training.trainer import Trainer

    env = parallel.init_distributed()
    cfg = config.load(
        TWO_TOWER,
        tiny_overrides(data_dir, run_dir)
        + ["train.epochs=2", "train.log_every=1", "train.lr=0.003", "train.warmup_steps=5"],
    )
    summary = Trainer(cfg, env, hooks=[RunLog()]).run()
    if rank == 0:
        with open(os.path.join(result_dir, "summary.json"), "w") as f:
            json.dump(summary, f, default=float)


@pytest.mark.slow
def test_two_tower_trains_on_two_ranks(tiny_data, tmp_path):
    _, data_dir = tiny_data
    run_dir = str(tmp_path / "run")
    result_dir = run_ranks(_train_two_tower, 2, str(tmp_path), str(data_dir), run_dir, timeout_s=300)
    with open(os.path.join(result_dir, "summary.json")) as f:
        summary = json.load(f)
    losses = [r["loss"] for r in read_run_log(run_dir).steps]
    assert len(losses) >= 20
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.8 * first, (first, last)
    # TrainPipelineSparseDist overlapped every sharded collection's input distribution.
    assert sorted(name.rsplit(".", 1)[-1] for name in summary["pipelined_modules"]) == ["ebc", "ec", "user_ebc"]
    assert len(summary["eval"]) == 4 * 3  # (3 surfaces + all) x 3 tasks
    assert all(0.0 <= row["auc"] <= 1.0 for row in summary["eval"])
