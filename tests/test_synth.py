"""The planted-truth synthetic generator: contract, determinism, timelines, planted structure, faults."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from conftest import read_rows

from pinads_rec.config import ConfigError, load
from pinads_rec.data import synth as S

DEMO = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"

TINY = [
    "synth.train_requests=300",
    "synth.eval_requests=100",
    "synth.calibration_requests=80",
    "synth.num_users=100",
    "synth.num_items=800",
    "synth.num_advertisers=50",
    "synth.sequence_length=20",
    "synth.event_embedding_dim=16",
    "synth.num_files=2",
    "synth.row_group_size=500",
]
# Large enough for label rates and AUCs, small enough to write in about a second.
MEDIUM = [
    "synth.train_requests=8000",
    "synth.eval_requests=2000",
    "synth.calibration_requests=2000",
    "synth.num_users=2000",
    "synth.num_items=5000",
    "synth.num_files=3",
    "synth.row_group_size=4096",
]

INT_LISTS = [
    "query_tokens",
    "seq_pin_item",
    "seq_pin_ts",
    "seq_pin_action",
    "seq_pin_topic",
    "seq_ad_item",
    "seq_ad_ts",
    "seq_ad_action",
    "seq_ad_topic",
    "seq_query_token",
    "seq_query_ts",
    "seq_query_topic",
]
GROUPS = {
    "pins": ["seq_pin_item", "seq_pin_ts", "seq_pin_action", "seq_pin_topic", "seq_pin_emb"],
    "ads": ["seq_ad_item", "seq_ad_ts", "seq_ad_action", "seq_ad_topic"],
    "queries": ["seq_query_token", "seq_query_ts", "seq_query_topic"],
}


def _cfg(*overrides):
    return load(DEMO, list(overrides))


def _read(out: Path, split: str) -> pa.Table:
    """One row per candidate (the generator writes per request)."""
    return read_rows(out / split)


def _lengths(col) -> np.ndarray:
    return pc.list_value_length(col).to_numpy(zero_copy_only=False).astype(np.int64)


def _flat(col) -> np.ndarray:
    return pc.list_flatten(col).to_numpy(zero_copy_only=False)


def _same_type(a: pa.DataType, b: pa.DataType) -> bool:
    """Type equality ignoring list child field names (Parquet round trips rename them)."""
    if pa.types.is_fixed_size_list(a) or pa.types.is_fixed_size_list(b):
        return (
            pa.types.is_fixed_size_list(a)
            and pa.types.is_fixed_size_list(b)
            and a.list_size == b.list_size
            and _same_type(a.value_type, b.value_type)
        )
    if pa.types.is_list(a) or pa.types.is_list(b):
        return pa.types.is_list(a) and pa.types.is_list(b) and _same_type(a.value_type, b.value_type)
    return a == b


def _np(t: pa.Table, name: str) -> np.ndarray:
    return t.column(name).to_numpy()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = _cfg(*TINY)
    out = tmp_path_factory.mktemp("tiny")
    summary = S.generate(cfg, out)
    return cfg, out, summary, _read(out, "train"), _read(out, "eval")


def _all_splits(out: Path) -> pa.Table:
    return pa.concat_tables(_read(out, split) for split in ("train", "calibration", "eval"))


@pytest.fixture(scope="module")
def medium(tmp_path_factory):
    cfg = _cfg(*MEDIUM)
    out = tmp_path_factory.mktemp("medium")
    summary = S.generate(cfg, out)
    return cfg, out, summary, _read(out, "train"), _read(out, "eval")


# --------------------------------------------------------------------------------------------


def test_deterministic_for_a_seed(tmp_path, tiny):
    cfg, out, _, train, evl = tiny
    S.generate(cfg, tmp_path / "again", num_threads=1)  # thread count must not matter either
    assert _read(tmp_path / "again", "train").equals(train)
    assert _read(tmp_path / "again", "eval").equals(evl)
    for f in sorted((out / "train").glob("*.parquet")):
        assert f.read_bytes() == (tmp_path / "again" / "train" / f.name).read_bytes()
    S.generate(_cfg(*TINY, "synth.seed=1"), tmp_path / "other")
    other = _read(tmp_path / "other", "train")
    assert not other.equals(train)
    assert not np.array_equal(_np(other, "true_p_click")[:100], _np(train, "true_p_click")[:100])


def test_schema_and_types(tiny):
    cfg, _, _, train, evl = tiny
    E = cfg.synth.event_embedding_dim
    lst = pa.list_(pa.int64())
    expected = {
        "request_id": pa.int64(),
        "user_id": pa.int64(),
        "item_id": pa.int64(),
        "advertiser_id": pa.int64(),
        "ad_type": pa.int64(),
        "surface": pa.string(),
        "timestamp": pa.int64(),
        "item_topic": pa.int64(),
        "context_topic": pa.int64(),
        "user_activity": pa.float32(),
        "item_ctr_prior": pa.float32(),
        "item_embedding": pa.list_(pa.float32(), 32),
        "seq_pin_emb": pa.list_(pa.list_(pa.float32(), E)),
        "click": pa.int64(),
        "good_click": pa.int64(),
        "save": pa.int64(),
        "true_p_click": pa.float64(),
        "true_p_good_click": pa.float64(),
        "true_p_save": pa.float64(),
        **{c: lst for c in INT_LISTS},
    }
    for t in (train, evl):
        assert set(t.column_names) == set(expected)  # nothing extra (no latent/debug columns)
        for name, typ in expected.items():
            assert _same_type(t.schema.field(name).type, typ), (name, t.schema.field(name).type)


def test_value_ranges_and_item_functions(tiny):
    cfg, _, _, train, evl = tiny
    s = cfg.synth
    t = pa.concat_tables([train, evl])
    for name, hi in (
        ("user_id", s.num_users),
        ("item_id", s.num_items),
        ("advertiser_id", s.num_advertisers),
        ("ad_type", 2),
    ):
        v = _np(t, name)
        assert v.min() >= 0 and v.max() < hi, name
    topic = _np(t, "item_topic")
    assert topic.min() >= 1 and topic.max() <= s.num_topics
    item = _np(t, "item_id")
    for name in ("advertiser_id", "ad_type", "item_topic"):  # functions of the item
        v = _np(t, name)
        uniq, first = np.unique(item, return_index=True)
        assert np.array_equal(v, v[first][np.searchsorted(uniq, item)]), name
    surface = np.array(t.column("surface").to_pylist())
    assert set(surface) == set(S.SURFACES)
    ctx = _np(t, "context_topic")
    assert (ctx[surface != "related_pins"] == 0).all()
    assert ((ctx[surface == "related_pins"] >= 1) & (ctx[surface == "related_pins"] <= s.num_topics)).all()
    n_qt = _lengths(t.column("query_tokens"))
    assert (n_qt[surface != "search"] == 0).all()
    assert ((n_qt[surface == "search"] >= 1) & (n_qt[surface == "search"] <= 3)).all()
    K = S.query_tokens_per_topic(s.num_topics)
    for row in t.column("query_tokens").to_pylist():  # all tokens of a query reveal one topic
        assert len({(tok - 1) // K for tok in row}) <= 1 and all(1 <= tok < 1024 for tok in row)
    act = _np(t, "user_activity")
    assert (act > 0).all()
    emb = np.stack(t.column("item_embedding").to_numpy(zero_copy_only=False))
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, rtol=1e-4)


def test_requests_contiguous_ids_disjoint_and_time_split(tiny):
    _, out, summary, train, evl = tiny
    calib = _read(out, "calibration")
    for t in (train, calib, evl):
        rid = _np(t, "request_id")
        starts = np.flatnonzero(np.diff(rid)) + 1
        assert len(np.unique(rid)) == len(starts) + 1  # contiguous: each id forms one run
        assert (np.diff(rid) >= 0).all()
        assert (np.diff(_np(t, "timestamp")) >= 0).all()  # request time increases over the data
        for c in ("user_id", "timestamp", "surface", "context_topic", "user_activity"):
            v = t.column(c).to_numpy(zero_copy_only=False)
            assert (v[1:][np.diff(rid) == 0] == v[:-1][np.diff(rid) == 0]).all(), c
    # Time order: train, then calibration (the latest part of the training period), then eval;
    # request ids follow time; each split lies in its window, the windows tile the span.
    assert _np(train, "request_id").max() < _np(calib, "request_id").min()
    assert _np(calib, "request_id").max() < _np(evl, "request_id").min()
    windows = [summary["splits"][name]["window"] for name in ("train", "calibration", "eval")]
    assert windows[0][0] == S.T0 and windows[-1][1] == S.T0 + S.SPAN_S
    assert windows[0][1] == windows[1][0] and windows[1][1] == windows[2][0]
    for t, (a, b) in zip((train, calib, evl), windows):
        ts = _np(t, "timestamp")
        assert a <= ts.min() and ts.max() < b
        assert a % 3600 == 0 and b % 3600 == 0  # whole hours: easy to write in a build config


def test_users_have_several_requests_on_a_timeline(tiny):
    cfg, out, summary, *_ = tiny
    t = _all_splits(out)
    rid, user = _np(t, "request_id"), _np(t, "user_id")
    head = np.concatenate([[True], np.diff(rid) != 0])
    per_user = np.bincount(user[head])
    per_user = per_user[per_user > 0]
    assert per_user.mean() > 3 and summary["users"] == len(per_user)
    demo = _cfg().synth  # the demo: a handful of requests per user
    assert 4 <= (demo.train_requests + demo.calibration_requests + demo.eval_requests) / demo.num_users <= 8


def test_later_requests_see_earlier_events(tiny):
    """A user's requests read one timeline: a later request's events older than an earlier request
    are the newest events that request saw (fewer only where the cap cut them); a search request's
    own query is in later requests' query history, never in its own."""
    cfg, out, *_ = tiny
    t = _all_splits(out)
    rid = _np(t, "request_id")
    head = np.flatnonzero(np.concatenate([[True], np.diff(rid) != 0]))
    user, ts = _np(t, "user_id")[head], _np(t, "timestamp")[head]
    caps = S.sequence_caps(cfg.synth)
    seqs = {
        group: list(zip(*(t.column(c).take(pa.array(head)).to_pylist() for c in cols[1:2] + cols[:1])))
        for group, cols in GROUPS.items()
    }  # (timestamps, items or tokens) per request
    tokens = t.column("query_tokens").take(pa.array(head)).to_pylist()
    pairs = checked_queries = 0
    for u in np.unique(user):
        mine = np.flatnonzero(user == u)
        for i, j in zip(mine[:-1], mine[1:]):  # consecutive requests of the user, time order
            if ts[i] == ts[j]:
                continue
            pairs += 1
            for group, per_request in seqs.items():
                (ts_a, id_a), (ts_b, id_b) = per_request[i], per_request[j]
                old = [k for k, x in enumerate(ts_b) if x < ts[i]]
                assert old == list(range(len(ts_b) - len(old), len(ts_b)))  # the older part is the tail
                k = len(old)
                assert ts_b[len(ts_b) - k :] == ts_a[:k] and id_b[len(ts_b) - k :] == id_a[:k], (group, i, j)
                assert k == len(ts_a) or len(ts_b) == caps[group], (group, i, j)
            if tokens[i] and len(seqs["queries"][j][0]) < caps["queries"]:
                q_ts, q_tok = seqs["queries"][j]
                assert ts[i] not in seqs["queries"][i][0]
                assert (ts[i], tokens[i][0]) in set(zip(q_ts, q_tok)), (i, j)
                checked_queries += 1
    assert pairs > 100 and checked_queries > 10, (pairs, checked_queries)


