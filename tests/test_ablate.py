"""The ablation runner end to end on tiny data: real training runs under torchrun (1 rank, a few
steps), an evaluate-only variant, reuse of finished runs, the report and its chart."""

import os

import pytest
import yaml
from conftest import DEMO, tiny_overrides

from pinads_rec.experiments import ablate

pytestmark = pytest.mark.slow


def test_ablation_trains_variants_and_writes_the_report(tiny_data, tmp_path, capsys):
    _, data = tiny_data
    spec = {
        "title": "Tiny calibration",
        "description": "Two variants and an evaluation of the first on one ad type.",
        "base": DEMO,
        "overrides": tiny_overrides(data) + ["train.max_steps=3", "train.log_every=1"],
        "metrics": ["auc", "calibration_vs_truth", "ece"],
        "chart": {"metric": "calibration_vs_truth", "task": "click"},
        "out": str(tmp_path / "report.md"),
        "variants": [
            {"name": "surface", "overrides": ["model.calibration=surface"]},
            {"name": "none", "overrides": ["model.calibration=none"]},
            {
                "name": "surface on shopping",
                "eval_of": "surface",
                "overrides": ["data.row_filter={column: ad_type, values: [1]}"],
            },
        ],
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(spec))
    runs = tmp_path / "runs"
    assert ablate.main(["--config", str(path), "--ranks", "1", "--runs", str(runs)]) == 0
    report = (tmp_path / "report.md").read_text()
    for name in ("| surface |", "| none |", "| surface on shopping |"):
        assert name in report, name
    assert report.count("| surface on shopping | home_feed | click |") == 1
    assert os.path.exists(tmp_path / "report" / "calibration-vs-truth_click.png")
    assert len(list(runs.iterdir())) == 3  # one run directory per distinct config

    # a second call reuses every finished run instead of training again
    capsys.readouterr()
    assert ablate.main(["--config", str(path), "--ranks", "1", "--runs", str(runs)]) == 0
    assert capsys.readouterr().out.count("reusing the finished run") == 3


def test_ablation_file_errors_name_the_problem(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        yaml.safe_dump({"title": "x", "base": DEMO, "variants": [{"name": "a", "eval_of": "b"}, {"name": "b"}]})
    )
    with pytest.raises(ablate.config.ConfigError, match="eval_of 'b' is not an earlier variant"):
        ablate.load_ablation(str(bad))
    bad.write_text(
        yaml.safe_dump({"title": "x", "base": DEMO, "metrics": ["auc", "accuracy"], "variants": [{"name": "a"}]})
    )
    with pytest.raises(ablate.config.ConfigError, match="metric 'accuracy'"):
        ablate.load_ablation(str(bad))
