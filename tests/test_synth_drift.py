"""A drifting world (synth.drift): one directory a day, new ads with new ids taking their share,
retired ads never shown again, rotating interests, trends, the drift check (the truth of day k goes
stale on the days after it), the raw logs by day building back to the same days, and off = the
fixed world."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from conftest import read_rows

from pinads_rec.config import ConfigError, load
from pinads_rec.data import build as B
from pinads_rec.data import synth as S
from pinads_rec.data.loader.contract import contract_columns
from pinads_rec.data.loader.dataset import LoaderSettings, ParquetBatches
from pinads_rec.data.loader.storage_layout import to_per_row
from pinads_rec.data.synth.truth import sigmoid
from pinads_rec.data.synth.world import dense_mixtures

DEMO = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"

# 4 days of 500 requests; the demo's sequence caps (sequence_length 100), so the raw logs build.
DAYS = 4
TINY = [
    "synth.num_users=600",
    "synth.num_items=1000",
    "synth.num_advertisers=50",
    "synth.sequence_length=100",
    "synth.event_embedding_dim=8",
    "synth.num_files=2",
    "synth.row_group_size=2000",
    f"synth.drift.days={DAYS}",
    "synth.drift.requests_per_day=500",
]
# The drift check: 8 days, enough clicks a day for the AUCs (about 9 s on 2 busy cores).
CHECK = [
    "synth.num_users=3000",
    "synth.num_items=2000",
    "synth.num_advertisers=100",
    "synth.sequence_length=30",
    "synth.event_embedding_dim=4",
    "synth.num_files=1",
    "synth.row_group_size=8192",
    "synth.drift.days=8",
    "synth.drift.requests_per_day=3000",
]
# The fall of the click AUC of day k's truth on day k + 7 below the oracle's, at least (measured
# 0.049 on CHECK; docs/synthetic_data.md, "A drifting world").
MIN_DROP_7_DAYS = 0.03


def _cfg(*overrides):
    return load(DEMO, list(overrides))


@pytest.fixture(scope="module")
def drifting(tmp_path_factory):
    out = tmp_path_factory.mktemp("drift")
    cfg = _cfg(*TINY)
    summary = S.generate(cfg, out, raw=True)
    world = S.make_world(cfg.synth)
    days = {name: read_rows(out / "days" / name) for name in S.day_names(cfg.synth)}
    return cfg, out, summary, world, days


def _np(table: pa.Table, col: str) -> np.ndarray:
    return table.column(col).to_numpy(zero_copy_only=False)


def _seen_ids(table: pa.Table) -> np.ndarray:
    """Every item id of the rows: candidates and the items of their sequences."""
    seq = [pc.list_flatten(table.column(c)).to_numpy(zero_copy_only=False) for c in ("seq_pin_item", "seq_ad_item")]
    return np.unique(np.concatenate([_np(table, "item_id")] + seq))


def test_one_directory_a_day_and_the_day_from_each_timestamp(drifting):
    cfg, out, summary, _, days = drifting
    names = S.day_names(cfg.synth)
    assert names == ["2023-11-15", "2023-11-16", "2023-11-17", "2023-11-18"]
    assert sorted(p.name for p in (out / "days").iterdir()) == names
    assert not (out / "train").exists() and not (out / "eval").exists()
    last = -1
    for d, name in enumerate(names):
        t = days[name]
        ts = _np(t, "timestamp")
        assert ((ts - S.T0) // S.DAY_S == d).all()  # the day index from the timestamp
        assert {time.strftime("%Y-%m-%d", time.gmtime(x)) for x in np.unique(ts)} == {name}
        rid = _np(t, "request_id")
        assert rid.min() > last  # request ids follow time across days
        last = rid.max()
        entry = summary["days"][name]
        assert entry["day"] == d and entry["impressions"] == t.num_rows == entry["rows"]
        assert entry["requests"] == len(np.unique(rid)) == cfg.synth.drift.requests_per_day
        assert set(entry["oracle_auc"]) == {"click", "good_click", "save"}
        assert 0.7 < entry["oracle_auc"]["click"] < 0.95
        # Sequences are the history up to the request, across days: older days' events included.
        pins_ts = pc.list_flatten(t.column("seq_pin_ts")).to_numpy()
        assert (pins_ts < S.T0 + d * S.DAY_S).any() and (pins_ts < ts.max()).all()
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["days"].keys() == summary["days"].keys() and on_disk["synth"]["drift"]["days"] == DAYS


def test_new_ads_have_new_ids_and_take_their_share(drifting):
    cfg, _, summary, world, days = drifting
    share = cfg.synth.drift.new_ads_share
    seen = np.zeros(0, np.int64)
    for d, (name, t) in enumerate(days.items()):
        ids = _seen_ids(t)
        launched = np.flatnonzero(world.drift.launch == d)
        if d == 0:
            assert summary["days"][name]["new_ad_share"] == 0.0 and len(launched) == 0
        else:
            assert launched.min() > seen.max()  # above every earlier day's ids: never seen before
            assert np.isin(ids[ids > seen.max()], launched).all()  # and the only ones above them
            assert np.isin(launched, ids).mean() > 0.9  # nearly all of them shown on their first day
            assert len(launched) == S.new_ads_per_day(cfg.synth) == summary["days"][name]["launched_ads"]
            fresh = np.isin(_np(t, "item_id"), launched).mean()
            assert fresh == pytest.approx(summary["days"][name]["new_ad_share"], abs=1e-4)
            assert abs(fresh - share) < 0.03, (name, fresh)
        seen = np.union1d(seen, ids)
    assert seen.max() < summary["num_item_ids"] == S.num_item_ids(cfg.synth) == len(world.item_topic)


def test_retired_ads_get_no_impressions(drifting):
    cfg, _, summary, world, days = drifting
    drift, life = world.drift, cfg.synth.drift.ad_lifetime_days
    retired = 0
    for d, (name, t) in enumerate(days.items()):
        items = _np(t, "item_id")
        assert (drift.launch[items] <= d).all() and (d < drift.retire[items]).all()
        gone = np.flatnonzero(drift.retire <= d)  # retired at the start of this day or before
        assert not np.isin(items, gone).any()
        # New behaviour events show only the ads of their day, too.
        for col, ts_col in (("seq_pin_item", "seq_pin_ts"), ("seq_ad_item", "seq_ad_ts")):
            ev, ev_ts = pc.list_flatten(t.column(col)).to_numpy(), pc.list_flatten(t.column(ts_col)).to_numpy()
            today = ev_ts >= S.T0 + d * S.DAY_S
            assert ((drift.launch[ev[today]] <= d) & (d < drift.retire[ev[today]])).all()
        if d:
            assert summary["days"][name]["retired_ads"] == len(np.flatnonzero(drift.retire == d)) > 0
            retired += summary["days"][name]["retired_ads"]
    assert retired == pytest.approx((DAYS - 1) * cfg.synth.num_items / life, rel=0.02)
    shown_first_day = np.unique(_np(days["2023-11-15"], "item_id"))
    later = np.concatenate([_np(t, "item_id") for t in list(days.values())[2:]])
    gone_by_2 = shown_first_day[drift.retire[shown_first_day] <= 2]
    assert len(gone_by_2) > 50 and not np.isin(later, gone_by_2).any()


def test_each_day_is_a_dataset_for_the_loader(drifting):
    cfg, out, summary, _, _ = drifting
    name = S.day_names(cfg.synth)[2]
    # New ids run past num_items: the item table needs summary["num_item_ids"] rows (or hash: true).
    cfg = _cfg(*TINY, f"features.tables.item.num_embeddings={summary['num_item_ids']}", "data.batch_size=256")
    rows = 0
    for batch in ParquetBatches(str(out / "days" / name), LoaderSettings.of(cfg), shuffle=False):
        rows += int(batch.valid.sum())
        assert batch.true_probs is not None
    assert rows == summary["days"][name]["impressions"]


def test_raw_logs_by_day_build_back_to_the_days(drifting, tmp_path):
    cfg, out, summary, _, _ = drifting
    names = S.day_names(cfg.synth)
    raw = out / "raw"
    assert sorted(p.name for p in (raw / "days").iterdir()) == names
    assert {p.name for p in (raw / "history").iterdir()} == {
        "pin_events.parquet",
        "ad_events.parquet",
        "search_events.parquet",
    }
    for d, name in enumerate(names):  # a day's events lie in the day; history's before the first
        for log in ("pin_events", "ad_events", "search_events"):
            ts = pq.read_table(raw / "days" / name / f"{log}.parquet").column("timestamp").to_numpy()
            assert (ts >= S.T0 + d * S.DAY_S).all() and (d == DAYS - 1 or (ts < S.T0 + (d + 1) * S.DAY_S).all())
        items = pq.read_table(raw / "days" / name / "items.parquet").column("item_id").to_numpy()
        assert len(items) == (cfg.synth.num_items if d == 0 else S.new_ads_per_day(cfg.synth))
    assert (pq.read_table(raw / "history" / "pin_events.parquet").column("timestamp").to_numpy() < S.T0).all()
    build_cfg = _cfg(*TINY)
    build_cfg.build = S.days_build_config(build_cfg.build, build_cfg.synth)
    B.build(build_cfg, str(raw), str(tmp_path / "built"))
    f = build_cfg.features
    for name in names:
        made = to_per_row(
            pa.concat_tables(pq.read_table(p) for p in sorted((tmp_path / "built" / name).glob("part-*.parquet"))), f
        )
        generated = read_rows(out / "days" / name)
        assert made.num_rows == generated.num_rows == summary["days"][name]["rows"]
        made = made.take(pc.sort_indices(made.column("request_id")))
        generated = generated.take(pc.sort_indices(generated.column("request_id")))
        for col in [c.name for c in contract_columns(f)]:
            want = generated.column(col).combine_chunks()
            assert made.column(col).combine_chunks().cast(want.type).equals(want), (name, col)


def test_interests_rotate_by_the_stated_fraction_a_day():
    cfg = _cfg(*TINY)
    world = S.make_world(cfg.synth)
    drift, T = world.drift, cfg.synth.num_topics
    users = np.arange(200)
    topic, weight = world.theta[0][users], world.theta[1][users]
    base = dense_mixtures(topic, weight, T)
    for days, moved in ((0.0, 0.0), (2.5, 0.25), (10.0, 1.0), (-3.0, -0.3)):
        t = np.full(len(users), S.T0 + int(days * S.DAY_S))
        now = dense_mixtures(*drift.rotated(topic, weight, t), T)
        np.testing.assert_allclose(now.sum(axis=1), 1.0, rtol=1e-6)
        n, f = int(np.floor(moved)), moved - np.floor(moved)
        want = (1 - f) * np.roll(base, n, axis=1) + f * np.roll(base, n + 1, axis=1)
        np.testing.assert_allclose(now, want, atol=1e-6)
    # Drawn topics follow the rotated mixture: after 5 days half a topic's draws moved on by one.
    rng = np.random.default_rng(0)
    k = np.full(100_000, 3)
    moved = drift.rotate(rng, k, np.full(len(k), S.T0 + 5 * S.DAY_S))
    assert set(np.unique(moved)) == {3, 4} and abs((moved == 4).mean() - 0.5) < 0.01
    assert (drift.rotate(rng, np.full(10, T), np.full(10, S.T0 + 10 * S.DAY_S)) == 1).all()  # T -> 1


def test_a_trending_topic_lasts_trend_days_and_lifts_its_clicks():
    cfg = _cfg(*TINY, "synth.drift.days=7")
    world = S.make_world(cfg.synth)
    trend = world.drift.trend
    assert len(trend) == 7 and (trend[:3] == trend[0]).all() and (trend[3:6] == trend[3]).all()
    assert trend[0] != trend[3] != trend[6]
    blk = S.sample_block(world, S.make_timeline(world, cfg.synth), cfg.synth, 0)
    day = np.repeat((blk.timestamp - S.T0) // S.DAY_S, blk.num_candidates)
    match = blk.latent["trend_match"] == 1
    np.testing.assert_array_equal(match, blk.rows["item_topic"] == trend[day])
    assert match.any() and len(np.unique(day)) > 3  # the block spans two trends
    np.testing.assert_allclose(sigmoid(blk.latent["logit_click"]), blk.rows["true_p_click"], rtol=1e-12)
    # The boost lifts the trending topic's clicks: its rows' true p against the same rows without it.
    boost = cfg.synth.drift.trend_boost
    without = sigmoid(blk.latent["logit_click"][match] - boost)
    assert blk.rows["true_p_click"][match].mean() > 3 * without.mean()


@pytest.mark.slow
def test_the_truth_of_a_day_goes_stale(tmp_path):
    """The drift check: the click AUC of day k's truth (its interests, trend and ads) on the
    impressions of day k + j, below the oracle's on the same rows, falls with j."""
    cfg = _cfg(*CHECK)
    summary = S.generate(cfg, tmp_path)
    drop = {int(j): v["drop"] for j, v in summary["drift"]["stale_truth"].items()}
    assert sorted(drop) == list(range(8)) and summary["drift"]["stale_truth"]["7"]["days"] == 1
    assert abs(drop[0]) < 0.002  # the day's own truth (at its noon) is the oracle, nearly
    assert drop[7] >= MIN_DROP_7_DAYS, drop
    assert 0 < drop[1] < drop[3] < drop[5] < drop[7], drop
    assert abs(summary["drift"]["new_ad_share"] - cfg.synth.drift.new_ads_share) < 0.01
    text = S.format_summary(summary)
    assert "the drift check" in text and "mean drop" in text and "2023-11-22" in text


