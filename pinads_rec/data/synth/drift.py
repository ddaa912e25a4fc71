"""The drifting world (``synth.drift``): consecutive days, ads that launch and retire, users'
interests that rotate and a topic that trends for a few days (``make_drift``), and what the timeline
and the blocks ask of it: the ads a day shows (``Drift.event_items``, ``Drift.candidate_items``), a
user's mixture at a time (``Drift.rotate``, ``Drift.rotated``) and a day's trending topic.

The items themselves (the first day's catalogue and every later day's launches) are made by
``world.make_world``; this module says when each is shown.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List, Tuple

import numpy as np

from pinads_rec.data.synth.truth import DAY_S, ITEM_POPULARITY_POWER, T0, stream
from pinads_rec.data.synth_settings import DriftConfig, SynthConfig


def new_ads_per_day(s: SynthConfig) -> int:
    """Ads launched each day from the second (and retired each day, in the steady state)."""
    return int(round(s.num_items / s.drift.ad_lifetime_days))


def num_item_ids(s: SynthConfig) -> int:
    """Item ids of the whole run: the first day's catalogue and every later day's launches."""
    return s.num_items + (s.drift.days - 1) * new_ads_per_day(s) if s.drift is not None else s.num_items


def day_names(s: SynthConfig) -> List[str]:
    """Each day's name (its UTC date, YYYY-MM-DD) and output directory, days/<name>/."""
    return [time.strftime("%Y-%m-%d", time.gmtime(T0 + d * DAY_S)) for d in range(s.drift.days)]


@dataclass
class Catalogue:
    """Items grouped by (day, topic), each group in appeal order (the popular head first): the items
    of day d and topic k are ``items[start[g] : start[g + 1]]``, g = d * T + k - 1."""

    items: np.ndarray
    start: np.ndarray

    def count(self, group: np.ndarray) -> np.ndarray:
        return self.start[group + 1] - self.start[group]

    def pick(self, rng: np.random.Generator, group: np.ndarray) -> np.ndarray:
        """One item of each (non-empty) group: index floor(count * U^1.5), as the fixed world picks."""
        start, count = self.start[group], self.count(group)
        idx = np.floor(count * rng.random(len(group)) ** ITEM_POPULARITY_POWER).astype(np.int64)
        return self.items[start + np.minimum(idx, count - 1)]


def _catalogue(shown: np.ndarray, item_topic: np.ndarray, appeal: np.ndarray, num_topics: int) -> Catalogue:
    """``shown`` [days, I] bool -> the Catalogue of those (day, item) pairs."""
    day, item = np.nonzero(shown)
    group = day * num_topics + item_topic[item] - 1
    order = np.lexsort((appeal[item], group))
    start = np.searchsorted(group[order], np.arange(shown.shape[0] * num_topics + 1))
    return Catalogue(item[order].astype(np.int64), start)


