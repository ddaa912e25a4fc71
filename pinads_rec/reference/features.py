"""Point-in-time features of built rows, computed from the built files alone: what a practitioner's
first model (LightGBM, ``pinads_rec.reference.fit``) is given.

Per row, generic over the config:

- for every candidate feature that shares a table with a sequence feature (the config's table
  sharing, ``FeatureLayout.shared_keys``), and every group holding a feature of that table: the
  matches of the candidate's id among the newest 5, 20 and all of the request's events (log1p) and
  the log seconds since the newest match. The events are the request's own (built before its
  timestamp), so nothing here looks past the request;
- when the item feature itself is such a feature (KuaiRand's ``video_id``): the same counts for
  each candidate attribute that is a function of the item (author, tags, ...; the map read off
  the built rows), the events' items mapped to it -- "an earlier click was by this author";
- the item's and the user's positive rate per task on the training split, smoothed towards the
  mean; out of fold on the training rows themselves (a row never sees its own label);
- the config's one-wide dense features (signed log where the config says ``norm: log``) and the
  surface, one-hot.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pinads_rec import config
from pinads_rec.data.loader import storage_layout
from pinads_rec.data.loader.reader import list_files, open_parquet
from pinads_rec.features import FeatureLayout

RECENT = (5, 20)  # the newest events counted, besides all of them
NO_MATCH_S = 90 * 86400.0  # the recency feature of a row with no match
RATE_PRIOR = 20.0  # pseudo-impressions at the mean rate in the smoothed rates
FOLDS = 5  # out-of-fold rates on the training rows
CHUNK_ROWS = 50_000  # rows per chunk of the match features (bounds their [rows, events] arrays)


def _padded(arr: pa.Array, fill: int = -1) -> np.ndarray:
    """A list<int> array as [n, longest] int64, ``fill`` past each list's end."""
    arr = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
    lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy().astype(np.int64)
    values = pc.list_flatten(arr).to_numpy(zero_copy_only=False).astype(np.int64)
    out = np.full((len(lengths), max(int(lengths.max(initial=0)), 1)), fill, dtype=np.int64)
    starts = np.cumsum(lengths) - lengths
    rows = np.repeat(np.arange(len(lengths)), lengths)
    out[rows, np.arange(len(values)) - starts[rows]] = values
    return out


def _read_requests(path: str, features: config.FeaturesConfig, columns: Sequence[str]) -> List[pa.Table]:
    """Every file of a built split as a per-request table of ``columns`` (per-row files converted)."""
    tables = []
    for name in list_files(path):
        table = open_parquet(name).read(columns=list(dict.fromkeys(columns)))
        if not storage_layout.is_per_request(table.schema, features):
            table = storage_layout.to_per_request(table, features)
        tables.append(table)
    return tables


