"""Evaluations during training (train.eval_every), early stopping and the best weights, on 2 gloo
ranks: every epoch's evaluation is logged (metrics.jsonl, TensorBoard); early stopping stops after
train.early_stop.patience evaluations without improvement; the run's last checkpoint (what serving
loads) holds the best evaluation's weights; evaluating does not change the training; a run resumed
mid-way keeps its best and its patience count. Plus the config's checks and the selection's
arithmetic, without a launch.

One 2-process launch records what the checks need in a JSON file; each test asserts one check.
Early stopping is made deterministic by train.early_stop.min_delta 1: no AUC can beat the first by
more than 1, so training stops exactly ``patience`` evaluations after the first, whatever it learns."""

import json
import logging
import os

import pytest
from conftest import load_tiny

from pinads_rec import config
from pinads_rec.experiments.harness import run_ranks
from pinads_rec.training.hooks import Hook
from pinads_rec.training.run_log import read_run_log
from pinads_rec.training.validator import improves, selection_name, selection_value

pytestmark = pytest.mark.slow

# Evaluations every 2 steps, stopping 2 evaluations after the first (the best, at step 2): step 6.
STOPPING = [
    "train.eval_every.steps=2",
    "train.early_stop.patience=2",
    "train.early_stop.min_delta=1.0",
    "train.checkpoint_every=4",
    "train.keep_checkpoints=1",
    "train.log_every=1",
    "train.epochs=2",
]


class DenseSnapshots(Hook):
    """Rank 0: the replicated (dense) weights at each evaluation, {step: {name: tensor}}."""

    def __init__(self):
        self.at = {}

    def on_validation(self, trainer, record):
        from pinads_rec import parallel

        if trainer.env.is_main:
            self.at[record["step"]] = {
                k: v.detach().clone()
                for k, v in trainer.dmp.state_dict().items()
                if not any(p in k for p in parallel.EMBEDDING_PARAM)
            }