@dataclass
class Drift:
    cfg: DriftConfig
    num_topics: int
    launch: np.ndarray  # [I] the day an ad is first shown (-1: the first day's catalogue)
    retire: np.ndarray  # [I] the first day it is not shown: shown on the days launch <= d < retire
    trend: np.ndarray  # [days] the trending topic of each day
    live: Catalogue  # per day the ads shown (the behaviour logs' items)
    new: Catalogue  # per day the ads launched that day
    old: Catalogue  # per day the ads shown that launched before it

    @property
    def days(self) -> int:
        return self.cfg.days

    def day(self, times: np.ndarray) -> np.ndarray:
        """The day index of each time, clipped to the run's days (events before the first day see its
        catalogue)."""
        return np.clip((np.asarray(times, np.int64) - T0) // DAY_S, 0, self.days - 1)

    def shift(self, times: np.ndarray) -> np.ndarray:
        """How far (in topics) the users' interests have rotated at each time: interest_shift_per_day
        a day since the first day's start (negative before it)."""
        return self.cfg.interest_shift_per_day * (np.asarray(times, np.int64) - T0) / DAY_S

    def rotate(self, rng: np.random.Generator, topics: np.ndarray, times: np.ndarray) -> np.ndarray:
        """Topics (1-based) drawn from the first day's mixtures -> draws from the mixtures at
        ``times``: topic k moves on by floor(shift), and one more with probability frac(shift)."""
        s = self.shift(times)
        step = np.floor(s).astype(np.int64) + (rng.random(len(topics)) < s - np.floor(s))
        return (topics.astype(np.int64) - 1 + step) % self.num_topics + 1

    def rotated(self, topic: np.ndarray, weight: np.ndarray, times: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """Sparse mixtures [R, slots] (0-based topics, weights) of the first day -> the same at
        ``times`` [R], as [R, 2 slots]: each weight w of topic k splits into (1 - f) w on k + n and
        f w on k + n + 1, n + f = shift."""
        s = self.shift(times)
        n = np.floor(s)
        f = (s - n)[:, None]
        t0 = (topic.astype(np.int64) + n.astype(np.int64)[:, None]) % self.num_topics
        t1 = (t0 + 1) % self.num_topics
        return np.concatenate([t0, t1], axis=1), np.concatenate([weight * (1.0 - f), weight * f], axis=1)

    def event_items(self, rng: np.random.Generator, topics: np.ndarray, times: np.ndarray) -> np.ndarray:
        """An item of each topic among the ads shown on the event's day."""
        return self.live.pick(rng, self.day(times) * self.num_topics + topics - 1)

    def candidate_items(self, rng: np.random.Generator, topics: np.ndarray, times: np.ndarray) -> np.ndarray:
        """A candidate of each topic: one of the day's launches with probability new_ads_share, else
        one of the earlier ads still shown (either, where the other has none of the topic)."""
        group = self.day(times) * self.num_topics + topics - 1
        fresh = rng.random(len(group)) < self.cfg.new_ads_share
        use_new = (fresh & (self.new.count(group) > 0)) | (self.old.count(group) == 0)
        out = np.empty(len(group), np.int64)
        out[use_new] = self.new.pick(rng, group[use_new])
        out[~use_new] = self.old.pick(rng, group[~use_new])
        return out


def make_drift(s: SynthConfig, item_topic: np.ndarray, pop: np.ndarray) -> Drift:
    """When each item is shown and which topic trends when, for ``item_topic`` [num_item_ids(s)]
    (the first day's num_items ads, then new_ads_per_day(s) a day); ``pop`` [T]: the topics'
    popularity, which the trending topics are drawn by. The first day's ad i retires at
    the start of day 1 + (i mod ad_lifetime_days); an ad launched on day d at the start of day
    d + ad_lifetime_days."""
    d, T = s.drift, s.num_topics
    n, life = new_ads_per_day(s), d.ad_lifetime_days
    first = np.arange(s.num_items)
    launch = np.concatenate([np.full(s.num_items, -1), 1 + np.arange((d.days - 1) * n) // max(n, 1)])
    retire = np.concatenate([1 + first % life, launch[s.num_items :] + life])
    rng = stream(s.seed, 5, 1)
    appeal = rng.permutation(len(item_topic))  # the order of popularity within a (day, topic)
    periods = -(-d.days // d.trend_days)
    trend = np.zeros(periods + 1, np.int64)  # by popularity, each period's differing from the one before
    for p in range(1, periods + 1):
        weights = np.where(np.arange(1, T + 1) == trend[p - 1], 0.0, pop)
        trend[p] = 1 + rng.choice(T, p=weights / weights.sum())
    trend = trend[1:]
    day = np.arange(d.days)[:, None]
    shown = (launch[None, :] <= day) & (day < retire[None, :])
    return Drift(
        d,
        T,
        launch,
        retire,
        trend[np.arange(d.days) // d.trend_days],
        _catalogue(shown, item_topic, appeal, T),
        _catalogue(shown & (launch[None, :] == day), item_topic, appeal, T),
        _catalogue(shown & (launch[None, :] < day), item_topic, appeal, T),
    )
