"""Benchmark scripts run end to end on tiny data (their figures are measured by hand, never asserted
against a time: these only check the scripts work and report what they claim to)."""

import csv
import os
import subprocess
import sys

import pytest

from conftest import REPO, tiny_overrides

pytestmark = pytest.mark.slow


def test_train_throughput_measures_every_mode_and_the_utilization(tiny_data, tmp_path):
    _, data = tiny_data
    args = [sys.executable, os.path.join(REPO, "benchmarks", "train_throughput.py"),
            "--ranks", "1", "--steps", "2", "--warmup", "1", "--out", str(tmp_path)]
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
    util = next(r for r in rows if r["mode"] == "utilization")
    assert float(util["dense_flops_per_example"]) > 1e5
    out = proc.stdout
    assert "pipeline / plain PyTorch" in out and "dense MFLOP per example" in out
