"""Raw logs in the exact layout of KuaiRand-Pure (a month of Kuaishou short-video feed logs), with
a planted truth kept aside: the five CSVs ``configs/datasets/kuairand.yaml`` reads, as the released
dataset has them, plus ``truth.csv`` (the true click, long-view and like probability of every
impression, keyed by ``user_id, video_id, time_ms``).

This is not the demo's generator in another layout, nor the test fixture scaled up: its world is a
video feed's.

- **Videos** (7,583, Pure's pool): an author (popularity Zipf-like: about a hundred authors with
  ten videos or more, two thirds with one or two), 1-3 tags of 30 drawn by popularity, a quality,
  a duration (seconds to minutes) and an upload date (most before the log, some during it).
- **Users** watch in *sessions* (a few to a few dozen impressions, seconds apart, in one tab) over
  2022-04-08..05-08 (Beijing time); more sessions the more active they are. Each has 3 favourite
  authors and 2 favourite tags (long-term: all through their history) and a **current interest**,
  a tag that changes every few sessions (it shows only in the newest clicks).
- **Exposures.** The standard log's recommender mixes videos of the current interest, of the
  favourites and popular ones; from 04-22 on, about one impression in six is replaced by a video
  drawn uniformly from the pool (``is_rand = 1``: the random-exposure log, the config's eval split).
- **The click** is drawn from ``sigmoid(logit)`` with the logit a sum of: a base rate, the tab, the
  user's activity degree and propensity, the video's quality, a short-video and a freshness
  effect, **a tag of the video being the current interest**, **a favourite tag**, **a favourite
  author**. **Long view** (given a click) falls with the duration and rises with quality and the
  interests; **like** (given a click) rises with a favourite author, a favourite tag and quality.
  ``truth.csv`` holds the unconditional probabilities (long view and like imply a click).
- The history is the impression log itself (the config's ``clicks`` group: earlier clicks, random
  exposures' included), so nothing here computes one.
- Quirks of the real files (as tests/dataset_fixtures.py's ``write_kuairand``): times in
  milliseconds with ``date`` / ``hourmin`` in Beijing time, the standard log in two files split at
  04-22, the random log apart, text ranges quoted (``"(0,10]"``), blank tags and music types, a
  video shown but missing from ``video_features_basic_pure.csv``.

``write`` returns (and saves as ``summary.json``) the counts, label rates and the oracle's AUC on
the random exposures, with and without the current interest (what the newest clicks are worth).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Optional

import numpy as np
import pandas as pd

from pinads_rec.data.shaped_logs.common import auc, beijing, sigmoid, zipf_weights

START, RANDOM_START, END = beijing(2022, 4, 8), beijing(2022, 4, 22), beijing(2022, 5, 9)
N_VIDEOS, N_AUTHORS, N_TAGS = 7583, 2500, 30
TABS = 15
# Share of impressions per tab (0..14): the featured feed (1) first, several tabs nearly empty.
TAB_SHARE = np.array([0.20, 0.55, 0.10, 0.03, 0.07, 0.005, 0.02, 0.005, 0.005, 0.003, 0.003, 0.002, 0.001, 0.0, 0.001])
DEGREES = np.array(
    ["full_active", "high_active", "middle_active", "low_active", "2_14_day_new", "single_day_new", "UNKNOWN"]
)
DEGREE_SHARE = np.array([0.30, 0.25, 0.20, 0.10, 0.07, 0.05, 0.03])
DEGREE_SESSIONS = np.array([11.0, 9.0, 7.0, 4.0, 3.0, 2.0, 5.0])  # mean sessions per user, by degree
SESSION_MEAN = 7.0  # impressions per session (geometric)
RANDOM_SHARE = 0.17  # of impressions from 04-22 on, replaced by a random exposure
INTEREST_SESSIONS = 2.5  # sessions a current interest lasts (geometric mean)
POLICY = np.array([0.30, 0.15, 0.15, 0.40])  # current interest, favourite author, favourite tag, popular

# The planted logits' terms (the module docstring).
BASE = -1.9
TAB = np.array([0.3, 0.0, -0.4, -0.2, -0.8, 0.1, -0.3, 0.2, -0.5, 0.0, 0.4, -0.6, 0.2, 0.0, -0.2])
DEGREE = np.array([0.4, 0.2, 0.0, -0.3, -0.1, -0.4, 0.0])
USER_SD, QUALITY_SD = 0.4, 0.5
SHORT = 0.25  # per e-fold shorter than 20 s (clicks)
FRESH = 0.4  # x exp(-age / 10 days)
CURRENT, FAVOURITE_TAG, FAVOURITE_AUTHOR = 2.5, 1.0, 1.5
LONG_BASE, LONG_DURATION, LONG_QUALITY, LONG_CURRENT, LONG_AUTHOR = 0.6, 1.1, 0.6, 0.6, 0.5
LIKE_BASE, LIKE_AUTHOR, LIKE_TAG, LIKE_QUALITY = -2.6, 1.5, 0.7, 0.6

LOG_COLUMNS = [
    "user_id",
    "video_id",
    "date",
    "hourmin",
    "time_ms",
    "is_click",
    "is_like",
    "is_follow",
    "is_comment",
    "is_forward",
    "is_hate",
    "long_view",
    "play_time_ms",
    "duration_ms",
    "profile_stay_time",
    "comment_stay_time",
    "is_profile_enter",
    "is_rand",
    "tab",
]
ONEHOT_RANGES = [2, 7, 50, 1471, 15, 34, 3, 118, 454, 7, 5, 5, 2, 2, 2, 2, 2, 2]  # values 0..n-1


def write(raw: Path, users: int = 8000, seed: int = 0, world: Optional[Dict] = None) -> Dict:
    """Writes log_standard_4_08_to_4_21_pure.csv, log_standard_4_22_to_5_08_pure.csv,
    log_random_4_22_to_5_08_pure.csv, user_features_pure.csv, video_features_basic_pure.csv and
    truth.csv into ``raw``; returns the summary (also written as summary.json). ``world``: a dict
    that receives the hidden state, one array per impression in log order (benchmarks/
    kuairand_ceiling.py: what the logs reveal of it)."""
    rng = np.random.default_rng(seed)
    raw = Path(raw)
    raw.mkdir(parents=True, exist_ok=True)

    # --- videos: author, tags (padded with -1), quality, duration, upload time ---
    video_ids = rng.choice(np.arange(0, 10_000_000), N_VIDEOS, replace=False)
    author_ids = rng.choice(np.arange(0, 8_839_735), N_AUTHORS, replace=False)
    author = rng.choice(N_AUTHORS, N_VIDEOS, p=zipf_weights(N_AUTHORS, 0.9, rng))
    tag_pop = zipf_weights(N_TAGS, 0.8, rng)
    n_tags = rng.choice([1, 2, 3], N_VIDEOS, p=[0.5, 0.35, 0.15])
    tags = np.full((N_VIDEOS, 3), -1)
    for v in range(N_VIDEOS):  # 7,583 small draws without replacement
        tags[v, : n_tags[v]] = rng.choice(N_TAGS, n_tags[v], replace=False, p=tag_pop)
    quality = rng.normal(0.0, QUALITY_SD, N_VIDEOS)
    duration_ms = np.clip(rng.lognormal(np.log(20_000), 0.8, N_VIDEOS), 3_000, 300_000).astype(np.int64)
    upload = np.where(
        rng.random(N_VIDEOS) < 0.85,
        START - (rng.exponential(60.0, N_VIDEOS) * 86400).astype(np.int64),
        rng.integers(START, END, N_VIDEOS),
    )
    upload_day = (upload + 8 * 3600) // 86400  # Beijing day number
    exposure = zipf_weights(N_VIDEOS, 0.7, rng) * np.exp(quality)  # the recommender's popular pick
    popular_cdf = np.cumsum(exposure / exposure.sum())
    by_tag = _index(np.repeat(np.arange(N_VIDEOS), n_tags), tags[tags >= 0], N_TAGS)
    by_author = _index(np.arange(N_VIDEOS), author, N_AUTHORS)

    # --- users: activity, propensity, favourites ---
    user_ids = rng.choice(27285, users, replace=False) if users <= 27285 else np.arange(users)
    degree = rng.choice(len(DEGREES), users, p=DEGREE_SHARE)
    user_bias = rng.normal(0.0, USER_SD, users)
    author_pop = np.bincount(author, minlength=N_AUTHORS) / N_VIDEOS
    fav_author = np.stack([rng.choice(N_AUTHORS, 3, replace=False, p=author_pop) for _ in range(users)])
    fav_tag = np.stack([rng.choice(N_TAGS, 2, replace=False, p=tag_pop) for _ in range(users)])

    # --- sessions (time order per user), each with a tab and a current interest ---
    n_sessions = 1 + rng.poisson(DEGREE_SESSIONS[degree] - 1)
    s_user = np.repeat(np.arange(users), n_sessions)
    s_start = rng.integers(START, END - 1800, len(s_user))
    order = np.lexsort((s_start, s_user))
    s_user, s_start = s_user[order], s_start[order]
    first = np.r_[True, s_user[1:] != s_user[:-1]]
    s_tab = rng.choice(TABS, len(s_user), p=TAB_SHARE / TAB_SHARE.sum())
    # A new interest at a user's first session, then with probability 1 / INTEREST_SESSIONS.
    new_interest = first | (rng.random(len(s_user)) < 1.0 / INTEREST_SESSIONS)
    episode = np.cumsum(new_interest) - 1
    interest = _draw_excluding(rng, tag_pop, fav_tag[s_user[new_interest]])[episode]

    # --- impressions: seconds apart within a session, a unique millisecond per user ---
    size = rng.geometric(1.0 / SESSION_MEAN, len(s_user))
    i_session = np.repeat(np.arange(len(s_user)), size)
    start_of = np.repeat(np.cumsum(size) - size, size)
    gaps = rng.integers(3_000, 40_000, len(i_session))
    gaps[np.arange(len(i_session)) == start_of] = rng.integers(0, 1000, len(s_user))  # first: at the start
    elapsed = np.cumsum(gaps) - np.repeat((np.cumsum(gaps) - gaps)[np.cumsum(size) - size], size)
    time_ms = s_start[i_session] * 1000 + elapsed
    keep = time_ms < END * 1000
    i_session, time_ms = i_session[keep], time_ms[keep]
    usr = s_user[i_session]
    order = np.lexsort((time_ms, usr))
    i_session, time_ms, usr = i_session[order], time_ms[order], usr[order]
    while True:  # two sessions of a user meeting on one millisecond: move the later row on
        same = np.r_[False, (usr[1:] == usr[:-1]) & (time_ms[1:] <= time_ms[:-1])]
        if not same.any():
            break
        time_ms[same] = time_ms[np.flatnonzero(same) - 1] + 1
    keep = time_ms < END * 1000
    i_session, time_ms, usr = i_session[keep], time_ms[keep], usr[keep]
    n = len(usr)
    tab = s_tab[i_session]
    current = interest[i_session]
    is_rand = ((time_ms >= RANDOM_START * 1000) & (rng.random(n) < RANDOM_SHARE)).astype(np.int64)

    # --- which video: the recommender's mix (standard) or uniform over the pool (random) ---
    pick = rng.choice(len(POLICY), n, p=POLICY)
    video = _draw(rng, popular_cdf, n)
    video = np.where(pick == 0, _member(rng, by_tag, current), video)
    video = np.where(pick == 1, _member(rng, by_author, fav_author[usr, rng.integers(0, 3, n)]), video)
    video = np.where(pick == 2, _member(rng, by_tag, fav_tag[usr, rng.integers(0, 2, n)]), video)
    video = np.where(is_rand == 1, rng.integers(0, N_VIDEOS, n), video)

    # --- the planted truth ---
    vtags = tags[video]
    is_current = (vtags == current[:, None]).any(1)
    fav_tags = (vtags[:, :, None] == fav_tag[usr][:, None, :]).any(2).sum(1)
    is_fav_author = (fav_author[usr] == author[video][:, None]).any(1)
    day = (time_ms // 1000 + 8 * 3600) // 86400
    age = np.maximum(day - upload_day[video], 0)
    log_dur = np.log(duration_ms[video] / 20_000.0)
    shared = BASE + TAB[tab] + DEGREE[degree[usr]] + user_bias[usr] + quality[video]
    shared = shared - SHORT * log_dur + FRESH * np.exp(-age / 10.0)
    p_click = sigmoid(shared + CURRENT * is_current + FAVOURITE_TAG * fav_tags + FAVOURITE_AUTHOR * is_fav_author)
    p_click_no_current = sigmoid(shared + FAVOURITE_TAG * fav_tags + FAVOURITE_AUTHOR * is_fav_author)
    long_given = sigmoid(
        LONG_BASE
        - LONG_DURATION * log_dur
        + LONG_QUALITY * quality[video]
        + LONG_CURRENT * is_current
        + LONG_AUTHOR * is_fav_author
    )
    like_given = sigmoid(
        LIKE_BASE + LIKE_AUTHOR * is_fav_author + LIKE_TAG * (fav_tags > 0) + LIKE_QUALITY * quality[video]
    )
    click = rng.random(n) < p_click
    long_view = click & (rng.random(n) < long_given)
    like = click & (rng.random(n) < like_given)

    # --- the other feedback: outcomes, drawn only to fill the log's columns (and the history's actions) ---
    follow = click & (rng.random(n) < np.where(is_fav_author, 0.03, 0.005))
    comment = click & (rng.random(n) < 0.01)
    forward = click & (rng.random(n) < 0.005)
    hate = ~click & (rng.random(n) < 0.002)
    profile_enter = click & (rng.random(n) < np.where(is_fav_author, 0.08, 0.02))
    dur = duration_ms[video]
    play = np.where(
        long_view,
        dur * rng.uniform(0.8, 2.0, n),
        np.where(click, dur * rng.uniform(0.05, 0.6, n), rng.uniform(0, 1500, n)),
    ).astype(np.int64)
    moment = pd.to_datetime(time_ms, unit="ms", utc=True).tz_convert("Asia/Shanghai")

    log = pd.DataFrame(
        {
            "user_id": user_ids[usr],
            "video_id": video_ids[video],
            "date": moment.strftime("%Y%m%d").astype(np.int64),
            "hourmin": (moment.hour * 100 + moment.minute).to_numpy(),
            "time_ms": time_ms,
            "is_click": click.astype(np.int64),
            "is_like": like.astype(np.int64),
            "is_follow": follow.astype(np.int64),
            "is_comment": comment.astype(np.int64),
            "is_forward": forward.astype(np.int64),
            "is_hate": hate.astype(np.int64),
            "long_view": long_view.astype(np.int64),
            "play_time_ms": play,
            "duration_ms": dur,
            "profile_stay_time": np.where(profile_enter, rng.integers(1_000, 30_000, n), 0),
            "comment_stay_time": np.where(comment, rng.integers(1_000, 60_000, n), 0),
            "is_profile_enter": profile_enter.astype(np.int64),
            "is_rand": is_rand,
            "tab": tab,
        },
        columns=LOG_COLUMNS,
    )
    standard, rand = log[is_rand == 0], log[is_rand == 1]
    before = standard.time_ms < RANDOM_START * 1000
    standard[before].to_csv(raw / "log_standard_4_08_to_4_21_pure.csv", index=False)
    standard[~before].to_csv(raw / "log_standard_4_22_to_5_08_pure.csv", index=False)
    rand.to_csv(raw / "log_random_4_22_to_5_08_pure.csv", index=False)
    truth = pd.DataFrame(
        {
            "user_id": log.user_id,
            "video_id": log.video_id,
            "time_ms": time_ms,
            "p_click": np.round(p_click, 6),
            "p_long_view": np.round(p_click * long_given, 6),
            "p_like": np.round(p_click * like_given, 6),
        }
    )
    truth.to_csv(raw / "truth.csv", index=False)

    _user_features(rng, user_ids, degree).to_csv(raw / "user_features_pure.csv", index=False)
    missing = int(video[0])  # shown, but absent from the video file
    present = np.setdiff1d(np.arange(N_VIDEOS), [missing])
    tag_text = np.array([",".join(str(t) for t in row if t >= 0) for row in tags[present]], dtype=object)
    tag_text[rng.random(len(present)) < 0.05] = None  # blank tags occur
    music = rng.choice(np.array(["4", "9", "11", None], dtype=object), len(present), p=[0.5, 0.25, 0.15, 0.10])
    upload_dt = pd.to_datetime(upload[present], unit="s", utc=True).tz_convert("Asia/Shanghai").strftime("%Y-%m-%d")
    videos = pd.DataFrame(
        {
            "video_id": video_ids[present],
            "author_id": author_ids[author[present]],
            "video_type": np.where(rng.random(len(present)) < 0.03, "AD", "NORMAL"),
            "upload_dt": upload_dt,
            "upload_type": rng.choice(["ShortImport", "LongImport", "Web", "PictureSet"], len(present)),
            "visible_status": 1,
            "video_duration": duration_ms[present].astype(np.float64),
            "server_width": 720,
            "server_height": 1280,
            "music_id": rng.integers(1, 10**9, len(present)),
            "music_type": music,
            "tag": tag_text,
        }
    )
    videos.to_csv(raw / "video_features_basic_pure.csv", index=False, float_format="%.1f")

    ev = is_rand == 1
    summary = {
        "users": users,
        "videos": N_VIDEOS,
        "standard_impressions": int((~ev).sum()),
        "random_impressions": int(ev.sum()),
        "train_impressions": int(((~ev) & (time_ms < beijing(2022, 5, 8) * 1000)).sum()),
        "sessions": int(len(s_user)),
        "rates": {
            split: {
                "click": float(click[on].mean()),
                "long_view": float(long_view[on].mean()),
                "like": float(like[on].mean()),
            }
            for split, on in (("standard", ~ev), ("random", ev))
        },
        # On the random exposures (the eval split): the oracle, and the oracle blind to the
        # current interest (the part only the newest clicks tell).
        "oracle_auc_random": {
            "click": auc(p_click[ev], click[ev]),
            "long_view": auc((p_click * long_given)[ev], long_view[ev]),
            "like": auc((p_click * like_given)[ev], like[ev]),
            "click_without_current_interest": auc(p_click_no_current[ev], click[ev]),
        },
        "random_exposures_with": {
            "current_interest": float(is_current[ev].mean()),
            "favourite_tag": float((fav_tags[ev] > 0).mean()),
            "favourite_author": float(is_fav_author[ev].mean()),
        },
        "planted_logit": {
            "click": {
                "base": BASE,
                "tab": TAB.tolist(),
                "degree": dict(zip(DEGREES.tolist(), DEGREE.tolist())),
                "user_sd": USER_SD,
                "quality_sd": QUALITY_SD,
                "short_per_efold": SHORT,
                "fresh": FRESH,
                "current_interest": CURRENT,
                "favourite_tag_each": FAVOURITE_TAG,
                "favourite_author": FAVOURITE_AUTHOR,
            },
            "long_view_given_click": {
                "base": LONG_BASE,
                "per_efold_longer": -LONG_DURATION,
                "quality": LONG_QUALITY,
                "current_interest": LONG_CURRENT,
                "favourite_author": LONG_AUTHOR,
            },
            "like_given_click": {
                "base": LIKE_BASE,
                "favourite_author": LIKE_AUTHOR,
                "favourite_tag": LIKE_TAG,
                "quality": LIKE_QUALITY,
            },
        },
    }
    (raw / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if world is not None:
        world.update(
            user=usr,
            time_ms=time_ms,
            video=video,
            click=click,
            is_rand=is_rand,
            video_tags=tags,  # [videos, 3], -1 padded: tag indices 0..29
            video_author=author,
            tag_popularity=tag_pop,
            p_click=p_click,
            # the click logit without the history's terms (base, tab, activity, user, quality,
            # duration, freshness): what a model learns from the ids and the other features
            logit_without_history=shared,
        )
    return summary


def _user_features(rng: np.random.Generator, user_ids: np.ndarray, degree: np.ndarray) -> pd.DataFrame:
    """user_features_pure.csv: the activity degree, the three flags, the counts with their range
    texts (the ranges follow the counts, as in the real file) and the eighteen encrypted one-hots."""
    n = len(user_ids)
    follow = np.minimum(rng.lognormal(3.0, 1.5, n).astype(np.int64), 2000) * (rng.random(n) > 0.05)
    fans = rng.lognormal(1.5, 1.8, n).astype(np.int64) * (rng.random(n) > 0.1)
    friend = rng.lognormal(1.0, 1.2, n).astype(np.int64) * (rng.random(n) > 0.2)
    register = rng.integers(15, 3000, n)
    frame = {
        "user_id": user_ids,
        "user_active_degree": DEGREES[degree],
        "is_lowactive_period": (rng.random(n) < 0.05).astype(np.int64),
        "is_live_streamer": (rng.random(n) < 0.03).astype(np.int64),
        "is_video_author": (rng.random(n) < 0.3).astype(np.int64),
        "follow_user_num": follow,
        "follow_user_num_range": _ranges(
            follow,
            [0, 10, 50, 100, 150, 250, 500],
            ["0", "(0,10]", "(10,50]", "(50,100]", "(100,150]"] + ["(150,250]", "(250,500]", "500+"],
            right=True,
        ),
        "fans_user_num": fans,
        "fans_user_num_range": _ranges(
            fans, [1, 10, 100, 1000, 5000], ["0", "[1,10)", "[10,100)", "[100,1k)", "[1k,5k)", "[5k,1w)"]
        ),
        "friend_user_num": friend,
        "friend_user_num_range": _ranges(
            friend, [1, 5, 30, 60, 120, 250], ["0", "[1,5)", "[5,30)", "[30,60)", "[60,120)", "[120,250)", "250+"]
        ),
        "register_days": register,
        "register_days_range": _ranges(
            register, [31, 61, 91, 181, 366, 731], ["15-30", "31-60", "61-90", "91-180", "181-365", "366-730", "730+"]
        ),
    }
    for i, k in enumerate(ONEHOT_RANGES):
        frame[f"onehot_feat{i}"] = rng.integers(0, k, n)
    return pd.DataFrame(frame).sample(frac=1.0, random_state=int(rng.integers(1 << 31)))


def _ranges(values: np.ndarray, edges, names, right: bool = False) -> np.ndarray:
    """The range text of each count: ``names[i]`` for the i-th bin of ``edges``."""
    return np.array(names)[np.digitize(values, edges, right=right)]


def _index(members: np.ndarray, groups: np.ndarray, n_groups: int):
    """(offsets, members sorted by group): group g's members are ``sorted[offsets[g]:offsets[g + 1]]``."""
    order = np.argsort(groups, kind="stable")
    offsets = np.r_[0, np.cumsum(np.bincount(groups, minlength=n_groups))]
    return offsets, members[order]


def _member(rng: np.random.Generator, index, group: np.ndarray) -> np.ndarray:
    """A uniformly drawn member of each ``group`` (every group drawn here has members)."""
    offsets, members = index
    count = offsets[group + 1] - offsets[group]
    return members[offsets[group] + (rng.random(len(group)) * count).astype(np.int64)]


def _draw(rng: np.random.Generator, cdf: np.ndarray, size: int) -> np.ndarray:
    return np.minimum(np.searchsorted(cdf, rng.random(size) * cdf[-1]), len(cdf) - 1)


def _draw_excluding(rng: np.random.Generator, p: np.ndarray, excluded: np.ndarray) -> np.ndarray:
    """One index per row drawn with probabilities ``p``, never one of that row's ``excluded``."""
    cdf = np.cumsum(p)
    out = _draw(rng, cdf, len(excluded))
    for _ in range(100):
        bad = (out[:, None] == excluded).any(1)
        if not bad.any():
            return out
        out[bad] = _draw(rng, cdf, int(bad.sum()))
    raise RuntimeError("could not draw an interest outside the favourites")
