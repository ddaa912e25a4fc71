"""The ``synth:`` section: sizes, seed, planted faults, long histories and drift of the planted-truth
generator (``pinads_rec/data/synth/``; docs/synthetic_data.md), declared beside the generator that
reads it. Its values are checked where it generates (``synth/checks.py``: ``check_synth_config``).

A leaf module outside the ``synth`` package on purpose: the config composes this section, and
importing ``pinads_rec.data.synth.<x>`` would run the package's ``__init__``, which imports the
config back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class FaultsConfig:
    """Feature faults the generator can plant (to exercise Resilient Batch Norm)."""

    # Dense column zero-filled for requests whose time falls in [start, end) (fractions of the span).
    zero_fill_column: Optional[str] = None
    # [start, end) of the zero-fill, as fractions of the data's time span.
    zero_fill_window: List[float] = field(default_factory=lambda: [0.4, 0.5])
    # Dense column whose distribution shifts (scale x shift_scale + shift_offset) after a time point.
    shift_column: Optional[str] = None
    # The time point (a fraction of the span) from which shift_column is shifted.
    shift_after: float = 0.7
    # The shift's factor.
    shift_scale: float = 5.0
    # The shift's offset (added after the scaling).
    shift_offset: float = 3.0
    # Fraction of rows whose dense values are stale (copied from an earlier row of the user).
    stale_fraction: float = 0.0


@dataclass
class LongHistoryConfig:
    """Long pins histories and a planted dormant interest (docs/synthetic_data.md, "Long histories
    and a dormant interest"). Off: the data are exactly those of the generator without it."""

    # Plant long histories and the dormant interest (false: the plain generator's data).
    enabled: bool = False
    # Each user's total pins events over the 90-day log: LogNormal with this median and 90th
    # percentile, rounded and clipped to [1, max_length]; max_length is also the pins cap a request
    # carries (sequence_caps()["pins"]).
    median: float = 200.0
    # The 90th percentile of that LogNormal.
    p90: float = 1500.0
    # The clip of a user's event count, and the pins cap a request carries.
    max_length: int = 4000
    # Users with at least min_history pins events have a dormant topic outside their mixture: a burst
    # of burst_share of their events on it in the log's first burst_days days, candidates of it with
    # probability candidate_share and dormant_coef on the click logit, on the surfaces listed.
    min_history: int = 300
    # Fraction of a dormant user's events in the burst on the dormant topic.
    burst_share: float = 0.1
    # The burst falls in the log's first burst_days days.
    burst_days: float = 15.0
    # Probability that a candidate of such a user is of the dormant topic.
    candidate_share: float = 0.1
    # Added to the click logit of a candidate of the user's dormant topic.
    dormant_coef: float = 3.0
    # The surfaces where the dormant topic's candidates appear.
    surfaces: List[str] = field(default_factory=lambda: ["home_feed", "related_pins"])


@dataclass
class DriftConfig:
    """A world that drifts day by day, written one directory a day (docs/synthetic_data.md, "A
    drifting world"): ads launch and retire, users' interests rotate, a topic trends for a few days.
    Set (e.g. ``--set synth.drift.days=14``) it replaces the train / calibration / eval splits."""

    # Consecutive calendar days from 2023-11-15 (UTC): <out>/days/<YYYY-MM-DD>/ each.
    days: int = 14
    # Requests per day (synth.train_requests, eval_requests and calibration_requests are not read).
    requests_per_day: int = 20000
    # From the second day: share of a day's candidate draws that go to the ads launched that day.
    new_ads_share: float = 0.2
    # Days an ad is shown: round(num_items / ad_lifetime_days) ads launch a day (new ids, above all
    # earlier ones) and about as many retire (no impressions after); the first day's over its first days.
    ad_lifetime_days: int = 10
    # Users' interests rotate: each day this fraction of every topic's weight in a user's mixtures
    # (long-term and shopping) moves on to the next topic (k -> k + 1, the last to the first).
    interest_shift_per_day: float = 0.1
    # A trending topic lasts this many days, then another one trends.
    trend_days: int = 3
    # Added to the click logit of a candidate of the day's trending topic.
    trend_boost: float = 1.5


@dataclass
class SynthConfig:
    """Sizes and seed of the planted-truth synthetic data (see docs/synthetic_data.md)."""

    # Seeds every random draw of the generator: same seed and sizes, same data.
    seed: int = 0
    # Requests in the train split.
    train_requests: int = 20000
    # Requests in the eval split (after every training one in time).
    eval_requests: int = 4000
    # Requests of the training period's latest part (after every train request, before every eval
    # one), written to calibration/ (fit the calibration layers on them with data.calibration_dir).
    # 0: no calibration split.
    calibration_requests: int = 0
    # Mean candidate rows per request: 1 + Poisson(candidates_per_request - 1).
    candidates_per_request: float = 12.0
    # Users the requests are drawn from (a user makes several).
    num_users: int = 200000
    # Candidate items (ads): item_id in [0, num_items).
    num_items: int = 50000
    # Advertisers; each item belongs to one.
    num_advertisers: int = 2000
    # Topics of the planted world (items, interests, queries).
    num_topics: int = 32
    # L: the pins group's cap (L / 2 for ads and queries), also the background events' scale.
    sequence_length: int = 100
    # Width of the pretrained per-event embedding of the pins group (a noisy topic vector). It is
    # repeated on every candidate row of a request, so it dominates the file size.
    event_embedding_dim: int = 32
    # Train files (eval and calibration get proportionally fewer, at least 2).
    num_files: int = 4
    # Rows per Parquet row group, at most (row groups hold whole requests).
    row_group_size: int = 8192
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    long_history: LongHistoryConfig = field(default_factory=LongHistoryConfig)
    # A world that drifts day by day (DriftConfig); null: the fixed world and its splits.
    drift: Optional[DriftConfig] = None
