"""scripts/gpu_check.sh end to end in its CPU dry run (tiny sizes): every kind of step it makes on a
GPU runs once and lands in the report -- the torch-only arch benchmark (benchmarks/arch_precision.py
with TorchRec and fbgemm made absent: its smoke test), the same on TorchRec's kernels, synthetic
data, a train.py run through torch.distributed.run, serve score, the online service under load, the
planner. The figures are
meaningless here; docs/performance.md says how the GPU ones are made."""

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
    "whole dense + sequence arch (transformer)",
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
    assert "## the online service" in text and "max requests/s with p99 <= 500 ms: batched/fp32/1" in text
    assert "| fp32 | 4 |" in text  # the train run: its steps, examples/s and AUCs
    assert "- auto: scored " in text
