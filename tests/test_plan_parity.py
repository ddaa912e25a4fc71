"""Plan parity: the same seed and data give the same losses whichever way the tables are sharded.

Every table is initialized from (seed, table, row) and trained by the same optimizer whether it is
sharded (fused into backward) or replicated (data_parallel), so a plan changes only where the
arithmetic happens. One 2-rank launch trains 20 steps under each plan."""

import json
import os

import pytest
from conftest import load_tiny

from pinads_rec.experiments.harness import run_ranks
from pinads_rec.training.run_log import read_run_log

pytestmark = pytest.mark.slow

PLANS = {
    "table_wise": ["train.sharding_types=[table_wise]"],
    "row_wise": ["train.sharding_types=[row_wise]"],
    "column_wise": ["train.sharding_types=[column_wise]"],
    # Bag tables replicated; sequence tables cannot be (not on CPU), so they go row-wise.
    "data_parallel": ["train.sharding_types=[data_parallel, row_wise]"],
}


def _train_each_plan(rank, world, result_dir, data_dir, run_root):
    from pinads_rec import parallel
    from pinads_rec.training.run_log import RunLog
    from pinads_rec.training.trainer import Trainer, shard_train_task

    env = parallel.init_distributed()
    losses, types = {}, {}
    for name, overrides in PLANS.items():
        common = [
            "train.max_steps=20",
            "train.epochs=3",
            "train.log_every=1",
            f"train.run_dir={run_root}/{name}",
            "train.embedding_optimizer=rowwise_adagrad",
        ]
        cfg = load_tiny(data_dir, overrides + common)
        plan = shard_train_task(cfg, env).plan.plan
        types[name] = sorted({p.sharding_type for module in plan.values() for p in module.values()})
        Trainer(cfg, env, hooks=[RunLog()]).run()
        if rank == 0:
            losses[name] = [r["loss"] for r in read_run_log(f"{run_root}/{name}").steps]
    if rank == 0:
        with open(os.path.join(result_dir, "losses.json"), "w") as f:
            json.dump({"losses": losses, "types": types}, f)


@pytest.fixture(scope="module")
def losses(tiny_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plan_parity")
    result_dir = run_ranks(_train_each_plan, 2, str(tmp), str(tiny_data[1]), str(tmp / "runs"), timeout_s=400)
    with open(os.path.join(result_dir, "losses.json")) as f:
        return json.load(f)


def test_the_plans_really_differ(losses):
    assert losses["types"] == {
        "table_wise": ["table_wise"],
        "row_wise": ["row_wise"],
        "column_wise": ["column_wise"],
        "data_parallel": ["data_parallel", "row_wise"],
    }


@pytest.mark.parametrize("plan", [p for p in PLANS if p != "table_wise"])
def test_same_losses_as_table_wise(losses, plan):
    losses = losses["losses"]
    assert len(losses["table_wise"]) == 20
    for step, (a, b) in enumerate(zip(losses["table_wise"], losses[plan]), start=1):
        assert b == pytest.approx(a, abs=1e-5), f"step {step}: {plan} {b} vs table_wise {a}"