def test_the_command_line_writes_days(tmp_path, capsys):
    argv = ["--config", str(DEMO), "--out", str(tmp_path)] + [a for o in TINY for a in ("--set", o)]
    assert S.main(argv + ["--set", "synth.drift.days=2"]) == 0
    assert "the drift check" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "days").iterdir()) == ["2023-11-15", "2023-11-16"]


def test_a_shorter_rerun_leaves_no_file_of_the_later_days(tmp_path):
    small = [*TINY, "synth.drift.requests_per_day=100"]
    S.generate(_cfg(*small, "synth.drift.days=3"), tmp_path, raw=True)
    assert list((tmp_path / "raw" / "days" / "2023-11-17").rglob("*.parquet"))
    S.generate(_cfg(*small, "synth.drift.days=2"), tmp_path, raw=True)
    days = {p.relative_to(tmp_path).parts[:3] for p in tmp_path.rglob("*.parquet")}
    assert not [d for d in days if "2023-11-17" in d], days  # a build globbing raw/days/* finds two days


def test_deterministic_whatever_the_threads(tmp_path):
    cfg = _cfg(*TINY, "synth.drift.days=2", "synth.drift.requests_per_day=300")
    S.generate(cfg, tmp_path / "a", num_threads=1)
    S.generate(cfg, tmp_path / "b", num_threads=2)
    files = sorted((tmp_path / "a" / "days").rglob("*.parquet"))
    assert len(files) == 4
    for p in files:
        assert p.read_bytes() == (tmp_path / "b" / p.relative_to(tmp_path / "a")).read_bytes()


