"""Warm start (train.init_from): another run's weights and optimizer state start a new run, on the
same or another world size; its step, LR schedule, RNG, metrics and best evaluation start fresh, and
a relaunch of the warm-started run resumes from its own checkpoints."""

import json
from pathlib import Path

import pytest
import torch
from conftest import checkpoint_tensors, load_tiny

from pinads_rec.experiments.harness import run_ranks
from pinads_rec.training import checkpoint
from pinads_rec.training.run_log import read_run_log

pytestmark = pytest.mark.slow

SOURCE_STEPS, WARM_STEPS, WARMUP = 6, 4, 3


def _source(rank, world, result_dir, data_dir, run_dir):
    """Yesterday's model: trained with evaluations during training, so it has a best evaluation."""
    from pinads_rec.training.run_log import RunLog
    from pinads_rec.training.trainer import Trainer

    overrides = [f"train.max_steps={SOURCE_STEPS}", "train.eval_every={steps: 3}", f"train.run_dir={run_dir}"]
    Trainer(load_tiny(data_dir, overrides), hooks=[RunLog()]).run()


def _warm(data_dir, source, run_dir, carry="all", extra=()):
    overrides = [f"train.init_from={source}", f"train.init_optimizer={carry}", f"train.run_dir={run_dir}"]
    overrides += [f"train.max_steps={WARM_STEPS}", f"train.warmup_steps={WARMUP}", "train.log_every=1"]
    return load_tiny(data_dir, overrides + list(extra))


def _warm_start(rank, world, result_dir, data_dir, source, run_dir):
    """Warm-starts from ``source`` and saves at once (step-0: what it loaded), then trains."""
    from pinads_rec.training.run_log import RunLog
    from pinads_rec.training.trainer import Trainer

    trainer = Trainer(_warm(data_dir, source, run_dir), hooks=[RunLog()])
    trainer.setup()
    trainer.save()
    trainer.run()


def _one_rank_cases(rank, world, result_dir, data_dir, source, run_dir):
    """On one rank: the other init_optimizer choices, the errors, and a relaunch resuming."""
    from pinads_rec.training.run_log import RunLog
    from pinads_rec.training.trainer import Trainer

    out = {}
    for carry in ("embedding", "none"):
        trainer = Trainer(_warm(data_dir, source, f"{run_dir}-{carry}", carry))
        trainer.setup()
        trainer.save()
    for name, extra, source_dir in (
        ("missing", [], f"{source}-nowhere"),
        ("other_model", ["model.dcn.num_layers=3"], source),
    ):
        try:
            Trainer(_warm(data_dir, source_dir, f"{run_dir}-{name}", extra=extra)).setup()
            out[name] = None
        except (checkpoint.NoCheckpoint, checkpoint.IncompatibleCheckpoint) as e:
            out[name] = f"{type(e).__name__}: {e}"
    relaunch = Trainer(_warm(data_dir, source, f"{run_dir}-all"), hooks=[RunLog()])  # finished on 1 rank
    relaunch.setup()
    out["relaunch"] = {"resumed_from": str(relaunch.resumed_from), "warm_from": relaunch.warm_from}
    Path(result_dir, "cases.json").write_text(json.dumps(out))


def _one_rank(rank, world, result_dir, data_dir, source, run_dir):
    """The 1-rank warm start into ``<run_dir>-all``, then the 1-rank cases, in one process (one start-up)."""
    _warm_start(rank, world, result_dir, data_dir, source, f"{run_dir}-all")
    _one_rank_cases(rank, world, result_dir, data_dir, source, run_dir)


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    """A 2-rank source run, warm-started on 1 rank (and the 1-rank cases) and on 2 ranks."""
    data_dir = str(tiny_data[1])
    root = tmp_path_factory.mktemp("warm_start")
    source = root / "source"
    run_ranks(_source, 2, str(root / "w-source"), data_dir, str(source))
    cases = run_ranks(_one_rank, 1, str(root / "w-1"), data_dir, str(source), str(root / "warm1"))
    run_ranks(_warm_start, 2, str(root / "w-2"), data_dir, str(source), str(root / "warm2-all"))
    return {"root": root, "source": source, "cases": json.loads((cases / "cases.json").read_text())}


