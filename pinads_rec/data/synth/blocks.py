"""A block of ``BLOCK_REQUESTS`` requests of the timeline, sampled from its own stream: their
sequences (each user's events before the request), their rows and the planted probabilities and
labels (``sample_block``), and the feature faults applied to them. ``slice_block`` cuts a block
into the requests of a row group. In a drifting world a block also scores its rows with the truth of
each of the days before theirs (``stale_logits``: the drift check).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

import numpy as np

from pinads_rec.config import SynthConfig
from pinads_rec.data.synth.timeline import Events, Group, Timeline, segment_positions, span_end, touched_surfaces
from pinads_rec.data.synth.truth import (
    BLOCK_REQUESTS,
    CLICK_OFFSET,
    CONTEXT_COEF,
    DAY_S,
    DENSE_COLUMNS,
    GOOD_INTENT_COEF,
    GOOD_OFFSET,
    GOOD_QUALITY_COEF,
    GOOD_SHOPPING_OFFSET,
    INTENT_COEF,
    INTEREST_SCALE,
    LONG_TERM_COEF,
    QUERY_COEF,
    RELATED,
    SAVE_ACTION,
    SAVE_CLICK_BOOST,
    SAVE_HISTORY_COEF,
    SAVE_INTEREST_COEF,
    SAVE_OFFSET,
    SAVE_QUALITY_COEF,
    SAVE_SHOPPING_OFFSET,
    SEARCH,
    SHOPPING_OFFSET,
    STALE_DAYS,
    T0,
    sigmoid,
    stream,
)
from pinads_rec.data.synth.world import World, mixtures_at


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
    rng = stream(s.seed, 3, block)
    lo = block * BLOCK_REQUESTS
    hi = min(lo + BLOCK_REQUESTS, tl.num_requests)
    R, T = hi - lo, world.num_topics
    reqs = np.arange(R)
    user, ts, surface = tl.user[lo:hi], tl.time[lo:hi], tl.surface[lo:hi]
    intent, query_topic, context_topic = tl.intent[lo:hi], tl.query_topic[lo:hi], tl.context_topic[lo:hi]
    frac = (ts - T0) / (span_end(s) - T0)
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
    w = _long_term_weights(world, user, ts, r, k, shopping)
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
    drift = world.drift
    trend_match = np.zeros(N)
    if drift is not None:  # the day's trending topic
        trend_match = (k == drift.trend[drift.day(ts)][r]).astype(np.float64)
        logit_click = logit_click + drift.cfg.trend_boost * trend_match
    lh = s.long_history
    dormant_match = np.zeros(N)
    if lh.enabled:
        dormant_match = (touched_surfaces(lh)[surf] & (k == tl.dormant[user][r])).astype(np.float64)
        logit_click = logit_click + lh.dormant_coef * dormant_match
    p_click = sigmoid(logit_click)
    p_good_given_click = sigmoid(
        GOOD_OFFSET[surf]
        + GOOD_QUALITY_COEF * world.item_quality[cand]
        + GOOD_INTENT_COEF * is_intent
        + GOOD_SHOPPING_OFFSET * shopping
    )
    # Saves on the candidate's topic among the pins events the request sees.
    ev = np.repeat(reqs, pins.lengths)
    saves = pins.cols["seq_pin_action"] == SAVE_ACTION
    if lh.enabled:  # the save term stays short-range: the newest L events, as without long histories
        saves = saves & (segment_positions(pins.lengths) < s.sequence_length)
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
    p_save_click, p_save_noclick = sigmoid(logit_save + SAVE_CLICK_BOOST), sigmoid(logit_save)
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
        "trend_match": trend_match,  # 1[k = the day's trending topic] (0 in the fixed world)
        "logit_click": logit_click,
    }
    if drift is not None:
        fixed = (
            CLICK_OFFSET[surf]
            + SHOPPING_OFFSET * shopping
            + INTEREST_SCALE[surf] * INTENT_COEF * is_intent
            + QUERY_COEF * query_match
            + CONTEXT_COEF * context_match
        )
        latent["stale_logit"] = stale_logits(world, user, ts, r, cand, surf, fixed)
    _apply_faults(rows, frac[r], s, stream(s.seed, 4, block))
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


def _long_term_weights(world: World, user, times, r, k, shopping) -> np.ndarray:
    """Per row the weight of its candidate's topic k in its user's mixture at the request ``times``:
    the shopping mixture for a shopping ad, the long-term one otherwise."""
    theta = mixtures_at(world, world.theta, user, times)
    phi = mixtures_at(world, world.phi, user, times)
    return np.where(shopping == 1, phi[r, k - 1], theta[r, k - 1]).astype(np.float64)


def stale_logits(world: World, user, ts, r, cand, surf, fixed) -> np.ndarray:
    """A drifting world's rows [N, STALE_DAYS + 1]: column j the click logit under the truth of the
    day j days before the row's own (NaN before the first day): that day's user interests (at its
    noon), its trending topic and its ads -- an ad launched after it counts its advertiser's effect
    a_adv, not its own quality. ``fixed``: the rest of the logit (offsets, intent, query and context
    matches), the same on every day."""
    drift = world.drift
    k, shopping = world.item_topic[cand], world.item_ad_type[cand]
    day = drift.day(ts)
    out = np.full((len(cand), STALE_DAYS + 1), np.nan)
    for j in range(STALE_DAYS + 1):
        ref = np.maximum(day - j, 0)
        w = _long_term_weights(world, user, T0 + ref * DAY_S + DAY_S // 2, r, k, shopping)
        known = drift.launch[cand] <= ref[r]
        quality = np.where(known, world.item_quality[cand], world.advertiser_effect[world.item_advertiser[cand]])
        trend = drift.cfg.trend_boost * (k == drift.trend[ref][r])
        logit = fixed + INTEREST_SCALE[surf] * LONG_TERM_COEF * w + quality + trend
        out[:, j] = np.where((day - j >= 0)[r], logit, np.nan)
    return out


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
