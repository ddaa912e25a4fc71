"""pinads_rec/parallel/: the planner's search space in a fixed order whatever the string-hash seed,
the fused embedding optimizer attached to every embedding collection, a planner set-up that warns of
nothing, and plan parity -- the same seed and data give the same losses whichever way the tables are
sharded.

Every table is initialized from (seed, table, row) and trained by the same optimizer whether it is
sharded (fused into backward) or replicated (data_parallel), so a plan changes only where the
arithmetic happens. One 2-rank launch trains 20 steps under each plan."""

import inspect
import json
import logging
import os
import subprocess
import sys
import warnings

import pytest
import torch
from conftest import DEMO, REPO, load_tiny
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.optim.optimizers import in_backward_optimizer_filter

from pinads_rec import config, parallel
from pinads_rec.experiments.harness import run_ranks
from pinads_rec.models import build_model
from pinads_rec.models.train_task import TrainTask
from pinads_rec.training.run_log import read_run_log

# A GPU cluster's topology: every sharding type and several kernels per table, so the order of the
# search space has something to get wrong.
SEARCH_SPACE = f"""
import json, torch
from pinads_rec import config, parallel
from pinads_rec.models import build_model
from pinads_rec.models.train_task import TrainTask
cfg = config.load({str(DEMO)!r})
model = TrainTask(build_model(cfg.features, cfg.model, device=torch.device("meta")))
topology = parallel.topology(16, "cuda", 8)
allowed = parallel.constraints(cfg.features, cfg.train, "cuda")
enumerator = parallel.ordered_enumerator(topology, cfg.data.batch_size, allowed)
options = enumerator.enumerate(model, parallel.sharders())
print(json.dumps([[o.fqn, o.sharding_type, o.compute_kernel] for o in options]))
"""


def search_space_with_hash_seed(seed: str) -> list:
    env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(
        [sys.executable, "-c", SEARCH_SPACE], env=env, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def demo_search_space():
    cfg = config.load(DEMO)
    model = TrainTask(build_model(cfg.features, cfg.model, device=torch.device("meta")))
    topology = parallel.topology(16, "cuda", 8)
    allowed = parallel.constraints(cfg.features, cfg.train, "cuda")
    enumerator = parallel.ordered_enumerator(topology, cfg.data.batch_size, allowed)
    return enumerator.enumerate(model, parallel.sharders())


def test_the_enumerator_overrides_only_torchrecs_public_interface():
    """OrderedEnumerator reorders what the public EmbeddingEnumerator.enumerate returns; if TorchRec
    changes that interface, say so here rather than as a wrong plan."""
    params = list(inspect.signature(EmbeddingEnumerator.enumerate).parameters)
    assert params == ["self", "module", "sharders"], f"TorchRec changed EmbeddingEnumerator.enumerate: {params}"
    init = inspect.signature(EmbeddingEnumerator.__init__).parameters
    assert {"topology", "batch_size", "constraints"} <= set(init), f"TorchRec changed EmbeddingEnumerator(): {init}"
    overridden = {k for k, v in vars(parallel.OrderedEnumerator).items() if callable(v) and not k.startswith("__")}
    assert overridden == {"enumerate"}, f"OrderedEnumerator overrides more than the public enumerate: {overridden}"


def test_within_a_table_the_search_space_follows_the_sharders_order(demo_search_space):
    sharder_of = {s.module_type: s for s in parallel.sharders()}
    seen = []
    for option in demo_search_space:
        if not seen or seen[-1] != option.fqn:
            assert option.fqn not in seen, f"{option.fqn}: its options are not together"
            seen.append(option.fqn)
    for fqn in seen:
        options = [o for o in demo_search_space if o.fqn == fqn]
        sharder = sharder_of[type(options[0].module[1])]
        types = sharder.sharding_types("cuda")
        got = [
            (types.index(o.sharding_type), sharder.compute_kernels(o.sharding_type, "cuda").index(o.compute_kernel))
            for o in options
        ]
        assert got == sorted(got), fqn
    assert len({o.sharding_type for o in demo_search_space}) > 3  # the order had choices to make


@pytest.mark.slow
def test_the_search_space_does_not_depend_on_the_hash_seed(demo_search_space):
    here = [[o.fqn, o.sharding_type, o.compute_kernel] for o in demo_search_space]
    seed = "1" if os.environ.get("PYTHONHASHSEED") == "0" else "0"
    assert search_space_with_hash_seed(seed) == here


def test_the_fused_embedding_optimizer_is_attached_to_every_collection_and_nothing_else():
    cfg = config.load(DEMO)
    model = build_model(cfg.features, cfg.model)
    parallel.attach_embedding_optimizer(model, cfg.train, torch.device("cpu"))
    tables = {
        id(p)
        for m in model.modules()
        if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection))
        for p in m.parameters()
    }
    assert len(tables) == len(cfg.features.tables)
    fused = {id(p) for _, p in in_backward_optimizer_filter(model.named_parameters(), include=True)}
    assert fused == tables


def test_planning_warns_of_nothing(caplog):
    """The planner set-up uses what TorchRec asks for (TopologyFactory, a dense estimate for the
    storage reservation) and silences exactly the notices that do not apply: planning the demo
    config -- as training does on one CPU rank, and offline for 8 GPUs with data-parallel tables
    allowed -- raises no warning and logs none (docs/reliability.md, "A quiet start")."""
    from pinads_rec import plan

    cfg = config.load(DEMO)
    model = TrainTask(build_model(cfg.features, cfg.model, device=torch.device("meta")))
    parallel.attach_embedding_optimizer(model, cfg.train, torch.device("cpu"))
    env = parallel.Distributed(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        # As Python shows them to a user: DeprecationWarnings raised inside libraries are hidden by
        # default (TorchRec's apply_optimizer_in_backward raises one, pointing at a private torch API).
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        parallel.plan_sharding(model, cfg, env, local_world_size=1)
        report = plan.plan(cfg, plan.PlanSpec(world_size=8))
    assert [f"{w.category.__name__}: {w.message}" for w in caught] == []
    assert [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert "data_parallel" in {t["sharding_type"] for t in report["tables"].values()}  # it had one to log


# --- plan parity: one 2-rank launch trains 20 steps under each plan --------------------------------


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
    from pinads_rec.training.task import shard_train_task
    from pinads_rec.training.trainer import Trainer

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


@pytest.mark.slow
def test_the_plans_really_differ(losses):
    assert losses["types"] == {
        "table_wise": ["table_wise"],
        "row_wise": ["row_wise"],
        "column_wise": ["column_wise"],
        "data_parallel": ["data_parallel", "row_wise"],
    }


@pytest.mark.slow
@pytest.mark.parametrize("plan", [p for p in PLANS if p != "table_wise"])
def test_same_losses_as_table_wise(losses, plan):
    losses = losses["losses"]
    assert len(losses["table_wise"]) == 20
    for step, (a, b) in enumerate(zip(losses["table_wise"], losses[plan]), start=1):
        assert b == pytest.approx(a, abs=1e-5), f"step {step}: {plan} {b} vs table_wise {a}"