def test_event_logs_tie_free_and_sequences_are_their_windows(tiny):
    cfg, out, *_ = tiny
    world = S.make_world(cfg.synth)
    tl = S.make_timeline(world, cfg.synth)
    for group in ("pins", "ads", "queries"):
        log = getattr(tl, group)
        same_user = log.user[1:] == log.user[:-1]
        assert (np.diff(log.time)[same_user] > 0).all(), group  # strictly increasing per user: no ties
        assert (np.diff(log.user) >= 0).all()
    t = _read(out, "train")
    rid = _np(t, "request_id")
    head = np.flatnonzero(np.concatenate([[True], np.diff(rid) != 0]))
    n, idx = tl.pins.window(_np(t, "user_id")[head], _np(t, "timestamp")[head], S.sequence_caps(cfg.synth)["pins"])
    np.testing.assert_array_equal(n, _lengths(t.column("seq_pin_ts"))[head])
    np.testing.assert_array_equal(tl.pins.time[idx], _flat(t.column("seq_pin_ts").take(pa.array(head))))
    np.testing.assert_array_equal(tl.pins.cols["item"][idx], _flat(t.column("seq_pin_item").take(pa.array(head))))


def test_sequences_newest_first_aligned_and_per_request(tiny):
    cfg, _, _, train, _ = tiny
    s = cfg.synth
    req_ts = _np(train, "timestamp")
    for group, cols in GROUPS.items():
        lengths = _lengths(train.column(cols[0]))
        for c in cols[1:]:
            assert np.array_equal(_lengths(train.column(c)), lengths), (group, c)
        assert lengths.max() <= (s.sequence_length if group == "pins" else s.sequence_length // 2)
        ts_col = cols[1]
        ts = _flat(train.column(ts_col))
        row = np.repeat(np.arange(train.num_rows), lengths)
        assert (ts < req_ts[row]).all(), group  # strictly before the request
        same_row = row[1:] == row[:-1]
        assert (np.diff(ts)[same_row] < 0).all(), group  # newest first, strictly decreasing
    assert (_flat(train.column("seq_pin_action")) < 8).all() and (_flat(train.column("seq_pin_action")) >= 0).all()
    assert (_flat(train.column("seq_ad_action")) < 8).all()
    for c in ("seq_pin_topic", "seq_ad_topic", "seq_query_topic"):
        v = _flat(train.column(c))
        assert v.min() >= 1 and v.max() <= s.num_topics, c
    K = S.query_tokens_per_topic(s.num_topics)
    np.testing.assert_array_equal(
        (_flat(train.column("seq_query_token")) - 1) // K + 1, _flat(train.column("seq_query_topic"))
    )
    emb = _flat(train.column("seq_pin_emb"))
    assert len(emb) == _lengths(train.column("seq_pin_item")).sum()
    assert len(emb[0]) == s.event_embedding_dim
    # Sequences are a property of the request: identical on every candidate row.
    rid = _np(train, "request_id")
    first = {}
    for c in [c for cols in GROUPS.values() for c in cols] + ["query_tokens"]:
        values = train.column(c).to_pylist()
        for i, r in enumerate(rid):
            first.setdefault((c, r), values[i])
            assert values[i] == first[(c, r)], (c, r)


@pytest.mark.slow
def test_sequence_lengths(medium):
    cfg, _, _, train, _ = medium
    rid = _np(train, "request_id")
    head = np.concatenate([[True], np.diff(rid) != 0])
    n = _lengths(train.column("seq_pin_item"))[head]
    L = cfg.synth.sequence_length
    assert 0.3 * L < n.mean() < 0.55 * L  # ~40% of the maximum on average
    assert (n >= S.SESSION_EVENTS).mean() > 0.95  # every visit opens with a session
    act = _np(train, "user_activity")[head]
    assert np.corrcoef(np.log(act), n)[0, 1] > 0.3  # activity tracks history length


def test_files_and_row_groups(tiny):
    cfg, out, summary, _, _ = tiny
    s = cfg.synth
    for split, n_min in (("train", s.num_files), ("eval", 2)):
        files = sorted((out / split).glob("part-*.parquet"))
        assert len(files) == (s.num_files if split == "train" else 2) and len(files) >= n_min
        seen = set()
        for f in files:
            meta = pq.ParquetFile(f).metadata
            assert meta.num_row_groups >= 2, f
            ids_in_file = set()
            for i in range(meta.num_row_groups):
                rid = pq.ParquetFile(f).read_row_group(i, columns=["request_id"]).column(0).to_numpy()
                assert len(rid) <= s.row_group_size or len(np.unique(rid)) == 1
                assert not set(rid) & seen  # a request never spans row groups or files
                ids_in_file |= set(rid)
            seen |= ids_in_file
        info = summary["splits"][split]["files"]
        assert [Path(x["path"]).name for x in info] == [f.name for f in files]
        assert sum(x["rows"] for x in info) == summary["splits"][split]["rows"]
    assert json.loads((out / "summary.json").read_text())["rows"] == summary["rows"]


@pytest.mark.slow
def test_label_rates_match_true_probabilities(medium):
    _, _, summary, train, evl = medium
    for t, split in ((train, "train"), (evl, "eval")):
        surface = np.array(t.column("surface").to_pylist())
        for name in S.SURFACES:
            m = surface == name
            for task in S.TASKS:
                y, p = _np(t, task)[m], _np(t, f"true_p_{task}")[m]
                se = np.sqrt(np.sum(p * (1 - p))) / m.sum()
                assert abs(y.mean() - p.mean()) < 4.5 * se + 1e-4, (split, name, task, y.mean(), p.mean())
                entry = summary["splits"][split]["surfaces"][name][task]
                assert entry["rate"] == pytest.approx(y.mean())
                assert entry["mean_true_p"] == pytest.approx(p.mean())
    # Surfaces have different base rates (home_feed < related_pins < search).
    rates = [summary["splits"]["train"]["surfaces"][n]["click"]["rate"] for n in S.SURFACES]
    assert rates[0] < rates[1] < rates[2]


@pytest.mark.slow
def test_oracle_auc_per_surface(medium):
    _, _, summary, _, _ = medium
    for split in ("train", "eval"):
        for name in S.SURFACES:
            e = summary["splits"][split]["surfaces"][name]
            assert e["click"]["oracle_auc"] > 0.6, (split, name)
            assert e["click"]["oracle_ne"] < 1.0, (split, name)


@pytest.mark.slow
def test_good_click_subset_of_click(medium):
    _, _, _, train, _ = medium
    click, good = _np(train, "click"), _np(train, "good_click")
    assert ((good == 1) <= (click == 1)).all()
    assert (_np(train, "true_p_good_click") <= _np(train, "true_p_click")).all()
    assert good.sum() > 0 and good.sum() < click.sum()
    save = _np(train, "save")
    assert save[click == 1].mean() > 2 * save[click == 0].mean()  # tasks are correlated


def test_short_term_intent_only_in_newest_events():
    cfg = _cfg(*TINY, "synth.train_requests=2000", "synth.num_users=1000", "synth.sequence_length=100")
    world = S.make_world(cfg.synth)
    b = S.sample_block(world, S.make_timeline(world, cfg.synth), cfg.synth, 0)
    off = np.concatenate([[0], np.cumsum(b.pins.lengths)])
    topics = b.pins.cols["seq_pin_topic"]
    newest, older, n = 0, 0, 0
    for r in np.flatnonzero(b.pins.lengths >= 2 * S.SESSION_EVENTS):
        ev = topics[off[r] : off[r + 1]]
        newest += np.bincount(ev[: S.SESSION_EVENTS]).argmax() == b.intent[r]
        older += np.bincount(ev[S.SESSION_EVENTS :]).argmax() == b.intent[r]
        n += 1
    assert n > 200
    assert newest / n > 0.85 and older / n < 0.35, (newest / n, older / n)
    # ...and the intent matters: clicks are likelier on intent-topic candidates.
    is_intent = b.latent["is_intent"] == 1
    assert b.rows["true_p_click"][is_intent].mean() > 2 * b.rows["true_p_click"][~is_intent].mean()


def test_faults_applied_and_probabilities_unchanged(tmp_path, tiny):
    _, _, _, clean, _ = tiny
    faults = [
        "synth.faults.zero_fill_column=item_ctr_prior",
        "synth.faults.zero_fill_window=[0.2, 0.5]",
        "synth.faults.shift_column=user_activity",
        "synth.faults.shift_after=0.6",
        "synth.faults.shift_scale=5.0",
        "synth.faults.shift_offset=3.0",
        "synth.faults.stale_fraction=0.1",
    ]
    cfg = _cfg(*TINY, *faults)
    S.generate(cfg, tmp_path)
    t = _read(tmp_path, "train")
    for c in ("true_p_click", "true_p_good_click", "true_p_save", "click", "item_id", "seq_pin_ts"):
        assert t.column(c).equals(clean.column(c)), c  # feature faults only
    ts = _np(t, "timestamp") - S.T0
    lo, hi = ts / S.SPAN_S, (ts + 1) / S.SPAN_S  # the request's time fraction lies in [lo, hi)
    prior = _np(t, "item_ctr_prior")
    in_window = (lo >= 0.2) & (hi <= 0.5)
    outside = (hi <= 0.2) | (lo >= 0.5)
    assert in_window.sum() > 50
    assert (prior[in_window] == 0).all() and prior[in_window].var() == 0
    assert (prior[outside] > 0).all()
    act, act0 = _np(t, "user_activity"), _np(clean, "user_activity")
    after, before = lo >= 0.6, hi <= 0.6
    assert act[after].mean() > 3 * act0[after].mean()
    stale = act[before] != act0[before]
    assert 0.03 < stale.mean() < 0.2  # ~10% of rows copy an earlier row's dense values
    emb, emb0 = (np.stack(x.column("item_embedding").to_numpy(zero_copy_only=False)) for x in (t, clean))
    changed = (emb != emb0).any(axis=1)
    assert 0.03 < changed.mean() < 0.2


def test_bad_fault_column_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="synth.faults.zero_fill_column"):
        S.generate(_cfg(*TINY, "synth.faults.zero_fill_column=nope"), tmp_path)


