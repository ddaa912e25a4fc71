"""Planted-truth synthetic ads-engagement data, written in the project's Parquet contract.

One row per ad impression (candidate); the rows of a request are contiguous and carry the user's
engagement sequences (all pins, ads only, search queries; newest first) duplicated per row, as
logged features are. Labels are drawn from known probabilities (``true_p_*`` columns), and each
term of those probabilities is recoverable only by the model part meant to find it:

- long-term interest (user topic mixture)      -> the full pins / ads sequences
- short-term intent (per request)               -> only the newest ~8 events of the pins sequence
- query / context match                         -> ``query_tokens`` / ``context_topic`` vs item
- item quality                                  -> ``item_id`` embedding, ``item_ctr_prior``
- per-surface offsets and interest scales       -> surface-specific calibration
- shopping ads                                   -> the ads sequence (a separate shopping mixture)
- save on a topic                                -> past save actions on that topic in the sequence

Formulas and coefficient values: docs/synthetic_data.md (keep it in sync with the constants
below). Everything is vectorized numpy; requests are generated in fixed blocks of
``BLOCK_REQUESTS``, each from its own PCG64 stream, so the data depend only on the seed and the
sizes, not on the number of files or the row-group size.

    python -m pinads_rec.data.synth --config configs/demo.yaml --out data/demo [--seed N]
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
from pinads_rec.config import ConfigError, ExperimentConfig, SynthConfig, load

# --------------------------------------------------------------------------------------------
# Planted truth: every coefficient is documented in docs/synthetic_data.md.
# --------------------------------------------------------------------------------------------

SURFACES = ("home_feed", "related_pins", "search")
HOME, RELATED, SEARCH = 0, 1, 2
SURFACE_PROBS = np.array([0.5, 0.3, 0.2])

T0 = 1_700_000_000  # first request time (seconds)
SPAN_S = 30 * 86400  # train + eval requests cover 30 days; eval is the latest part
BLOCK_REQUESTS = 2048  # requests per RNG block (fixed: changing it changes the data)
ITEM_EMB_DIM = 32  # item_embedding width ("GraphSage"-like noisy topic vector)
ITEM_EMB_NOISE = 0.6  # per-coordinate noise sd is ITEM_EMB_NOISE / sqrt(dim) before normalizing
QUERY_VOCAB = 1024  # token ids in [1, QUERY_VOCAB); 0 is padding

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
# Sequences (lengths ~ Poisson(frac * L * a_u / E[a_u]), clipped to the group's maximum).
PINS_LENGTH_FRAC = 0.42
PINS_EMPTY_PROB = 0.03  # cold requests with no history at all
ADS_LENGTH_FRAC = 0.15
QUERIES_LENGTH_FRAC = 0.10
RECENT_EVENTS = 8  # the short-term intent shows in this many newest pins events
RECENT_INTENT_PROB = 0.75  # a recent event's topic is the intent topic with this probability
OLD_UNIFORM_PROB = 0.1  # older events: topic ~ user mixture, or uniform with this probability
ADS_UNIFORM_PROB = 0.1  # ads events: topic ~ shopping mixture, or uniform
QUERIES_UNIFORM_PROB = 0.2  # query events: topic ~ user mixture, or uniform
RECENT_GAP_S = 90.0  # mean gap between the newest events (a session)
OLD_GAP_S = 6 * 3600.0
AD_GAP_S = 86400.0
QUERY_GAP_S = 12 * 3600.0
# Action types of sequence events, [0, 8).
ACTIONS = ("click", "save", "closeup", "long_click", "comment", "share", "video_view", "add_to_cart")
SAVE_ACTION = 1
PIN_ACTION_PROBS = np.array([0.45, 0.0, 0.25, 0.12, 0.03, 0.05, 0.10, 0.0])  # non-save actions
AD_ACTION_PROBS = np.array([0.55, 0.0, 0.10, 0.20, 0.0, 0.0, 0.0, 0.15])
# Per request.
INTENT_FROM_MIXTURE = 0.3  # intent ~ user mixture w.p. this, else uniform over topics
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

TASKS = ("click", "good_click", "save")
DENSE_COLUMNS = ("user_activity", "item_ctr_prior", "item_embedding")


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _stream(seed: int, *key: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=key)))


def query_tokens_per_topic(num_topics: int) -> int:
    """K: topic k (1-based) owns tokens 1 + (k-1)*K + r, r in [0, K), all < QUERY_VOCAB."""
    return (QUERY_VOCAB - 1) // num_topics


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
# A split's plan (candidate counts, files, row groups) and its request blocks.
# --------------------------------------------------------------------------------------------


@dataclass
class SplitPlan:
    name: str  # "train" / "eval" / "calibration"
    index: int  # 0 / 1 / 2: selects the RNG streams
    synth: SynthConfig
    num_requests: int
    first_request: int  # global index of request 0 (request_id)
    # Request i's time is (time_start + i + u) / time_scale of the span (u uniform in [0, 1)):
    # train and eval tile the span one request per 1 / (train + eval) of it.
    time_start: float
    time_scale: float
    num_candidates: np.ndarray  # [num_requests]
    row_offsets: np.ndarray  # [num_requests + 1]

    @property
    def num_blocks(self) -> int:
        return -(-self.num_requests // BLOCK_REQUESTS)


# The calibration split (synth.calibration_requests) is extra requests drawn over the latest 5% of
# the training span: data from the time the model was last trained on, never trained on itself.
CALIBRATION_WINDOW = 0.05

SPLITS = ("train", "eval", "calibration")


def plan_split(s: SynthConfig, split: str) -> SplitPlan:
    index = SPLITS.index(split)
    n = (s.train_requests, s.eval_requests, s.calibration_requests)[index]
    rng = _stream(s.seed, 1 + index, 0)
    n_cand = 1 + rng.poisson(max(s.candidates_per_request - 1.0, 0.0), n).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(n_cand)])
    total = s.train_requests + s.eval_requests
    if split == "calibration":
        density = n / (CALIBRATION_WINDOW * s.train_requests)  # requests per train request's time
        first, start, scale = total, (1.0 - CALIBRATION_WINDOW) * s.train_requests * density, total * density
    else:
        first = 0 if split == "train" else s.train_requests
        start, scale = first, total
    return SplitPlan(split, index, s, n, first, start, scale, n_cand, offsets)


@dataclass
class Group:
    """A ragged per-request sequence group: flat event arrays + per-request lengths."""

    lengths: np.ndarray  # [R]
    cols: Dict[str, np.ndarray]  # column -> [E] or [E, D] (newest first within each request)


@dataclass
class Block:
    lo: int  # first request (index within the split)
    hi: int
    # per request (latent ones are never written)
    request_id: np.ndarray
    user: np.ndarray
    surface: np.ndarray  # index into SURFACES
    timestamp: np.ndarray
    time_fraction: np.ndarray  # position of the request time in the whole span, [0, 1)
    intent: np.ndarray  # latent short-term intent topic
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


def _event_times(
    rng: np.random.Generator, req_ts: np.ndarray, lengths: np.ndarray, pos: np.ndarray, mean_gap: np.ndarray
) -> np.ndarray:
    """Strictly decreasing event times, all before the request time (gaps >= 1 s)."""
    gaps = 1 + np.floor(rng.exponential(1.0, len(pos)) * mean_gap).astype(np.int64)
    csum = np.cumsum(gaps)
    seg_end = np.cumsum(lengths)
    base = np.repeat(np.concatenate([[0], csum])[seg_end - lengths], lengths)
    return np.repeat(req_ts, lengths) - (csum - base)


def _actions(rng: np.random.Generator, save_prob: np.ndarray, probs: np.ndarray) -> np.ndarray:
    other = rng.choice(len(probs), size=len(save_prob), p=probs / probs.sum())
    return np.where(rng.random(len(save_prob)) < save_prob, SAVE_ACTION, other).astype(np.int64)


def _lengths(rng: np.random.Generator, rel_activity: np.ndarray, frac: float, max_len: int, full: int) -> np.ndarray:
    return np.minimum(rng.poisson(frac * full * rel_activity), max_len).astype(np.int64)


def sample_block(world: World, plan: SplitPlan, block: int) -> Block:
    """Requests [block * BLOCK_REQUESTS, ...) of the split, with their rows, from the block's stream."""
    s = plan.synth
    rng = _stream(s.seed, 1 + plan.index, 1, block)
    lo = block * BLOCK_REQUESTS
    hi = min(lo + BLOCK_REQUESTS, plan.num_requests)
    R, T, L = hi - lo, world.num_topics, s.sequence_length
    K = query_tokens_per_topic(T)
    reqs = np.arange(R)

    # ---- per request --------------------------------------------------------------------
    g = plan.time_start + lo + np.arange(R)
    frac = (g + rng.random(R)) / plan.time_scale
    ts = T0 + np.floor(frac * SPAN_S).astype(np.int64)
    user = rng.integers(0, s.num_users, R)
    surface = rng.choice(len(SURFACES), size=R, p=SURFACE_PROBS)
    theta = _dense_mixtures(world.theta[0][user], world.theta[1][user], T)
    phi = _dense_mixtures(world.phi[0][user], world.phi[1][user], T)
    rel_act = world.activity[user] / math.exp(ACTIVITY_SD**2 / 2)  # E[a_u] = 1
    user_activity = (5.0 * world.activity[user] * np.exp(rng.normal(0.0, 0.15, R))).astype(np.float32)

    def from_mixture_or_uniform(p_mixture: float) -> np.ndarray:
        return np.where(rng.random(R) < p_mixture, _sample_topics(rng, theta, reqs), rng.integers(1, T + 1, R))

    intent = from_mixture_or_uniform(INTENT_FROM_MIXTURE)
    anchor = from_mixture_or_uniform(ANCHOR_FROM_MIXTURE)
    query_topic = np.where(surface == SEARCH, anchor, 0)
    context_topic = np.where(surface == RELATED, anchor, 0)
    n_qt = np.where(surface == SEARCH, rng.integers(1, 4, R), 0)
    qt_req = np.repeat(reqs, n_qt)
    qt = 1 + (query_topic[qt_req] - 1) * K + rng.integers(0, K, len(qt_req))
    query_tokens = Group(n_qt, {"query_tokens": qt.astype(np.int64)})

    # ---- pins sequence: newest RECENT_EVENTS mostly the intent, older ones the mixture ------
    n_pins = _lengths(rng, rel_act, PINS_LENGTH_FRAC, L, L)
    n_pins[rng.random(R) < PINS_EMPTY_PROB] = 0
    ev = np.repeat(reqs, n_pins)
    pos = _segment_positions(n_pins)
    recent = pos < RECENT_EVENTS
    u = rng.random(len(ev))
    topic = np.where(recent & (u < RECENT_INTENT_PROB), intent[ev], _sample_topics(rng, theta, ev))
    topic = np.where(~recent & (u < OLD_UNIFORM_PROB), rng.integers(1, T + 1, len(ev)), topic)
    item = _items_of_topics(rng, world, topic)
    action = _actions(rng, world.save_propensity[user][ev], PIN_ACTION_PROBS)
    gap = np.where(recent, RECENT_GAP_S, OLD_GAP_S)
    pins = Group(
        n_pins,
        {
            "seq_pin_item": item,
            "seq_pin_ts": _event_times(rng, ts, n_pins, pos, gap),
            "seq_pin_action": action,
            "seq_pin_topic": topic.astype(np.int64),
            "seq_pin_emb": world.item_event_emb[item],
        },
    )

    # ---- ads sequence: the shopping mixture ----------------------------------------------
    n_ads = _lengths(rng, rel_act, ADS_LENGTH_FRAC, L // 2, L)
    ev_a = np.repeat(reqs, n_ads)
    topic_a = np.where(
        rng.random(len(ev_a)) < ADS_UNIFORM_PROB, rng.integers(1, T + 1, len(ev_a)), _sample_topics(rng, phi, ev_a)
    )
    item_a = _items_of_topics(rng, world, topic_a)
    ads = Group(
        n_ads,
        {
            "seq_ad_item": item_a,
            "seq_ad_ts": _event_times(rng, ts, n_ads, _segment_positions(n_ads), AD_GAP_S),
            "seq_ad_action": _actions(rng, world.save_propensity[user][ev_a], AD_ACTION_PROBS),
            "seq_ad_topic": topic_a.astype(np.int64),
        },
    )

    # ---- search queries --------------------------------------------------------------------
    n_q = _lengths(rng, rel_act, QUERIES_LENGTH_FRAC, L // 2, L)
    ev_q = np.repeat(reqs, n_q)
    topic_q = np.where(
        rng.random(len(ev_q)) < QUERIES_UNIFORM_PROB,
        rng.integers(1, T + 1, len(ev_q)),
        _sample_topics(rng, theta, ev_q),
    )
    queries = Group(
        n_q,
        {
            "seq_query_token": 1 + (topic_q - 1) * K + rng.integers(0, K, len(ev_q)),
            "seq_query_ts": _event_times(rng, ts, n_q, _segment_positions(n_q), QUERY_GAP_S),
            "seq_query_topic": topic_q.astype(np.int64),
        },
    )

    # ---- candidates ------------------------------------------------------------------------
    n_cand = plan.num_candidates[lo:hi]
    r = np.repeat(reqs, n_cand)
    N = len(r)
    surf = surface[r]
    src_cum = np.cumsum(CANDIDATE_SOURCES[surf], axis=1)
    src = (rng.random(N)[:, None] >= src_cum).sum(axis=1)
    options = np.stack(
        [
            _sample_topics(rng, theta, r),
            _sample_topics(rng, phi, r),
            intent[r],
            rng.integers(1, T + 1, N),
            np.maximum(query_topic, context_topic)[r],
        ]
    )
    cand_topic = options[np.minimum(src, 4), np.arange(N)]
    cand = _items_of_topics(rng, world, cand_topic)
    k = world.item_topic[cand]
    shopping = world.item_ad_type[cand]
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
    p_click = _sigmoid(logit_click)
    p_good_given_click = _sigmoid(
        GOOD_OFFSET[surf]
        + GOOD_QUALITY_COEF * world.item_quality[cand]
        + GOOD_INTENT_COEF * is_intent
        + GOOD_SHOPPING_OFFSET * shopping
    )
    saves_on_topic = np.bincount(ev * (T + 1) + topic, weights=(action == SAVE_ACTION), minlength=R * (T + 1)).reshape(
        R, T + 1
    )[r, k]
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
        "user_activity": user_activity[r],
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
        "logit_click": logit_click,
    }
    _apply_faults(rows, frac[r], s, _stream(s.seed, 1 + plan.index, 2, block))
    return Block(
        lo,
        hi,
        plan.first_request + lo + reqs,
        user,
        surface,
        ts,
        frac,
        intent,
        query_topic,
        context_topic,
        user_activity,
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


def block_table(b: Block, sch: pa.Schema) -> pa.Table:
    n_cand = b.num_candidates
    rep = lambda a: np.repeat(a, n_cand)  # noqa: E731
    cols: Dict[str, pa.Array] = {
        "request_id": pa.array(rep(b.request_id)),
        "user_id": pa.array(rep(b.user)),
        "surface": pa.DictionaryArray.from_arrays(
            pa.array(rep(b.surface).astype(np.int32)), pa.array(SURFACES)
        ).dictionary_decode(),
        "timestamp": pa.array(rep(b.timestamp)),
        "context_topic": pa.array(rep(b.context_topic)),
    }
    cols.update({name: _arrow(v) for name, v in b.rows.items()})
    for group in (b.query_tokens, b.pins, b.ads, b.queries):
        offsets, idx = _per_row_lists(group, n_cand)
        for name, v in group.cols.items():
            # Arrow's take allocates from its pool, which keeps its pages: numpy's fancy indexing
            # here would page-fault fresh memory for every block and halve throughput.
            cols[name] = pa.ListArray.from_arrays(offsets, pc.take(_arrow(v), idx))
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
    """Per file, its row groups as request ranges [a, b): whole requests, <= row_group_size rows
    each (a single request larger than that is a row group of its own)."""
    s = plan.synth
    if plan.index == 0:
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
            groups.append((a, b))
            a = b
        files.append(groups)
    return files


def _slice_group(g: Group, a: int, b: int) -> Group:
    start = int(g.lengths[:a].sum())
    stop = start + int(g.lengths[a:b].sum())
    return Group(g.lengths[a:b], {k: v[start:stop] for k, v in g.cols.items()})


def slice_block(blk: Block, a: int, b: int) -> Block:
    """Requests [a, b) of the split (within the block's range), with their rows and events."""
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


def _write_file(world: World, plan: SplitPlan, groups: List[Tuple[int, int]], path: Path) -> dict:
    """Write one file's row groups; generates the blocks it overlaps (deterministic per block)."""
    sch = schema(plan.synth.event_embedding_dim)
    first, last = groups[0][0], groups[-1][1]
    surf, labels, probs = [], {t: [] for t in TASKS}, {t: [] for t in TASKS}
    blk: Optional[Block] = None
    with pq.ParquetWriter(path, sch, **PARQUET_OPTIONS) as writer:
        for a, b in groups:
            pieces = []
            while a < b:
                if blk is None or blk.hi <= a:
                    full = sample_block(world, plan, a // BLOCK_REQUESTS)
                    blk = slice_block(full, max(full.lo, first), min(full.hi, last))
                    surf.append(np.repeat(blk.surface, blk.num_candidates))
                    for t in TASKS:
                        labels[t].append(blk.rows[t].astype(np.int8))
                        probs[t].append(blk.rows[f"true_p_{t}"])
                y = min(b, blk.hi)
                pieces.append(block_table(slice_block(blk, a, y), sch))
                a = y
            rg = pa.concat_tables(pieces) if len(pieces) > 1 else pieces[0]
            writer.write_table(rg, row_group_size=max(rg.num_rows, 1))
    return {
        "path": str(path),
        "bytes": path.stat().st_size,
        "row_groups": len(groups),
        "rows": int(plan.row_offsets[last] - plan.row_offsets[first]),
        "requests": last - first,
        "_surface": np.concatenate(surf),
        "_labels": {t: np.concatenate(v) for t, v in labels.items()},
        "_probs": {t: np.concatenate(v) for t, v in probs.items()},
    }


def _split_summary(plan: SplitPlan, files: List[dict]) -> dict:
    metrics = oracle_metrics(
        np.concatenate([f.pop("_surface") for f in files]),
        {t: np.concatenate([f["_labels"][t] for f in files]) for t in TASKS},
        {t: np.concatenate([f["_probs"][t] for f in files]) for t in TASKS},
    )
    for f in files:
        del f["_labels"], f["_probs"]
    n = plan.num_requests
    return {
        "requests": n,
        "rows": int(plan.row_offsets[-1]),
        "files": files,
        "bytes": sum(f["bytes"] for f in files),
        "surfaces": metrics,
        "request_ids": [plan.first_request, plan.first_request + n - 1],
        "time_range": [
            int(T0 + plan.time_start * SPAN_S // plan.time_scale),
            int(T0 + (plan.time_start + n) * SPAN_S // plan.time_scale),
        ],
    }


def generate(cfg: ExperimentConfig, out_dir: str | Path, num_threads: int = 0) -> dict:
    """Write ``out_dir/{train,eval}/part-*.parquet`` (and ``calibration/`` when
    synth.calibration_requests > 0) and ``out_dir/summary.json``; return the summary.

    ``num_threads``: files written in parallel (0: one per CPU core). The bytes do not depend on it.
    """
    s = cfg.synth
    out = Path(out_dir)
    t_start = time.perf_counter()
    world = make_world(s)
    t_world = time.perf_counter() - t_start
    jobs = []
    plans = {name: plan_split(s, name) for name in SPLITS if name != "calibration" or s.calibration_requests}
    for name in SPLITS:  # no stale files of an earlier, larger or calibration-split run
        for old in (out / name).glob("part-*.parquet"):
            old.unlink()
    for name, plan in plans.items():
        d = out / name
        d.mkdir(parents=True, exist_ok=True)
        jobs += [(plan, groups, d / f"part-{f:05d}.parquet") for f, groups in enumerate(split_files(plan))]
    # Files are independent (each regenerates the blocks it overlaps) and Parquet encoding releases
    # the GIL: one thread per core roughly doubles throughput on 2 cores.
    workers = max(1, min(num_threads or len(os.sched_getaffinity(0)), len(jobs)))
    with ThreadPoolExecutor(workers) as pool:
        done = list(pool.map(lambda job: _write_file(world, *job), jobs))
    splits = {
        name: _split_summary(plan, [f for job, f in zip(jobs, done) if job[0] is plan]) for name, plan in plans.items()
    }
    seconds = time.perf_counter() - t_start
    rows = sum(v["rows"] for v in splits.values())
    summary = {
        "seed": s.seed,
        "out_dir": str(out),
        "rows": rows,
        "requests": sum(v["requests"] for v in splits.values()),
        "bytes": sum(v["bytes"] for v in splits.values()),
        "seconds": round(seconds, 3),
        "world_seconds": round(t_world, 3),
        "rows_per_second": round(rows / seconds, 1),
        "threads": workers,
        "synth": dataclasses.asdict(s),
        "splits": splits,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def is_cached(s: SynthConfig, out_dir: str | Path, at_least: Sequence[str] = ()) -> bool:
    """Whether ``out_dir/summary.json`` was written with the settings ``s``: every field equal, except
    the fields named in ``at_least`` (e.g. ``train_requests``), where more than asked also serves."""
    try:
        old = json.loads((Path(out_dir) / "summary.json").read_text())["synth"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
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
    args = ap.parse_args(argv)
    overrides = list(args.set)
    for flag, key in (("seed", "seed"), ("train_requests", "train_requests"), ("eval_requests", "eval_requests")):
        if getattr(args, flag) is not None:
            overrides.append(f"synth.{key}={getattr(args, flag)}")
    try:
        cfg = load(args.config, overrides)
        summary = generate(cfg, args.out)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
