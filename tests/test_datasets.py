"""The public datasets' configs (configs/datasets/) on fixture files in their exact shape
(tests/dataset_fixtures.py): each builds with the real config (only its paths and row-group size
overridden); the sequences equal hand-computed ones around planted events at t - 1, t and t + 1
and an independent pandas computation for a sample of requests; then each trains through
``torchx run ... pinads_rec/train.py`` on 2 ranks and beats an AUC floor on the planted signal."""

from __future__ import annotations

import random
from datetime import datetime
from pathlib import Path
from typing import Dict, List

import pandas as pd
import pyarrow.parquet as pq
import pytest
from conftest import torchx_train
from dataset_fixtures import BEIJING, TAOBAO_PIDS, beijing, write_kuairand, write_taobao

from pinads_rec import config
from pinads_rec.data.build import build

REPO = Path(__file__).resolve().parent.parent
TAOBAO = REPO / "configs" / "datasets" / "taobao_ad.yaml"
KUAIRAND = REPO / "configs" / "datasets" / "kuairand.yaml"
LAUNCH_TIMEOUT_S = 300

# Every test needs a raw-log fixture built (seconds each); three train through TorchX.
pytestmark = pytest.mark.slow


def data_overrides(out: Path) -> List[str]:
    """The config's data directories pointed at a build's output."""
    return [
        f"data.train_dir={out / 'train'}",
        f"data.calibration_dir={out / 'calibration'}",
        f"data.eval_dir={out / 'eval'}",
    ]


def build_fixture(tmp: Path, config_path: Path) -> tuple:
    out = tmp / "out"
    # Small row groups: every rank gets some of each small split.
    cfg = config.load(config_path, data_overrides(out) + ["build.requests_per_row_group=64"])
    summary = build(cfg, str(tmp / "raw"), str(out))
    return cfg, out, summary


def read_split(out: Path, split: str) -> List[dict]:
    return pq.read_table(out / split).to_pylist()


def vocabulary(out: Path, table: str) -> Dict[str, int]:
    """raw id (as text) -> index, as the build saved it; absent: 0 (out of vocabulary)."""
    rows = pq.read_table(out / "vocabularies" / f"{table}.parquet").to_pylist()
    return {r["raw"]: r["idx"] for r in rows}


def mapped(vocab: Dict[str, int], raw_ids) -> List[int]:
    return [vocab.get(str(r), 0) for r in raw_ids]


# --- Taobao ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def taobao(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("taobao")
    fixture = write_taobao(tmp / "raw")
    cfg, out, summary = build_fixture(tmp, TAOBAO)
    return fixture, cfg, out, summary


def taobao_requests(out: Path) -> Dict[tuple, dict]:
    """(split, user index, timestamp, surface) -> request row."""
    found = {}
    for split in ("train", "calibration", "eval"):
        for r in read_split(out, split):
            found[(split, r["user_id"], r["timestamp"], r["pid"][0])] = r
    return found