@pytest.mark.parametrize(
    "override,pattern",
    [
        ("synth.num_files=0", r"^synth\.num_files: must be > 0"),
        ("synth.calibration_requests=-1", r"^synth\.calibration_requests: must be >= 0"),
    ],
)
def test_bad_sizes_are_refused_wherever_the_generator_runs(override, pattern, tmp_path):
    """config.load leaves the synth section to the generator: each entry point checks it first."""
    cfg = _cfg(*TINY, override)
    for run in (
        lambda: S.check_synth_config(cfg.synth),
        lambda: S.make_world(cfg.synth),
        lambda: S.generate(cfg, tmp_path),
        lambda: S.ensure(cfg, tmp_path),
    ):
        with pytest.raises(ConfigError, match=pattern):
            run()
    assert not any(tmp_path.iterdir())  # refused before anything is written


def test_oracle_metrics_score_the_true_probabilities_against_the_labels():
    """pinads_rec.metrics computes the oracle columns, (scores, labels) in that order."""
    y = (np.arange(1000) < 300).astype(int)  # base rate 0.3 on every surface
    surface = np.arange(1000) % len(S.SURFACES)
    ranked = np.where(y == 1, 0.9, 0.2)  # every positive above every negative
    labels = {t: y for t in S.TASKS}
    probs = {t: ranked if i == 0 else np.full(1000, 0.3) for i, t in enumerate(S.TASKS)}
    out = S.oracle_metrics(surface, labels, probs)
    first, second = S.TASKS[0], S.TASKS[1]
    assert out["all"][first]["oracle_auc"] == 1.0
    assert out["all"][second]["oracle_auc"] == 0.5  # all tied
    assert out["all"][second]["oracle_ne"] == pytest.approx(1.0)  # the base rate everywhere
    assert out[S.SURFACES[0]]["rows"] == len(range(0, 1000, len(S.SURFACES)))


