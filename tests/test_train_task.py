"""The training task (pinads_rec/models/train_task.py): the non-finite guard stopping with the task and
the source named, or skipping without an update, on the loss and on the gradients."""

import pytest
import torch
from conftest import load_tiny
from torch import nn

from pinads_rec.data.loader.dataset import LoaderSettings, ParquetBatches
from pinads_rec.models import build_model
from pinads_rec.models.train_task import NonFiniteError, NonFiniteGuard, TrainTask, guard_gradients


def _batch(cfg):
    return next(iter(ParquetBatches(cfg.data.eval_dir, LoaderSettings.of(cfg), shuffle=False)))


def _nan_task(cfg, policy):
    torch.manual_seed(0)
    model = build_model(cfg.features, cfg.model)
    with torch.no_grad():
        model.mmoe.towers[1][-1].bias.fill_(float("nan"))  # the good_click head emits NaN
    return TrainTask(model, NonFiniteGuard([t.name for t in cfg.features.tasks], policy)), model


def test_nonfinite_guard_stops_naming_task_and_source(tiny_data):
    _, data = tiny_data
    cfg = load_tiny(data)
    task, _ = _nan_task(cfg, "stop")
    batch = _batch(cfg)
    with pytest.raises(NonFiniteError, match=r"good_click.*part-00000.parquet, row group 0"):
        task(batch)


def test_nonfinite_guard_skips_without_updating(tiny_data):
    _, data = tiny_data
    cfg = load_tiny(data)
    task, model = _nan_task(cfg, "skip")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    loss, _ = task(_batch(cfg))
    loss.backward()
    optimizer.step()
    assert float(loss.detach()) == 0.0 and task.guard.skipped == 1
    assert all(p.grad is None for p in model.parameters())
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) or torch.isnan(before[k]).any() for k in before)


def test_nonfinite_gradient_is_caught_before_the_step():
    layer = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    counter = NonFiniteGuard(["click"], "skip")
    guard_gradients(optimizer, "skip", counter)
    before = layer.weight.detach().clone()
    layer.weight.grad = torch.tensor([[float("inf"), 0.0]])
    layer.bias.grad = torch.zeros(1)
    optimizer.step()
    assert torch.equal(layer.weight, before) and counter.skipped == 1
    stop = torch.optim.SGD(layer.parameters(), lr=0.1)
    guard_gradients(stop, "stop", counter)
    layer.weight.grad = torch.tensor([[float("nan"), 0.0]])
    with pytest.raises(NonFiniteError, match="non-finite gradient"):
        stop.step()
