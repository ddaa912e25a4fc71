"""Checkpoint compatibility: a run refuses a checkpoint written by a different model, and a resume
refuses a train.run_dir holding a run of another config (but for what a resume may change)."""

import json

import pytest
from conftest import load_tiny

from pinads_rec import config
from pinads_rec.training import checkpoint


def _write_state(path, cfg):
    path.mkdir(parents=True)
    (path / checkpoint.STATE_FILE).write_text(json.dumps({"config": config.to_dict(cfg)}))


def test_config_differences_name_dotted_keys():
    a = {"model": {"dcn": {"num_layers": 2}, "x": [1, 2]}, "y": 1}
    b = {"model": {"dcn": {"num_layers": 3}, "x": [1, 5]}, "y": 1}
    assert checkpoint.config_differences(a, b) == ["model.dcn.num_layers", "model.x[1]"]


def test_same_model_other_training_settings_is_compatible(tmp_path):
    cfg = load_tiny(tmp_path)
    _write_state(tmp_path / "ckpt", cfg)
    other = load_tiny(tmp_path, ["train.lr=0.5", "data.batch_size=64"])
    assert checkpoint.check_compatible(tmp_path / "ckpt", other) is None  # no IncompatibleCheckpoint
    assert checkpoint.config_differences(config.to_dict(cfg), config.to_dict(other)) == ["data.batch_size", "train.lr"]


@pytest.mark.parametrize(
    "override,key",
    [
        ("model.dcn.num_layers=3", "model.dcn.num_layers"),
        ("model.sequence.d_model=64", "model.sequence.d_model"),
        ("features.surfaces=[home_feed, search]", "features.surfaces"),
    ],
)
def test_different_model_is_refused_naming_the_keys(tmp_path, override, key):
    _write_state(tmp_path / "ckpt", load_tiny(tmp_path))
    with pytest.raises(checkpoint.IncompatibleCheckpoint, match=rf"{tmp_path}/ckpt .*{key.replace('.', '[.]')}"):
        checkpoint.check_compatible(tmp_path / "ckpt", load_tiny(tmp_path, [override]))


# --- a train.run_dir holding a run of another config ------------------------------------------


def _checkpoint_of(run_dir, cfg):
    """A checkpoint of ``cfg`` in ``run_dir`` as the resume check reads it: its train_state.json."""
    _write_state(run_dir / "checkpoints" / "step-4", cfg)
    return checkpoint.latest(run_dir)


def test_a_resume_may_change_how_far_what_data_evaluation_and_reporting(tmp_path):
    run = tmp_path / "run"
    ckpt = _checkpoint_of(run, load_tiny(tmp_path, [f"train.run_dir={run}"]))
    relaunch = [
        f"train.run_dir={run}/",  # the same directory spelled otherwise
        "train.max_steps=40",
        "train.epochs=3",
        f"data.train_dir={tmp_path}/next_day",
        "train.eval_every={steps: 10}",
        "train.early_stop={patience: 5}",
        "data.nonfinite_dense=replace",
        "data.num_workers=2",
        "train.log_every=5",
        "train.checkpoint_every=10",
        "train.profile_steps=[3, 4]",
        f"train.plan_file={ckpt}/plan.json",
        "data.row_filter={column: surface, values: [0]}",  # the ablation's evaluation of a slice
    ]
    assert checkpoint.check_same_run(ckpt, load_tiny(tmp_path, relaunch)) is None  # no RunDirConflict


@pytest.mark.parametrize(
    "overrides,keys",
    [
        (["train.lr=0.5"], "train.lr"),
        (["data.batch_size=64", "train.seed=3"], "data.batch_size, train.seed"),
        (["train.embedding_lr=0.1"], "train.embedding_lr"),
    ],
)
def test_a_run_dir_of_another_config_is_refused_naming_the_keys_and_the_fix(tmp_path, overrides, keys):
    run = tmp_path / "run"
    ckpt = _checkpoint_of(run, load_tiny(tmp_path, [f"train.run_dir={run}"]))
    with pytest.raises(checkpoint.RunDirConflict) as refused:
        checkpoint.check_same_run(ckpt, load_tiny(tmp_path, [f"train.run_dir={run}"] + overrides))
    message = str(refused.value)
    assert f"checkpoint step-4 differs in {keys})" in message, message
    assert f"new train.run_dir, or delete {run} to start over" in message and "\n" not in message


@pytest.mark.slow
def test_train_py_refuses_a_run_dir_of_another_config_in_one_line(tmp_path):
    # As a user meets it: train.py (one process) on a run_dir holding another config's checkpoint
    # stops before reading any data, exit 2, the error alone on stderr. (The check runs before the
    # checkpoint's weights are read: a checkpoint's train_state.json is all it needs.)
    import subprocess
    import sys

    from conftest import REPO, tiny_overrides

    run = tmp_path / "run"
    _checkpoint_of(run, load_tiny(tmp_path, [f"train.run_dir={run}"]))
    for split in ("train", "eval", "calibration"):  # there (train.py checks its paths first), never read
        (tmp_path / split).mkdir()
    overrides = ",".join(tiny_overrides(tmp_path, run) + ["train.lr=0.5"])
    proc = subprocess.run(
        [sys.executable, "-m", "pinads_rec.train", "--config", "configs/demo.yaml", "--set", overrides],
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PINADS_RDZV_FILE": str(tmp_path / "rdzv")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        f"[rank 0] checkpoint error: train.run_dir {run} holds a run of another config (its checkpoint step-4 "
        f"differs in train.lr): give this run a new train.run_dir, or delete {run} to start over (a resume may "
        "change only how far it trains, the data directories, evaluation, fault policies and reporting)"
    ]