class Split:
    """One built split in memory, per request: candidate columns one value per row, request-level
    ones once per request; ``req`` the request of each row, ``request_index`` each kept request's
    position in the whole split (a sample keeps some requests whole)."""

    def __init__(self, table: pa.Table, features: config.FeaturesConfig, request_index: np.ndarray, total_rows: int):
        self.table = table
        self.request_level = storage_layout.stored_request_level(table.schema, features)
        counts = storage_layout.candidate_counts(table, features)
        self.req = np.repeat(np.arange(len(counts)), counts)
        self.n = len(self.req)
        self.request_index = request_index
        self.total_rows = total_rows  # rows of the whole split, sampled or not

    @classmethod
    def read(
        cls,
        path: str,
        features: config.FeaturesConfig,
        columns: Sequence[str],
        max_rows: int = 0,
        seed: int = 0,
    ) -> "Split":
        """The split under ``path``; with ``max_rows`` > 0 and more rows than that, a uniform sample of
        whole requests holding about ``max_rows`` rows (read a file at a time)."""
        label = features.tasks[0].label_column
        counts = [storage_layout.candidate_counts(t, features) for t in _read_requests(path, features, [label])]
        total = int(sum(c.sum() for c in counts))
        sizes = np.concatenate(counts) if counts else np.zeros(0, np.int64)
        keep = np.ones(len(sizes), bool)
        if 0 < max_rows < total:
            order = np.random.default_rng(seed).permutation(len(sizes))
            chosen = order[: int(np.searchsorted(np.cumsum(sizes[order]), max_rows)) + 1]
            keep = np.zeros(len(sizes), bool)
            keep[chosen] = True
        held = set(open_parquet(list_files(path)[0]).schema_arrow.names)
        columns = [c for c in columns if c in held]  # user and item ids are optional
        parts, start = [], 0
        for name in list_files(path):
            table = _read_requests(name, features, columns)[0]
            mask = keep[start : start + table.num_rows]
            parts.append(table if mask.all() else table.filter(pa.array(mask)))
            start += table.num_rows
        return cls(pa.concat_tables(parts), features, np.flatnonzero(keep), total)

    def has(self, column: str) -> bool:
        return column in self.table.column_names

    def row_values(self, column: str) -> np.ndarray:
        """A scalar column, one value per row."""
        col = self.table.column(column).combine_chunks()
        if column in self.request_level:
            return col.to_numpy(zero_copy_only=False)[self.req]
        return pc.list_flatten(col).to_numpy(zero_copy_only=False)

    def row_lists(self, column: str) -> np.ndarray:
        """An id column as [rows, k] (single ids: k = 1), -1 padded."""
        col = self.table.column(column).combine_chunks()
        if column in self.request_level:
            one = col if pa.types.is_list(col.type) else pa.array([[x] for x in col.to_pylist()])
            return _padded(one)[self.req]
        flat = pc.list_flatten(col)
        return _padded(flat) if pa.types.is_list(flat.type) else flat.to_numpy(zero_copy_only=False)[:, None]

    def request_padded(self, column: str) -> np.ndarray:
        """A request-level list column as [requests, L]; a list of bags (a multi-valued event
        attribute) as [requests, L, K]; -1 padded."""
        col = self.table.column(column).combine_chunks()
        if not pa.types.is_list(col.type.value_type):
            return _padded(col)
        events = _padded(pc.list_flatten(col))  # [all events, K]
        lengths = pc.fill_null(pc.list_value_length(col), 0).to_numpy().astype(np.int64)
        out = np.full((len(lengths), max(int(lengths.max(initial=0)), 1), events.shape[1]), -1, dtype=np.int64)
        starts = np.cumsum(lengths) - lengths
        rows = np.repeat(np.arange(len(lengths)), lengths)
        out[rows, np.arange(len(events)) - starts[rows]] = events
        return out

    def surface_index(self, features: config.FeaturesConfig) -> np.ndarray:
        """The surface of each row as an index into features.surfaces (stored as a name or an index)."""
        values = self.row_values(features.columns.surface)
        if values.dtype.kind in "iu":
            return values.astype(np.int64)
        index = {name: i for i, name in enumerate(features.surfaces)}
        return np.array([index.get(v, -1) for v in values.tolist()], dtype=np.int64)

    def labels(self, features: config.FeaturesConfig) -> np.ndarray:
        """[rows, tasks] float64."""
        return np.stack([self.row_values(t.label_column) for t in features.tasks], 1).astype(np.float64)


def _signed_log(x: np.ndarray) -> np.ndarray:
    return np.sign(x) * np.log1p(np.abs(x))


def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-6, 1 - 1e-6)
    return np.log(p / (1 - p))


class RateTable:
    """Label sums and counts per id (each task), over the whole training split and per fold."""

    def __init__(self, ids: np.ndarray, labels: np.ndarray, fold: np.ndarray):
        self.keys, inverse = np.unique(ids.astype(np.int64), return_inverse=True)
        size, tasks = len(self.keys), labels.shape[1]
        self.sums = np.zeros((FOLDS, size, tasks))
        self.counts = np.zeros((FOLDS, size))
        for k in range(FOLDS):
            on = fold == k
            self.counts[k] = np.bincount(inverse[on], minlength=size)
            for t in range(tasks):
                self.sums[k, :, t] = np.bincount(inverse[on], weights=labels[on, t], minlength=size)

    def rates(self, ids: np.ndarray, prior: np.ndarray, fold: Optional[np.ndarray]) -> np.ndarray:
        """Smoothed rates (logit) of ``ids`` per task; ``fold`` given: without that fold's rows."""
        ids = ids.astype(np.int64)
        pos = np.clip(np.searchsorted(self.keys, ids), 0, max(len(self.keys) - 1, 0))
        known = (self.keys[pos] == ids) if len(self.keys) else np.zeros(len(ids), bool)
        s = np.where(known[:, None], self.sums.sum(0)[pos], 0.0)
        c = np.where(known, self.counts.sum(0)[pos], 0.0)
        if fold is not None:
            s -= np.where(known[:, None], self.sums[fold, pos], 0.0)
            c -= np.where(known, self.counts[fold, pos], 0.0)
        return _logit((s + RATE_PRIOR * prior) / (c + RATE_PRIOR)[:, None])


