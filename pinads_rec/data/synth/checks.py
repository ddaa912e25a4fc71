"""What the generator needs of the ``synth:`` section (``check_synth_config``): every entry point
that generates runs it (``generate``, ``ensure``, ``make_world``); ConfigError names the key.
"""

from __future__ import annotations

import math

from pinads_rec.config import ConfigError, SynthConfig, positive
from pinads_rec.data.synth.truth import DENSE_COLUMNS, LOG_START, MIXTURE_SLOTS, QUERY_VOCAB, SURFACES, T0


def check_synth_config(s: SynthConfig) -> None:
    """Every value of the ``synth:`` section as the generator needs it (config.load leaves the section
    to the generator); raises ConfigError naming the key."""
    positive("synth.calibration_requests", s.calibration_requests, allow_zero=True)
    for name in (
        "train_requests",
        "eval_requests",
        "num_users",
        "num_items",
        "num_advertisers",
        "num_topics",
        "sequence_length",
        "event_embedding_dim",
        "num_files",
        "row_group_size",
    ):
        positive(f"synth.{name}", getattr(s, name))
    positive("synth.candidates_per_request", s.candidates_per_request)
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
    if s.drift is not None:
        _check_drift(s)
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


def _check_drift(s: SynthConfig) -> None:
    d, key = s.drift, "synth.drift"
    for name in ("days", "requests_per_day", "ad_lifetime_days", "trend_days"):
        positive(f"{key}.{name}", getattr(d, name))
    if not 0.0 <= d.new_ads_share < 1.0:
        raise ConfigError(f"{key}.new_ads_share: must be in [0, 1), got {d.new_ads_share}")
    positive(f"{key}.interest_shift_per_day", d.interest_shift_per_day, allow_zero=True)
    if not math.isfinite(d.trend_boost):
        raise ConfigError(f"{key}.trend_boost: must be a finite number, got {d.trend_boost}")
    if s.num_topics < 2:
        raise ConfigError(f"synth.num_topics: must be >= 2 with {key} (a trend moves to another topic), got 1")
    launched = round(s.num_items / d.ad_lifetime_days)
    if launched < s.num_topics:
        raise ConfigError(
            f"{key}.ad_lifetime_days: synth.num_items / ad_lifetime_days = {launched} ads launch a day, fewer than "
            f"synth.num_topics ({s.num_topics}): every topic launches one a day"
        )
    if s.long_history.enabled:
        raise ConfigError(
            f"{key}: not with synth.long_history.enabled (a dormant topic lies outside a user's mixture, which "
            "rotates in a drifting world)"
        )
