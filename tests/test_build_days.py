"""Builds by day (``--day``, data/build/days.py): a day's partition equals, row for row and column
for column, that day of the full build -- on the demo's raw logs (every day of them) and on a small
multi-day fixture with derived request ids, a vocabulary of text ids, negative downsampling, a
history from the impression log itself, a request across midnight and a time zone east of UTC.
Plus: the vocabulary rule, a day without requests, bad days, and all or nothing per day."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from datetime import datetime
from pathlib import Path
from typing import Dict, List
from zoneinfo import ZoneInfo

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from conftest import load_tiny
from dataset_fixtures import write_taobao

from pinads_rec import config
from pinads_rec.config import ConfigError, SplitConfig
from pinads_rec.data import build as B
from pinads_rec.data import build_output
from pinads_rec.data import synth as S
from pinads_rec.data.loader.contract import ContractError, contract_columns
from pinads_rec.data.loader.dataset import LoaderSettings, ParquetBatches
from pinads_rec.data.loader.storage_layout import to_per_row

REPO = Path(__file__).resolve().parent.parent


# --- comparing a partition with the full build's day --------------------------------------------


def read_parts(directory: Path) -> pa.Table:
    return pa.concat_tables(pq.read_table(p) for p in sorted(directory.glob("part-*.parquet")))


def full_rows(out: Path, splits: List[str], features) -> pa.Table:
    """Every split of a full build, one row per candidate."""
    return pa.concat_tables(to_per_row(read_parts(out / s), features) for s in splits)


def on_day(rows: pa.Table, day: str, tz: str, features) -> pa.Table:
    """The rows whose request time falls on ``day`` in ``tz``."""
    stamps = rows.column(features.columns.timestamp).to_pylist()
    keep = [datetime.fromtimestamp(t, ZoneInfo(tz)).date().isoformat() == day for t in stamps]
    return rows.filter(pa.array(keep))


def assert_same_rows(got: pa.Table, want: pa.Table, features, what: str) -> None:
    """Equal row for row, every contract column, both sorted by request id (a request's candidates
    kept in their order)."""
    assert got.num_rows == want.num_rows > 0, (what, got.num_rows, want.num_rows)
    rid = features.columns.request_id
    got = got.take(pc.sort_indices(got.column(rid)))  # stable: candidate order kept
    want = want.take(pc.sort_indices(want.column(rid)))
    for name in [c.name for c in contract_columns(features)]:
        w = want.column(name).combine_chunks()
        g = got.column(name).combine_chunks().cast(w.type)
        if not g.equals(w):
            bad = next(i for i in range(len(w)) if g[i] != w[i])
            pytest.fail(f"{what}.{name}: row {bad} (request {want.column(rid)[bad]}): {g[bad]} != {w[bad]}")


def partition(out: Path, day: str) -> Path:
    return B.day_dir(str(out), day)


def leftovers(directory: Path) -> List[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(".")) if directory.exists() else []


def contents(directory: Path) -> Dict[str, str]:
    return {
        p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


# --- the demo's raw logs: every day --------------------------------------------------------------


def _iso(t: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo's raw logs (tests/test_build_demo.py's sizes), their full build, and one range
    build of every day they hold."""
    root = tmp_path_factory.mktemp("days_demo")
    cfg = load_tiny(root / "synth", ["synth.num_users=150", "synth.sequence_length=100"])
    S.generate(cfg, root / "synth", raw=True)
    bounds = S.split_boundaries(cfg.synth)
    cfg.build.splits = [
        SplitConfig("train", end=_iso(bounds["train"][1])),
        SplitConfig("calibration", start=_iso(bounds["calibration"][0]), end=_iso(bounds["calibration"][1])),
        SplitConfig("eval", start=_iso(bounds["eval"][0])),
    ]
    raw = str(root / "synth" / "raw")
    B.build(cfg, raw, str(root / "full"))
    rows = full_rows(root / "full", ["train", "calibration", "eval"], cfg.features)
    stamps = rows.column(cfg.features.columns.timestamp).to_pylist()
    days = sorted({time.strftime("%Y-%m-%d", time.gmtime(t)) for t in stamps})
    summaries = B.build_days(cfg, raw, str(root / "by_day"), days, threads=2)
    return cfg, root, rows, days, summaries


