"""The stability experiment (python -m pinads_rec.experiments.stability) end to end on tiny data:
both variants trained through both phases by the real trainer once (a module fixture), then one
check per test on the report, its CSV and plot, and a report-only rewrite."""

import contextlib
import csv
import io

import pytest

from pinads_rec.experiments import stability

pytestmark = pytest.mark.slow

TINY = [
    "synth.train_requests=300",
    "synth.eval_requests=100",
    "synth.row_group_size=500",
    "synth.num_files=2",
    "synth.sequence_length=20",
    "data.batch_size=128",
    "data.num_workers=0",
    "data.shuffle_buffer_rows=1024",
    "train.log_every=1",
    "model.calibration=none",
    "data.calibration_holdout=0",
    "reference.enabled=false",  # the LightGBM reference each of the 4 launches would fit: no check reads it
]


def _argv(tmp, *extra):
    argv = ["--out", str(tmp / "report" / "stability.md"), *extra]
    sets = TINY + [f"data.train_dir={tmp}/data/train", f"data.eval_dir={tmp}/data/eval", f"train.run_dir={tmp}/runs"]
    for s in sets:
        argv += ["--set", s]
    return argv


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    """(work directory, the report's text, what the command printed)."""
    tmp = tmp_path_factory.mktemp("stability")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert stability.main(_argv(tmp)) == 0
    return tmp, (tmp / "report" / "stability.md").read_text(), printed.getvalue()


def test_data_is_generated_then_both_variants_train_both_phases(experiment):
    _, _, printed = experiment
    assert "generating" in printed
    for label in ("BatchNorm1d:", "Resilient BN:"):
        assert label in printed
    assert printed.count("before:") == 2 and printed.count("newest:") == 2


def test_report_has_every_section(experiment):
    _, text, _ = experiment
    for title in ("# Model stability", "## What breaks plain batch norm", "## The experiment", "## Results"):
        assert title in text
    assert "## Findings" in text and "**Cause, measured**" in text


def test_report_tables_have_a_row_per_run_and_phase(experiment):
    _, text, _ = experiment
    for label in ("BatchNorm1d", "Resilient BN"):
        assert text.count(f"| {label} | day 1 |") == 1 + 3 + 3 + 1  # phases, tasks, surfaces, running stats
        assert text.count(f"| {label} | day 2 |") == 1 + 3 + 3 + 1
    assert "| Resilient BN | day 2 | " in text and "batches left out" in text


def test_csv_and_plot_are_written(experiment):
    tmp, _, _ = experiment
    with open(tmp / "report" / "stability" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["norm"] for r in rows} == {"batch_norm", "resilient_bn"}
    assert {r["phase"] for r in rows} == {"before", "newest"}
    with open(tmp / "report" / "stability" / "loss_logits.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_report_only_rewrites_the_same_report(experiment):
    tmp, text, _ = experiment
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert stability.main(_argv(tmp, "--report-only")) == 0
    assert "reusing it" in printed.getvalue() and "Resilient BN: reusing" in printed.getvalue()
    assert (tmp / "report" / "stability.md").read_text() == text
