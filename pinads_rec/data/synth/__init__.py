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

A drifting world (synth.drift, off by default) replaces the splits by consecutive days, one
directory each: ads launch (new ids) and retire, users' interests rotate, a topic trends for a few
days; ``summary.json`` measures how fast the truth of one day goes stale on the next ones.

Splits are time windows: train, then calibration, then eval. ``--raw`` also writes the raw logs
(behaviour logs keyed by user and time, impression log, items table) that configs/demo.yaml's
``build:`` section turns back into the same contract (pinads_rec.data.build).

Formulas and coefficient values: docs/synthetic_data.md (keep it in sync with the constants of
``truth.py``). Everything is vectorized numpy; the timeline and the requests' blocks of
``BLOCK_REQUESTS`` each draw from their own PCG64 stream, so the data depend only on the seed and
the sizes, not on the number of files, the row-group size or the threads.

    python -m pinads_rec.data.synth --config configs/demo.yaml --out data/demo [--raw] [--seed N]

One job a module, in the order the data are made:

- ``truth.py``: the planted truth (every coefficient), the query-token scheme, the seeded streams
- ``world.py``: topics, items, advertisers, users and their topic mixtures (``make_world``)
- ``drift.py``: a drifting world's days: when each ad is shown, rotating interests, trends
  (``make_drift``)
- ``checks.py``: what the generator needs of the ``synth:`` section (``check_synth_config``)
- ``timeline.py``: visits, requests, behaviour logs and candidates in time; the splits' windows
  (``make_timeline``)
- ``blocks.py``: a block of requests with its sequences, planted probabilities, labels and feature
  faults (``sample_block``)
- ``tables.py``: the Arrow schema and tables (the contract, the raw logs)
- ``summary.py``: what ``summary.json`` says of a split (oracle metrics, sequence lengths)
- ``writing.py``: the files of every split, the raw logs and ``summary.json`` (``generate``)
- ``cache.py``: a data directory reused when generated with the same settings (``ensure``)
- ``cli.py``: the command line (``main``) and the summary as text

The names callers use are re-exported here; everything else is imported from its module.
"""

from pinads_rec.data.synth.blocks import Block, sample_block, sequence_caps
from pinads_rec.data.synth.cache import ensure, is_cached
from pinads_rec.data.synth.checks import check_synth_config
from pinads_rec.data.synth.cli import format_summary, main
from pinads_rec.data.synth.drift import Drift, day_names, new_ads_per_day, num_item_ids
from pinads_rec.data.synth.summary import burst_in_newest, drift_summary, oracle_metrics
from pinads_rec.data.synth.tables import contract_schema, schema
from pinads_rec.data.synth.timeline import (
    SPLITS,
    Timeline,
    history_lengths,
    make_timeline,
    pins_totals,
    split_boundaries,
    touched_surfaces,
    windows,
)
from pinads_rec.data.synth.truth import (
    BLOCK_REQUESTS,
    CLICK_OFFSET,
    CONTEXT_COEF,
    DAY_S,
    DENSE_COLUMNS,
    INTENT_COEF,
    INTEREST_SCALE,
    LOG_START,
    LONG_TERM_COEF,
    QUERY_COEF,
    SESSION_EVENTS,
    SHOPPING_OFFSET,
    SPAN_S,
    STALE_DAYS,
    SURFACES,
    T0,
    TASKS,
    Z_P90,
    query_tokens_per_topic,
)
from pinads_rec.data.synth.world import World, make_world
from pinads_rec.data.synth.writing import (
    PARQUET_OPTIONS,
    RAW_LOGS,
    check_raw,
    days_build_config,
    generate,
    write_raw,
)

__all__ = [
    "BLOCK_REQUESTS",
    "CLICK_OFFSET",
    "CONTEXT_COEF",
    "DAY_S",
    "DENSE_COLUMNS",
    "INTENT_COEF",
    "INTEREST_SCALE",
    "LOG_START",
    "LONG_TERM_COEF",
    "PARQUET_OPTIONS",
    "QUERY_COEF",
    "RAW_LOGS",
    "SESSION_EVENTS",
    "SHOPPING_OFFSET",
    "SPAN_S",
    "SPLITS",
    "STALE_DAYS",
    "SURFACES",
    "T0",
    "TASKS",
    "Z_P90",
    "Block",
    "Drift",
    "Timeline",
    "World",
    "burst_in_newest",
    "check_raw",
    "check_synth_config",
    "contract_schema",
    "day_names",
    "days_build_config",
    "drift_summary",
    "ensure",
    "format_summary",
    "generate",
    "history_lengths",
    "is_cached",
    "main",
    "make_timeline",
    "make_world",
    "new_ads_per_day",
    "num_item_ids",
    "oracle_metrics",
    "pins_totals",
    "query_tokens_per_topic",
    "sample_block",
    "schema",
    "sequence_caps",
    "split_boundaries",
    "touched_surfaces",
    "windows",
    "write_raw",
]