def test_cli(tmp_path, capsys):
    rc = S.main(
        [
            "--config",
            str(DEMO),
            "--out",
            str(tmp_path),
            "--seed",
            "3",
            "--train-requests",
            "200",
            "--eval-requests",
            "60",
            *[x for o in TINY[2:] for x in ("--set", o)],
        ]
    )
    assert rc == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["seed"] == 3 and summary["splits"]["train"]["requests"] == 200
    assert summary["splits"]["eval"]["requests"] == 60
    assert "rows/s" in capsys.readouterr().out


def test_ensure_generates_once_and_reuses_matching_data(tmp_path, tiny):
    cfg, out, *_ = tiny
    assert S.is_cached(cfg.synth, out)
    fewer = _cfg(*TINY, "synth.train_requests=200").synth
    assert not S.is_cached(fewer, out)  # exact by default
    assert S.is_cached(fewer, out, at_least=["train_requests"])  # more rows than asked also serve
    assert not S.is_cached(_cfg(*TINY, "synth.train_requests=400").synth, out, at_least=["train_requests"])
    assert not S.is_cached(_cfg(*TINY, "synth.seed=3").synth, out, at_least=["train_requests"])
    assert not S.is_cached(cfg.synth, tmp_path / "nothing")

    heard = []
    assert S.ensure(cfg, tmp_path / "d", echo=heard.append)
    assert _read(tmp_path / "d", "train").equals(_read(out, "train"))
    assert not S.ensure(cfg, tmp_path / "d", echo=heard.append)
    assert "generating" in heard[0] and "reusing" in heard[-1]