def test_taobao_probe_point_in_time(taobao):
    fixture, _, out, _ = taobao
    p = fixture.probe
    users, cates, brands = vocabulary(out, "user"), vocabulary(out, "cate"), vocabulary(out, "brand")
    requests = taobao_requests(out)
    first = requests[("train", users[str(p.user)], p.time, TAOBAO_PIDS[0])]
    second = requests[("train", users[str(p.user)], p.time + 1, TAOBAO_PIDS[1])]
    (fav, pv, cart, buy, _after) = p.events  # at t-7200, t-3600, t-1, t, t+1
    # At t: the event at t-1 and earlier, newest first; not the one at t, nor at t+1.
    assert first["behaviour_ts"] == [p.time - 1, p.time - 3600, p.time - 7200]
    assert first["behaviour_cate"] == mapped(cates, [cart[2], pv[2], fav[2]])
    assert first["behaviour_brand"] == [brands[str(cart[3])], brands["0"], brands[str(fav[3])]]  # NULL -> raw 0
    assert first["behaviour_btag"] == [2, 1, 3]  # cart, pv, fav
    assert first["intent_ts"] == [p.time - 1, p.time - 7200]  # cart and fav; the pv filtered out
    assert first["intent_cate"] == mapped(cates, [cart[2], fav[2]])
    assert first["intent_btag"] == [2, 3]
    # At t + 1: the buy at t is now in; the pv at t + 1 is not.
    assert second["behaviour_ts"] == [p.time, p.time - 1, p.time - 3600, p.time - 7200]
    assert second["behaviour_cate"] == mapped(cates, [buy[2], cart[2], pv[2], fav[2]])
    assert second["behaviour_btag"] == [4, 2, 1, 3]
    assert second["intent_ts"] == [p.time, p.time - 1, p.time - 7200]
    assert second["intent_btag"] == [4, 2, 3]
    # The request's candidates (ordered by raw adgroup_id) share its sequences; the probe user has
    # no profile row: every profile feature is 0 (unknown).
    ads = vocabulary(out, "adgroup")
    assert first["adgroup_id"] == mapped(ads, sorted(p.ads_first))
    assert first["cate_id"] == mapped(cates, [fixture.ad_cate[a] for a in sorted(p.ads_first)])
    assert first["pid"] == [TAOBAO_PIDS[0]] * len(p.ads_first) and first["clk"] == [0] * len(p.ads_first)
    for col in ("cms_segid", "cms_group_id", "final_gender_code", "age_level", "pvalue_level", "occupation"):
        assert first[col] == 0, col


def test_taobao_sequences_match_an_independent_computation(taobao):
    fixture, cfg, out, _ = taobao
    raw = fixture.raw
    log = pd.read_csv(raw / "behavior_log.csv", na_values=["NULL"], keep_default_na=False)
    log["brand"] = log["brand"].fillna(0).astype("int64")
    codes = {"pv": 1, "cart": 2, "fav": 3, "buy": 4}
    users, cates, brands = vocabulary(out, "user"), vocabulary(out, "cate"), vocabulary(out, "brand")
    raw_user = {v: int(k) for k, v in users.items()}
    by_user = {u: g.sort_values("time_stamp", ascending=False) for u, g in log.groupby("user")}
    groups = {g.name: g.max_length for g in cfg.features.sequence_groups}
    rows = [r for split in ("train", "eval") for r in read_split(out, split)]
    rng = random.Random(1)
    checked = 0
    for r in rng.sample(rows, 60):
        if r["user_id"] == 0:  # a user first seen after training: out of vocabulary
            continue
        events = by_user[raw_user[r["user_id"]]]
        before = events[events.time_stamp < r["timestamp"]]
        intent = before[before.btag != "pv"]
        for name, ev in (("behaviour", before), ("intent", intent)):
            ev = ev.head(groups[name])
            assert r[f"{name}_ts"] == ev.time_stamp.tolist()
            assert r[f"{name}_cate"] == mapped(cates, ev.cate)
            assert r[f"{name}_brand"] == mapped(brands, ev.brand)
            assert r[f"{name}_btag"] == [codes[b] for b in ev.btag]
        checked += 1
    assert checked >= 50


