"""scripts/gpu_check.sh end to end in its CPU dry run (tiny sizes): every kind of step it makes on a
GPU runs once and lands in the report -- the torch-only arch benchmark (benchmarks/arch_precision.py
with TorchRec and fbgemm made absent: its smoke test), the same on TorchRec's kernels, synthetic
data, a train.py run through torch.distributed.run, serve score, the online service under load, the
planner. The figures are
meaningless here; docs/performance.md says how the GPU ones are made."""

import csv
import json
import os
import subprocess

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow

PARTS = {
    "sequence arch: transformer",
    "sequence arch: din",
    "DCNv2 cross network",
    "MMoE",
    "whole dense + sequence arch (transformer+counts)",  # configs/demo.yaml's encoders
}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run", str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return out


def test_every_step_ran(report):
    steps = dict(line.split("\t")[:2] for line in (report / "steps.tsv").read_text().splitlines())
    expected = ["arch_torch_only_demo", "arch_torchrec_demo", "data", "train_fp32", "serve_auto", "serve_online"]
    expected.append("plan_demo")
    assert list(steps) == expected and set(steps.values()) == {"ok"}, steps


def test_the_torch_only_benchmark_ran_without_torchrec_and_fbgemm(report):
    alone = json.loads((report / "arch_torch_only_demo.json").read_text())
    assert (alone["torchrec"], alone["fbgemm"]) == (False, False)
    assert json.loads((report / "arch_torchrec_demo.json").read_text())["torchrec"] is True
    measured = {(f["part"], f["mode"]) for f in alone["figures"]}
    assert measured == {(p, m) for p in PARTS for m in ("inference", "training")}
    assert all(f["fp32_ms"] > 0 and f["bf16_ms"] > 0 for f in alone["figures"])
    assert 0 < alone["max_logit_diff"] < 0.1  # BF16 differs from FP32, but not by much


def test_the_report_holds_each_section(report):
    text = (report / "report.md").read_text()
    for heading in ("## arch_torch_only_demo", "## arch_torchrec_demo", "## train.py, one process", "## plan_demo"):
        assert heading in text, heading
    assert "## the online service" in text and "max requests/s with p99 <= 500 ms: batched/auto/1" in text
    assert "| fp32 | 4 |" in text  # the train run: its steps, examples/s and AUCs
    assert "- auto: scored " in text


def test_the_serving_benchmark_drives_the_service_beside_the_model_alone(report):
    """benchmarks/serving.py --smoke (the serving step): both variants swept open loop over loopback,
    every point real scored responses, the model alone timed at each precision, the chart drawn."""
    with open(report / "serve_online.csv") as f:
        points = list(csv.DictReader(f))
    variants = ["batched/auto/1", "unbatched/fp32/1"]
    assert [p["variant"] for p in points if p["offered_rps"] == "4.0"] == variants  # every variant swept
    for p in points:  # every point: real scored responses, latencies ordered, the CPU measured
        assert int(p["ok"]) > 0 and int(p["n_503"]) == 0 and int(p["n_errors"]) == 0, p
        assert 0 < float(p["p50_ms"]) <= float(p["p95_ms"]) <= float(p["p99_ms"]) and float(p["ok_rps"]) > 0
        assert float(p["rows_per_s"]) > float(p["ok_rps"]) and float(p["server_cores"]) > 0
        assert (
            p["served_precision"] == "fp32" if p["precision"] == "fp32" else p["served_precision"] in ("bf16", "fp32")
        )
    out = (report / "serve_online.log").read_text()  # its stdout and stderr
    table = out.split("-" * 40)[-1]  # the final points table, after the progress lines
    for v in variants:
        assert any(line.startswith(v + " ") for line in table.splitlines()), v
    alone = [line.split() for line in out.splitlines() if line.startswith(("fp32 ", "auto -> "))]
    assert {a[0] for a in alone} == {"fp32", "auto"} and all(float(a[-2].replace(",", "")) > 0 for a in alone)  # rows/s
    for line in (
        "max requests/s with p99 <= 500 ms: batched/auto/1 ",
        "max requests/s with p99 <= 25 ms: ",
        "batched/auto/1 / unbatched/fp32/1 at p99 <= 500 ms: ",
        "(acceptance: >= 5x) -> ",
        "best variant at p99 <= 25 ms: ",
        "load generator CPU: ",
    ):
        assert line in out, line
    chart = report / "serve_online.png"
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and chart.stat().st_size > 10_000