class Crash(Hook):
    """Every rank raises after step ``step`` (a run that dies there, its checkpoints on disk)."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, trainer):
        if trainer.state.step == self.step:
            raise RuntimeError(f"crash after step {self.step}")


def _runs(rank, world, result_dir, data_dir, run_root):
    import torch

    from pinads_rec import parallel
    from pinads_rec.serve.loading import load_model
    from pinads_rec.training.run_log import RunLog
    from pinads_rec.training.tensorboard_writer import TensorBoardWriter
    from pinads_rec.training.trainer import Trainer

    env = parallel.init_distributed()
    if rank == 0:  # the trainer's INFO lines: which evaluation, its value, the stop
        handler = logging.FileHandler(os.path.join(result_dir, "train.log"))
        logging.getLogger("pinads_rec").addHandler(handler)
        logging.getLogger("pinads_rec").setLevel(logging.INFO)
    out = {}

    # 1. An evaluation at every epoch's end, on the held-out calibration rows.
    cfg = load_tiny(
        data_dir,
        [f"train.run_dir={run_root}/epochs", "train.epochs=2", "train.eval_every.epochs=1", "train.log_every=1"],
    )
    summary = Trainer(cfg, env, hooks=[RunLog(), TensorBoardWriter()]).run()
    out["epochs_summary_selection"] = summary["selection"]

    # 2. Early stopping at step 6, the best at step 2; and the same 6 steps without evaluations.
    snapshots = DenseSnapshots()
    cfg = load_tiny(data_dir, STOPPING + [f"train.run_dir={run_root}/stop"])
    summary = Trainer(cfg, env, hooks=[RunLog(), snapshots]).run()
    out["stop_summary"] = {"step": summary["step"], "selection": summary["selection"]}
    plain = ["train.max_steps=6", "train.log_every=1", f"train.run_dir={run_root}/plain"]
    Trainer(load_tiny(data_dir, plain), env, hooks=[RunLog()]).run()

    # 3. The same run dying after step 5 (its step-4 checkpoint on disk), then resumed.
    cfg = load_tiny(data_dir, STOPPING + [f"train.run_dir={run_root}/resumed"])
    try:
        Trainer(cfg, env, hooks=[RunLog(), Crash(5)]).run()
    except RuntimeError as e:
        out["crash"] = str(e)
    torch.distributed.barrier()
    out["checkpoints_at_crash"] = sorted(os.listdir(f"{run_root}/resumed/checkpoints"))
    summary = Trainer(cfg, env, hooks=[RunLog()]).run()
    out["resumed_summary"] = {"step": summary["step"], "selection": summary["selection"]}

    if rank == 0:
        # What serving loads (the latest checkpoint) against the best step's checkpoint, and the
        # weights the trainer held at each evaluation.
        final, _ = load_model(f"{run_root}/stop", precision="fp32")
        best, _ = load_model(f"{run_root}/stop", precision="fp32", step=2)
        final_state, best_state = final.state_dict(), best.state_dict()
        calibration = {k for k in final_state if k.endswith(("calibration.scale", "calibration.bias"))}
        out["calibration_keys"] = sorted(calibration)
        out["final_vs_best_checkpoint"] = max(
            float((final_state[k] - best_state[k]).abs().max()) for k in final_state if k not in calibration
        )
        out["checkpoints_after_stop"] = sorted(os.listdir(f"{run_root}/stop/checkpoints"))
        for step, weights in snapshots.at.items():
            out[f"final_vs_weights_at_{step}"] = max(
                float((final_state[k[len("model.") :]] - v).abs().max())
                for k, v in weights.items()
                if k[len("model.") :] not in calibration
            )
        with open(os.path.join(result_dir, "checks.json"), "w") as f:
            json.dump(out, f)


@pytest.fixture(scope="module")
def launch(tiny_data, tmp_path_factory):
    _, data_dir = tiny_data
    tmp = tmp_path_factory.mktemp("early_stopping")
    run_root = str(tmp / "runs")
    result_dir = run_ranks(_runs, 2, str(tmp), str(data_dir), run_root, timeout_s=500)
    with open(os.path.join(result_dir, "checks.json")) as f:
        checks = json.load(f)
    return checks, run_root, (result_dir / "train.log").read_text()


def test_an_evaluation_at_every_epoch_is_logged(launch):
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    checks, run_root, _ = launch
    log = read_run_log(f"{run_root}/epochs")
    records = log.validations
    assert [r["epoch"] for r in records] == [0, 1]
    last_of_epoch = [max(r["step"] for r in log.steps if r["epoch"] == e) for e in (0, 1)]
    assert [r["step"] for r in records] == last_of_epoch and last_of_epoch[1] == log.summary["step"]
    assert all(r["validation_on"] == "holdout" and len(r["rows"]) == 4 * 3 for r in records)
    assert all(r["value"] == selection_value(r["rows"], config.EarlyStopConfig()) for r in records)
    assert not any("validation_on" in r for r in log.steps)  # step records stay step records
    chosen = checks["epochs_summary_selection"]
    best = max(records, key=lambda r: r["value"])
    assert (chosen["best_step"], chosen["best_value"]) == (best["step"], best["value"])
    assert chosen["by"] == "auc (mean over surfaces, mean over tasks; max) on holdout"
    assert log.summary["selection"] == chosen and chosen["stopped_early_at"] is None

    events = EventAccumulator(f"{run_root}/epochs", size_guidance={SCALARS: 0})
    events.Reload()
    selected = {e.step: e.value for e in events.Scalars("validation/selected")}
    assert sorted(selected) == [r["step"] for r in records]
    assert {e.step for e in events.Scalars("validation/auc/all/click")} == set(selected)
    assert [e.value for e in events.Scalars("summary/best_step")] == [chosen["best_step"]]


def test_early_stopping_stops_after_patience_evaluations_without_improvement(launch):
    checks, run_root, train_log = launch
    records = read_run_log(f"{run_root}/stop").validations
    assert [(r["step"], r["improved"], r["evals_since_best"], r["stopping"]) for r in records] == [
        (2, True, 0, False),
        (4, False, 1, False),
        (6, False, 2, True),
    ]
    assert checks["stop_summary"]["step"] == 6
    assert checks["stop_summary"]["selection"]["stopped_early_at"] == 6
    assert checks["stop_summary"]["selection"]["best_step"] == 2
    assert "early stopping at step 6 (epoch 0): 2 evaluations without improving on auc" in train_log
    assert "the run's model: the weights of step 2 (of 6)" in train_log


def test_the_final_model_is_the_best_checkpoints_weights(launch):
    checks, _, _ = launch
    # Pruning to train.keep_checkpoints 1 spared the best (step 2) beside the last (step 6).
    assert checks["checkpoints_after_stop"] == ["step-2", "step-6"]
    assert checks["calibration_keys"]  # refit on the best weights: compared apart
    assert checks["final_vs_best_checkpoint"] == 0.0
    assert checks["final_vs_weights_at_2"] == 0.0  # the weights evaluated best...
    assert checks["final_vs_weights_at_6"] > 1e-4  # ...not those training stopped with


def test_evaluating_during_training_does_not_change_the_training(launch):
    _, run_root, _ = launch
    stopped = {r["step"]: r["loss"] for r in read_run_log(f"{run_root}/stop").steps}
    plain = {r["step"]: r["loss"] for r in read_run_log(f"{run_root}/plain").steps}
    assert sorted(stopped) == sorted(plain) == list(range(1, 7))
    assert stopped == plain


def test_a_resumed_run_keeps_its_best_and_its_patience_count(launch):
    checks, run_root, train_log = launch
    assert checks["crash"] == "crash after step 5"
    assert checks["checkpoints_at_crash"] == ["step-2", "step-4"]  # the best spared by pruning
    assert "best evaluation so far: step 2" in train_log
    # Resumed at step 4 with 1 evaluation without improvement: it stops at 6, as the uninterrupted
    # run did (a lost count would stop at 8; a lost best would make step 6 the best).
    assert checks["resumed_summary"] == checks["stop_summary"]
    uninterrupted = read_run_log(f"{run_root}/stop").validations
    resumed = read_run_log(f"{run_root}/resumed").validations  # the crashed run's, then the resumed one's
    assert [r["step"] for r in resumed] == [2, 4, 6]
    assert resumed[-1]["value"] == uninterrupted[-1]["value"]


# ---- without a launch --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["train.eval_every={}"], "train.eval_every: set one of epochs or steps"),
        (["train.eval_every={epochs: 1, steps: 10}"], "train.eval_every: set one of epochs or steps"),
        (["train.eval_every.steps=-5"], "train.eval_every.steps: must be >= 0"),
        (["train.eval_every.epochs=3", "train.epochs=2"], "train.eval_every.epochs: 3 is more than train.epochs 2"),
        (["train.eval_every={every: 1}"], "train.eval_every.every: unknown key"),
        (["train.early_stop.patience=2"], "train.early_stop: needs train.eval_every"),
        (["train.eval_every.epochs=1", "train.eval_on=train"], "train.eval_on: must be one of ['holdout', 'eval']"),
        (
            ["train.eval_every.epochs=1", "data.calibration_dir=null", "model.calibration=none"],
            "train.eval_on: holdout evaluates on the rows held out for calibration",
        ),
        (["train.eval_every.epochs=1", "train.early_stop.metric=calibration"], "train.early_stop.metric: must be"),
        (["train.eval_every.epochs=1", "train.early_stop.task=purchase"], "train.early_stop.task: no task named"),
        (["train.eval_every.epochs=1", "train.early_stop.surface=feed"], "train.early_stop.surface: 'feed' is not"),
        (
            ["train.eval_every.epochs=1", "train.early_stop.mode=min"],
            "train.early_stop.mode: auc is better when higher",
        ),
        (["train.eval_every.epochs=1", "train.early_stop.patience=-1"], "train.early_stop.patience: must be >= 0"),
        (["train.eval_every.epochs=1", "train.early_stop.min_delta=-0.1"], "train.early_stop.min_delta: must be >= 0"),
    ],
)
def test_config_errors_name_the_key(tiny_data, overrides, message):
    _, data_dir = tiny_data
    with pytest.raises(config.ConfigError) as e:
        load_tiny(data_dir, overrides)
    assert message in str(e.value)


def test_evaluations_are_off_by_default_and_configurable(tiny_data):
    _, data_dir = tiny_data
    cfg = load_tiny(data_dir)
    assert cfg.train.eval_every is None and cfg.train.early_stop is None
    cfg = load_tiny(
        data_dir, ["train.eval_every.steps=500", "train.eval_on=eval", "train.early_stop={metric: ne, task: click}"]
    )
    assert (cfg.train.eval_every.steps, cfg.train.selection.better) == (500, "min")
    assert selection_name(cfg.train) == "ne (mean over surfaces, task click; min) on eval"
    # data.calibration_holdout's rows serve as the holdout too.
    cfg = load_tiny(
        data_dir, ["train.eval_every.epochs=1", "data.calibration_dir=null", "data.calibration_holdout=0.2"]
    )
    assert cfg.train.eval_on == "holdout"


def test_the_selected_value_averages_the_chosen_cells():
    nan = float("nan")
    rows = [
        {"surface": s, "task": t, "auc": v, "log_loss": 1.0 - v}
        for s, t, v in [("a", "x", 0.6), ("b", "x", nan), ("a", "y", 0.8), ("b", "y", 0.7), ("all", "x", 0.9)]
        + [("all", "y", 0.5)]
    ]
    stop = config.EarlyStopConfig
    assert selection_value(rows, stop()) == pytest.approx((0.6 + 0.8 + 0.7) / 3)  # NaN cell left out
    assert selection_value(rows, stop(task="x")) == pytest.approx(0.6)
    assert selection_value(rows, stop(surface="all")) == pytest.approx(0.7)
    assert selection_value(rows, stop(surface="b", task="y", metric="log_loss")) == pytest.approx(0.3)
    assert selection_value(rows, stop(surface="b", task="x")) != selection_value(rows, stop(surface="b", task="x"))
    assert improves(0.5, None, stop()) and not improves(nan, None, stop())
    assert improves(0.71, 0.7, stop()) and not improves(0.71, 0.7, stop(min_delta=0.02))
    assert improves(0.3, 0.4, stop(metric="log_loss")) and not improves(0.5, 0.4, stop(metric="log_loss"))