def test_taobao_joins_profile_defaults_and_splits(taobao):
    fixture, _, out, summary = taobao
    raw = fixture.raw
    samples = pd.read_csv(raw / "raw_sample.csv").drop_duplicates()
    assert summary["repairs"]["duplicated impressions (dropped)"] == 1
    # Profile: missing users counted as join misses, their features 0; a blank pvalue_level is 0.
    missing = samples.user.isin(fixture.users_without_profile).sum()
    assert summary["join_misses"]["profile"] == missing
    profile = pd.read_csv(raw / "user_profile.csv")
    assert "new_user_class_level " in profile.columns  # the real header's trailing space: the build strips it
    profile.columns = [c.strip() for c in profile.columns]
    profile = profile.set_index("userid")
    users = vocabulary(out, "user")
    raw_user = {v: int(k) for k, v in users.items()}
    rows = read_split(out, "train")
    for r in rows:
        u = raw_user.get(r["user_id"])
        if u in profile.index:
            p = profile.loc[u]
            assert r["cms_segid"] == p.cms_segid + 1 and r["age_level"] == p.age_level + 1
            assert r["pvalue_level"] == (0 if pd.isna(p.pvalue_level) else p.pvalue_level)
            assert r["new_user_class_level"] == (0 if pd.isna(p.new_user_class_level) else p.new_user_class_level)
        elif u is not None:
            assert r["cms_segid"] == 0 and r["pvalue_level"] == 0
    assert any(raw_user.get(r["user_id"]) in fixture.blank_profile_users and r["pvalue_level"] == 0 for r in rows)
    # Ads missing from ad_feature.csv: the "none" values and price 0.
    ads = pd.read_csv(raw / "ad_feature.csv", na_values=["NULL"], keep_default_na=False)
    assert summary["join_misses"]["ad"] == (~samples.adgroup_id.isin(ads.adgroup_id)).sum() > 0
    # Splits: Beijing days 05-06..05-11 train, 05-12 calibration, 05-13 eval.
    bounds = {
        "train": (beijing(2017, 5, 6), beijing(2017, 5, 12)),
        "calibration": (beijing(2017, 5, 12), beijing(2017, 5, 13)),
        "eval": (beijing(2017, 5, 13), beijing(2017, 5, 14)),
    }
    total = 0
    for split, (lo, hi) in bounds.items():
        got = read_split(out, split)
        assert got and all(lo <= r["timestamp"] < hi for r in got), split
        total += sum(len(r["clk"]) for r in got)
    assert total == len(samples)


# --- KuaiRand -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kuairand(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kuairand")
    fixture = write_kuairand(tmp / "raw")
    cfg, out, summary = build_fixture(tmp, KUAIRAND)
    return fixture, cfg, out, summary


def kuairand_log(raw: Path) -> pd.DataFrame:
    return pd.concat([pd.read_csv(f) for f in sorted(raw.glob("log_*.csv"))], ignore_index=True)


def test_kuairand_probe_point_in_time(kuairand):
    fixture, _, out, _ = kuairand
    p = fixture.probe
    users, videos = vocabulary(out, "user"), vocabulary(out, "video")
    u = users[str(p.user)]
    requests = {
        (split, r["timestamp"]): r for split in ("train", "eval") for r in read_split(out, split) if r["user_id"] == u
    }
    hour, unclicked, before, at, after, rand = p.rows  # t-3600 s, t-10 s, t-0.4 s, t, t+1 s, t+2 s (random)
    t = p.time

    def video(row):
        return videos[str(row[1])]

    # The request at t: the click 0.4 s before is in (its second floored: t - 1), the unclicked
    # impression is not, and neither is the request's own click nor the one at t + 1.
    r = requests[("train", t)]
    assert r["click_ts"] == [t - 1, t - 3600]
    assert r["click_video"] == [video(before), video(hour)]
    assert r["click_tab"] == [before[2] + 1, hour[2] + 1]
    assert r["click_action"] == [1, 1 + 1 + 2]  # nothing after the click; long view + like
    assert r["tab"] == [f"tab_{at[2]}"] and r["is_click"] == [1] and r["long_view"] == [1]
    # The request at t - 0.4 s (timestamp floored to t - 1) sees only the click an hour earlier.
    assert requests[("train", t - 1)]["click_ts"] == [t - 3600]
    r = requests[("train", t + 1)]
    assert r["click_ts"] == [t, t - 1, t - 3600]
    assert r["click_video"] == [video(at), video(before), video(hour)]
    assert r["click_action"] == [2, 1, 4]
    # The random exposure at t + 2 s (eval) sees the standard log's clicks before it.
    r = requests[("eval", t + 2)]
    assert r["click_ts"] == [t + 1, t, t - 1, t - 3600]
    assert r["click_video"] == [video(after), video(at), video(before), video(hour)]
    assert r["click_action"] == [3, 2, 1, 4]


