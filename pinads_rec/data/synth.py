"""Planted-truth synthetic ads-engagement data, written in the project's Parquet contract.

Users live on a timeline: each has behaviour logs (engaged pins, engaged ads, search queries) over
90 days, and makes requests in visits; a visit opens with a session of pins events on its intent.
A request's sequences are its user's events strictly before it, newest first, capped, so later
requests see what earlier ones saw. One row per ad impression (candidate); the rows of a request
are contiguous and carry its sequences duplicated per row, as logged features are. Labels are
drawn from known probabilities (``true_p_*`` columns), and each term of those probabilities is
recoverable only by the model part meant to find it:

- long-term interest (user topic mixture)      -> the pins / ads sequences' background events
- short-term intent (per visit)                 -> the session: the newest ~8 pins events
- query / context match                         -> ``query_tokens`` / ``context_topic`` vs item
- item quality                                  -> ``item_id`` embedding, ``item_ctr_prior``
- per-surface offsets and interest scales       -> surface-specific calibration
- shopping ads                                   -> the ads sequence (a separate shopping mixture)
- save on a topic                                -> past save actions on that topic in the sequence
- dormant interest (synth.long_history, off by   -> a burst of pins events older than the newest
  default; long-tailed pins histories to 4,000)     100 (the log's first 15 days)

Splits are time windows: train, then calibration, then eval. ``--raw`` also writes the raw logs
(behaviour logs keyed by user and time, impression log, items table) that configs/demo.yaml's
``build:`` section turns back into the same contract (pinads_rec.data.build).

Formulas and coefficient values: docs/synthetic_data.md (keep it in sync with the constants
below). Everything is vectorized numpy; the timeline and the requests' blocks of
``BLOCK_REQUESTS`` each draw from their own PCG64 stream, so the data depend only on the seed and
the sizes, not on the number of files, the row-group size or the threads.

    python -m pinads_rec.data.synth --config configs/demo.yaml --out data/demo [--raw] [--seed N]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pinads_rec import metrics
from pinads_rec.config import ConfigError, ExperimentConfig, LongHistoryConfig, SynthConfig, load
from pinads_rec.data import layout

# --------------------------------------------------------------------------------------------
# Planted truth: every coefficient is documented in docs/synthetic_data.md.
# --------------------------------------------------------------------------------------------

SURFACES = ("home_feed", "related_pins", "search")
HOME, RELATED, SEARCH = 0, 1, 2
SURFACE_PROBS = np.array([0.5, 0.3, 0.2])

T0 = 1_700_006_400  # first request time (seconds): 2023-11-15 00:00 UTC
SPAN_S = 30 * 86400  # the requests cover 30 days: train, then calibration, then eval
LOG_START = T0 - 60 * 86400  # the behaviour logs begin 60 days before the first request ...
LOG_END = T0 + SPAN_S  # ... and end with the last
BLOCK_REQUESTS = 2048  # requests per RNG block (fixed: changing it changes the data)
ITEM_EMB_DIM = 32  # item_embedding width ("GraphSage"-like noisy topic vector)
ITEM_EMB_NOISE = 0.6  # per-coordinate noise sd is ITEM_EMB_NOISE / sqrt(dim) before normalizing
QUERY_VOCAB = 1024  # token ids in [1, QUERY_VOCAB); 0 is padding
QUERY_TOKENS_PER_TOPIC = 8  # a topic owns this many query tokens (fewer when T is large)

# Topics: popularity ~ (rank + 3)^-0.8. A user's mixture puts Dirichlet(1, ..., 1) weights on
# 1 + min(Poisson(MIXTURE_EXTRA_TOPICS), MIXTURE_SLOTS - 1) topics drawn by popularity.
TOPIC_ZIPF = 0.8
MIXTURE_EXTRA_TOPICS = 1.5
MIXTURE_SLOTS = 6
# Items and advertisers.
SHOPPING_ADVERTISER_FRACTION = 0.3
QUALITY_SD = 0.5  # latent item quality q_i (click logit)
ADVERTISER_SD = 0.3  # latent advertiser effect a_adv (click logit)
PRIOR_BASE = -3.6  # item_ctr_prior = sigmoid(PRIOR_BASE + q_i + a_adv + N(0, PRIOR_NOISE))
PRIOR_NOISE = 0.5
ITEM_POPULARITY_POWER = 1.5  # within a topic, item index = floor(count * U^power): popular head

# Users.
ACTIVITY_SD = 0.7  # activity a_u ~ LogNormal(0, ACTIVITY_SD); user_activity = 5 a_u e^{N(0, 0.15)}
SAVE_PROPENSITY = (2.0, 10.0)  # Beta: fraction of a user's engaged events that are saves
# Visits: a user (uniform) opens a visit at a uniform time of a split's window; it holds
# 1 + Poisson(VISIT_EXTRA_REQUESTS) requests, REQUEST_GAP_S apart on average, all within VISIT_MAX_S.
VISIT_EXTRA_REQUESTS = 1.5
REQUEST_GAP_S = 120.0
VISIT_MAX_S = 3600
# Behaviour logs. Background events: Poisson(rate * L * a_u / E[a_u]) per 30 days, uniform in
# time over the whole log; a visit opens with a session of SESSION_EVENTS pins events.
PINS_PER_30_DAYS = 0.15
ADS_PER_30_DAYS = 0.07
QUERIES_PER_30_DAYS = 0.045
SESSION_EVENTS = 8  # the short-term intent shows in the session before a visit
SESSION_INTENT_PROB = 0.75  # a session event's topic is the visit's intent with this probability
SESSION_GAP_S = 90.0  # mean gap between session events
OLD_UNIFORM_PROB = 0.1  # background pins events: topic ~ user mixture, or uniform with this probability
ADS_UNIFORM_PROB = 0.1  # ads events: topic ~ shopping mixture, or uniform
QUERIES_UNIFORM_PROB = 0.2  # query events: topic ~ user mixture, or uniform
# Action types of sequence events, [0, 8).
ACTIONS = ("click", "save", "closeup", "long_click", "comment", "share", "video_view", "add_to_cart")
SAVE_ACTION = 1
PIN_ACTION_PROBS = np.array([0.45, 0.0, 0.25, 0.12, 0.03, 0.05, 0.10, 0.0])  # non-save actions
AD_ACTION_PROBS = np.array([0.55, 0.0, 0.10, 0.20, 0.0, 0.0, 0.0, 0.15])
# Per request.
INTENT_FROM_MIXTURE = 0.3  # a visit's intent ~ user mixture w.p. this, else uniform over topics
ANCHOR_FROM_MIXTURE = 0.6  # search query topic / related-pins context topic ~ mixture, else uniform
# Candidate topic sources per surface: (mixture, shopping mixture, intent, uniform, anchor).
CANDIDATE_SOURCES = np.array(
    [
        [0.35, 0.10, 0.15, 0.40, 0.00],  # home_feed
        [0.20, 0.05, 0.10, 0.30, 0.35],  # related_pins (anchor: context topic)
        [0.15, 0.05, 0.10, 0.30, 0.40],  # search (anchor: query topic)
    ]
)

# Click logit (see docs): offsets and interest scales per surface.
CLICK_OFFSET = np.array([-5.59, -5.32, -4.88])
INTEREST_SCALE = np.array([1.0, 0.6, 0.4])
LONG_TERM_COEF = 2.0  # x theta_u[k] (standard) or phi_u[k] (shopping)
INTENT_COEF = 1.8  # x 1[k == intent]
QUERY_COEF = 2.0  # search: x 1[k == query topic]
CONTEXT_COEF = 1.5  # related_pins: x 1[k == context topic]
SHOPPING_OFFSET = -0.3
# good_click | click.
GOOD_OFFSET = np.array([-0.6, -0.4, -0.2])
GOOD_QUALITY_COEF = 0.8
GOOD_INTENT_COEF = 0.6
GOOD_SHOPPING_OFFSET = 0.3
# save (marginal over click): logit_s, and a boost when the impression was clicked.
SAVE_OFFSET = np.array([-6.2, -6.0, -5.8])
SAVE_INTEREST_COEF = 0.6  # x the click interest term
SAVE_HISTORY_COEF = 0.8  # x log1p(#save events on the item's topic in the pins sequence)
SAVE_QUALITY_COEF = 0.4
SAVE_SHOPPING_OFFSET = -0.5
SAVE_CLICK_BOOST = 2.0

# Long histories (synth.long_history; its knobs are config, these are fixed).
Z_P90 = 1.2815515655446004  # the standard normal's 90th percentile: sigma = ln(p90 / median) / Z_P90
BURST_WINDOWS = (100, 1000, 4000)  # newest-event windows the summary checks for burst events

TASKS = ("click", "good_click", "save")
DENSE_COLUMNS = ("user_activity", "item_ctr_prior", "item_embedding")


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _stream(seed: int, *key: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=key)))


def query_tokens_per_topic(num_topics: int) -> int:
    """K: topic k (1-based) owns tokens 1 + (k-1)*K + r, r in [0, K), all < QUERY_VOCAB."""
    return min(QUERY_TOKENS_PER_TOPIC, (QUERY_VOCAB - 1) // num_topics)


# --------------------------------------------------------------------------------------------
# The world: topics, items, advertisers, users (fixed for a seed).
# --------------------------------------------------------------------------------------------


@dataclass
class World:
    num_topics: int
    centroids: np.ndarray  # [T, 32] unit topic centroids (index k-1 for topic k)
    item_topic: np.ndarray  # [I] in [1, T]
    item_advertiser: np.ndarray  # [I]
    item_ad_type: np.ndarray  # [I] 0 standard / 1 shopping (the advertiser's type)
    item_quality: np.ndarray  # [I] latent q_i + a_adv
    item_prior: np.ndarray  # [I] float32 item_ctr_prior
    item_emb: np.ndarray  # [I, 32] float32
    item_event_emb: np.ndarray  # [I, event_embedding_dim] float32
    items_by_topic: np.ndarray  # [I] item ids sorted by topic
    topic_start: np.ndarray  # [T+1] offsets into items_by_topic (index k-1 .. k)
    theta: Tuple[np.ndarray, np.ndarray]  # long-term topic mixture, sparse (see _sparse_mixtures)
    phi: Tuple[np.ndarray, np.ndarray]  # shopping mixture (revealed by the ads sequence), sparse
    activity: np.ndarray  # [U] a_u
    save_propensity: np.ndarray  # [U]


def _unit_vectors(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    v = rng.standard_normal((n, dim))
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def _noisy_topic_vectors(rng: np.random.Generator, centroids: np.ndarray, topic: np.ndarray) -> np.ndarray:
    dim = centroids.shape[1]
    v = centroids[topic - 1] + rng.standard_normal((len(topic), dim)) * (ITEM_EMB_NOISE / math.sqrt(dim))
    return (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)


def _sparse_mixtures(rng: np.random.Generator, pop: np.ndarray, n: int) -> Tuple[np.ndarray, np.ndarray]:
    """n mixtures over 1 + min(Poisson(MIXTURE_EXTRA_TOPICS), MIXTURE_SLOTS - 1) topics drawn by
    popularity (repeats merge), with Dirichlet(1, ..., 1) weights. Stored sparse, as [n, slots]
    topic indices (0-based) and weights (0 on unused slots): 36 bytes a user, whatever T is."""
    active = 1 + np.minimum(rng.poisson(MIXTURE_EXTRA_TOPICS, n), MIXTURE_SLOTS - 1)
    topic = rng.choice(len(pop), size=(n, MIXTURE_SLOTS), p=pop).astype(np.int16)
    weight = np.maximum(rng.standard_exponential((n, MIXTURE_SLOTS), dtype=np.float32), 1e-6)
    weight *= np.arange(MIXTURE_SLOTS) < active[:, None]
    weight /= weight.sum(axis=1, keepdims=True)
    return topic, weight


def _dense_mixtures(topic: np.ndarray, weight: np.ndarray, num_topics: int) -> np.ndarray:
    """[R, T] float64 mixtures from the sparse [R, slots] form."""
    R = len(topic)
    flat = (np.arange(R)[:, None] * num_topics + topic).ravel()
    return np.bincount(flat, weights=weight.ravel(), minlength=R * num_topics).reshape(R, num_topics)


def check_synth_config(s: SynthConfig) -> None:
    """What the generator needs beyond config validation; raises ConfigError naming the key."""
    if s.num_topics >= QUERY_VOCAB:
        raise ConfigError(f"synth.num_topics: must be < {QUERY_VOCAB} (query-token scheme), got {s.num_topics}")
    if s.num_items < s.num_topics:
        raise ConfigError(f"synth.num_items: must be >= synth.num_topics ({s.num_topics}), got {s.num_items}")
    f = s.faults
    for key in ("zero_fill_column", "shift_column"):
        col = getattr(f, key)
        if col is not None and col not in DENSE_COLUMNS:
            raise ConfigError(f"synth.faults.{key}: {col!r} is not a dense column {list(DENSE_COLUMNS)}")
    if len(f.zero_fill_window) != 2 or f.zero_fill_window[0] > f.zero_fill_window[1]:
        raise ConfigError(f"synth.faults.zero_fill_window: expected [start, end], got {f.zero_fill_window}")
    if not 0.0 <= f.stale_fraction < 1.0:
        raise ConfigError(f"synth.faults.stale_fraction: must be in [0, 1), got {f.stale_fraction}")
    lh = s.long_history
    if lh.enabled:
        key = "synth.long_history"
        if not 1.0 <= lh.median < lh.p90:
            raise ConfigError(f"{key}.p90: must exceed {key}.median (>= 1), got median {lh.median}, p90 {lh.p90}")
        if lh.max_length < max(s.sequence_length, 1):
            raise ConfigError(
                f"{key}.max_length: must be >= synth.sequence_length ({s.sequence_length}), got {lh.max_length}"
            )
        if lh.min_history < 1:
            raise ConfigError(f"{key}.min_history: must be >= 1, got {lh.min_history}")
        for name in ("burst_share", "candidate_share"):
            if not 0.0 <= getattr(lh, name) < 1.0:
                raise ConfigError(f"{key}.{name}: must be in [0, 1), got {getattr(lh, name)}")
        if not 0.0 < lh.burst_days <= (T0 - LOG_START) / 86400:
            raise ConfigError(f"{key}.burst_days: must be in (0, 60] (before the first request), got {lh.burst_days}")
        bad = [x for x in lh.surfaces if x not in SURFACES]
        if bad:
            raise ConfigError(f"{key}.surfaces: {bad[0]!r} is not a surface {list(SURFACES)}")
        if s.num_topics <= MIXTURE_SLOTS:
            raise ConfigError(
                f"synth.num_topics: must be > {MIXTURE_SLOTS} with {key}.enabled (a dormant topic lies outside "
                f"the user's mixture), got {s.num_topics}"
            )


def make_world(s: SynthConfig) -> World:
    check_synth_config(s)
    rng = _stream(s.seed, 0)
    T, I, U = s.num_topics, s.num_items, s.num_users
    pop = (np.arange(T) + 3.0) ** -TOPIC_ZIPF
    pop /= pop.sum()
    centroids = _unit_vectors(rng, T, ITEM_EMB_DIM)
    # Every topic owns at least one item; the rest follow topic popularity.
    item_topic = np.concatenate([np.arange(1, T + 1), 1 + rng.choice(T, size=I - T, p=pop)])
    rng.shuffle(item_topic)
    adv_shopping = (rng.random(s.num_advertisers) < SHOPPING_ADVERTISER_FRACTION).astype(np.int64)
    adv_effect = rng.normal(0.0, ADVERTISER_SD, s.num_advertisers)
    item_advertiser = rng.integers(0, s.num_advertisers, I)
    quality = rng.normal(0.0, QUALITY_SD, I) + adv_effect[item_advertiser]
    prior = _sigmoid(PRIOR_BASE + quality + rng.normal(0.0, PRIOR_NOISE, I)).astype(np.float32)
    item_emb = _noisy_topic_vectors(rng, centroids, item_topic)
    if s.event_embedding_dim == ITEM_EMB_DIM:
        item_event_emb = item_emb
    else:
        item_event_emb = _noisy_topic_vectors(rng, _unit_vectors(rng, T, s.event_embedding_dim), item_topic)
    order = np.argsort(item_topic, kind="stable")
    topic_start = np.searchsorted(item_topic[order], np.arange(1, T + 2))
    theta = _sparse_mixtures(rng, pop, U)
    phi = _sparse_mixtures(rng, pop, U)
    activity = rng.lognormal(0.0, ACTIVITY_SD, U)
    save_prop = rng.beta(*SAVE_PROPENSITY, U)
    return World(
        T,
        centroids,
        item_topic.astype(np.int64),
        item_advertiser.astype(np.int64),
        adv_shopping[item_advertiser],
        quality,
        prior,
        item_emb,
        item_event_emb,
        order.astype(np.int64),
        topic_start,
        theta,
        phi,
        activity,
        save_prop,
    )


# --------------------------------------------------------------------------------------------
# The timeline: visits and requests in time, every user's behaviour events, every candidate.
# --------------------------------------------------------------------------------------------

SPLITS = ("train", "eval", "calibration")  # output directories
TIME_ORDER = ("train", "calibration", "eval")  # the splits' order on the timeline


def split_sizes(s: SynthConfig) -> Dict[str, int]:
    return {"train": s.train_requests, "calibration": s.calibration_requests, "eval": s.eval_requests}


def split_boundaries(s: SynthConfig) -> Dict[str, Tuple[int, int]]:
    """Each split's time window [start, end) in epoch seconds: the span cut in proportion to the
    splits' sizes (train first, then calibration, then eval), boundaries on whole hours."""
    sizes = split_sizes(s)
    total = sum(sizes.values())
    out, start, done = {}, T0, 0
    for name in TIME_ORDER:
        done += sizes[name]
        end = T0 + 3600 * round(SPAN_S / 3600 * done / total)
        end = max(end, start + 2 * VISIT_MAX_S) if sizes[name] else start
        out[name] = (start, end if done < total else max(end, T0 + SPAN_S))
        start = out[name][1]
    return out


