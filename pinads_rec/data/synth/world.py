"""The world the planted truth acts on: topics, items, advertisers and users with their topic
mixtures, fixed for a seed (``make_world``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from pinads_rec.config import SynthConfig
from pinads_rec.data.synth.checks import check_synth_config
from pinads_rec.data.synth.drift import Drift, make_drift, new_ads_per_day
from pinads_rec.data.synth.truth import (
    ACTIVITY_SD,
    ADVERTISER_SD,
    ITEM_EMB_DIM,
    ITEM_EMB_NOISE,
    MIXTURE_EXTRA_TOPICS,
    MIXTURE_SLOTS,
    PRIOR_BASE,
    PRIOR_NOISE,
    QUALITY_SD,
    SAVE_PROPENSITY,
    SHOPPING_ADVERTISER_FRACTION,
    TOPIC_ZIPF,
    sigmoid,
    stream,
)


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
    advertiser_effect: np.ndarray  # [A] a_adv (the part of q_i an advertiser's ads share)
    drift: Optional[Drift] = None  # synth.drift: when each item is shown, the trends (drift.py)


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


def dense_mixtures(topic: np.ndarray, weight: np.ndarray, num_topics: int) -> np.ndarray:
    """[R, T] float64 mixtures from the sparse [R, slots] form."""
    R = len(topic)
    flat = (np.arange(R)[:, None] * num_topics + topic).ravel()
    return np.bincount(flat, weights=weight.ravel(), minlength=R * num_topics).reshape(R, num_topics)


def mixtures_at(world: World, mix, users: np.ndarray, times: np.ndarray) -> np.ndarray:
    """[R, T] float64: the mixtures ``mix`` (world.theta or world.phi) of ``users`` at ``times``: as
    drawn in the fixed world, rotated to the time in a drifting one (Drift.rotated)."""
    topic, weight = mix[0][users], mix[1][users]
    if world.drift is not None:
        topic, weight = world.drift.rotated(topic, weight, times)
    return dense_mixtures(topic, weight, world.num_topics)


def _launched_ads(rng, s: SynthConfig, pop, centroids, event_centroids, adv_effect) -> Tuple[np.ndarray, ...]:
    """synth.drift: the ads launched on the days after the first, new_ads_per_day(s) a day, each day's
    covering every topic (the rest by popularity); drawn as the first day's are. Returns (topic,
    advertiser, quality, prior, embedding, event embedding)."""
    T, n = s.num_topics, new_ads_per_day(s)
    days = [
        rng.permutation(np.concatenate([np.arange(1, T + 1), 1 + rng.choice(T, size=n - T, p=pop)]))
        for _ in range(s.drift.days - 1)
    ]
    topic = np.concatenate(days).astype(np.int64) if days else np.zeros(0, np.int64)
    advertiser = rng.integers(0, s.num_advertisers, len(topic))
    quality = rng.normal(0.0, QUALITY_SD, len(topic)) + adv_effect[advertiser]
    prior = sigmoid(PRIOR_BASE + quality + rng.normal(0.0, PRIOR_NOISE, len(topic))).astype(np.float32)
    emb = _noisy_topic_vectors(rng, centroids, topic)
    event_emb = emb if event_centroids is centroids else _noisy_topic_vectors(rng, event_centroids, topic)
    return topic, advertiser, quality, prior, emb, event_emb


def make_world(s: SynthConfig) -> World:
    check_synth_config(s)
    rng = stream(s.seed, 0)
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
    prior = sigmoid(PRIOR_BASE + quality + rng.normal(0.0, PRIOR_NOISE, I)).astype(np.float32)
    item_emb = _noisy_topic_vectors(rng, centroids, item_topic)
    if s.event_embedding_dim == ITEM_EMB_DIM:
        event_centroids, item_event_emb = centroids, item_emb
    else:
        event_centroids = _unit_vectors(rng, T, s.event_embedding_dim)
        item_event_emb = _noisy_topic_vectors(rng, event_centroids, item_topic)
    theta = _sparse_mixtures(rng, pop, U)
    phi = _sparse_mixtures(rng, pop, U)
    activity = rng.lognormal(0.0, ACTIVITY_SD, U)
    save_prop = rng.beta(*SAVE_PROPENSITY, U)
    if s.drift is not None:  # the later days' launches, from a stream of their own: day 0 is the fixed world
        new = _launched_ads(stream(s.seed, 5, 0), s, pop, centroids, event_centroids, adv_effect)
        item_topic, item_advertiser, quality, prior, item_emb, item_event_emb = (
            np.concatenate([a, b])
            for a, b in zip((item_topic, item_advertiser, quality, prior, item_emb, item_event_emb), new)
        )
        item_event_emb = item_emb if event_centroids is centroids else item_event_emb
    order = np.argsort(item_topic, kind="stable")
    topic_start = np.searchsorted(item_topic[order], np.arange(1, T + 2))
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
        adv_effect,
        make_drift(s, item_topic.astype(np.int64), pop) if s.drift is not None else None,
    )