def test_kuairand_sequences_match_an_independent_computation(kuairand):
    fixture, cfg, out, _ = kuairand
    log = kuairand_log(fixture.raw)
    clicks = log[log.is_click == 1].assign(t=lambda d: d.time_ms / 1000.0)
    by_user = {u: g.sort_values("time_ms", ascending=False) for u, g in clicks.groupby("user_id")}
    shown_at = {(r.user_id, r.time_ms // 1000): r.time_ms / 1000.0 for r in log.itertuples()}
    users, videos, authors = vocabulary(out, "user"), vocabulary(out, "video"), vocabulary(out, "author")
    raw_user = {v: int(k) for k, v in users.items()}
    # A clicked video's author, from video_features_basic (the side table the impression log joins);
    # a video missing from it has the side table's default, -1.
    features = pd.read_csv(fixture.raw / "video_features_basic_pure.csv")
    author_of = dict(zip(features.video_id, features.author_id))
    # Its tags, a bag per click: "12,65" -> [13, 66]; blank or missing -> [0].
    tags_of = {
        v: [int(x) + 1 for x in str(t).split(",")] if isinstance(t, str) and t.strip() else [0]
        for v, t in zip(features.video_id, features.tag)
    }
    max_length = cfg.features.sequence_groups[0].max_length
    rows = [r for split in ("train", "calibration", "eval") for r in read_split(out, split)]
    checked = 0
    for r in random.Random(2).sample(rows, 80):
        u = raw_user[r["user_id"]]
        t = shown_at[(u, r["timestamp"])]  # the request's time to the millisecond
        ev = by_user.get(u, clicks.iloc[:0])
        ev = ev[ev.t < t].head(max_length)
        assert r["click_ts"] == [int(x // 1) for x in ev.t]
        assert r["click_video"] == mapped(videos, ev.video_id)
        assert r["click_tab"] == (ev.tab + 1).tolist()
        action = 1 + ev.long_view + 2 * ev.is_like + 4 * ev.is_follow + 8 * ev.is_comment + 16 * ev.is_forward
        assert r["click_action"] == action.tolist()
        assert r["click_author"] == mapped(authors, [author_of.get(v, -1) for v in ev.video_id])
        assert r["click_tags"] == [tags_of.get(v, [0]) for v in ev.video_id]
        checked += 1
    assert checked == 80


def test_kuairand_splits_random_exposures_and_features(kuairand):
    fixture, _, out, summary = kuairand
    log = kuairand_log(fixture.raw)
    # Every random exposure, and only those, is in eval; the standard rows train and calibrate by day.
    ev = read_split(out, "eval")
    assert sum(len(r["is_click"]) for r in ev) == fixture.random_rows == (log.is_rand == 1).sum()
    day = {
        s: {datetime.fromtimestamp(r["timestamp"], BEIJING).date().isoformat() for r in read_split(out, s)}
        for s in ("train", "calibration")
    }
    assert day["calibration"] == {"2022-05-08"} and max(day["train"]) == "2022-05-07"
    assert (
        sum(len(r["is_click"]) for s in ("train", "calibration") for r in read_split(out, s)) == fixture.standard_rows
    )
    # Videos: multi-hot tags shifted by one ([0] unknown), a video missing from the file counted.
    videos = pd.read_csv(fixture.raw / "video_features_basic_pure.csv", dtype={"tag": str}).set_index("video_id")
    vocab = vocabulary(out, "video")
    raw_video = {v: int(k) for k, v in vocab.items()}
    seen = {"tags": 0, "unknown": 0}
    for r in read_split(out, "train")[:400]:
        v = raw_video[r["video_id"][0]]
        tag = videos.tag.get(v)
        if isinstance(tag, str):
            assert r["tag"][0] == [int(x) + 1 for x in tag.split(",")]
            seen["tags"] += 1
        else:
            assert r["tag"][0] == [0]
            seen["unknown"] += 1
        assert r["tab"][0].startswith("tab_") and r["duration_s"][0] in {6.0, 12.0, 17.2, 25.0, 60.0, 104.4}
    assert seen["tags"] and seen["unknown"]
    assert summary["join_misses"]["video"] > 0 and summary["join_misses"]["profile"] == 0


# --- Training through TorchX ----------------------------------------------------------------


def train_through_torchx(tmp: Path, config_path: Path, overrides: List[str]) -> Path:
    """``torchx run -s local_cwd components/train.py:train -j 1x2`` (pinads_rec/train.py on 2 gloo
    ranks) with ``overrides``; returns the run directory."""
    run_dir = tmp / "run"
    torchx_train(tmp, "1x2", config_path.relative_to(REPO), overrides + [f"train.run_dir={run_dir}"], LAUNCH_TIMEOUT_S)
    return run_dir


def eval_auc(run_dir: Path) -> Dict[tuple, float]:
    """(surface, task) -> eval AUC of the run, from its metrics.jsonl."""
    from pinads_rec.training.run_log import read_run_log

    log = read_run_log(run_dir)
    assert log.summary is not None and log.summary["world_size"] == 2, log
    return {(r["surface"], r["task"]): r["auc"] for r in log.summary["eval"]}


# A short run on a fixture: small batches, a few passes, a higher learning rate; tables and arch as
# configured. (40-60 s a dataset on the shared 2 cores, about half of it start-up.)
FIXTURE_TRAINING = [
    "data.batch_size=256",
    "data.shuffle_buffer_rows=2048",
    "data.num_workers=0",
    "train.lr=0.005",
    "train.warmup_steps=5",
    "train.log_every=10",
    "train.tensorboard=false",
    "reference.enabled=false",  # the LightGBM reference after the run: these check the model's AUC
]


def test_taobao_trains_through_torchx(taobao, tmp_path):
    # Planted (dataset_fixtures.write_taobao): hot categories and categories of the recent behaviour.
    # A model that learned nothing scores 0.5; this one ~0.69.
    _, _, out, _ = taobao
    run = train_through_torchx(tmp_path, TAOBAO, data_overrides(out) + FIXTURE_TRAINING + ["train.epochs=3"])
    auc = eval_auc(run)
    assert auc[("all", "click")] >= 0.62, auc


def test_kuairand_trains_through_torchx(kuairand, tmp_path):
    # Planted (dataset_fixtures.write_kuairand): hot tags, active users and re-shown recent clicks,
    # evaluated on the random exposures; ~0.77 click and ~0.74 long view.
    _, _, out, _ = kuairand
    run = train_through_torchx(tmp_path, KUAIRAND, data_overrides(out) + FIXTURE_TRAINING + ["train.epochs=2"])
    auc = eval_auc(run)
    assert auc[("all", "click")] >= 0.68 and auc[("all", "long_view")] >= 0.65, auc


# --- The planted signal of Taobao-shaped logs ------------------------------------------------

# pinads_rec.data.shaped_logs.taobao at 3,000 users: ~31k impressions (23k training rows), written
# and built in about 10 s; the click is driven by the session's intent category (visible only in the
# newest behaviour events) and favourite categories (older history).
SHAPED_USERS = 3000
SHAPED_TRAINING = ["data.batch_size=128", "data.num_workers=0", "train.log_every=20", "train.tensorboard=false"]
SHAPED_TRAINING += ["reference.enabled=false"]  # the model's lift is checked, not the LightGBM reference's


@pytest.fixture(scope="module")
def taobao_shaped(tmp_path_factory):
    from pinads_rec.data.shaped_logs import config_with_truth, taobao

    tmp = tmp_path_factory.mktemp("taobao_shaped")
    taobao.write(tmp / "raw", users=SHAPED_USERS)
    out = tmp / "out"
    build(config_with_truth("taobao", data_overrides(out)), str(tmp / "raw"), str(out))
    return out


def test_taobao_shaped_logs_sequence_signal_is_learned(taobao_shaped, tmp_path):
    # The config as shipped (only the batch size and the data paths changed) must close most of the
    # oracle's lift on both placements. Before the retrieval and the warm-up fix (encoders
    # [transformer, din], warmup_steps 500, lr 0.001) this run reached lift 0.16 / 0.07; with them
    # 0.71 / 0.74 (eval: ~2,350 and ~1,700 impressions, 245 and 87 clicks).
    from pinads_rec.data.shaped_logs import truth_overrides
    from pinads_rec.metrics import oracle_lift
    from pinads_rec.training.run_log import read_run_log

    out = taobao_shaped
    run = train_through_torchx(tmp_path, TAOBAO, data_overrides(out) + truth_overrides("taobao") + SHAPED_TRAINING)
    rows = read_run_log(run).summary["eval"]
    lift = {r["surface"]: round(oracle_lift(r), 3) for r in rows if r["task"] == "click"}
    assert min(lift[p] for p in TAOBAO_PIDS) >= 0.5, lift