def _state(runs, run: str, step: int) -> dict:
    return checkpoint_tensors(runs["root"] / run / "checkpoints" / f"step-{step}", runs["root"] / f"{run}-{step}.pt")


def test_a_warm_start_on_one_or_two_ranks_loads_the_two_rank_model_and_optimizer_exactly(runs):
    source = _state(runs, "source", SOURCE_STEPS)
    for run in ("warm1-all", "warm2-all"):
        loaded = _state(runs, run, 0)
        assert loaded.keys() == source.keys(), run
        assert any("momentum" in k for k in source), "the fused embedding optimizer's state is carried"
        assert any(k.startswith("optimizer.state.dense.") for k in source)
        for key, value in source.items():
            if key.startswith("optimizer.param_groups"):  # this run's hyperparameters, not the source's
                continue
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, loaded[key]), (run, key)
            else:
                assert value == loaded[key], (run, key)


def test_init_optimizer_embedding_keeps_the_tables_state_and_zeroes_the_dense_moments(runs):
    source, loaded = _state(runs, "source", SOURCE_STEPS), _state(runs, "warm1-embedding", 0)
    for key, value in source.items():
        if not isinstance(value, torch.Tensor):
            continue
        if key.startswith("optimizer.state.dense."):
            assert not loaded[key].any(), key
        elif key.startswith(("model.", "optimizer.state.")):
            assert torch.equal(value, loaded[key]), key
    assert any(source[k].any() for k in source if k.startswith("optimizer.state.dense.") and "exp_avg" in k)


def test_init_optimizer_none_loads_the_weights_only(runs):
    source, loaded = _state(runs, "source", SOURCE_STEPS), _state(runs, "warm1-none", 0)
    for key, value in source.items():
        if key.startswith("model.") and isinstance(value, torch.Tensor):
            assert torch.equal(value, loaded[key]), key
    momentum = [k for k in loaded if "momentum" in k]
    assert momentum and not any(loaded[k].any() for k in momentum)
    assert any(source[k].any() for k in momentum)


@pytest.mark.parametrize("run", ["warm1-all", "warm2-all"])
def test_the_warm_started_run_starts_its_step_schedule_and_best_evaluation_fresh(runs, run):
    source_meta = json.loads(
        (runs["source"] / "checkpoints" / f"step-{SOURCE_STEPS}" / checkpoint.STATE_FILE).read_text()
    )
    assert source_meta["train"]["best_value"] is not None and source_meta["schedule"]["last_epoch"] == SOURCE_STEPS
    meta = json.loads((runs["root"] / run / "checkpoints" / "step-0" / checkpoint.STATE_FILE).read_text())
    assert meta["train"]["step"] == 0 and meta["train"]["epoch"] == 0
    assert meta["train"]["best_value"] is None and meta["train"]["best_step"] is None
    assert meta["schedule"]["last_epoch"] == 0
    log = read_run_log(runs["root"] / run)
    assert [r["step"] for r in log.steps] == list(range(1, WARM_STEPS + 1))
    lr = json.loads((runs["root"] / run / "config.json").read_text())["train"]["lr"]
    # The warm-up again, not the source's decayed LR: step 1's record has the LR the schedule set
    # for step 2, (1 + 1) / train.warmup_steps of train.lr.
    assert log.steps[0]["lr"] == pytest.approx(lr * 2 / WARMUP)
    assert log.summary["step"] == WARM_STEPS


def test_errors_name_the_missing_checkpoint_and_the_model_difference(runs):
    cases = runs["cases"]
    assert cases["missing"].startswith("NoCheckpoint: train.init_from ") and "-nowhere" in cases["missing"]
    assert (
        cases["other_model"].startswith("IncompatibleCheckpoint: ") and "model.dcn.num_layers" in cases["other_model"]
    )


def test_a_relaunched_warm_start_resumes_from_its_own_checkpoint(runs):
    relaunch = runs["cases"]["relaunch"]
    assert relaunch["warm_from"] is None
    assert relaunch["resumed_from"].endswith(f"warm1-all/checkpoints/step-{WARM_STEPS}")