@dataclass
class Events:
    """One behaviour log: events sorted by (user, time), times strictly increasing per user."""

    user: np.ndarray  # [E]
    time: np.ndarray  # [E] epoch seconds
    cols: Dict[str, np.ndarray]  # attribute -> [E]
    key: np.ndarray  # [E] user * 2**34 + (time - LOG_START): sorted, for searchsorted

    def window(self, user: np.ndarray, time: np.ndarray, cap: int) -> Tuple[np.ndarray, np.ndarray]:
        """Per (user, time): lengths and flat indices of that user's events strictly before
        ``time``, newest first, at most ``cap``."""
        base = user.astype(np.int64) << 34
        end = np.searchsorted(self.key, base + (time - LOG_START), side="left")
        first = np.searchsorted(self.key, base, side="left")
        n = np.minimum(end - first, cap)
        return n, np.repeat(end - 1, n) - _segment_positions(n)


@dataclass
class Timeline:
    """All requests of all splits in time order (request_id = index), their candidates and the
    behaviour logs. Visits are latent; a request's ``intent`` is its visit's."""

    boundaries: Dict[str, Tuple[int, int]]
    split_range: Dict[str, Tuple[int, int]]  # split -> [first, last) request ids
    time: np.ndarray  # [N]
    user: np.ndarray
    surface: np.ndarray
    intent: np.ndarray
    query_topic: np.ndarray  # 0 unless search
    context_topic: np.ndarray  # 0 unless related_pins
    user_activity: np.ndarray  # float32
    query_tokens: "Group"
    cand_offsets: np.ndarray  # [N + 1]
    cand_item: np.ndarray  # [rows]
    pins: Events
    ads: Events
    queries: Events
    # synth.long_history only: per user its dormant topic (0: none), per pins event whether it is
    # one of the dormant burst's.
    dormant: Optional[np.ndarray] = None
    pins_burst: Optional[np.ndarray] = None

    @property
    def num_requests(self) -> int:
        return len(self.time)


