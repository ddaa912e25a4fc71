"""The reference beside every run (pinads_rec/reference/): its point-in-time features against an
independent count on the built rows, the sample of whole requests, out-of-fold rates, the AUC's
standard error against simulation, the table's columns, and a real run that prints the reference
beside the model and writes it to metrics.jsonl (the command line too)."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import DEMO, REPO, read_rows, tiny_overrides

from pinads_rec import metrics
from pinads_rec.reference.features import FOLDS, RECENT, PointInTimeFeatures, Split


def test_history_matches_are_those_counted_row_by_row(tiny_data):
    cfg, data_dir = tiny_data
    f = cfg.features
    columns = PointInTimeFeatures.columns(f)
    train = Split.read(str(data_dir / "train"), f, columns)
    evaluated = Split.read(str(data_dir / "eval"), f, columns)
    features = PointInTimeFeatures(f, train, [train, evaluated])
    x, names = features.transform(evaluated), features.names()
    rows = read_rows(data_dir / "eval", f).to_pylist()
    assert x.shape == (len(rows), len(names)) and evaluated.n == len(rows)
    for candidate, events_column, least in (("item_id", "seq_pin_item", 5), ("item_topic", "seq_pin_topic", 50)):
        newest = names.index(f"{candidate}~{events_column}: newest {RECENT[0]}")
        everything = names.index(f"{candidate}~{events_column}: all")
        since = names.index(f"{candidate}~{events_column}: log s since")
        checked = 0
        for i, row in enumerate(rows):
            events, own = row[events_column] or [], row[candidate]
            hits = [j for j, e in enumerate(events) if e == own and own > 0]
            assert x[i, everything] == pytest.approx(math.log1p(len(hits)), rel=1e-6)
            assert x[i, newest] == pytest.approx(math.log1p(sum(1 for j in hits if j < RECENT[0])), rel=1e-6)
            if hits:
                age = max(row["timestamp"] - row["seq_pin_ts"][hits[0]], 0)
                assert x[i, since] == pytest.approx(math.log1p(age), rel=1e-5)
                checked += 1
        assert checked >= least, (candidate, checked)  # rows with a match were checked


def test_training_rates_leave_each_rows_fold_out(tiny_data):
    cfg, data_dir = tiny_data
    f = cfg.features
    train = Split.read(str(data_dir / "train"), f, PointInTimeFeatures.columns(f))
    features = PointInTimeFeatures(f, train, [train])
    names = features.names()
    col = names.index(f"user rate {f.tasks[0].label_column}")
    users, labels = train.row_values(f.columns.user_id), train.labels(f)[:, 0]
    fold = train.request_index[train.req] % FOLDS
    x = features.transform(train, train_rows=True)
    prior = labels.mean()
    for i in range(0, train.n, 97):
        others = (users == users[i]) & (fold != fold[i])
        p = (labels[others].sum() + 20.0 * prior) / (others.sum() + 20.0)
        assert x[i, col] == pytest.approx(math.log(p / (1 - p)), abs=1e-5)
        assert not others[i]


def test_a_sample_keeps_whole_requests_near_the_bound(tiny_data):
    cfg, data_dir = tiny_data
    f = cfg.features
    columns = PointInTimeFeatures.columns(f) + [f.columns.request_id]
    whole = Split.read(str(data_dir / "train"), f, columns)
    sample = Split.read(str(data_dir / "train"), f, columns, max_rows=1000, seed=3)
    again = Split.read(str(data_dir / "train"), f, columns, max_rows=1000, seed=3)
    assert (sample.request_index == again.request_index).all()
    most = int(np.bincount(whole.req).max())
    assert 1000 <= sample.n < 1000 + most and sample.total_rows == whole.n
    # Each kept request is the whole split's request of that index, every candidate of it.
    ids = whole.table.column(f.columns.request_id).to_numpy()[sample.request_index]
    assert (sample.table.column(f.columns.request_id).to_numpy() == ids).all()
    assert (np.bincount(sample.req) == np.bincount(whole.req)[sample.request_index]).all()


def test_auc_standard_error_matches_simulation():
    rng = np.random.default_rng(0)
    positives, negatives = 150, 600
    draws = []
    for _ in range(400):
        scores = np.concatenate([rng.normal(1.0, 1.0, positives), rng.normal(0.0, 1.0, negatives)])
        labels = np.concatenate([np.ones(positives), np.zeros(negatives)])
        draws.append(metrics.auc(torch.from_numpy(scores), torch.from_numpy(labels)))
    se = metrics.auc_standard_error(float(np.mean(draws)), positives, negatives)
    # Hanley & McNeil assume exponential score distributions: on normal ones they overstate the
    # spread a little (measured here: 0.0242 against 0.0210), the safe side for a margin.
    assert 0.95 * float(np.std(draws)) <= se <= 1.25 * float(np.std(draws))
    assert metrics.auc_standard_error(0.7, 0, 10) is None


def test_table_shows_the_oracle_only_where_there_is_one_and_the_reference_beside():
    acc = metrics.MetricAccumulator(["click"], ["home"], has_oracle=False)
    acc.update(
        torch.tensor([[0.2], [0.7], [0.6], [0.1]]), torch.tensor([[0.0], [1.0], [0.0], [1.0]]), torch.tensor([0] * 4)
    )
    rows = acc.compute()
    plain = metrics.format_table(rows).splitlines()[0].split()
    assert "oAUC" not in plain and "lift" not in plain and "cal/true" not in plain
    ref = [dict(r, auc=r["auc"] - 0.25) for r in rows]
    lines = metrics.format_table(rows, ref).splitlines()
    assert "ref AUC" in lines[0] and "vs ref" in lines[0]
    assert "+0.2500" in lines[2]


@pytest.fixture(scope="module")
def run_with_reference(tiny_data, tmp_path_factory):
    """A real run of train.py (one process) on the tiny data: its stdout and run directory."""
    _, data_dir = tiny_data
    run_dir = tmp_path_factory.mktemp("reference_run") / "run"
    overrides = tiny_overrides(data_dir, run_dir) + [
        "train.max_steps=6",
        "train.warmup_steps=1",
        "train.tensorboard=false",
    ]
    out = subprocess.run(
        [sys.executable, "-m", "pinads_rec.train", "--config", DEMO] + [a for o in overrides for a in ("--set", o)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout, run_dir


def test_a_run_prints_and_writes_the_reference(run_with_reference, tiny_data):
    stdout, run_dir = run_with_reference
    cfg, _ = tiny_data
    table = stdout[stdout.index("surface") :]
    assert "ref AUC" in table and "vs ref" in table and "AUC se" in table
    assert "reference: LightGBM on" in stdout
    summary = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"eval"' in line][
        -1
    ]
    ref = summary["reference"]
    cells = {(r["surface"], r["task"]) for r in ref["eval"]}
    assert cells == {(r["surface"], r["task"]) for r in summary["eval"]}
    assert ref["eval_rows"] == next(r["examples"] for r in summary["eval"] if r["surface"] == "all")
    # The tiny world plants a learnable signal: the reference is well above chance on it.
    everything = next(r for r in ref["eval"] if r["surface"] == "all" and r["task"] == cfg.features.tasks[0].name)
    assert everything["auc"] > 0.6 and everything["gauc"] is not None


def test_the_command_line_compares_with_the_run(run_with_reference, tiny_data):
    _, run_dir = run_with_reference
    _, data_dir = tiny_data
    sets = [a for o in tiny_overrides(data_dir) for a in ("--set", o)]
    cmd = [sys.executable, "-m", "pinads_rec.reference", "--config", DEMO] + sets
    out = subprocess.run(cmd + ["--run", str(run_dir)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "beside the reference" in out.stdout and "vs ref" in out.stdout
    bad = subprocess.run(cmd + ["--run", str(run_dir / "nowhere")], cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "nowhere" in bad.stderr


def test_the_console_prints_the_table_then_the_reference_then_the_slices(capsys):
    from types import SimpleNamespace

    from tqdm import tqdm

    from pinads_rec.training.console import ConsoleReport

    acc = metrics.MetricAccumulator(["click"], ["home"])
    acc.update(torch.tensor([[0.2], [0.7], [0.6], [0.1]]), torch.tensor([[0.0], [1.0], [0.0], [1.0]]), torch.zeros(4))
    rows = acc.compute()
    reference = {
        "model": "LightGBM",
        "features": 3,
        "train_rows": 10,
        "train_split_rows": 20,
        "eval_rows": 4,
        "feature_s": 1.0,
        "fit_s": 1.0,
        "eval": [dict(r, auc=0.25) for r in rows],
    }
    slices = [dict(r, slice=f"{which} users") for which in ("known", "new") for r in rows]
    report = ConsoleReport()
    report.bar = tqdm(total=1, disable=True)
    trainer = SimpleNamespace(env=SimpleNamespace(is_main=True))
    summary = {"step": 1, "world_size": 1, "train_examples_per_s": 1.0, "eval": rows, "reference": reference}
    report.on_evaluation(trainer, dict(summary, slices=slices))
    out = capsys.readouterr().out
    table, ref, sliced = out.index("ref AUC"), out.index("reference: LightGBM"), out.index("new users")
    assert table < ref < sliced
    assert "10 of 20 training rows" in out and "+0.2500" in out
    report.on_evaluation(trainer, dict(summary, reference={"model": "LightGBM", "error": "no rows"}))
    assert "reference (LightGBM): not fitted: no rows" in capsys.readouterr().out
