"""The daily loop (pinads_rec/experiments/continuous.py) on a tiny drifting world: 3 days, each built
from the raw logs the day it is needed, the three strategies side by side, each day's training one
TorchX launch on 2 ranks, each model evaluated on the next day as serving scores it (with the ads
launched that day apart) and exported."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from conftest import rows_of

from pinads_rec.data.loader.contract import contract_columns
from pinads_rec.experiments.continuous import Loop, run_loop, seen_items
from pinads_rec.experiments.continuous_report import END, START, findings, metric_value, write_report

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
TINY_DRIFT = [
    "synth.drift.days=3",
    "synth.drift.requests_per_day=300",
    "synth.num_items=2000",
    "synth.num_users=1500",
    "synth.row_group_size=600",
    "build.requests_per_row_group=50",  # the built days in row groups as small as the generated ones
    "data.batch_size=128",
    "data.shuffle_buffer_rows=1024",
    "data.num_workers=0",
    "train.log_every=5",
    "train.warmup_steps=2",
    "reference.enabled=false",  # the LightGBM reference each launch would fit: no check reads it
]


@pytest.fixture(scope="module")
def loop_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("continuous")
    loop = Loop(str(REPO / "configs" / "continuous.yaml"), TINY_DRIFT, out, window=2, ranks=2, raw=True)
    results = run_loop(loop, echo=print)
    return loop, results


def _row(results, day, strategy):
    (row,) = [r for r in results if r["day"] == day and r["strategy"] == strategy]
    return row


def test_every_day_but_the_last_has_a_row_per_strategy(loop_run):
    _, results = loop_run
    assert sorted((r["day"], r["strategy"]) for r in results) == [
        (d, s) for d in (0, 1) for s in ("frozen", "incremental", "window")
    ]
    for r in results:
        assert 0.5 < metric_value(r["eval"]["all"], "auc") < 1.0, r["strategy"]
        assert metric_value(r["eval"]["all"], "gauc") is not None


def test_each_day_is_built_from_the_raw_logs_equal_to_the_generators_day(loop_run):
    loop, results = loop_run
    features = loop.cfg.features
    built = loop.day_dirs()
    assert [d.parent.parent for d in built] == [loop.out / "built"] * 3
    assert all(r["build_seconds"] >= 0 for r in results) and results[0]["build_seconds"] > 0
    for day in built:
        generated = rows_of(pq.read_table(loop.out / "data" / "days" / day.name), features)
        made = rows_of(pa.concat_tables(pq.read_table(p) for p in sorted(day.glob("part-*.parquet"))), features)
        assert made.num_rows == generated.num_rows > 0, day.name
        made = made.take(pc.sort_indices(made.column("request_id")))
        generated = generated.take(pc.sort_indices(generated.column("request_id")))
        for col in [c.name for c in contract_columns(features)]:
            want = generated.column(col).combine_chunks()
            assert made.column(col).combine_chunks().cast(want.type).equals(want), (day.name, col)


def test_incremental_warm_starts_from_yesterday_and_frozen_never_changes(loop_run):
    loop, results = loop_run
    day0, day1 = _row(results, 0, "incremental"), _row(results, 1, "incremental")
    saved = json.loads((Path(day1["run_dir"]) / "config.json").read_text())
    assert saved["train"]["init_from"] == day0["run_dir"]
    assert "warm start from" in (Path(day1["run_dir"]) / "train.log").read_text()
    assert json.loads((Path(day0["run_dir"]) / "config.json").read_text())["train"]["init_from"] is None
    assert _row(results, 1, "frozen")["run_dir"] == day0["run_dir"] == _row(results, 0, "frozen")["run_dir"]
    assert _row(results, 1, "frozen")["rows_trained"] == 0
    assert _row(results, 0, "window")["run_dir"] == day0["run_dir"]  # day 0: one model for all three


def test_the_window_retrains_on_the_last_days_from_scratch(loop_run):
    _, results = loop_run
    window, incremental = _row(results, 1, "window"), _row(results, 1, "incremental")
    assert json.loads((Path(window["run_dir"]) / "config.json").read_text())["train"]["init_from"] is None
    assert window["rows_trained"] > 1.5 * incremental["rows_trained"]  # two days against one


def test_the_new_ads_slice_holds_the_ads_no_earlier_day_showed(loop_run):
    loop, results = loop_run
    days = loop.day_dirs()
    seen = seen_items(days[:2], "item_id")
    launched = set(seen_items(days[2:3], "item_id").tolist()) - set(seen.tolist())
    assert launched, "the drifting world launches ads on day 2"
    ev = _row(results, 1, "incremental")["eval"]
    assert metric_value(ev["new"], "examples") > 0
    assert metric_value(ev["new"], "examples") + metric_value(ev["old"], "examples") == metric_value(
        ev["all"], "examples"
    )
    # Of the others: the ads first shown on the last training day, and the ones shown before it.
    assert metric_value(ev["recent"], "examples") > 0 and metric_value(ev["older"], "examples") > 0
    assert metric_value(ev["recent"], "examples") + metric_value(ev["older"], "examples") == metric_value(
        ev["old"], "examples"
    )


def test_every_model_the_loop_publishes_is_exported_for_serving(loop_run):
    _, results = loop_run
    for r in results:  # incremental is published (named first); window after day 0 is a reference only
        exported = (Path(r["run_dir"]) / "model.pt2").exists()
        if r["strategy"] == "incremental":
            assert exported and (Path(r["run_dir"]) / "model.pt2").stat().st_size > 0, r["day"]
        elif r["strategy"] == "window" and r["day"] > 0:
            assert not exported


def test_the_online_service_serves_the_loops_newest_published_model(loop_run):
    from pinads_rec.serve.online import ModelSource, Ranker

    loop, results = loop_run
    newest = max((r for r in results if r["strategy"] == "incremental"), key=lambda r: r["day"])
    run_dir, step = ModelSource(str(loop.out / "incremental")).newest()
    assert run_dir == Path(newest["run_dir"])
    ranker = Ranker(run_dir, step, str(loop.out / "data" / "raw"), None, "fp32")  # the raw logs, a day a directory
    answers = ranker.score(ranker.live.requests_from_logs(None, limit=6))
    assert len(answers) == 6 and all(len(a["scores"]) > 0 for a in answers), answers
    assert {a["model_version"] for a in answers} == {f"{run_dir.name}@step-{step}"}


def test_a_rerun_reuses_the_finished_days_and_the_report_fills_its_marks(loop_run, tmp_path):
    loop, results = loop_run
    logs = {r["run_dir"]: (Path(r["run_dir"]) / "train.log").stat().st_mtime_ns for r in results}
    again = run_loop(loop, echo=lambda _: None)
    assert [(r["day"], r["strategy"], r["rows_trained"]) for r in again] == [
        (r["day"], r["strategy"], r["rows_trained"]) for r in results
    ]
    assert {d: (Path(d) / "train.log").stat().st_mtime_ns for d in logs} == logs  # nothing retrained
    doc = tmp_path / "continuous.md"
    doc.write_text(f"# Guide\n\nprose before\n\n{START}\nold\n{END}\n\nprose after\n")
    write_report(results, loop, doc)
    text = doc.read_text()
    assert text.startswith("# Guide\n\nprose before") and text.rstrip().endswith("prose after")
    assert "old\n" not in text and "| day trained |" in text
    assert (tmp_path / "continuous" / "auc_by_day.png").stat().st_size > 0
    assert "incremental_minus_window" in findings(results) and "frozen_fall" in findings(results)
