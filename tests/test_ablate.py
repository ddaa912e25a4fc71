"""The ablation runner end to end on tiny data: real training runs under torchrun (1 rank, a few
steps), an evaluate-only variant, reuse of finished runs, the report and its chart."""

import os

import pytest
import yaml
from conftest import DEMO, tiny_overrides

from pinads_rec.experiments import ablate
from pinads_rec.experiments.harness import meters

pytestmark = pytest.mark.slow

# The LightGBM reference train.py fits after each run: the report reads none of it.
NO_REFERENCE = ["reference.enabled=false"]


def test_ablation_trains_variants_and_writes_the_report(tiny_data, tmp_path, capsys):
    _, data = tiny_data
    spec = {
        "title": "Tiny calibration",
        "description": "Two variants and an evaluation of the first on one ad type.",
        "base": DEMO,
        "overrides": tiny_overrides(data) + ["train.max_steps=3", "train.log_every=1"] + NO_REFERENCE,
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

    # --report-only rewrites the report from the finished runs (here with findings), training nothing;
    # a variant without a finished run is named
    spec["findings"] = "Surface calibration is the closest to the truth."
    path.write_text(yaml.safe_dump(spec))
    assert ablate.main(["--config", str(path), "--ranks", "1", "--runs", str(runs), "--report-only"]) == 0
    out = capsys.readouterr().out
    assert out.count("report from") == 3 and "training ->" not in out
    assert "## Findings\n\nSurface calibration is the closest to the truth.\n" in (tmp_path / "report.md").read_text()
    spec["variants"].append({"name": "global", "overrides": ["model.calibration=global"]})
    path.write_text(yaml.safe_dump(spec))
    assert ablate.main(["--config", str(path), "--ranks", "1", "--runs", str(runs), "--report-only"]) == 2
    assert "variant 'global': no finished run of its config" in capsys.readouterr().err


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


def test_ablation_costs_serving_history_cost_only_and_the_cost_chart(tiny_data, tmp_path):
    """A cost-only variant, serving latency, the mean history length and the cost chart."""
    _, data = tiny_data
    spec = {
        "title": "Tiny costs",
        "base": DEMO,
        "overrides": tiny_overrides(data) + ["train.max_steps=2", "train.log_every=1"] + NO_REFERENCE,
        "metrics": ["auc"],
        "serving": {"candidates": 20, "requests": 3, "warmup": 1},
        "history_group": "pins",
        "cost_chart": {"x": "history_length", "y": ["examples_per_s", "peak_rss_mb", "serving_ms"]},
        "out": str(tmp_path / "costs.md"),
        "variants": [
            {"name": "short", "series": "Transformer", "overrides": ["model.sequence.num_layers=1"]},
            {"name": "short, 1 step", "series": "Transformer", "cost_only": True, "overrides": ["train.max_steps=1"]},
        ],
    }
    path = tmp_path / "costs.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert ablate.main(["--config", str(path), "--ranks", "1", "--runs", str(tmp_path / "runs")]) == 0
    report = (tmp_path / "costs.md").read_text()
    cost = report.split("## Cost per variant")[1].split("\n\n")[1].splitlines()
    assert "mean history length" in cost[0] and "serving ms / request (median)" in cost[0]
    rows = {line.split("|")[1].strip(): _numbers(line) for line in cost[2:]}
    assert set(rows) == {"short", "short, 1 step (cost only)"}
    for history, rate, rss, median, p90, dense, _ in rows.values():
        # tiny data: histories of up to 20 pins events; a rank holds torch (hundreds of MiB); a run of a
        # second or less shows no examples/s ("-")
        assert 0 < history <= 20 and 150 < rss < 20000 and 0 < median <= p90 and dense > 0
        assert rate is None or rate > 0
    assert "| short, 1 step | cost only | cost only | cost only | cost only |" in report
    assert "| short, 1 step | - | - | cost only | cost only |" in report
    assert os.path.exists(tmp_path / "costs" / "cost.png") and "(costs/cost.png)" in report


def _numbers(line):
    """The cells of a table row after the first, as numbers ("-": None)."""
    cells = [c.strip().replace(",", "") for c in line.split("|")[2:-1]]
    return [None if c == "-" else float(c) for c in cells]


def test_rank_memory_sees_the_children_not_the_launcher():
    import subprocess
    import sys

    child = "b = bytearray(300 << 20); import time; time.sleep(0.8)"
    launcher = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])"
    proc = subprocess.Popen([sys.executable, "-c", launcher])
    with meters.RankMemory(proc.pid, period_s=0.05) as memory:
        proc.wait()
    (peak,) = memory.peaks()  # one child: the launcher's own memory not counted
    assert 300 <= peak < 400


def test_history_length_and_serving_requests_read_the_eval_split(tiny_data):
    import dataclasses

    import numpy as np
    import pyarrow.parquet as pq

    from pinads_rec.data.loader.reader import list_files

    cfg, data = tiny_data
    stored = [
        len(x or []) for f in list_files(f"{data}/eval") for x in pq.read_table(f).column("seq_pin_ts").to_pylist()
    ]
    for cap in (5, 1000):
        groups = [
            dataclasses.replace(g, max_length=cap) if g.name == "pins" else g for g in cfg.features.sequence_groups
        ]
        capped = dataclasses.replace(cfg, features=dataclasses.replace(cfg.features, sequence_groups=groups))
        assert ablate.mean_history_length(capped, "pins", f"{data}/eval") == pytest.approx(
            np.minimum(stored, cap).mean()
        )
    with pytest.raises(ablate.config.ConfigError, match="no sequence group 'clicks'"):
        ablate.mean_history_length(cfg, "clicks", f"{data}/eval")

    first = pq.read_table(list_files(f"{data}/eval")[0]).slice(0, 2)
    tables = ablate.request_tables(cfg.features, f"{data}/eval", 30, 2)
    for table, i in zip(tables, range(2)):
        assert table.num_rows == 1  # the per-request layout: one row, 30 candidates
        items, own = table.column("item_id")[0].as_py(), first.column("item_id")[i].as_py()
        assert len(items) == 30 and items == (own * 30)[:30]
        assert table.column("seq_pin_item")[0].as_py() == first.column("seq_pin_item")[i].as_py()


def test_cost_keys_are_checked(tmp_path):
    bad = tmp_path / "bad.yaml"
    base = {"title": "x", "base": DEMO, "variants": [{"name": "a", "series": "s"}]}
    for extra, message in (
        ({"cost_chart": {"x": "history_length", "y": ["examples_per_s"]}}, "needs history_group"),
        ({"cost_chart": {"y": ["latency"]}, "history_group": "pins"}, "'latency' is not one of"),
        ({"serving": {"candidates": 0}}, "serving.candidates must be a positive integer"),
        ({"serving": {"users": 1}}, "unexpected keyword argument 'users'"),
    ):
        bad.write_text(yaml.safe_dump(dict(base, **extra)))
        with pytest.raises(ablate.config.ConfigError, match=message):
            ablate.load_ablation(str(bad))
    bad.write_text(
        yaml.safe_dump(dict(base, variants=[{"name": "a"}, {"name": "b", "eval_of": "a", "cost_only": True}]))
    )
    with pytest.raises(ablate.config.ConfigError, match="cost_only and eval_of exclude each other"):
        ablate.load_ablation(str(bad))
