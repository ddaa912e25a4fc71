"""Benchmark scripts run end to end on tiny data (their figures are measured by hand, never asserted
against a time: these only check the scripts work and report what they claim to)."""

import csv
import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, tiny_overrides

pytestmark = pytest.mark.slow


def test_train_throughput_measures_every_mode_and_the_utilization(tiny_data, tmp_path):
    _, data = tiny_data
    args = [
        sys.executable,
        os.path.join(REPO, "benchmarks", "train_throughput.py"),
        "--ranks",
        "1",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--profile",
        "--out",
        str(tmp_path),
    ]
    for o in tiny_overrides(data) + ["model.calibration=none"]:
        args += ["--set", o]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "throughput.csv") as f:
        rows = list(csv.DictReader(f))
    measured = {(r["model"], r["mode"]) for r in rows}
    for model in ("full", "no_sequence"):
        for mode in ("pipeline", "loop", "plain"):
            assert (model, mode) in measured
    for r in rows:
        if r["mode"] != "utilization":
            assert float(r["examples_per_s"]) > 0
    util = {r["model"]: r for r in rows if r["mode"] == "utilization"}
    assert set(util) == {"full", "no_sequence"}
    assert float(util["full"]["dense_flops_per_example"]) > 1e5
    for r in util.values():
        # sequences and pooled ids are looked up; the kernel alone and the loader both measured
        assert float(r["lookups_per_example"]) > 3
        assert float(r["fbgemm_lookups_per_s"]) > 0 and float(r["loader_examples_per_s"]) > 0
        assert float(r["loader_zero_fill_examples_per_s"]) > 0
    assert float(util["full"]["lookups_per_example"]) > float(util["no_sequence"]["lookups_per_example"])
    out = proc.stdout
    assert "pipeline / plain PyTorch" in out and "MFLOP/example" in out and "of fbgemm alone" in out
    for model in ("full", "no_sequence"):
        assert "self cpu" in (tmp_path / f"profile-{model}.txt").read_text().lower()


def test_training_efficiency_switches_run(tiny_data, tmp_path, monkeypatch):
    """The switches (attention pinned to SDPA's MATH kernel, the non-fused dense AdamW kernels,
    loader prefetch) train; the MATH switch reaches every self-attention layer."""
    import functools

    benchmarks = os.path.join(REPO, "benchmarks")
    monkeypatch.syspath_prepend(benchmarks)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([benchmarks] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    import train_throughput as tt

    from pinads_rec import config
    from pinads_rec.experiments import harness

    switches = (
        (["train.dense_optimizer_kernel=for_loop"], {"attention": "math"}),
        (["train.dense_optimizer_kernel=foreach", "data.prefetch_factor=1"], {}),
    )
    for overrides, kwargs in switches:
        cfg = config.load(
            os.path.join(REPO, "configs", "demo.yaml"),
            tiny_overrides(tiny_data[1]) + ["model.calibration=none"] + tt.REFERENCE["full"] + overrides,
        )
        (r,) = harness.rank_results(
            functools.partial(tt.measure_pipeline, **kwargs), 1, tmp_path / "switch", cfg, 1, 2, 1, timeout_s=600
        )
        assert r["steps"] == 2 and r["valid_rows_per_step"] > 0
        # 3 sequence groups x 2 Transformer layers
        assert r["attention_layers_pinned"] == (6 if kwargs else 0)


def test_equal_auc_trains_both_and_evaluates_both(tiny_data, tmp_path):
    _, data = tiny_data
    args = [
        sys.executable,
        os.path.join(REPO, "benchmarks", "equal_auc.py"),
        "--steps",
        "3",
        "--ranks",
        "1",
        "--models",
        "no_sequence",
        "--out",
        str(tmp_path),
    ]
    for o in tiny_overrides(data) + ["model.calibration=none"]:
        args += ["--set", o]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]

    rows = json.loads((tmp_path / "equal_auc.json").read_text())
    assert [r["trainer"] for r in rows] == ["train.py", "plain"]
    for r in rows:
        assert r["examples_per_s"] > 0 and 0.0 <= r["auc_all"] <= 1.0 and r["steps"] == 3
    assert "train.py / plain:" in proc.stdout
    assert os.path.exists(tmp_path / "no_sequence-train_py" / "metrics.jsonl")


def test_collective_latency_reports_each_compute_setting():
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "benchmarks", "collective_latency.py"),
            "--calls",
            "10",
            "--compute-us",
            "0",
            "200",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if "of compute:" in line]
    assert [line.split()[1] for line in lines] == ["0", "200"]
    assert all("median" in line and "p90" in line and "compute alone" in line for line in lines)
