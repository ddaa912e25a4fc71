"""Arrow tables of the generated data: the contract's schema and a block's rows in the per-request
layout the generator writes (data/loader/storage_layout.py), and the raw logs' tables (impressions, behaviour
logs, items).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pinads_rec.config import SynthConfig
from pinads_rec.data.loader import storage_layout
from pinads_rec.data.synth.blocks import Block
from pinads_rec.data.synth.timeline import Events, Group, segment_positions
from pinads_rec.data.synth.truth import ITEM_EMB_DIM, SURFACES, TASKS
from pinads_rec.data.synth.world import World

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


def _arrow(v: np.ndarray) -> pa.Array:
    return pa.FixedSizeListArray.from_arrays(pa.array(v.reshape(-1)), v.shape[1]) if v.ndim == 2 else pa.array(v)


# Stored once per request: every column the generator draws per request (the data/loader/storage_layout.py metadata
# records them, so a config marking other features user-side reads the files as well).
REQUEST_LEVEL = ("request_id", "user_id", "surface", "timestamp", "context_topic", "query_tokens") + tuple(
    name
    for name in schema(1).names
    if name.startswith("seq_")  # every sequence group column
)


def request_table(b: Block, sch: pa.Schema) -> pa.Table:
    """A block's requests in the per-request layout (data/loader/storage_layout.py): the request-level columns once,
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


def contract_table(b: Block, sch: pa.Schema) -> pa.Table:
    """The contract rows of a block in the storage layout the generator writes (per request)."""
    return request_table(b, sch)


def contract_schema(s: SynthConfig) -> pa.Schema:
    return storage_layout.per_request_schema(schema(s.event_embedding_dim), None, REQUEST_LEVEL)


# The raw logs' tables (out/raw/): what a logging system would have recorded.
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


def _per_row_lists(group: Group, n_cand: np.ndarray) -> Tuple[pa.Array, pa.Array]:
    """Row offsets and the gather index that repeats each request's sequence on its rows."""
    row_len = np.repeat(group.lengths, n_cand)
    row_off = np.zeros(len(row_len) + 1, dtype=np.int32)
    np.cumsum(row_len, out=row_off[1:])
    req_start = np.cumsum(group.lengths) - group.lengths
    shift = np.repeat(req_start, n_cand) - row_off[:-1]
    idx = np.repeat(shift, row_len) + np.arange(row_off[-1], dtype=np.int64)
    return pa.array(row_off), pa.array(idx)


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
        "position": pa.array(segment_positions(n)),
        "context_topic": pa.array(rep(b.context_topic)),
        "query_tokens": pa.ListArray.from_arrays(offsets, pc.take(pa.array(qt.cols["query_tokens"]), idx)),
        "user_activity": pa.array(b.rows["user_activity"]),
    }
    for t in TASKS:
        cols[t] = pa.array(b.rows[t])
        cols[f"true_p_{t}"] = pa.array(b.rows[f"true_p_{t}"])
    return pa.Table.from_arrays([cols[f.name] for f in IMPRESSION_SCHEMA], schema=IMPRESSION_SCHEMA)


def log_table(world: World, log: Events, group: str, order: Optional[np.ndarray] = None) -> pa.Table:
    """A behaviour log keyed by user and time only, in time order (as logs are written); ``order``:
    the events written, in that order (default: all, by time)."""
    order = np.argsort(log.time, kind="stable") if order is None else order
    cols = {"user_id": pa.array(log.user[order]), "timestamp": pa.array(log.time[order])}
    cols.update({name: pa.array(v[order]) for name, v in log.cols.items()})
    if group == "pins":
        cols["embedding"] = _arrow(world.item_event_emb[log.cols["item"][order]])
    return pa.table(cols)


def items_table(world: World, ids: Optional[np.ndarray] = None) -> pa.Table:
    """The items side table: every item, or those of ``ids``."""
    ids = np.arange(len(world.item_topic), dtype=np.int64) if ids is None else ids.astype(np.int64)
    return pa.table(
        {
            "item_id": pa.array(ids),
            "advertiser_id": pa.array(world.item_advertiser[ids]),
            "ad_type": pa.array(world.item_ad_type[ids]),
            "topic": pa.array(world.item_topic[ids]),
            "ctr_prior": pa.array(world.item_prior[ids]),
            "embedding": _arrow(world.item_emb[ids]),
        }
    )