def _tie_free(user: np.ndarray, time: np.ndarray, cols: Dict[str, np.ndarray]) -> Events:
    """Sort by (user, time) (stable) and move an event tying with the one before it to one second
    after it: event times strictly increase per user."""
    order = np.argsort((user.astype(np.int64) << 34) + (time - LOG_START), kind="stable")
    user, time = user[order], time[order].astype(np.int64)
    i = np.arange(len(time), dtype=np.int64)
    # t'_i = max(t_i, t'_{i-1} + 1) within a user: a running max of t_i - i, reset per user by
    # the user offset (users sorted ascending, so a user's values exceed all earlier users').
    off = user.astype(np.int64) << 40
    time = np.maximum.accumulate(time - LOG_START - i + off) - off + i + LOG_START
    key = (user.astype(np.int64) << 34) + (time - LOG_START)
    return Events(user.astype(np.int64), time, {k: v[order] for k, v in cols.items()}, key)


def _background(
    rng: np.random.Generator, world: World, users: np.ndarray, per_30_days: float
) -> Tuple[np.ndarray, np.ndarray]:
    """Each user's background events: Poisson(per_30_days * rel. activity * log days / 30) events
    at uniform times over the whole log."""
    rel = world.activity[users] / math.exp(ACTIVITY_SD**2 / 2)  # E[a_u] = 1
    n = rng.poisson(per_30_days * rel * (LOG_END - LOG_START) / (30 * 86400))
    return np.repeat(users, n), rng.integers(LOG_START, LOG_END, int(n.sum()))


def history_lengths(lh: LongHistoryConfig, z: np.ndarray) -> np.ndarray:
    """The long-history length distribution at standard-normal quantiles ``z``: LogNormal with
    median ``lh.median`` and 90th percentile ``lh.p90``, rounded, clipped to [1, lh.max_length]."""
    sigma = math.log(lh.p90 / lh.median) / Z_P90
    return np.clip(np.rint(lh.median * np.exp(sigma * z)), 1, lh.max_length).astype(np.int64)


def pins_totals(world: World, users: np.ndarray, lh: LongHistoryConfig) -> np.ndarray:
    """Each user's total pins events over the whole log with long histories (``history_lengths``).
    The normal quantile is the user's activity's (a_u ~ LogNormal(0, ACTIVITY_SD)), so more active
    users have longer histories, as without long histories."""
    return history_lengths(lh, np.log(world.activity[users]) / ACTIVITY_SD)


def _dormant_topics(rng: np.random.Generator, world: World, users: np.ndarray) -> np.ndarray:
    """One topic in [1, T] per user, uniform over the topics outside the user's mixture θ_u."""
    topic, weight = world.theta
    t = np.where(weight[users] > 0, topic[users].astype(np.int64), world.num_topics)  # unused: T
    t.sort(axis=1)
    t[:, 1:][t[:, 1:] == t[:, :-1]] = world.num_topics  # repeats merge
    t.sort(axis=1)
    outside = world.num_topics - (t < world.num_topics).sum(axis=1)
    d = np.floor(rng.random(len(users)) * outside).astype(np.int64)
    for j in range(t.shape[1]):  # the d-th topic not in the (ascending) mixture topics
        d += d >= t[:, j]
    return d + 1


def _long_background(rng: np.random.Generator, world: World, s: SynthConfig, present: np.ndarray, v_user):
    """Background and burst pins events with long histories: a user's pins_totals() less its
    sessions' events, of them a burst on its dormant topic in the log's first burst_days days
    (users with at least min_history events), the rest uniform over the log. Returns
    (bg_user, bg_time, burst_user, burst_time, dormant [num_users], 0 where none)."""
    lh = s.long_history
    total = pins_totals(world, present, lh)
    sessions = SESSION_EVENTS * np.bincount(v_user, minlength=s.num_users)[present]
    has = total >= lh.min_history
    dormant = np.zeros(s.num_users, np.int64)
    dormant[present[has]] = _dormant_topics(rng, world, present[has])
    room = np.maximum(total - sessions, 0)
    burst = np.minimum(np.where(has, np.rint(lh.burst_share * total), 0).astype(np.int64), room)
    n_bg = room - burst
    bg_time = rng.integers(LOG_START, LOG_END, int(n_bg.sum()))
    burst_time = rng.integers(LOG_START, LOG_START + int(lh.burst_days * 86400), int(burst.sum()))
    return np.repeat(present, n_bg), bg_time, np.repeat(present, burst), burst_time, dormant


def _mixture_topics(rng, world: World, mix, users: np.ndarray, uniform_prob: float) -> np.ndarray:
    """One topic per entry of ``users``: ~ the user's mixture, or uniform w.p. uniform_prob."""
    uniq, inv = np.unique(users, return_inverse=True)
    dense = _dense_mixtures(mix[0][uniq], mix[1][uniq], world.num_topics)
    t = _sample_topics(rng, dense, inv)
    return np.where(rng.random(len(users)) < uniform_prob, rng.integers(1, world.num_topics + 1, len(users)), t)