def test_off_is_the_fixed_world(tmp_path):
    fixed = [o for o in TINY if not o.startswith("synth.drift")] + [
        "synth.train_requests=300",
        "synth.eval_requests=100",
        "synth.calibration_requests=100",
    ]
    S.generate(_cfg(*fixed), tmp_path / "default")
    S.generate(_cfg(*fixed, "synth.drift=null"), tmp_path / "off")
    files = sorted((tmp_path / "default").rglob("*.parquet"))
    assert {p.parent.name for p in files} == {"train", "calibration", "eval"}
    assert not (tmp_path / "off" / "days").exists()
    for p in files:
        assert p.read_bytes() == (tmp_path / "off" / p.relative_to(tmp_path / "default")).read_bytes()
    summary = json.loads((tmp_path / "off" / "summary.json").read_text())
    assert "days" not in summary and "drift" not in summary and summary["synth"]["drift"] is None
    # The drifting world's first day is the fixed world: the same catalogue, users and mixtures.
    a, b = S.make_world(_cfg(*fixed).synth), S.make_world(_cfg(*TINY).synth)
    n = a.item_topic.size
    for name in ("item_topic", "item_advertiser", "item_quality", "item_prior", "item_emb", "item_event_emb"):
        np.testing.assert_array_equal(getattr(b, name)[:n], getattr(a, name))
    for name in ("activity", "save_propensity"):
        np.testing.assert_array_equal(getattr(b, name), getattr(a, name))
    np.testing.assert_array_equal(b.theta[1], a.theta[1])
    assert a.drift is None and b.drift is not None


