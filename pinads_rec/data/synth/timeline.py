"""The timeline: every split's visits and requests in time, every user's behaviour events (pins,
ads, queries; with long histories also the dormant topics and their bursts) and every request's
candidates -- everything but the labels (``make_timeline``). A split is a time window of it
(``split_boundaries``, ``plan_split``); in a drifting world (synth.drift) a day is (``windows``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np

from pinads_rec.config import LongHistoryConfig, SynthConfig
from pinads_rec.data.synth.drift import day_names
from pinads_rec.data.synth.truth import (
    ACTIVITY_SD,
    AD_ACTION_PROBS,
    ADS_PER_30_DAYS,
    ADS_UNIFORM_PROB,
    ANCHOR_FROM_MIXTURE,
    BLOCK_REQUESTS,
    CANDIDATE_SOURCES,
    DAY_S,
    INTENT_FROM_MIXTURE,
    ITEM_POPULARITY_POWER,
    LOG_END,
    LOG_START,
    OLD_UNIFORM_PROB,
    PIN_ACTION_PROBS,
    PINS_PER_30_DAYS,
    QUERIES_PER_30_DAYS,
    QUERIES_UNIFORM_PROB,
    RELATED,
    REQUEST_GAP_S,
    SAVE_ACTION,
    SEARCH,
    SESSION_EVENTS,
    SESSION_GAP_S,
    SESSION_INTENT_PROB,
    SPAN_S,
    SURFACE_PROBS,
    SURFACES,
    T0,
    VISIT_EXTRA_REQUESTS,
    VISIT_MAX_S,
    Z_P90,
    query_tokens_per_topic,
    stream,
)
from pinads_rec.data.synth.world import World, dense_mixtures, mixtures_at

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


def span_end(s: SynthConfig) -> int:
    """The end of the requests' span and of the behaviour logs: 30 days after T0, or the end of a
    drifting world's last day."""
    return LOG_END if s.drift is None else T0 + s.drift.days * DAY_S


def windows(s: SynthConfig) -> Dict[str, Tuple[int, int]]:
    """The time windows requests are drawn in, in time order, by name: the splits
    (``split_boundaries``), or a drifting world's days (named by their dates: ``drift.day_names``)."""
    if s.drift is None:
        return split_boundaries(s)
    return {name: (T0 + d * DAY_S, T0 + (d + 1) * DAY_S) for d, name in enumerate(day_names(s))}


def window_sizes(s: SynthConfig) -> Dict[str, int]:
    """Requests per window of ``windows``."""
    return split_sizes(s) if s.drift is None else {name: s.drift.requests_per_day for name in day_names(s)}


def output_names(s: SynthConfig) -> List[str]:
    """The windows written, in the order they are written: the splits (calibration only with
    requests), or the days."""
    if s.drift is not None:
        return day_names(s)
    return [name for name in SPLITS if name != "calibration" or s.calibration_requests]


@dataclass
class Group:
    """A ragged per-request sequence group: flat event arrays + per-request lengths."""

    lengths: np.ndarray  # [R]
    cols: Dict[str, np.ndarray]  # column -> [E] or [E, D] (newest first within each request)


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
        return n, np.repeat(end - 1, n) - segment_positions(n)


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
    query_tokens: Group
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
    rng: np.random.Generator, world: World, users: np.ndarray, per_30_days: float, log_end: int
) -> Tuple[np.ndarray, np.ndarray]:
    """Each user's background events: Poisson(per_30_days * rel. activity * log days / 30) events
    at uniform times over the whole log, [LOG_START, log_end)."""
    rel = world.activity[users] / math.exp(ACTIVITY_SD**2 / 2)  # E[a_u] = 1
    n = rng.poisson(per_30_days * rel * (log_end - LOG_START) / (30 * 86400))
    return np.repeat(users, n), rng.integers(LOG_START, log_end, int(n.sum()))


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


def _mixture_topics(rng, world: World, mix, users: np.ndarray, times: np.ndarray, uniform_prob: float) -> np.ndarray:
    """One topic per entry of ``users``: ~ the user's mixture (at ``times`` in a drifting world), or
    uniform w.p. uniform_prob."""
    uniq, inv = np.unique(users, return_inverse=True)
    dense = dense_mixtures(mix[0][uniq], mix[1][uniq], world.num_topics)
    t = _sample_topics(rng, dense, inv)
    if world.drift is not None:
        t = world.drift.rotate(rng, t, times)
    return np.where(rng.random(len(users)) < uniform_prob, rng.integers(1, world.num_topics + 1, len(users)), t)