@pytest.mark.slow
def test_every_day_of_the_demo_equals_that_day_of_the_full_build(demo):
    cfg, root, rows, days, summaries = demo
    assert len(days) >= 25  # the generator's 30 days
    total = 0
    for day in days:
        got = to_per_row(read_parts(partition(root / "by_day", day)), cfg.features)
        assert_same_rows(got, on_day(rows, day, "UTC", cfg.features), cfg.features, day)
        assert summaries[day]["splits"][day]["rows"] == got.num_rows
        total += got.num_rows
    assert total == rows.num_rows  # the days together are the whole build


@pytest.mark.slow
def test_a_single_day_equals_its_day_of_a_range(demo, tmp_path):
    cfg, root, rows, days, _ = demo
    day = days[len(days) // 2]
    B.build_days(cfg, str(root / "synth" / "raw"), str(tmp_path / "one"), [day], threads=1)
    alone, of_range = read_parts(partition(tmp_path / "one", day)), read_parts(partition(root / "by_day", day))
    assert alone.equals(of_range)
    assert sorted(p.name for p in (tmp_path / "one" / "days").iterdir()) == [day]


@pytest.mark.slow
def test_a_partition_is_a_complete_build_the_loader_reads(demo):
    cfg, root, _, days, summaries = demo
    day = days[3]
    part = partition(root / "by_day", day)
    assert sorted(p.name for p in part.iterdir() if not p.name.startswith("part-")) == ["manifest.json", "summary.json"]
    build_output.verify(str(part))
    manifest = json.loads((part / "manifest.json").read_text())
    assert manifest["day"] == day and manifest["complete"] is True and manifest["splits"] == []
    assert manifest["impression_time_range"][0].startswith(day)
    assert json.loads((part / "summary.json").read_text()) == summaries[day]
    stamps = read_parts(part).column(cfg.features.columns.timestamp).to_pylist()
    assert stamps == sorted(stamps)  # in time order
    assert (
        ParquetBatches(str(part), LoaderSettings.of(cfg), shuffle=False).num_rows
        == (summaries[day]["splits"][day]["rows"])
    )
    assert leftovers(root / "by_day" / "days") == []


@pytest.mark.slow
def test_out_holding_a_full_build_is_refused(demo, tmp_path):
    cfg, root, _, days, _ = demo
    with pytest.raises(ConfigError, match=r"--out .*full: holds a full build \(manifest.json\)"):
        B.build_days(cfg, str(root / "synth" / "raw"), str(root / "full"), days[:1])
    assert not (root / "full" / "days").exists()


# --- a small multi-day fixture: derived ids, vocabulary, downsampling, midnight ------------------

TZ = "Asia/Shanghai"
DAYS = ["2024-01-02", "2024-01-03", "2024-01-04"]

CONFIG = f"""
features:
  columns: {{request_id: request_id, timestamp: timestamp, surface: surface}}
  surfaces: [feed, search]
  tasks: [{{name: click, label_column: click}}]
  tables:
    - {{name: user, num_embeddings: 50, embedding_dim: 4}}
    - {{name: item, num_embeddings: 40, embedding_dim: 4}}
    - {{name: btag, num_embeddings: 5, embedding_dim: 4}}
  sparse:
    - {{name: user_id, column: user_id, table: user, user_side: true}}
    - {{name: item_id, column: item_id, table: item}}
  sequence_groups:
    - name: behaviour
      timestamp_column: beh_ts
      max_length: 6
      features:
        - {{name: item, column: beh_item, table: item}}
        - {{name: btag, column: beh_btag, table: btag}}
    - name: clicks
      timestamp_column: click_ts
      max_length: 4
      features:
        - {{name: item, column: click_item, table: item}}
data: {{calibration_holdout: 0.0}}
model: {{calibration: none}}
build:
  timezone: {TZ}
  impressions:
    path: [impressions.csv]
    user: user
    time: ts
    request_key: [user, session]
    item: ad
  sequences:
    - group: behaviour
      path: [behaviour.csv]
      user: user
      time: ts
      min_gap_s: 30
      columns: {{beh_item: item, beh_btag: "CASE btag WHEN 'pv' THEN 1 WHEN 'cart' THEN 2 ELSE 3 END"}}
    - group: clicks
      user: user
      time: ts
      filter: "clk = 1"
      columns: {{click_item: ad}}
  columns:
    user_id: user
    item_id: ad
    surface: "CASE pid WHEN 'p1' THEN 'feed' ELSE 'search' END"
    click: clk
  splits:
    - {{name: train, start: "2024-01-02", end: "2024-01-04"}}
    - {{name: eval, start: "2024-01-04", end: "2024-01-05"}}
  negative_downsampling: {{task: click, rates: {{feed: 0.5, search: 0.7}}, splits: [train], seed: 3}}
  vocabularies: [{{table: item}}]
  requests_per_row_group: 3
"""


def local(day: str, seconds: int) -> int:
    """Epoch seconds of ``seconds`` after midnight of ``day`` in TZ."""
    return int(datetime.fromisoformat(day).replace(tzinfo=ZoneInfo(TZ)).timestamp()) + seconds


def write_fixture(tmp: Path):
    """12 users, a few sessions (requests) a day on 3 days, 1-4 ads each, text ad ids (60 of them:
    more than the item table keeps), a behaviour log from 3 days before to a day after; user 1's
    session ``late`` runs across midnight of 2024-01-03."""
    rng = random.Random(7)
    imps, events = [], []
    for user in range(1, 13):
        for d, day in enumerate(DAYS):
            for k in range(rng.randint(1, 3)):
                start, pid = local(day, rng.randint(0, 86_000)), rng.choice(["p1", "p2"])
                for ad in rng.sample(range(60), rng.randint(1, 4)):
                    t = start + rng.choice([0, 0, 0, 2])  # some requests' impressions at two times
                    imps.append((user, f"s{d}{k}", t, pid, f"a{ad}", int(rng.random() < 0.3)))
        for _ in range(30):
            t = local("2023-12-30", rng.randint(0, 7 * 86_400))
            events.append((user, t, rng.choice(["pv", "pv", "cart", "fav", "buy"]), f"a{rng.randrange(60)}"))
    imps += [
        (1, "late", local("2024-01-03", 86_398), "p1", "a5", 1),
        (1, "late", local("2024-01-04", 3), "p1", "a6", 0),
    ]
    raw = tmp / "raw"
    raw.mkdir()
    (raw / "impressions.csv").write_text(
        "user,session,ts,pid,ad,clk\n" + "".join(",".join(map(str, r)) + "\n" for r in imps)
    )
    (raw / "behaviour.csv").write_text("user,ts,btag,item\n" + "".join(",".join(map(str, r)) + "\n" for r in events))
    path = tmp / "config.yaml"
    path.write_text(textwrap.dedent(CONFIG))
    return raw, path


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """The fixture's raw logs, config, full build (train: 01-02..01-03 sampled; eval: 01-04) and its rows."""
    tmp = tmp_path_factory.mktemp("days_small")
    raw, path = write_fixture(tmp)
    cfg = config.load(path)
    summary = B.build(cfg, str(raw), str(tmp / "full"), threads=1)
    return tmp, raw, path, summary, full_rows(tmp / "full", ["train", "eval"], cfg.features)


def test_days_equal_the_full_build_with_its_vocabulary_ids_and_sampling(small):
    tmp, raw, path, full_summary, rows = small
    cfg = config.load(path)
    f = cfg.features
    summaries = B.build_days(cfg, str(raw), str(tmp / "by_day"), DAYS[:2], vocabularies=str(tmp / "full"), threads=1)
    for day in DAYS[:2]:  # the full build's sampled train days: the same draws
        got = to_per_row(read_parts(partition(tmp / "by_day", day)), f)
        assert_same_rows(got, on_day(rows, day, TZ, f), f, day)
    # The eval day, which the full build does not sample: the day built unsampled equals it.
    unsampled = config.load(path, ["build.negative_downsampling=null"])
    B.build_days(unsampled, str(raw), str(tmp / "eval_day"), DAYS[2:], vocabularies=str(tmp / "full"), threads=1)
    got = to_per_row(read_parts(partition(tmp / "eval_day", DAYS[2])), f)
    assert_same_rows(got, on_day(rows, DAYS[2], TZ, f), f, DAYS[2])
    # What the equality covered: sampling, out-of-vocabulary ids, the request across midnight, and
    # histories reaching back into earlier days.
    repairs = {k: v for s in summaries.values() for k, v in s["repairs"].items()}
    assert full_summary["repairs"]["negatives of click downsampled away"] > 0
    assert repairs["negatives of click downsampled away"] > 0
    assert repairs["vocabulary item: ids out of vocabulary (mapped to 0)"] > 0
    assert repairs["requests across midnight (put in the day of their earliest impression)"] == 1
    day2 = read_parts(partition(tmp / "by_day", DAYS[1])).to_pylist()
    assert any(t < local(DAYS[1], 0) for r in day2 for t in r["beh_ts"])  # events of earlier days
    assert any(t < local(DAYS[1], 0) for r in day2 for t in r["click_ts"])  # clicks of the day before
    late = [r for r in day2 if r["user_id"] == 1 and r["timestamp"] == local(DAYS[1], 86_398)]
    assert len(late) == 1 and len(late[0]["click"]) == 2  # its impression after midnight kept with it


def test_a_config_without_splits_builds_by_day(small, tmp_path):
    tmp, raw, path, _, rows = small
    cfg = config.load(path)
    cfg.build.splits = []  # the full build needs them, a day build ignores them
    B.build_days(cfg, str(raw), str(tmp_path / "out"), DAYS[:1], vocabularies=str(tmp / "full"), threads=1)
    got = to_per_row(read_parts(partition(tmp_path / "out", DAYS[0])), cfg.features)
    assert_same_rows(got, on_day(rows, DAYS[0], TZ, cfg.features), cfg.features, DAYS[0])


def test_the_taobao_config_by_day_equals_its_full_build(tmp_path):
    """The real config: side tables, six vocabularies (one with min_count), request ids numbered
    from (user, time, placement), Beijing days."""
    write_taobao(tmp_path / "raw", users=40, requests_per_user=3)
    cfg = config.load(REPO / "configs" / "datasets" / "taobao_ad.yaml", ["build.requests_per_row_group=16"])
    raw, tz = str(tmp_path / "raw"), cfg.build.timezone
    B.build(cfg, raw, str(tmp_path / "full"), threads=1)
    rows = full_rows(tmp_path / "full", [s.name for s in cfg.build.splits], cfg.features)
    days = sorted(
        {datetime.fromtimestamp(t, ZoneInfo(tz)).date().isoformat() for t in rows.column("timestamp").to_pylist()}
    )
    assert days == B.parse_days("2017-05-06:2017-05-13")
    B.build_days(cfg, raw, str(tmp_path / "by_day"), days, vocabularies=str(tmp_path / "full"), threads=1)
    for day in days:
        got = to_per_row(read_parts(partition(tmp_path / "by_day", day)), cfg.features)
        assert_same_rows(got, on_day(rows, day, tz, cfg.features), cfg.features, day)


def test_a_day_maps_ids_with_the_given_builds_vocabulary_only(small, tmp_path):
    tmp, raw, path, _, _ = small
    cfg = config.load(path)
    with pytest.raises(ConfigError, match=r"--vocabularies: build.vocabularies maps the ids of item; .*give --voc"):
        B.build_days(cfg, str(raw), str(tmp_path / "out"), DAYS[:1])
    with pytest.raises(ConfigError, match=r"--vocabularies .*nowhere: no such directory"):
        B.build_days(cfg, str(raw), str(tmp_path / "out"), DAYS[:1], vocabularies=str(tmp_path / "nowhere"))
    assert not (tmp_path / "out").exists()
    # Two days built on different runs record the same mapping: the full build's file, byte for byte.
    B.build_days(cfg, str(raw), str(tmp_path / "out"), DAYS[1:2], vocabularies=str(tmp / "full"), threads=1)
    B.build_days(cfg, str(raw), str(tmp_path / "out"), DAYS[2:3], vocabularies=str(tmp / "full"), threads=1)
    full = json.loads((tmp / "full" / "manifest.json").read_text())
    for day in DAYS[1:]:
        source = json.loads((partition(tmp_path / "out", day) / "manifest.json").read_text())["vocabularies_from"]
        assert source["fingerprint"] == full["fingerprint"]
        assert source["files"] == {"vocabularies/item.parquet": full["files"]["vocabularies/item.parquet"]["sha256"]}
    assert sorted(p.name for p in (tmp_path / "out" / "days").iterdir()) == DAYS[1:]  # the first one kept too


def test_a_day_without_requests_is_an_error_and_writes_nothing(small, tmp_path):
    tmp, raw, path, _, _ = small
    cfg = config.load(path)
    for days in (["2024-01-09"], B.parse_days("2024-01-04:2024-01-05")):
        with pytest.raises(ContractError, match=r"--day: no request of .*impressions.csv falls on 2024-01-0[59] "):
            B.build_days(cfg, str(raw), str(tmp_path / "out"), days, vocabularies=str(tmp / "full"))
        assert not (tmp_path / "out" / "days").exists() or list((tmp_path / "out" / "days").iterdir()) == []
    with pytest.raises(ContractError, match=r"days in build.timezone Asia/Shanghai; its requests' days run "):
        B.build_days(cfg, str(raw), str(tmp_path / "out"), ["2024-01-09"], vocabularies=str(tmp / "full"))


@pytest.mark.parametrize(
    "text, why",
    [
        ("2024-13-01", "month must be in 1..12"),
        ("yesterday", "not a day"),
        ("2024-1-3", "not a day"),
        ("2024-01-03:", "not a day"),
        ("2024-01-03:2024-01-04:2024-01-05", "give a day YYYY-MM-DD or a range"),
        ("2024-01-09:2024-01-03", "the range ends before it starts"),
    ],
)
def test_a_bad_day_is_an_error_naming_the_flag(small, tmp_path, capsys, text, why):
    _, raw, path, _, _ = small
    argv = ["--config", str(path), "--raw", str(raw), "--out", str(tmp_path / "out"), "--day", text]
    assert B.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --day {text!r}: ") and why in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_parse_days():
    assert B.parse_days("2024-01-03") == ["2024-01-03"]
    assert B.parse_days("2024-02-28:2024-03-01") == ["2024-02-28", "2024-02-29", "2024-03-01"]


def test_the_command_notes_the_ignored_splits(small, tmp_path, capsys):
    tmp, raw, path, _, _ = small
    out = tmp_path / "out"
    argv = ["--config", str(path), "--raw", str(raw), "--out", str(out), "--threads", "1"]
    assert B.main(argv + ["--day", DAYS[0]]) == 2  # the config has vocabularies
    assert "error: --vocabularies: " in capsys.readouterr().err
    assert B.main(argv + ["--vocabularies", str(tmp / "full")]) == 2  # only with --day
    assert "error: --vocabularies: only with --day" in capsys.readouterr().err
    assert B.main(argv + ["--day", f"{DAYS[0]}:{DAYS[1]}", "--vocabularies", str(tmp / "full")]) == 0
    printed = capsys.readouterr()
    assert "note: --day: build.splits ignored (train, eval): each day is its own partition" in printed.err
    assert f"days/{DAYS[0]}/: built in" in printed.out and f"days/{DAYS[1]}/: built in" in printed.out
    assert sorted(p.name for p in (out / "days").iterdir()) == DAYS[:2]


# --- all or nothing, per day ----------------------------------------------------------------------


def killed_day_build(raw: Path, path: Path, out: Path, vocabularies: Path, day: str, step: str) -> None:
    cmd = [sys.executable, "-m", "pinads_rec.data.build", "--config", str(path), "--raw", str(raw), "--out", str(out)]
    cmd += ["--day", day, "--vocabularies", str(vocabularies), "--threads", "1"]
    env = {**os.environ, build_output.KILL_AT: step}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr


@pytest.mark.slow
def test_a_killed_day_build_leaves_no_partial_partition(small, tmp_path):
    tmp, raw, path, _, _ = small
    out, days_dir = tmp_path / "out", tmp_path / "out" / "days"
    # A fresh day killed once its files are written: no partition, only its temporary directory.
    killed_day_build(raw, path, out, tmp / "full", DAYS[0], f"split:{DAYS[0]}")
    assert not partition(out, DAYS[0]).exists()
    (temporary,) = leftovers(days_dir)
    assert temporary.startswith(f".{DAYS[0]}.building-")
    with pytest.raises(ContractError, match=r"is the temporary directory of a build of"):
        build_output.require_complete(str(days_dir / temporary))
    # The next build of the day cleans up; a rebuild killed before its swap leaves it byte for byte.
    cfg = config.load(path)
    B.build_days(cfg, str(raw), str(out), DAYS[:1], vocabularies=str(tmp / "full"), threads=1)
    assert leftovers(days_dir) == []
    before = contents(partition(out, DAYS[0]))
    killed_day_build(raw, path, out, tmp / "full", DAYS[0], "publish")
    assert contents(partition(out, DAYS[0])) == before
    # A range is swapped in day by day: killed right after its first day is in, that day is whole and
    # the next one absent -- never half a day.
    killed_day_build(raw, path, out, tmp / "full", f"{DAYS[1]}:{DAYS[2]}", "cleanup")
    build_output.verify(str(partition(out, DAYS[1])))
    assert not partition(out, DAYS[2]).exists()
    B.build_days(cfg, str(raw), str(out), DAYS[1:], vocabularies=str(tmp / "full"), threads=1)
    assert leftovers(days_dir) == [] and sorted(p.name for p in days_dir.iterdir()) == DAYS
    for day in DAYS:
        build_output.verify(str(partition(out, day)))
