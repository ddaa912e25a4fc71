"""Whole requests -> the rows of each batch: a bounded pool shuffles requests, never rows.

A request's rows stay together (request-level broadcasting relies on it): each row group is split
into ``RequestSpan``s, one per request, and the pool holds spans. When it holds more than
``buffer_rows`` rows it permutes them and draws spans off the front until half the buffer remains;
the drawn spans are cut, in draw order, into batches of ``batch_size`` rows and at most
``max_requests`` requests. A request cut by a batch boundary appears in both batches (each with its
own copy of the request-level columns). Memory stays at about ``buffer_rows`` rows plus one row group:
the spans still waiting are copied out of a partly drawn row group so it is freed (``compact``).

In: lists of spans (one list per row group read, storage_layout.py's ``Requests``: request-level
columns once per request). Out: ``BatchRows``: the ``Requests`` of at most ``batch_size`` candidate
rows (fewer when the request bound closed it early, or for the last one), the row groups they came
from, and whether it is the last. A request's sequences are never copied per candidate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, Iterator, List, NamedTuple, Optional

import numpy as np

from pinads_rec.data.loader.reader import RowGroup, RowGroupReader
from pinads_rec.data.loader.storage_layout import Requests


@dataclass(frozen=True)
class RequestSpan:
    """One request's candidates ``block.rows[start : start + length]`` (request ``request`` of the
    block: all its candidates, or those a batch boundary left), read from ``group``."""

    block: Requests
    request: int
    start: int
    length: int
    group: RowGroup


class BatchRows(NamedTuple):
    requests: Requests  # the requests of one batch and their candidates, in order
    source: str  # the row groups they came from ("; "-joined), named in errors about the batch
    last: bool  # the pool's final, partial batch

    @property
    def num_rows(self) -> int:
        return self.requests.num_rows


def request_spans(block: Requests, group: RowGroup) -> List[RequestSpan]:
    """One span per request of the block, in order."""
    offsets = block.offsets.tolist()
    return [RequestSpan(block, i, offsets[i], offsets[i + 1] - offsets[i], group) for i in range(block.num_requests)]


def read_requests(reader: RowGroupReader, groups: Iterable[RowGroup]) -> Iterator[List[RequestSpan]]:
    """Each row group read in turn (``reader.read_requests``), as its request spans; a row group the
    row filter emptied gives none."""
    for group in groups:
        block = reader.read_requests(group)
        if block.num_rows:
            yield request_spans(block, group)


def compact(spans: List[RequestSpan]) -> List[RequestSpan]:
    """Copies the requests still waiting into fresh blocks, so a row group is freed as soon as it
    is drained instead of living until its last request is drawn (keeps memory at the buffer size)."""
    by_block: Dict[int, list] = {}
    for span in spans:
        by_block.setdefault(id(span.block), [span.block, []])[1].append(span)
    out = []
    for block, waiting in by_block.values():
        if sum(s.length for s in waiting) == block.num_rows:  # untouched: nothing to free
            out += waiting
            continue
        kept = Requests.gather([(s.block, s.request, s.start, s.length) for s in waiting])
        offsets = kept.offsets.tolist()
        out += [RequestSpan(kept, i, offsets[i], s.length, s.group) for i, s in enumerate(waiting)]
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
            pieces.append((span.block, span.request, span.start, k))
            groups[span.group] = None
            if k < span.length:  # a request cut at the batch boundary: the rest opens the next batch
                rest = [
                    RequestSpan(span.block, span.request, span.start + k, span.length - k, span.group)
                ] + self.drawn[i + 1 :]
            taken += k
            if k < span.length:
                break
        self.drawn, self.drawn_rows = rest, sum(s.length for s in rest)
        return BatchRows(Requests.gather(pieces), "; ".join(map(str, groups)), last)