def test_cache_tells_drift_settings_apart(tmp_path):
    cfg = _cfg(*TINY, "synth.drift.days=1", "synth.drift.requests_per_day=200")
    S.generate(cfg, tmp_path)
    assert S.is_cached(cfg.synth, tmp_path)
    assert not S.is_cached(_cfg(*TINY, "synth.drift.days=1", "synth.drift.requests_per_day=201").synth, tmp_path)
    assert not S.is_cached(_cfg(*TINY, "synth.drift=null").synth, tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    summary["synth"] = {k: v for k, v in summary["synth"].items() if k != "drift"}  # written before the key
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert S.is_cached(_cfg(*TINY, "synth.drift=null").synth, tmp_path)


@pytest.mark.parametrize(
    "override, key",
    [
        ("synth.drift.new_ads_share=1.0", "synth.drift.new_ads_share"),
        ("synth.drift.ad_lifetime_days=40", "synth.drift.ad_lifetime_days"),  # 25 ads a day < 32 topics
        ("synth.drift.days=0", "synth.drift.days"),
        ("synth.drift.trend_days=0", "synth.drift.trend_days"),
        ("synth.drift.interest_shift_per_day=-0.1", "synth.drift.interest_shift_per_day"),
        ("synth.long_history.enabled=true", "synth.drift"),
    ],
)
def test_bad_drift_settings_are_config_errors(override, key, tmp_path):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        S.generate(_cfg(*TINY, override), tmp_path)