def make_timeline(world: World, s: SynthConfig) -> Timeline:
    """Visits and requests of every split, the users' behaviour logs and every request's
    candidates: everything but labels (sample_block). Deterministic for the seed and sizes."""
    T, K = world.num_topics, query_tokens_per_topic(world.num_topics)
    bounds = split_boundaries(s)
    sizes = split_sizes(s)

    # ---- visits and their requests, split by split -------------------------------------
    v_user, v_time, r_visit, r_time = [], [], [], []
    n_visits = 0
    for index, name in enumerate(TIME_ORDER):
        n = sizes[name]
        if not n:
            continue
        rng = _stream(s.seed, 1, 0, index)
        per_visit = 1 + rng.poisson(VISIT_EXTRA_REQUESTS, n)
        m = int(np.searchsorted(np.cumsum(per_visit), n)) + 1  # visits needed for n requests
        per_visit = per_visit[:m]
        per_visit[-1] -= int(per_visit.sum()) - n
        a, b = bounds[name]
        start = rng.integers(a, b - VISIT_MAX_S, m)
        v_user.append(rng.integers(0, s.num_users, m))
        v_time.append(start)
        gaps = 1 + np.floor(rng.exponential(REQUEST_GAP_S, n)).astype(np.int64)
        gaps[np.cumsum(per_visit) - per_visit] = 0  # a visit's first request opens it
        within = np.cumsum(gaps) - np.repeat(np.cumsum(gaps)[np.cumsum(per_visit) - per_visit], per_visit)
        r_visit.append(n_visits + np.repeat(np.arange(m), per_visit))
        r_time.append(np.repeat(start, per_visit) + np.minimum(within, VISIT_MAX_S - 1))
        n_visits += m
    v_user, v_time = np.concatenate(v_user), np.concatenate(v_time)
    r_visit, r_time = np.concatenate(r_visit), np.concatenate(r_time)
    order = np.argsort(r_time, kind="stable")  # request ids in time order
    r_visit, r_time = r_visit[order], r_time[order]
    N = len(r_time)
    split_range, first = {}, 0
    for name in TIME_ORDER:
        split_range[name] = (first, first + sizes[name])
        first += sizes[name]

    # ---- per visit: intent; per request: surface, anchor, query, activity ---------------
    rng = _stream(s.seed, 1, 1)
    user = v_user[r_visit]
    v_intent = np.where(
        rng.random(n_visits) < INTENT_FROM_MIXTURE,
        _mixture_topics(rng, world, world.theta, v_user, 0.0),
        rng.integers(1, T + 1, n_visits),
    )
    intent = v_intent[r_visit]
    surface = rng.choice(len(SURFACES), size=N, p=SURFACE_PROBS)
    anchor = _mixture_topics(rng, world, world.theta, user, 1.0 - ANCHOR_FROM_MIXTURE)
    query_topic = np.where(surface == SEARCH, anchor, 0)
    context_topic = np.where(surface == RELATED, anchor, 0)
    n_qt = np.where(surface == SEARCH, rng.integers(1, 4, N), 0)
    qt_req = np.repeat(np.arange(N), n_qt)
    qt = 1 + (query_topic[qt_req] - 1) * K + rng.integers(0, K, len(qt_req))
    query_tokens = Group(n_qt, {"query_tokens": qt.astype(np.int64)})
    user_activity = (5.0 * world.activity[user] * np.exp(rng.normal(0.0, 0.15, N))).astype(np.float32)
    n_cand = 1 + rng.poisson(max(s.candidates_per_request - 1.0, 0.0), N).astype(np.int64)

    # ---- behaviour logs -------------------------------------------------------------------
    L = s.sequence_length
    present = np.unique(v_user)
    rng = _stream(s.seed, 2, 0)
    lh = s.long_history
    if lh.enabled:
        bg_user, bg_time, burst_user, burst_time, dormant = _long_background(rng, world, s, present, v_user)
    else:
        bg_user, bg_time = _background(rng, world, present, PINS_PER_30_DAYS * L)
    bg_topic = _mixture_topics(rng, world, world.theta, bg_user, OLD_UNIFORM_PROB)
    # A visit opens with a session of SESSION_EVENTS pins events, mostly on its intent.
    ss_visit = np.repeat(np.arange(n_visits), SESSION_EVENTS)
    ss_user = v_user[ss_visit]
    gaps = 1 + np.floor(rng.exponential(SESSION_GAP_S, (n_visits, SESSION_EVENTS))).astype(np.int64)
    ss_time = (v_time[:, None] - np.cumsum(gaps, axis=1)).ravel()
    ss_topic = np.where(
        rng.random(len(ss_visit)) < SESSION_INTENT_PROB,
        v_intent[ss_visit],
        _mixture_topics(rng, world, world.theta, ss_user, 0.0),
    )
    p_user = np.concatenate([bg_user, ss_user])
    p_topic = np.concatenate([bg_topic, ss_topic])
    p_time = np.concatenate([bg_time, ss_time])
    if lh.enabled:
        p_user = np.concatenate([p_user, burst_user])
        p_topic = np.concatenate([p_topic, dormant[burst_user]])
        p_time = np.concatenate([p_time, burst_time])
    p_item = _items_of_topics(rng, world, p_topic)
    p_cols = {
        "item": p_item,
        "action": _actions(rng, world.save_propensity[p_user], PIN_ACTION_PROBS),
        "topic": p_topic.astype(np.int64),
    }
    if lh.enabled:
        p_cols["burst"] = np.arange(len(p_user)) >= len(p_user) - len(burst_user)
    pins = _tie_free(p_user, p_time, p_cols)
    pins_burst = pins.cols.pop("burst") if lh.enabled else None

    rng = _stream(s.seed, 2, 1)
    a_user, a_time = _background(rng, world, present, ADS_PER_30_DAYS * L)
    a_topic = _mixture_topics(rng, world, world.phi, a_user, ADS_UNIFORM_PROB)
    ads = _tie_free(
        a_user,
        a_time,
        {
            "item": _items_of_topics(rng, world, a_topic),
            "action": _actions(rng, world.save_propensity[a_user], AD_ACTION_PROBS),
            "topic": a_topic.astype(np.int64),
        },
    )

    # Search queries: background ones, and each search request's own query (its first token) at
    # the request's time: later requests see it, the request itself does not.
    rng = _stream(s.seed, 2, 2)
    q_user, q_time = _background(rng, world, present, QUERIES_PER_30_DAYS * L)
    q_topic = _mixture_topics(rng, world, world.theta, q_user, QUERIES_UNIFORM_PROB)
    q_token = 1 + (q_topic - 1) * K + rng.integers(0, K, len(q_user))
    searched = np.flatnonzero(n_qt > 0)
    queries = _tie_free(
        np.concatenate([q_user, user[searched]]),
        np.concatenate([q_time, r_time[searched]]),
        {
            "token": np.concatenate([q_token, qt[np.cumsum(n_qt)[searched] - n_qt[searched]]]).astype(np.int64),
            "topic": np.concatenate([q_topic, query_topic[searched]]).astype(np.int64),
        },
    )

    # ---- candidates, block by block ----------------------------------------------------------
    items = []
    for block in range(-(-N // BLOCK_REQUESTS)):
        lo, hi = block * BLOCK_REQUESTS, min((block + 1) * BLOCK_REQUESTS, N)
        items.append(
            _candidates(
                _stream(s.seed, 1, 2, block),
                world,
                user[lo:hi],
                surface[lo:hi],
                intent[lo:hi],
                anchor[lo:hi],
                n_cand[lo:hi],
                (dormant, lh) if lh.enabled else None,
            )
        )
    cand_item = np.concatenate([it for it, _ in items])
    n_cand = np.concatenate([n for _, n in items])
    return Timeline(
        bounds,
        split_range,
        r_time,
        user,
        surface,
        intent,
        query_topic,
        context_topic,
        user_activity,
        query_tokens,
        np.concatenate([[0], np.cumsum(n_cand)]),
        cand_item,
        pins,
        ads,
        queries,
        dormant if lh.enabled else None,
        pins_burst,
    )


def touched_surfaces(lh: LongHistoryConfig) -> np.ndarray:
    """[len(SURFACES)] bool: the surfaces the dormant interest shows on."""
    return np.array([name in lh.surfaces for name in SURFACES])


def _candidates(
    rng, world: World, user, surface, intent, anchor, n_cand, dormant=None
) -> Tuple[np.ndarray, np.ndarray]:
    """Candidate items of these requests (topic by surface-specific sources); an item drawn twice
    for one request is shown once. Returns (items, candidates per request). ``dormant``: (topic per
    user, LongHistoryConfig) with long histories: a candidate of a user with a dormant topic is of
    that topic with probability candidate_share on the touched surfaces."""
    R, T = len(user), world.num_topics
    r = np.repeat(np.arange(R), n_cand)
    N = len(r)
    theta = _dense_mixtures(world.theta[0][user], world.theta[1][user], T)
    phi = _dense_mixtures(world.phi[0][user], world.phi[1][user], T)
    src = (rng.random(N)[:, None] >= np.cumsum(CANDIDATE_SOURCES[surface[r]], axis=1)).sum(axis=1)
    options = np.stack(
        [_sample_topics(rng, theta, r), _sample_topics(rng, phi, r), intent[r], rng.integers(1, T + 1, N), anchor[r]]
    )
    topic = options[np.minimum(src, 4), np.arange(N)]
    if dormant is not None:
        d_topic, lh = dormant
        d = d_topic[user[r]]
        pick = touched_surfaces(lh)[surface[r]] & (d > 0) & (rng.random(N) < lh.candidate_share)
        topic = np.where(pick, d, topic)
    item = _items_of_topics(rng, world, topic)
    key = r * world.item_topic.size + item
    order = np.argsort(key, kind="stable")
    repeat = np.zeros(N, bool)
    repeat[order[1:]] = key[order[1:]] == key[order[:-1]]
    return item[~repeat], np.bincount(r[~repeat], minlength=R)


# --------------------------------------------------------------------------------------------
# A split's plan (files, row groups) and its request blocks.
# --------------------------------------------------------------------------------------------


@dataclass
class SplitPlan:
    name: str  # "train" / "eval" / "calibration"
    synth: SynthConfig
    first_request: int  # request id of the split's first request
    num_requests: int
    row_offsets: np.ndarray  # [num_requests + 1], from 0


def plan_split(s: SynthConfig, timeline: Timeline, split: str) -> SplitPlan:
    a, b = timeline.split_range[split]
    off = timeline.cand_offsets[a : b + 1]
    return SplitPlan(split, s, a, b - a, off - off[0])


@dataclass
class Group:
    """A ragged per-request sequence group: flat event arrays + per-request lengths."""

    lengths: np.ndarray  # [R]
    cols: Dict[str, np.ndarray]  # column -> [E] or [E, D] (newest first within each request)


@dataclass
class Block:
    lo: int  # first request id
    hi: int
    # per request (latent ones are never written)
    request_id: np.ndarray
    user: np.ndarray
    surface: np.ndarray  # index into SURFACES
    timestamp: np.ndarray
    time_fraction: np.ndarray  # position of the request time in the whole span, [0, 1)
    intent: np.ndarray  # latent short-term intent topic (its visit's)
    query_topic: np.ndarray  # latent (0 unless search)
    context_topic: np.ndarray  # 0 unless related_pins
    user_activity: np.ndarray
    num_candidates: np.ndarray
    query_tokens: Group
    pins: Group
    ads: Group
    queries: Group
    # per row (candidate): the written columns, and the latent terms of the logits (never written)
    rows: Dict[str, np.ndarray]
    latent: Dict[str, np.ndarray]

    @property
    def num_rows(self) -> int:
        return len(self.rows["item_id"])


def _segment_positions(lengths: np.ndarray) -> np.ndarray:
    """0, 1, ... within each segment of a concatenation of segments with these lengths."""
    total = int(lengths.sum())
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.arange(total, dtype=np.int64) - starts


def _sample_topics(rng: np.random.Generator, mix: np.ndarray, which: np.ndarray) -> np.ndarray:
    """One topic in [1, T] per entry of ``which`` (a row of ``mix``), ~ that row's mixture."""
    R, T = mix.shape
    cum = np.cumsum(mix, axis=1)
    cum /= cum[:, -1:]
    cum[:, -1] = 1.0
    # Rows offset by their index make one increasing array: one searchsorted for all draws.
    flat = (cum + np.arange(R)[:, None]).ravel()
    x = which + rng.random(len(which))
    idx = np.searchsorted(flat, x, side="right") - which * T
    return np.minimum(idx, T - 1) + 1


def _items_of_topics(rng: np.random.Generator, world: World, topics: np.ndarray) -> np.ndarray:
    start = world.topic_start[topics - 1]
    count = world.topic_start[topics] - start
    pick = np.floor(count * rng.random(len(topics)) ** ITEM_POPULARITY_POWER).astype(np.int64)
    return world.items_by_topic[start + np.minimum(pick, count - 1)]


def _actions(rng: np.random.Generator, save_prob: np.ndarray, probs: np.ndarray) -> np.ndarray:
    other = rng.choice(len(probs), size=len(save_prob), p=probs / probs.sum())
    return np.where(rng.random(len(save_prob)) < save_prob, SAVE_ACTION, other).astype(np.int64)


def sequence_caps(s: SynthConfig) -> Dict[str, int]:
    """Most events a request's sequence holds, per group: L for pins (long_history.max_length with
    long histories), L / 2 for ads and queries."""
    L = s.sequence_length
    pins = s.long_history.max_length if s.long_history.enabled else L
    return {"pins": pins, "ads": L // 2, "queries": L // 2}


GROUP_COLUMNS = {  # group -> (contract timestamp column, {contract column: log attribute})
    "pins": ("seq_pin_ts", {"seq_pin_item": "item", "seq_pin_action": "action", "seq_pin_topic": "topic"}),
    "ads": ("seq_ad_ts", {"seq_ad_item": "item", "seq_ad_action": "action", "seq_ad_topic": "topic"}),
    "queries": ("seq_query_ts", {"seq_query_token": "token", "seq_query_topic": "topic"}),
}


def _history(world: World, log: Events, group: str, user, time, cap: int) -> Tuple[Group, np.ndarray]:
    """The requests' sequences of one group (their users' events before them) and the flat event
    indices into the log."""
    n, idx = log.window(user, time, cap)
    ts_col, attrs = GROUP_COLUMNS[group]
    cols = {ts_col: log.time[idx]}
    cols.update({c: log.cols[a][idx] for c, a in attrs.items()})
    if group == "pins":
        cols["seq_pin_emb"] = world.item_event_emb[cols["seq_pin_item"]]
    return Group(n, cols), idx


def sample_block(world: World, tl: Timeline, s: SynthConfig, block: int) -> Block:
    """Requests [block * BLOCK_REQUESTS, ...) of the timeline with their sequences, rows and
    labels; labels from the block's stream."""
    rng = _stream(s.seed, 3, block)
    lo = block * BLOCK_REQUESTS
    hi = min(lo + BLOCK_REQUESTS, tl.num_requests)
    R, T = hi - lo, world.num_topics
    reqs = np.arange(R)
    user, ts, surface = tl.user[lo:hi], tl.time[lo:hi], tl.surface[lo:hi]
    intent, query_topic, context_topic = tl.intent[lo:hi], tl.query_topic[lo:hi], tl.context_topic[lo:hi]
    frac = (ts - T0) / SPAN_S
    caps = sequence_caps(s)
    pins, pin_idx = _history(world, tl.pins, "pins", user, ts, caps["pins"])
    ads, _ = _history(world, tl.ads, "ads", user, ts, caps["ads"])
    queries, _ = _history(world, tl.queries, "queries", user, ts, caps["queries"])
    qt = tl.query_tokens
    qt_off = np.concatenate([[0], np.cumsum(qt.lengths)])
    query_tokens = Group(qt.lengths[lo:hi], {"query_tokens": qt.cols["query_tokens"][qt_off[lo] : qt_off[hi]]})

    # ---- candidates and the planted probabilities -------------------------------------------
    c0, c1 = tl.cand_offsets[lo], tl.cand_offsets[hi]
    n_cand = np.diff(tl.cand_offsets[lo : hi + 1])
    cand = tl.cand_item[c0:c1]
    r = np.repeat(reqs, n_cand)
    N = len(r)
    surf = surface[r]
    k = world.item_topic[cand]
    shopping = world.item_ad_type[cand]
    theta = _dense_mixtures(world.theta[0][user], world.theta[1][user], T)
    phi = _dense_mixtures(world.phi[0][user], world.phi[1][user], T)
    w = np.where(shopping == 1, phi[r, k - 1], theta[r, k - 1]).astype(np.float64)
    is_intent = (k == intent[r]).astype(np.float64)
    interest = INTEREST_SCALE[surf] * (LONG_TERM_COEF * w + INTENT_COEF * is_intent)
    query_match = ((surf == SEARCH) & (k == query_topic[r])).astype(np.float64)
    context_match = ((surf == RELATED) & (k == context_topic[r])).astype(np.float64)
    logit_click = (
        CLICK_OFFSET[surf]
        + SHOPPING_OFFSET * shopping
        + interest
        + QUERY_COEF * query_match
        + CONTEXT_COEF * context_match
        + world.item_quality[cand]
    )
    lh = s.long_history
    dormant_match = np.zeros(N)
    if lh.enabled:
        dormant_match = (touched_surfaces(lh)[surf] & (k == tl.dormant[user][r])).astype(np.float64)
        logit_click = logit_click + lh.dormant_coef * dormant_match
    p_click = _sigmoid(logit_click)
    p_good_given_click = _sigmoid(
        GOOD_OFFSET[surf]
        + GOOD_QUALITY_COEF * world.item_quality[cand]
        + GOOD_INTENT_COEF * is_intent
        + GOOD_SHOPPING_OFFSET * shopping
    )
    # Saves on the candidate's topic among the pins events the request sees.
    ev = np.repeat(reqs, pins.lengths)
    saves = pins.cols["seq_pin_action"] == SAVE_ACTION
    if lh.enabled:  # the save term stays short-range: the newest L events, as without long histories
        saves = saves & (_segment_positions(pins.lengths) < s.sequence_length)
    saves_on_topic = np.bincount(
        ev * (T + 1) + pins.cols["seq_pin_topic"], weights=saves, minlength=R * (T + 1)
    ).reshape(R, T + 1)[r, k]
    logit_save = (
        SAVE_OFFSET[surf]
        + SAVE_INTEREST_COEF * interest
        + SAVE_HISTORY_COEF * np.log1p(saves_on_topic)
        + SAVE_QUALITY_COEF * world.item_quality[cand]
        + SAVE_SHOPPING_OFFSET * shopping
    )
    p_save_click, p_save_noclick = _sigmoid(logit_save + SAVE_CLICK_BOOST), _sigmoid(logit_save)
    click = rng.random(N) < p_click
    good = click & (rng.random(N) < p_good_given_click)
    save = rng.random(N) < np.where(click, p_save_click, p_save_noclick)

    rows = {
        "item_id": cand,
        "advertiser_id": world.item_advertiser[cand],
        "ad_type": shopping,
        "item_topic": k,
        "user_activity": tl.user_activity[lo:hi][r],
        "item_ctr_prior": world.item_prior[cand],
        "item_embedding": world.item_emb[cand],
        "click": click.astype(np.int64),
        "good_click": good.astype(np.int64),
        "save": save.astype(np.int64),
        "true_p_click": p_click,
        "true_p_good_click": p_click * p_good_given_click,
        "true_p_save": p_click * p_save_click + (1.0 - p_click) * p_save_noclick,
    }
    latent = {
        "long_term_weight": w,
        "is_intent": is_intent,
        "query_match": query_match,
        "context_match": context_match,
        "quality": world.item_quality[cand],
        "saves_on_topic": saves_on_topic,
        "dormant_match": dormant_match,  # 1[k = d_u] on a touched surface (0 without long histories)
        "logit_click": logit_click,
    }
    _apply_faults(rows, frac[r], s, _stream(s.seed, 4, block))
    return Block(
        lo,
        hi,
        lo + reqs,
        user,
        surface,
        ts,
        frac,
        intent,
        query_topic,
        context_topic,
        tl.user_activity[lo:hi],
        n_cand,
        query_tokens,
        pins,
        ads,
        queries,
        rows,
        latent,
    )


def _apply_faults(
    rows: Dict[str, np.ndarray], time_fraction: np.ndarray, s: SynthConfig, rng: np.random.Generator
) -> None:
    """Feature faults: they change dense values only, never the true probabilities."""
    f = s.faults
    if f.stale_fraction > 0:
        n = len(time_fraction)
        stale = np.flatnonzero(rng.random(n) < f.stale_fraction)
        stale = stale[stale > 0]
        src = np.floor(rng.random(len(stale)) * stale).astype(np.int64)  # an earlier row
        for c in DENSE_COLUMNS:
            rows[c] = rows[c].copy()
            rows[c][stale] = rows[c][src]
    if f.zero_fill_column is not None:
        a, b = f.zero_fill_window
        hit = (time_fraction >= a) & (time_fraction < b)
        rows[f.zero_fill_column] = rows[f.zero_fill_column].copy()
        rows[f.zero_fill_column][hit] = 0.0
    if f.shift_column is not None:
        hit = time_fraction >= f.shift_after
        c = f.shift_column
        rows[c] = rows[c].copy()
        rows[c][hit] = (rows[c][hit] * f.shift_scale + f.shift_offset).astype(np.float32)


def faults_enabled(s: SynthConfig) -> bool:
    f = s.faults
    return f.stale_fraction > 0 or f.zero_fill_column is not None or f.shift_column is not None


# --------------------------------------------------------------------------------------------
# Arrow / Parquet.
# --------------------------------------------------------------------------------------------

_I64 = pa.int64()
_LI64 = pa.list_(pa.int64())


def schema(event_embedding_dim: int) -> pa.Schema:
    return pa.schema(
        [
            ("request_id", _I64),
            ("user_id", _I64),
            ("item_id", _I64),
            ("advertiser_id", _I64),
            ("ad_type", _I64),
            ("surface", pa.string()),
            ("timestamp", _I64),
            ("item_topic", _I64),
            ("context_topic", _I64),
            ("query_tokens", _LI64),
            ("user_activity", pa.float32()),
            ("item_ctr_prior", pa.float32()),
            ("item_embedding", pa.list_(pa.float32(), ITEM_EMB_DIM)),
            ("seq_pin_item", _LI64),
            ("seq_pin_ts", _LI64),
            ("seq_pin_action", _LI64),
            ("seq_pin_topic", _LI64),
            ("seq_pin_emb", pa.list_(pa.list_(pa.float32(), event_embedding_dim))),
            ("seq_ad_item", _LI64),
            ("seq_ad_ts", _LI64),
            ("seq_ad_action", _LI64),
            ("seq_ad_topic", _LI64),
            ("seq_query_token", _LI64),
            ("seq_query_ts", _LI64),
            ("seq_query_topic", _LI64),
            ("click", _I64),
            ("good_click", _I64),
            ("save", _I64),
            ("true_p_click", pa.float64()),
            ("true_p_good_click", pa.float64()),
            ("true_p_save", pa.float64()),
        ]
    )


def _per_row_lists(group: Group, n_cand: np.ndarray) -> Tuple[pa.Array, pa.Array]:
    """Row offsets and the gather index that repeats each request's sequence on its rows."""
    row_len = np.repeat(group.lengths, n_cand)
    row_off = np.zeros(len(row_len) + 1, dtype=np.int32)
    np.cumsum(row_len, out=row_off[1:])
    req_start = np.cumsum(group.lengths) - group.lengths
    shift = np.repeat(req_start, n_cand) - row_off[:-1]
    idx = np.repeat(shift, row_len) + np.arange(row_off[-1], dtype=np.int64)
    return pa.array(row_off), pa.array(idx)


def _arrow(v: np.ndarray) -> pa.Array:
    return pa.FixedSizeListArray.from_arrays(pa.array(v.reshape(-1)), v.shape[1]) if v.ndim == 2 else pa.array(v)


# Stored once per request: every column the generator draws per request (the data/layout.py metadata
# records them, so a config marking other features user-side reads the files as well).
REQUEST_LEVEL = ("request_id", "user_id", "surface", "timestamp", "context_topic", "query_tokens") + tuple(
    name
    for name in schema(1).names
    if name.startswith("seq_")  # every sequence group column
)


def request_table(b: Block, sch: pa.Schema) -> pa.Table:
    """A block's requests in the per-request layout (data/layout.py): the request-level columns once,
    every candidate column a list of one value per candidate."""
    candidates = pa.array(np.concatenate([[0], np.cumsum(b.num_candidates)]).astype(np.int32))
    cols: Dict[str, pa.Array] = {
        "request_id": pa.array(b.request_id),
        "user_id": pa.array(b.user),
        "surface": pa.DictionaryArray.from_arrays(
            pa.array(b.surface.astype(np.int32)), pa.array(SURFACES)
        ).dictionary_decode(),
        "timestamp": pa.array(b.timestamp),
        "context_topic": pa.array(b.context_topic),
    }
    cols.update({name: pa.ListArray.from_arrays(candidates, _arrow(v)) for name, v in b.rows.items()})
    for group in (b.query_tokens, b.pins, b.ads, b.queries):
        offsets = pa.array(np.concatenate([[0], np.cumsum(group.lengths)]).astype(np.int32))
        for name, v in group.cols.items():
            cols[name] = pa.ListArray.from_arrays(offsets, _arrow(v))
    return pa.Table.from_arrays([cols[f.name] for f in sch], schema=sch)


# --------------------------------------------------------------------------------------------
# Oracle metrics.
# --------------------------------------------------------------------------------------------


def oracle_metrics(surface: np.ndarray, labels: Dict[str, np.ndarray], probs: Dict[str, np.ndarray]) -> Dict[str, dict]:
    """Per surface (and "all") x task: rows, label rate, mean true p, oracle AUC and NE."""
    out = {}
    for si, name in [(None, "all")] + list(enumerate(SURFACES)):
        m = np.ones(len(surface), bool) if si is None else surface == si
        entry: dict = {"rows": int(m.sum())}
        for t in TASKS:
            y, p = labels[t][m], probs[t][m]
            entry[t] = {
                "rate": float(y.mean()) if len(y) else float("nan"),
                "mean_true_p": float(p.mean()) if len(p) else float("nan"),
                "oracle_auc": metrics.auc(p, y),
                "oracle_ne": metrics.normalized_entropy(p, y),
            }
        out[name] = entry
    return out


# --------------------------------------------------------------------------------------------
# Writing a split.
# --------------------------------------------------------------------------------------------


def split_files(plan: SplitPlan) -> List[List[Tuple[int, int]]]:
    """Per file, its row groups as request-id ranges [a, b): whole requests, <= row_group_size rows
    each (a single request larger than that is a row group of its own)."""
    s = plan.synth
    if plan.name == "train":
        n_files = s.num_files
    else:  # eval, calibration: in proportion to its size, at least 2
        n_files = min(max(2, math.ceil(s.num_files * plan.num_requests / s.train_requests)), max(s.num_files, 2))
    n_files = max(1, min(n_files, plan.num_requests))
    bounds = (np.arange(n_files + 1) * plan.num_requests) // n_files
    off = plan.row_offsets
    files = []
    for f in range(n_files):
        a, end = int(bounds[f]), int(bounds[f + 1])
        groups = []
        while a < end:
            b = int(np.searchsorted(off, off[a] + s.row_group_size, side="right")) - 1
            b = min(max(b, a + 1), end)
            groups.append((plan.first_request + a, plan.first_request + b))
            a = b
        files.append(groups)
    return files


def _slice_group(g: Group, a: int, b: int) -> Group:
    start = int(g.lengths[:a].sum())
    stop = start + int(g.lengths[a:b].sum())
    return Group(g.lengths[a:b], {k: v[start:stop] for k, v in g.cols.items()})


def slice_block(blk: Block, a: int, b: int) -> Block:
    """Requests [a, b) (ids within the block's range), with their rows and events."""
    x, y = a - blk.lo, b - blk.lo
    r0 = int(blk.num_candidates[:x].sum())
    r1 = r0 + int(blk.num_candidates[x:y].sum())
    per_req = {
        f: getattr(blk, f)[x:y]
        for f in (
            "request_id",
            "user",
            "surface",
            "timestamp",
            "time_fraction",
            "intent",
            "query_topic",
            "context_topic",
            "user_activity",
            "num_candidates",
        )
    }
    groups = {f: _slice_group(getattr(blk, f), x, y) for f in ("query_tokens", "pins", "ads", "queries")}
    return Block(
        a,
        b,
        **per_req,
        **groups,
        rows={k: v[r0:r1] for k, v in blk.rows.items()},
        latent={k: v[r0:r1] for k, v in blk.latent.items()},
    )


# zstd finds the sequences repeated on the rows of a request (adjacent in a page); no dictionaries
# or statistics: they cost write time and the loader does not use them.
PARQUET_OPTIONS = dict(compression="lz4", use_dictionary=False, write_statistics=False)


def contract_table(b: Block, sch: pa.Schema) -> pa.Table:
    """The contract rows of a block in the storage layout the generator writes (per request)."""
    return request_table(b, sch)


def contract_schema(s: SynthConfig) -> pa.Schema:
    return layout.per_request_schema(schema(s.event_embedding_dim), None, REQUEST_LEVEL)


def _write_file(world: World, tl: Timeline, plan: SplitPlan, groups, path: Path, raw_path: Optional[Path]) -> dict:
    """Write one file's row groups (and, with raw_path, the same impressions as raw log rows);
    generates the blocks it overlaps (deterministic per block)."""
    s = plan.synth
    sch = contract_schema(s)
    first, last = groups[0][0], groups[-1][1]
    surf, labels, probs = [], {t: [] for t in TASKS}, {t: [] for t in TASKS}
    blind: List[np.ndarray] = []  # long histories: the click logit without the dormant term
    blk: Optional[Block] = None
    raw_writer = pq.ParquetWriter(raw_path, IMPRESSION_SCHEMA, **PARQUET_OPTIONS) if raw_path else None
    try:
        with pq.ParquetWriter(path, sch, **PARQUET_OPTIONS) as writer:
            for a, b in groups:
                pieces = []
                while a < b:
                    if blk is None or blk.hi <= a:
                        full = sample_block(world, tl, s, a // BLOCK_REQUESTS)
                        blk = slice_block(full, max(full.lo, first), min(full.hi, last))
                        surf.append(np.repeat(blk.surface, blk.num_candidates))
                        for t in TASKS:
                            labels[t].append(blk.rows[t].astype(np.int8))
                            probs[t].append(blk.rows[f"true_p_{t}"])
                        if s.long_history.enabled:
                            lat = blk.latent
                            blind.append(lat["logit_click"] - s.long_history.dormant_coef * lat["dormant_match"])
                    y = min(b, blk.hi)
                    part = slice_block(blk, a, y)
                    pieces.append(contract_table(part, sch))
                    if raw_writer is not None:
                        raw_writer.write_table(impression_table(part))
                    a = y
                rg = pa.concat_tables(pieces) if len(pieces) > 1 else pieces[0]
                writer.write_table(rg, row_group_size=max(rg.num_rows, 1))
    finally:
        if raw_writer is not None:
            raw_writer.close()
    return {
        "path": str(path),
        "bytes": path.stat().st_size,
        "row_groups": len(groups),
        "rows": int(tl.cand_offsets[last] - tl.cand_offsets[first]),
        "requests": last - first,
        "_surface": np.concatenate(surf),
        "_labels": {t: np.concatenate(v) for t, v in labels.items()},
        "_probs": {t: np.concatenate(v) for t, v in probs.items()},
        "_blind": np.concatenate(blind) if blind else None,
    }


def _iso(t: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))


def _history_stats(tl: Timeline, s: SynthConfig, a: int, b: int) -> dict:
    """Mean sequence length per group, and the pins sequences' length quantiles, for the split's
    requests [a, b)."""
    out = {}
    for group, cap in sequence_caps(s).items():
        n, _ = getattr(tl, group).window(tl.user[a:b], tl.time[a:b], cap)
        out[f"mean_{group}_length"] = round(float(n.mean()), 2) if len(n) else 0.0
        if group == "pins" and len(n):
            out["pins_length"] = {
                "median": float(np.median(n)),
                "p90": float(np.quantile(n, 0.9)),
                "max": int(n.max()),
                "mean": round(float(n.mean()), 2),
            }
    return out


def burst_in_newest(tl: Timeline, user: np.ndarray, time: np.ndarray, window: int) -> np.ndarray:
    """Per request (long histories): whether its user's newest ``window`` pins events before it
    hold an event of the dormant burst."""
    n, idx = tl.pins.window(user, time, window)
    hits = np.bincount(np.repeat(np.arange(len(n)), n), weights=tl.pins_burst[idx], minlength=len(n))
    return hits > 0


def _dormant_summary(tl: Timeline, s: SynthConfig, a: int, b: int, surface, click, p_click, blind) -> dict:
    """Long histories: the dormant term's worth per surface, the click oracle AUC with the true
    probabilities and with the term removed from the logit (about the best a model blind to the
    old events can do), and how often the burst lies in the requests' newest events."""
    out: dict = {"surfaces": {}}
    for si, name in enumerate(SURFACES):
        m = surface == si
        full, without = metrics.auc(p_click[m], click[m]), metrics.auc(blind[m], click[m])
        out["surfaces"][name] = {
            "oracle_auc": full,
            "oracle_auc_without_dormant": without,
            "dormant_lift": full - without,
        }
    user, time = tl.user[a:b], tl.time[a:b]
    has = tl.dormant[user] > 0
    out["dormant_request_share"] = round(float(has.mean()), 4) if len(has) else 0.0
    # Requests of users with a dormant topic whose newest W pins events hold a burst event.
    out["burst_in_newest"] = {
        str(w): round(float(burst_in_newest(tl, user[has], time[has], w).mean()), 5) if has.any() else 0.0
        for w in BURST_WINDOWS
    }
    return out


def _split_summary(tl: Timeline, plan: SplitPlan, files: List[dict]) -> dict:
    surface = np.concatenate([f.pop("_surface") for f in files])
    labels = {t: np.concatenate([f["_labels"][t] for f in files]) for t in TASKS}
    probs = {t: np.concatenate([f["_probs"][t] for f in files]) for t in TASKS}
    metrics = oracle_metrics(surface, labels, probs)
    n = plan.num_requests
    a, b = plan.first_request, plan.first_request + n
    dormant = None
    if plan.synth.long_history.enabled:
        blind = np.concatenate([f["_blind"] for f in files])
        dormant = _dormant_summary(tl, plan.synth, a, b, surface, labels["click"], probs["click"], blind)
    for f in files:
        del f["_labels"], f["_probs"], f["_blind"]
    start, end = tl.boundaries[plan.name]
    out = {
        "requests": n,
        "rows": int(plan.row_offsets[-1]),
        "files": files,
        "bytes": sum(f["bytes"] for f in files),
        "surfaces": metrics,
        "request_ids": [a, b - 1],
        "time_range": [int(tl.time[a]), int(tl.time[b - 1])],
        "window": [start, end],
        "window_utc": [_iso(start), _iso(end)],
        "users": int(len(np.unique(tl.user[a:b]))),
        **_history_stats(tl, plan.synth, a, b),
    }
    if dormant is not None:
        out["dormant"] = dormant
    return out


def generate(cfg: ExperimentConfig, out_dir: str | Path, num_threads: int = 0, raw: bool = False) -> dict:
    """Write ``out_dir/{train,eval}/part-*.parquet`` (and ``calibration/`` when
    synth.calibration_requests > 0) and ``out_dir/summary.json``; return the summary. With ``raw``,
    also the raw logs the same data build from (``out_dir/raw/``, see write_raw).

    ``num_threads``: files written in parallel (0: one per CPU core). The bytes do not depend on it.
    """
    s = cfg.synth
    out = Path(out_dir)
    if raw:
        check_raw(cfg)
    t_start = time.perf_counter()
    world = make_world(s)
    tl = make_timeline(world, s)
    t_world = time.perf_counter() - t_start
    jobs = []
    plans = {name: plan_split(s, tl, name) for name in SPLITS if name != "calibration" or s.calibration_requests}
    for name in SPLITS:  # no stale files of an earlier, larger or calibration-split run
        for old in (out / name).glob("part-*.parquet"):
            old.unlink()
    raw_dir = out / "raw"
    if raw:
        for old in (raw_dir / "impressions").glob("*.parquet"):
            old.unlink()
        (raw_dir / "impressions").mkdir(parents=True, exist_ok=True)
    for name, plan in plans.items():
        d = out / name
        d.mkdir(parents=True, exist_ok=True)
        for f, groups in enumerate(split_files(plan)):
            raw_path = raw_dir / "impressions" / f"{name}-{f:05d}.parquet" if raw else None
            jobs.append((plan, groups, d / f"part-{f:05d}.parquet", raw_path))
    # Files are independent (each regenerates the blocks it overlaps) and Parquet encoding releases
    # the GIL: one thread per core roughly doubles throughput on 2 cores.
    workers = max(1, min(num_threads or len(os.sched_getaffinity(0)), len(jobs)))
    with ThreadPoolExecutor(workers) as pool:
        pending = pool.submit(write_raw, world, tl, s, raw_dir) if raw else None
        done = list(pool.map(lambda job: _write_file(world, tl, *job), jobs))
        raw_info = pending.result() if pending is not None else None
    splits = {
        name: _split_summary(tl, plan, [f for job, f in zip(jobs, done) if job[0] is plan])
        for name, plan in plans.items()
    }
    seconds = time.perf_counter() - t_start
    rows = sum(v["rows"] for v in splits.values())
    summary = {
        "seed": s.seed,
        "out_dir": str(out),
        "rows": rows,
        "requests": sum(v["requests"] for v in splits.values()),
        "users": int(len(np.unique(tl.user))),
        "bytes": sum(v["bytes"] for v in splits.values()),
        "seconds": round(seconds, 3),
        "world_seconds": round(t_world, 3),
        "rows_per_second": round(rows / seconds, 1),
        "threads": workers,
        "synth": dataclasses.asdict(s),
        "splits": splits,
    }
    if raw_info is not None:
        summary["raw"] = raw_info
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


# --------------------------------------------------------------------------------------------
# Raw logs: what a logging system would have recorded (out/raw/).
# --------------------------------------------------------------------------------------------

IMPRESSION_SCHEMA = pa.schema(
    [
        ("request_id", _I64),
        ("user_id", _I64),
        ("timestamp", _I64),
        ("surface", pa.string()),
        ("item_id", _I64),
        ("position", _I64),
        ("context_topic", _I64),
        ("query_tokens", _LI64),
        ("user_activity", pa.float32()),
        ("click", _I64),
        ("good_click", _I64),
        ("save", _I64),
        ("true_p_click", pa.float64()),
        ("true_p_good_click", pa.float64()),
        ("true_p_save", pa.float64()),
    ]
)


def impression_table(b: Block) -> pa.Table:
    """The impression log's rows of a block: one per candidate, its position in the request."""
    n = b.num_candidates
    rep = lambda a: np.repeat(a, n)  # noqa: E731
    qt = b.query_tokens
    offsets, idx = _per_row_lists(qt, n)
    cols = {
        "request_id": pa.array(rep(b.request_id)),
        "user_id": pa.array(rep(b.user)),
        "timestamp": pa.array(rep(b.timestamp)),
        "surface": pa.array(np.array(SURFACES, dtype=object)[rep(b.surface)], pa.string()),
        "item_id": pa.array(b.rows["item_id"]),
        "position": pa.array(_segment_positions(n)),
        "context_topic": pa.array(rep(b.context_topic)),
        "query_tokens": pa.ListArray.from_arrays(offsets, pc.take(pa.array(qt.cols["query_tokens"]), idx)),
        "user_activity": pa.array(b.rows["user_activity"]),
    }
    for t in TASKS:
        cols[t] = pa.array(b.rows[t])
        cols[f"true_p_{t}"] = pa.array(b.rows[f"true_p_{t}"])
    return pa.Table.from_arrays([cols[f.name] for f in IMPRESSION_SCHEMA], schema=IMPRESSION_SCHEMA)


RAW_LOGS = {"pins": "pin_events", "ads": "ad_events", "queries": "search_events"}


def _log_table(world: World, log: Events, group: str) -> pa.Table:
    """A behaviour log keyed by user and time only, in time order (as logs are written)."""
    order = np.argsort(log.time, kind="stable")
    cols = {"user_id": pa.array(log.user[order]), "timestamp": pa.array(log.time[order])}
    cols.update({name: pa.array(v[order]) for name, v in log.cols.items()})
    if group == "pins":
        cols["embedding"] = _arrow(world.item_event_emb[log.cols["item"][order]])
    return pa.table(cols)


def items_table(world: World) -> pa.Table:
    return pa.table(
        {
            "item_id": pa.array(np.arange(len(world.item_topic), dtype=np.int64)),
            "advertiser_id": pa.array(world.item_advertiser),
            "ad_type": pa.array(world.item_ad_type),
            "topic": pa.array(world.item_topic),
            "ctr_prior": pa.array(world.item_prior),
            "embedding": _arrow(world.item_emb),
        }
    )


def write_raw(world: World, tl: Timeline, s: SynthConfig, raw_dir: Path) -> dict:
    """The behaviour logs (one per sequence group) and the items side table; the impression log is
    written beside the contract files (raw/impressions/<split>-<file>.parquet)."""
    raw_dir.mkdir(parents=True, exist_ok=True)
    info = {}
    for group, name in RAW_LOGS.items():
        path = raw_dir / f"{name}.parquet"
        table = _log_table(world, getattr(tl, group), group)
        pq.write_table(table, path, row_group_size=1 << 20, **PARQUET_OPTIONS)
        info[name] = {"rows": table.num_rows, "bytes": path.stat().st_size}
    path = raw_dir / "items.parquet"
    pq.write_table(items_table(world), path, **PARQUET_OPTIONS)
    info["items"] = {"rows": len(world.item_topic), "bytes": path.stat().st_size}
    return info


def check_raw(cfg: ExperimentConfig) -> None:
    """What --raw needs: fault-free data (faults have no raw form), and sequence groups capped as
    the generator caps them (else a build from the raw logs would not reproduce the contract)."""
    s = cfg.synth
    if faults_enabled(s):
        raise ConfigError("synth.faults: feature faults have no raw-log form; turn them off with --raw")
    caps = sequence_caps(s)
    for g in cfg.features.sequence_groups:
        for group, (ts_col, _) in GROUP_COLUMNS.items():
            if g.timestamp_column == ts_col and g.max_length != caps[group]:
                source = (
                    f"synth.long_history.max_length={s.long_history.max_length}"
                    if group == "pins" and s.long_history.enabled
                    else f"synth.sequence_length={s.sequence_length}"
                )
                raise ConfigError(
                    f"features.sequence_groups[{g.name}].max_length: {g.max_length}, but the generator caps that "
                    f"group at {caps[group]} (from {source}): a build of the raw logs would not equal the contract "
                    "output"
                )


def is_cached(s: SynthConfig, out_dir: str | Path, at_least: Sequence[str] = ()) -> bool:
    """Whether ``out_dir/summary.json`` was written with the settings ``s``: every field equal, except
    the fields named in ``at_least`` (e.g. ``train_requests``), where more than asked also serves."""
    try:
        old = json.loads((Path(out_dir) / "summary.json").read_text())["synth"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if isinstance(old, dict) and "long_history" not in old:  # written before the key existed: it was off
        old["long_history"] = dataclasses.asdict(LongHistoryConfig())
    want = json.loads(json.dumps(dataclasses.asdict(s)))  # tuples as lists, as the summary holds them
    return all(old.get(k, -math.inf) >= v if k in at_least else k in old and old[k] == v for k, v in want.items())


def ensure(cfg: ExperimentConfig, out_dir: str | Path, at_least: Sequence[str] = (), echo=None) -> bool:
    """Generates ``cfg.synth``'s data into ``out_dir`` unless it is there already (``is_cached``);
    returns True when it generated. ``echo`` (e.g. ``print``) hears what was decided."""
    say = echo or (lambda _: None)
    if is_cached(cfg.synth, out_dir, at_least):
        say(f"data {out_dir}: reusing it (same synth settings)")
        return False
    say(f"data {out_dir}: generating {cfg.synth.train_requests:,} train requests")
    summary = generate(cfg, out_dir)
    say(f"data {out_dir}: generated in {summary['seconds']:.1f} s")
    return True


def format_summary(summary: dict) -> str:
    lines = [
        f"wrote {summary['rows']:,} rows / {summary['requests']:,} requests, "
        f"{summary['bytes'] / 2**20:.1f} MiB to {summary['out_dir']} in {summary['seconds']:.2f} s "
        f"({summary['rows_per_second']:,.0f} rows/s)"
    ]
    head = (
        f"{'split':<11} {'surface':<13} {'rows':>9} {'click':>7} {'good':>7} {'save':>7} | "
        f"{'AUC clk':>7} {'good':>6} {'save':>6} | {'NE clk':>6} {'good':>6} {'save':>6}"
    )
    lines += [head, "-" * len(head)]
    for split, v in summary["splits"].items():
        for name, e in v["surfaces"].items():
            rates = " ".join(f"{e[t]['rate']:7.4f}" for t in TASKS)
            aucs = " ".join(f"{e[t]['oracle_auc']:{7 if i == 0 else 6}.3f}" for i, t in enumerate(TASKS))
            nes = " ".join(f"{e[t]['oracle_ne']:6.3f}" for t in TASKS)
            lines.append(f"{split:<11} {name:<13} {e['rows']:>9,} {rates} | {aucs} | {nes}")
    for split, v in summary["splits"].items():
        if "dormant" not in v:
            continue
        d, q = v["dormant"], v["pins_length"]
        lifts = ", ".join(
            f"{name} {e['oracle_auc']:.3f} -> {e['oracle_auc_without_dormant']:.3f} ({e['dormant_lift']:+.3f})"
            for name, e in d["surfaces"].items()
        )
        newest = ", ".join(f"{w}: {x:.4f}" for w, x in d["burst_in_newest"].items())
        lines.append(
            f"{split}: click oracle AUC with -> without the dormant term: {lifts}; pins length median "
            f"{q['median']:.0f} p90 {q['p90']:.0f} max {q['max']} mean {q['mean']:.0f}; "
            f"burst in the newest W events ({d['dormant_request_share']:.1%} of requests have one): {newest}"
        )
    for split, v in summary["splits"].items():
        sizes = ", ".join(
            f"{Path(f['path']).name} {f['bytes'] / 2**20:.1f} MiB ({f['row_groups']} rg)" for f in v["files"]
        )
        lines.append(f"{split}: {sizes}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pinads_rec.data.synth", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True, help="output directory (train/, eval/, summary.json)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--train-requests", type=int)
    ap.add_argument("--eval-requests", type=int)
    ap.add_argument(
        "--raw", action="store_true", help="also write the raw logs under OUT/raw/ (docs/synthetic_data.md)"
    )
    args = ap.parse_args(argv)
    overrides = list(args.set)
    for flag, key in (("seed", "seed"), ("train_requests", "train_requests"), ("eval_requests", "eval_requests")):
        if getattr(args, flag) is not None:
            overrides.append(f"synth.{key}={getattr(args, flag)}")
    try:
        cfg = load(args.config, overrides)
        summary = generate(cfg, args.out, raw=args.raw)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
