"""The planted truth: every coefficient of the generator (docs/synthetic_data.md states each and
its formula: keep the two in sync), the query-token scheme, and the seeded streams every draw
comes from (``stream``: the data depend only on the seed and the sizes).
"""

from __future__ import annotations

import numpy as np

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

# A drifting world (synth.drift; its knobs are config, these are fixed).
DAY_S = 86400
STALE_DAYS = 7  # each row is also scored by the truth of each of the 7 days before its own (the drift check)

TASKS = ("click", "good_click", "save")
DENSE_COLUMNS = ("user_activity", "item_ctr_prior", "item_embedding")


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def stream(seed: int, *key: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=key)))


def query_tokens_per_topic(num_topics: int) -> int:
    """K: topic k (1-based) owns tokens 1 + (k-1)*K + r, r in [0, K), all < QUERY_VOCAB."""
    return min(QUERY_TOKENS_PER_TOPIC, (QUERY_VOCAB - 1) // num_topics)
