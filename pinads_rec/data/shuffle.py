"""Whole requests -> the rows of each batch: a bounded pool shuffles requests, never rows.

A request's rows stay together (request-level broadcasting relies on it): each row group is split
into ``RequestSpan``s, one per request, and the pool holds spans. When it holds more than
``buffer_rows`` rows it permutes them and draws spans off the front until half the buffer remains;
the drawn spans are cut, in draw order, into batches of ``batch_size`` rows and at most
``max_requests`` requests. A request cut by a batch boundary appears in both batches (each with its
own copy of the user-side columns). Memory stays at about ``buffer_rows`` rows plus one row group:
the spans still waiting are copied out of a partly drawn row group so it is freed (``compact``).

In: lists of spans (one list per row group read). Out: ``BatchRows``: an Arrow table of at most
``batch_size`` rows (fewer when the request bound closed it early, or for the last one), the row
groups it came from, and whether it is the last.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, Iterator, List, NamedTuple, Optional

import numpy as np
import pyarrow as pa

from pinads_rec.data.contract import ContractError
from pinads_rec.data.reader import RowGroup, RowGroupReader


@dataclass(frozen=True)
class RequestSpan:
    """One request's rows: ``table[start : start + length]``, read from ``group``."""

    table: pa.Table
    start: int
    length: int
    group: RowGroup


class BatchRows(NamedTuple):
    table: pa.Table  # the rows of one batch, requests contiguous
    source: str  # the row groups they came from ("; "-joined), named in errors about the batch
    last: bool  # the pool's final, partial batch


def request_spans(table: pa.Table, request_column: str, group: RowGroup) -> List[RequestSpan]:
    """One span per request, in table order: the contract wants a request's rows contiguous."""
    req = table.column(request_column).to_numpy()
    starts = np.flatnonzero(np.concatenate([[True], req[1:] != req[:-1]]))
    if len(starts) != len(np.unique(req)):
        raise ContractError(
            f"{group}, column {request_column!r}: the rows of a request are not contiguous "
            f"(request-level broadcasting needs them together); sort the file by request"
        )
    lengths = np.diff(np.append(starts, len(req)))
    return [RequestSpan(table, s, n, group) for s, n in zip(starts.tolist(), lengths.tolist())]


def read_requests(
    reader: RowGroupReader, groups: Iterable[RowGroup], request_column: str
) -> Iterator[List[RequestSpan]]:
    """Each row group read in turn (``reader.read``), as its request spans; a row group the row
    filter emptied gives none."""
    for group in groups:
        table = reader.read(group)
        if table.num_rows:
            yield request_spans(table, request_column, group)


def compact(spans: List[RequestSpan]) -> List[RequestSpan]:
    """Copies the requests still waiting into fresh tables, so a row group is freed as soon as it
    is drained instead of living until its last request is drawn (keeps memory at the buffer size)."""
    by_table: Dict[int, list] = {}
    for span in spans:
        by_table.setdefault(id(span.table), [span.table, []])[1].append(span)
    out = []
    for table, waiting in by_table.values():
        if sum(s.length for s in waiting) == table.num_rows:  # untouched: nothing to free
            out += waiting
            continue
        kept = table.take(pa.array(np.concatenate([np.arange(s.start, s.start + s.length) for s in waiting])))
        at = 0
        for s in waiting:
            out.append(RequestSpan(kept, at, s.length, s.group))
            at += s.length
    return out


class ShufflePool:
    """The bounded request shuffle of one (rank, worker) slot; ``rng`` None keeps file order
    (evaluation, scoring). One pass: ``batches`` consumes the span lists and empties the pool."""

    def __init__(self, batch_size: int, max_requests: int, buffer_rows: int, rng: Optional[np.random.Generator]):
        self.batch_size, self.max_requests, self.buffer_rows, self.rng = batch_size, max_requests, buffer_rows, rng
        self.waiting: List[RequestSpan] = []  # in the pool, not yet drawn
        self.waiting_rows = 0
        self.drawn: List[RequestSpan] = []  # drawn, not yet cut into a batch
        self.drawn_rows = 0

    def batches(self, span_lists: Iterable[List[RequestSpan]]) -> Iterator[BatchRows]:
        for spans in span_lists:
            self.waiting += spans
            self.waiting_rows += sum(s.length for s in spans)
            if self.waiting_rows > self.buffer_rows:
                yield from self._draw(until_rows=self.buffer_rows // 2)
        yield from self._draw(until_rows=0)
        if self.drawn_rows:
            yield self._cut(self.drawn_rows, last=True)

    def _draw(self, until_rows: int) -> Iterator[BatchRows]:
        """Draws requests off the front of the (shuffled) pool until at most until_rows remain, and
        cuts the drawn ones into batches."""
        if self.rng is not None:
            self.waiting = [self.waiting[i] for i in self.rng.permutation(len(self.waiting))]
        sizes = np.cumsum([s.length for s in self.waiting])
        k = int(np.searchsorted(sizes, self.waiting_rows - until_rows)) + 1 if self.waiting_rows > until_rows else 0
        drawn, self.waiting = self.waiting[:k], compact(self.waiting[k:])
        self.waiting_rows -= int(sizes[k - 1]) if k else 0
        for span in drawn:
            self.drawn.append(span)
            self.drawn_rows += span.length
            while self.drawn_rows >= self.batch_size or len(self.drawn) >= self.max_requests:
                yield self._cut(self.batch_size, last=False)

    def _cut(self, rows: int, last: bool) -> BatchRows:
        """Takes up to ``rows`` rows of at most ``max_requests`` requests off the front of the drawn ones."""
        pieces, taken, rest, groups = [], 0, [], {}
        for i, span in enumerate(self.drawn):
            if taken == rows or i == self.max_requests:
                rest = self.drawn[i:]
                break
            k = min(span.length, rows - taken)
            pieces.append((span.table, span.start, k))
            groups[span.group] = None
            if k < span.length:  # a request cut at the batch boundary: the rest opens the next batch
                rest = [RequestSpan(span.table, span.start + k, span.length - k, span.group)] + self.drawn[i + 1 :]
            taken += k
            if k < span.length:
                break
        self.drawn, self.drawn_rows = rest, sum(s.length for s in rest)
        # Group the pieces by source table so each table is gathered once (rows of a request stay contiguous).
        by_table: Dict[int, list] = {}
        for table, start, k in pieces:
            by_table.setdefault(id(table), [table, []])[1].append(np.arange(start, start + k))
        out = pa.concat_tables([t.take(pa.array(np.concatenate(idx))) for t, idx in by_table.values()])
        return BatchRows(out, "; ".join(map(str, groups)), last)