class PointInTimeFeatures:
    """The feature map of the module docstring; the rates fitted on ``train`` (the whole training
    split: ids and labels only), the item attributes read off ``splits``' rows."""

    def __init__(self, features: config.FeaturesConfig, train: Split, splits: Sequence[Split]):
        f = features
        self.features, self.layout = f, FeatureLayout.of(f)
        sparse = {s.name: s for s in f.sparse}
        # (candidate column, group, event column) for each candidate feature on a sequence table.
        self.matches = []
        for key in self.layout.shared_keys:
            s = sparse[key]
            if s.user_side:
                continue
            for g in f.sequence_groups:
                for e in g.features:
                    if e.table == s.table:
                        self.matches.append((s.column, g, e.column))
        # The item's attributes, through the events' items: when the item feature is shared.
        item = next((s for s in f.sparse if s.column == f.columns.item_id and not s.user_side), None)
        self.attributes = []  # (attribute column, group, event column, item -> [k] ids)
        if item is not None and item.name in self.layout.shared_keys:
            for s in f.sparse:
                if s.user_side or s.name == item.name or s.table in self.layout.sequence_tables:
                    continue
                of_item = self._attribute_map(splits, f.columns.item_id, s.column)
                if of_item is None:
                    continue
                for column, g, e in self.matches:
                    if column == item.column:
                        self.attributes.append((s.column, g, e, of_item))
        labels = train.labels(f)
        fold = train.request_index[train.req] % FOLDS
        self.prior = labels.mean(0) if len(labels) else np.full(len(f.tasks), 0.5)
        # The item's and the user's rates, where the split holds their columns.
        self.rated = [(w, c) for w, c in (("item", f.columns.item_id), ("user", f.columns.user_id)) if train.has(c)]
        self.rate_tables = {w: RateTable(train.row_values(c), labels, fold) for w, c in self.rated}

    @staticmethod
    def columns(features: config.FeaturesConfig) -> List[str]:
        """The built columns the features read (with the labels and the user); the user's and the item's
        are read where the files hold them."""
        f = features
        out = [f.columns.timestamp, f.columns.user_id, f.columns.item_id, f.columns.surface]
        out += [t.label_column for t in f.tasks]
        out += [s.column for s in f.sparse if not s.user_side]
        out += [c for g in f.sequence_groups for c in [g.timestamp_column] + [e.column for e in g.features]]
        out += [d.column for d in f.dense if d.dim == 1]
        return list(dict.fromkeys(out))

    @staticmethod
    def _attribute_map(splits: Sequence[Split], item_column: str, column: str) -> Optional[np.ndarray]:
        """item id -> its ``column`` ids ([items, k], -1 padded) when every item has one value in
        every split's rows (an item attribute); None otherwise. The unknown item (0) has none."""
        items = np.concatenate([s.row_values(item_column) for s in splits]).astype(np.int64)
        lists = [s.row_lists(column) for s in splits]
        k = max(x.shape[1] for x in lists)
        values = np.concatenate([np.pad(x, ((0, 0), (0, k - x.shape[1])), constant_values=-1) for x in lists])
        known = items > 0
        items, values = items[known], values[known]
        if len(items) and int(items.max()) > 50_000_000:  # raw or hashed ids: no dense map
            return None
        out = np.full((int(items.max(initial=0)) + 1, k), -2, dtype=np.int64)
        out[items] = values
        if not (out[items] == values).all():  # an item with two values: not an attribute
            return None
        out[out == -2] = -1
        return out

    def names(self) -> List[str]:
        out = []
        for column, _, e in self.matches:
            out += [f"{column}~{e}: newest {k}" for k in RECENT] + [f"{column}~{e}: all", f"{column}~{e}: log s since"]
        for column, _, e, _ in self.attributes:
            out += [f"{column}~{e}.{column}: newest {k}" for k in RECENT]
            out += [f"{column}~{e}.{column}: all", f"{column}~{e}.{column}: log s since"]
        tasks = [t.label_column for t in self.features.tasks]
        out += [f"{w} rate {t}" for w, _ in self.rated for t in tasks]
        out += [d.name for d in self.features.dense if d.dim == 1]
        out += [f"surface {s}" for s in self.features.surfaces]
        return out

    def history(self) -> np.ndarray:
        """Which of ``names()`` the sequences give (the match features)."""
        return np.array(["~" in n for n in self.names()])

    def transform(self, split: Split, train_rows: bool = False) -> np.ndarray:
        """[rows, features] float32; ``train_rows``: the split is (a sample of) the training split, whose
        rates are out of fold."""
        f = self.features
        t_req = split.table.column(f.columns.timestamp).combine_chunks().to_numpy().astype(np.float64)
        blocks = []
        for column, g, e in self.matches:
            blocks.append(self._match_features(split, split.row_lists(column), split.request_padded(e), g, t_req, None))
        for column, g, e, of_item in self.attributes:
            cand = split.row_lists(column)
            blocks.append(self._match_features(split, cand, split.request_padded(e), g, t_req, of_item))
        fold = split.request_index[split.req] % FOLDS if train_rows else None
        for which, column in self.rated:
            blocks.append(self.rate_tables[which].rates(split.row_values(column), self.prior, fold))
        for d in f.dense:
            if d.dim == 1:
                x = split.row_values(d.column).astype(np.float64)
                blocks.append((_signed_log(x) if d.norm == "log" else x)[:, None])
        surface = split.surface_index(f)
        blocks.append(np.stack([surface == i for i in range(len(f.surfaces))], 1).astype(np.float64))
        return np.concatenate(blocks, 1).astype(np.float32)

    @staticmethod
    def _match_features(split, cand, events, g, t_req, of_item) -> np.ndarray:
        """Per row: matches of the candidate's ids (0 = unknown, never a match) among the newest
        5 / 20 / all events (log1p), and log1p(seconds since the newest match). ``of_item``: the
        events are items, compared through this attribute map. Events of bags ([U, L, K]: a
        multi-valued attribute) match when a bag holds one of the candidate's ids."""
        ts = split.request_padded(g.timestamp_column)
        out = np.empty((split.n, len(RECENT) + 2))
        for lo in range(0, split.n, CHUNK_ROWS):
            rows = slice(lo, min(lo + CHUNK_ROWS, split.n))
            req = split.req[rows]
            ev = events[req]  # [r, L]
            c = np.where(cand[rows] > 0, cand[rows], -3)  # [r, k]
            if of_item is not None:
                known = (ev >= 0) & (ev < len(of_item))
                ev_attr = np.where(known[:, :, None], of_item[np.where(known, ev, 0)], -1)  # [r, L, k']
                hit = (ev_attr[:, :, :, None] == c[:, None, None, :]).any((2, 3))
            elif ev.ndim == 3:
                hit = (ev[:, :, :, None] == c[:, None, None, :]).any((2, 3))
            else:
                hit = (ev[:, :, None] == c[:, None, :]).any(2)
            for i, k in enumerate(RECENT):
                out[rows, i] = np.log1p(hit[:, :k].sum(1))
            out[rows, len(RECENT)] = np.log1p(hit.sum(1))
            first = hit.argmax(1)
            any_hit = hit.any(1)
            age = t_req[req] - ts[req, first].astype(np.float64)
            out[rows, len(RECENT) + 1] = np.log1p(np.where(any_hit, np.maximum(age, 0.0), NO_MATCH_S))
        return out


def light_train_columns(features: config.FeaturesConfig) -> List[str]:
    """What the rate tables read of the whole training split."""
    f = features
    return list(dict.fromkeys([f.columns.user_id, f.columns.item_id] + [t.label_column for t in f.tasks]))
