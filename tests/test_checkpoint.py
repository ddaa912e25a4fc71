"""Checkpoint compatibility: a run refuses a checkpoint written by a different model."""

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
