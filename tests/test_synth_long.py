"""The generator's long histories and planted dormant interest (synth.long_history)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pytest
from conftest import read_rows
from test_synth import TINY

from pinads_rec.config import ConfigError, load
from pinads_rec.data import synth as S

DEMO = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
ON = "synth.long_history.enabled=true"
# Enough clicks per surface for the oracle AUCs to within about 0.01; about 5 s.
MEDIUM = [
    "synth.train_requests=8000",
    "synth.eval_requests=2000",
    "synth.calibration_requests=0",
    "synth.num_users=4000",
    "synth.num_items=5000",
    "synth.num_files=2",
    "synth.row_group_size=4096",
    ON,
]


def _cfg(*overrides):
    return load(DEMO, list(overrides))


@pytest.fixture(scope="module")
def medium(tmp_path_factory):
    cfg = _cfg(*MEDIUM)
    out = tmp_path_factory.mktemp("long")
    summary = S.generate(cfg, out)
    return cfg, out, summary


@pytest.fixture(scope="module")
def timeline():
    cfg = _cfg(*MEDIUM)
    world = S.make_world(cfg.synth)
    return cfg, world, S.make_timeline(world, cfg.synth)


def test_switched_off_it_changes_nothing(tmp_path):
    S.generate(_cfg(*TINY), tmp_path / "absent")
    # Off, its other knobs are not read either.
    off = [
        *TINY,
        "synth.long_history.enabled=false",
        "synth.long_history.dormant_coef=9",
        "synth.long_history.median=50",
    ]
    S.generate(_cfg(*off), tmp_path / "off")
    for split in ("train", "calibration", "eval"):
        files = sorted((tmp_path / "absent" / split).glob("*.parquet"))
        assert files
        for f in files:
            assert f.read_bytes() == (tmp_path / "off" / split / f.name).read_bytes(), f
    summary = json.loads((tmp_path / "off" / "summary.json").read_text())
    assert "dormant" not in summary["splits"]["train"]
    assert S.sequence_caps(_cfg(*off).synth)["pins"] == 20
    # A summary written before the key existed was written with it off: still a cache hit.
    old = json.loads((tmp_path / "off" / "summary.json").read_text())
    del old["synth"]["long_history"]
    (tmp_path / "off" / "summary.json").write_text(json.dumps(old))
    assert S.is_cached(_cfg(*TINY).synth, tmp_path / "off")
    assert not S.is_cached(_cfg(*TINY, ON).synth, tmp_path / "off")


def test_total_history_lengths_follow_the_stated_distribution(timeline):
    cfg, _, tl = timeline
    lh = cfg.synth.long_history
    # The distribution itself, over many users of a world.
    world = S.make_world(_cfg(*TINY, "synth.num_users=200000").synth)
    n = S.pins_totals(world, np.arange(200000), lh)
    assert n.min() >= 1 and n.max() == lh.max_length == 4000
    assert abs(np.median(n) - 200) < 8, np.median(n)
    assert abs(np.quantile(n, 0.9) - 1500) < 60, np.quantile(n, 0.9)
    sigma = math.log(1500 / 200) / S.Z_P90
    assert (n == 4000).mean() == pytest.approx(0.5 * math.erfc(math.log(20) / sigma / math.sqrt(2)), abs=0.003)
    # The timeline: every user with requests has exactly that many pins events over the whole log,
    # unless its visits' sessions hold more.
    users = np.unique(tl.user)
    world = timeline[1]
    total = np.bincount(tl.pins.user, minlength=cfg.synth.num_users)[users]
    want = S.pins_totals(world, users, lh)
    assert (total >= want).all()
    assert (total == want).mean() > 0.9
    assert abs(np.median(total) - 200) < 30 and abs(np.quantile(total, 0.9) - 1500) < 200
    # Ads and queries keep their Poisson rates: ~0.07 L and ~0.045 L per 30 days, 90 days of log.
    ads = np.bincount(tl.ads.user, minlength=cfg.synth.num_users)[users]
    assert 0.8 * 0.07 * 300 < ads.mean() < 1.2 * 0.07 * 300


def test_dormant_burst_is_old_off_mixture_and_beyond_the_newest_100(timeline):
    cfg, world, tl = timeline
    lh = cfg.synth.long_history
    users = np.unique(tl.user)
    total = np.bincount(tl.pins.user, minlength=cfg.synth.num_users)
    has = tl.dormant[users] > 0
    assert (has == (S.pins_totals(world, users, lh) >= lh.min_history)).all()
    assert 0.3 < has.mean() < 0.5  # P(LogNormal >= 300) = 0.40
    # The dormant topic lies outside the user's mixture.
    topic, weight = world.theta
    d = tl.dormant[users[has]]
    assert not ((topic[users[has]] + 1 == d[:, None]) & (weight[users[has]] > 0)).any()
    # The burst: burst_share of the user's events, on its dormant topic, in the log's first days.
    b = tl.pins_burst
    assert (tl.pins.cols["topic"][b] == tl.dormant[tl.pins.user[b]]).all()
    assert tl.pins.time[b].max() < S.LOG_START + lh.burst_days * 86400 + 3600
    n_burst = np.bincount(tl.pins.user[b], minlength=cfg.synth.num_users)[users[has]]
    assert np.abs(n_burst - lh.burst_share * total[users[has]]).max() <= 1
    # At every request of such a user the burst lies beyond the newest 100 events, and within the
    # newest 4000 (all of the history).
    req = tl.dormant[tl.user] > 0
    assert req.sum() > 3000
    in100 = S.burst_in_newest(tl, tl.user[req], tl.time[req], 100)
    assert in100.mean() < 0.001, in100.mean()
    assert S.burst_in_newest(tl, tl.user[req], tl.time[req], 4000).all()
    assert not S.burst_in_newest(tl, tl.user[~req], tl.time[~req], 4000).any()


@pytest.mark.slow
def test_oracle_lift_on_the_touched_surfaces_only(medium):
    cfg, _, summary = medium
    for split in ("train", "eval"):
        d = summary["splits"][split]["dormant"]
        for name in cfg.synth.long_history.surfaces:
            e = d["surfaces"][name]
            assert e["dormant_lift"] >= 0.02, (split, name, e)
            assert e["oracle_auc"] == pytest.approx(summary["splits"][split]["surfaces"][name]["click"]["oracle_auc"])
        assert d["surfaces"]["search"]["dormant_lift"] == 0.0  # no term, no candidates there
        assert d["burst_in_newest"]["100"] < 0.001
    assert "dormant term" in S.format_summary(summary)


def test_dormant_term_and_candidates(timeline):
    cfg, world, tl = timeline
    blk = S.sample_block(world, tl, cfg.synth, 0)
    r = np.repeat(np.arange(blk.hi - blk.lo), blk.num_candidates)
    d = tl.dormant[blk.user][r]
    touched = S.touched_surfaces(cfg.synth.long_history)[blk.surface[r]]
    k = blk.rows["item_topic"]
    assert (blk.latent["dormant_match"] == (touched & (k == d))).all()
    # The extra candidate source: the dormant topic is candidate_share + chance of the candidates of
    # such users on the touched surfaces, and chance elsewhere.
    on = (d > 0) & touched
    assert 0.08 < (k[on] == d[on]).mean() < 0.16
    assert (k[(d > 0) & ~touched] == d[(d > 0) & ~touched]).mean() < 0.06
    # The click logit is today's plus dormant_coef on those candidates.
    lat, surf = blk.latent, blk.surface[r]
    today = (
        S.CLICK_OFFSET[surf]
        + S.SHOPPING_OFFSET * blk.rows["ad_type"]
        + S.INTEREST_SCALE[surf] * (S.LONG_TERM_COEF * lat["long_term_weight"] + S.INTENT_COEF * lat["is_intent"])
        + S.QUERY_COEF * lat["query_match"]
        + S.CONTEXT_COEF * lat["context_match"]
        + lat["quality"]
    )
    np.testing.assert_allclose(lat["logit_click"], today + 3.0 * lat["dormant_match"], atol=1e-12)
    np.testing.assert_allclose(blk.rows["true_p_click"], 1 / (1 + np.exp(-lat["logit_click"])), rtol=1e-12)
    m = lat["dormant_match"] == 1
    assert m.sum() > 100 and blk.rows["true_p_click"][m].mean() > 2.5 * blk.rows["true_p_click"][on & ~m].mean()


@pytest.mark.slow
def test_sequences_long_newest_first_before_the_request(medium):
    cfg, out, summary = medium
    rows = read_rows(out / "eval", columns=["request_id", "timestamp", "seq_pin_ts", "seq_ad_ts", "seq_query_ts"])
    rid = rows.column("request_id").to_numpy()
    head = np.concatenate([[True], np.diff(rid) != 0])
    t = rows.filter(head)
    ts = t.column("timestamp").to_numpy()
    for col, cap in (("seq_pin_ts", 4000), ("seq_ad_ts", 50), ("seq_query_ts", 50)):
        n = pc.list_value_length(t.column(col)).to_numpy(zero_copy_only=False)
        flat = pc.list_flatten(t.column(col)).to_numpy()
        assert n.max() <= cap
        req = np.repeat(np.arange(len(n)), n)
        assert (flat < ts[req]).all()  # strictly before the request
        same = req[1:] == req[:-1]
        assert (np.diff(flat)[same] < 0).all()  # newest first, strictly
    n = pc.list_value_length(t.column("seq_pin_ts")).to_numpy(zero_copy_only=False)
    assert n.max() > 1000 and np.median(n) > 100
    q = summary["splits"]["eval"]["pins_length"]
    assert q["max"] == n.max() and q["median"] == np.median(n) and q["mean"] == pytest.approx(n.mean(), abs=0.01)
    assert S.sequence_caps(cfg.synth) == {"pins": 4000, "ads": 50, "queries": 50}


def test_raw_needs_the_pins_cap_and_bad_keys_are_named(tmp_path):
    with pytest.raises(ConfigError, match=r"sequence_groups\[pins\].max_length.*synth.long_history.max_length=4000"):
        S.generate(_cfg(*TINY, ON), tmp_path, raw=True)
    cfg = _cfg(ON)  # the demo's sequence_length, the ads and queries groups' caps
    cfg.features.sequence_groups[0].max_length = 4000  # the pins group capped as the generator caps it
    S.check_raw(cfg.features, cfg.synth)
    with pytest.raises(ConfigError, match="synth.long_history.surfaces"):
        S.make_world(_cfg(*TINY, ON, "synth.long_history.surfaces=[home_feed, feed]").synth)
    with pytest.raises(ConfigError, match="synth.long_history.p90"):
        S.make_world(_cfg(*TINY, ON, "synth.long_history.p90=100").synth)
    with pytest.raises(ConfigError, match="synth.num_topics"):
        S.make_world(_cfg(*TINY, ON, "synth.num_topics=6").synth)