def make_timeline(world: World, s: SynthConfig) -> Timeline:
    """Visits and requests of every split, the users' behaviour logs and every request's
    candidates: everything but labels (sample_block). Deterministic for the seed and sizes."""
    T, K = world.num_topics, query_tokens_per_topic(world.num_topics)
    bounds = windows(s)
    sizes = window_sizes(s)
    log_end = span_end(s)

    # ---- visits and their requests, window by window (split or day) ----------------------
    v_user, v_time, r_visit, r_time = [], [], [], []
    n_visits = 0
    for index, name in enumerate(bounds):
        n = sizes[name]
        if not n:
            continue
        rng = stream(s.seed, 1, 0, index)
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
    for name in bounds:
        split_range[name] = (first, first + sizes[name])
        first += sizes[name]

    # ---- per visit: intent; per request: surface, anchor, query, activity ---------------
    rng = stream(s.seed, 1, 1)
    user = v_user[r_visit]
    v_intent = np.where(
        rng.random(n_visits) < INTENT_FROM_MIXTURE,
        _mixture_topics(rng, world, world.theta, v_user, v_time, 0.0),
        rng.integers(1, T + 1, n_visits),
    )
    intent = v_intent[r_visit]
    surface = rng.choice(len(SURFACES), size=N, p=SURFACE_PROBS)
    anchor = _mixture_topics(rng, world, world.theta, user, r_time, 1.0 - ANCHOR_FROM_MIXTURE)
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
    rng = stream(s.seed, 2, 0)
    lh = s.long_history
    if lh.enabled:
        bg_user, bg_time, burst_user, burst_time, dormant = _long_background(rng, world, s, present, v_user)
    else:
        bg_user, bg_time = _background(rng, world, present, PINS_PER_30_DAYS * L, log_end)
    bg_topic = _mixture_topics(rng, world, world.theta, bg_user, bg_time, OLD_UNIFORM_PROB)
    # A visit opens with a session of SESSION_EVENTS pins events, mostly on its intent.
    ss_visit = np.repeat(np.arange(n_visits), SESSION_EVENTS)
    ss_user = v_user[ss_visit]
    gaps = 1 + np.floor(rng.exponential(SESSION_GAP_S, (n_visits, SESSION_EVENTS))).astype(np.int64)
    ss_time = (v_time[:, None] - np.cumsum(gaps, axis=1)).ravel()
    ss_topic = np.where(
        rng.random(len(ss_visit)) < SESSION_INTENT_PROB,
        v_intent[ss_visit],
        _mixture_topics(rng, world, world.theta, ss_user, ss_time, 0.0),
    )
    p_user = np.concatenate([bg_user, ss_user])
    p_topic = np.concatenate([bg_topic, ss_topic])
    p_time = np.concatenate([bg_time, ss_time])
    if lh.enabled:
        p_user = np.concatenate([p_user, burst_user])
        p_topic = np.concatenate([p_topic, dormant[burst_user]])
        p_time = np.concatenate([p_time, burst_time])
    p_item = _items_of_topics(rng, world, p_topic, p_time)
    p_cols = {
        "item": p_item,
        "action": _actions(rng, world.save_propensity[p_user], PIN_ACTION_PROBS),
        "topic": p_topic.astype(np.int64),
    }
    if lh.enabled:
        p_cols["burst"] = np.arange(len(p_user)) >= len(p_user) - len(burst_user)
    pins = _tie_free(p_user, p_time, p_cols)
    pins_burst = pins.cols.pop("burst") if lh.enabled else None

    rng = stream(s.seed, 2, 1)
    a_user, a_time = _background(rng, world, present, ADS_PER_30_DAYS * L, log_end)
    a_topic = _mixture_topics(rng, world, world.phi, a_user, a_time, ADS_UNIFORM_PROB)
    ads = _tie_free(
        a_user,
        a_time,
        {
            "item": _items_of_topics(rng, world, a_topic, a_time),
            "action": _actions(rng, world.save_propensity[a_user], AD_ACTION_PROBS),
            "topic": a_topic.astype(np.int64),
        },
    )

    # Search queries: background ones, and each search request's own query (its first token) at
    # the request's time: later requests see it, the request itself does not.
    rng = stream(s.seed, 2, 2)
    q_user, q_time = _background(rng, world, present, QUERIES_PER_30_DAYS * L, log_end)
    q_topic = _mixture_topics(rng, world, world.theta, q_user, q_time, QUERIES_UNIFORM_PROB)
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
                stream(s.seed, 1, 2, block),
                world,
                user[lo:hi],
                surface[lo:hi],
                intent[lo:hi],
                anchor[lo:hi],
                n_cand[lo:hi],
                r_time[lo:hi],
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
    rng, world: World, user, surface, intent, anchor, n_cand, times, dormant=None
) -> Tuple[np.ndarray, np.ndarray]:
    """Candidate items of these requests (topic by surface-specific sources, the user's mixtures at
    the request ``times``); an item drawn twice for one request is shown once. Returns (items,
    candidates per request). ``dormant``: (topic per user, LongHistoryConfig) with long histories: a
    candidate of a user with a dormant topic is of that topic with probability candidate_share on the
    touched surfaces. In a drifting world the items are the day's (Drift.candidate_items)."""
    R, T = len(user), world.num_topics
    r = np.repeat(np.arange(R), n_cand)
    N = len(r)
    theta = mixtures_at(world, world.theta, user, times)
    phi = mixtures_at(world, world.phi, user, times)
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
    if world.drift is not None:
        item = world.drift.candidate_items(rng, topic, times[r])
    else:
        item = _items_of_topics(rng, world, topic, times[r])
    key = r * world.item_topic.size + item
    order = np.argsort(key, kind="stable")
    repeat = np.zeros(N, bool)
    repeat[order[1:]] = key[order[1:]] == key[order[:-1]]
    return item[~repeat], np.bincount(r[~repeat], minlength=R)


def segment_positions(lengths: np.ndarray) -> np.ndarray:
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


def _items_of_topics(rng: np.random.Generator, world: World, topics: np.ndarray, times: np.ndarray) -> np.ndarray:
    """An item of each topic, the topic's popular head first; in a drifting world one shown on the
    day of its time (Drift.event_items)."""
    if world.drift is not None:
        return world.drift.event_items(rng, topics, times)
    start = world.topic_start[topics - 1]
    count = world.topic_start[topics] - start
    pick = np.floor(count * rng.random(len(topics)) ** ITEM_POPULARITY_POWER).astype(np.int64)
    return world.items_by_topic[start + np.minimum(pick, count - 1)]


def _actions(rng: np.random.Generator, save_prob: np.ndarray, probs: np.ndarray) -> np.ndarray:
    other = rng.choice(len(probs), size=len(save_prob), p=probs / probs.sum())
    return np.where(rng.random(len(save_prob)) < save_prob, SAVE_ACTION, other).astype(np.int64)
