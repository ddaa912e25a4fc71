"""The request shuffle pool (data/loader/shuffle.py) on small in-memory requests: whole requests, every row
once, batch sizes and the request bound, the buffer bound, file order without a generator, each
request's request-level values carried once with it."""

import collections

import numpy as np
import pyarrow as pa

from pinads_rec.data.loader.reader import RowGroup
from pinads_rec.data.loader.shuffle import BatchRows, RequestSpan, ShufflePool, compact, request_spans
from pinads_rec.data.loader.storage_layout import Requests


def group_table(first_request: int, sizes):
    """A row group of requests numbered from first_request with the given row counts; ``row`` is a
    global row id (request * 100 + position) so every row is identifiable; each request carries a
    request-level ``history`` [id, id, id] once."""
    ids = np.arange(first_request, first_request + len(sizes))
    req = np.repeat(ids, sizes)
    pos = np.concatenate([np.arange(n) for n in sizes])
    requests = pa.table({"request_id": pa.array(ids, pa.int64()), "history": [[int(i)] * 3 for i in ids]})
    rows = pa.table({"row": pa.array(req * 100 + pos, pa.int64())})
    return Requests(requests, rows, np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64))


def rows_of(b):
    """The batch's row ids, after checking each row's request carries that request's values."""
    rows = b.requests.rows.column("row").to_numpy()
    of_row = b.requests.request_of_rows()
    assert (b.requests.request_table.column("request_id").to_numpy()[of_row] == rows // 100).all()
    assert b.requests.request_column("history").to_pylist() == [
        [int(i)] * 3 for i in b.requests.request_table.column("request_id").to_numpy()
    ]
    return rows.tolist()


def groups(sizes_per_group):
    out, first = [], 0
    for i, sizes in enumerate(sizes_per_group):
        out.append((RowGroup(f"part-{i}.parquet", 0, sum(sizes)), group_table(first, sizes)))
        first += len(sizes)
    return out


def span_lists(gs):
    return [request_spans(table, g) for g, table in gs]


SIZES = [[3, 1, 4, 2, 5], [2, 2, 7], [1, 1, 1, 6, 3, 2], [4, 3]]  # 47 rows


def all_rows(gs):
    return [r for _, t in gs for r in t.rows.column("row").to_pylist()]


def test_request_spans_cover_the_block_one_span_per_request():
    g, block = groups([[3, 1, 4]])[0]
    spans = request_spans(block, g)
    assert [(s.request, s.start, s.length) for s in spans] == [(0, 0, 3), (1, 3, 1), (2, 4, 4)]
    assert all(isinstance(s, RequestSpan) and s.block is block and s.group == g for s in spans)


def test_without_a_generator_batches_are_the_rows_in_file_order():
    gs = groups(SIZES)
    out = list(ShufflePool(batch_size=8, max_requests=8, buffer_rows=0, rng=None).batches(span_lists(gs)))
    assert all(isinstance(b, BatchRows) for b in out)
    assert [r for b in out for r in rows_of(b)] == all_rows(gs)
    assert [b.num_rows for b in out[:-1]] == [8] * (len(out) - 1) and 0 < out[-1].num_rows < 8
    assert [b.last for b in out] == [False] * (len(out) - 1) + [True]
    # a request cut at a batch boundary continues in the next batch; each batch names its row groups
    assert out[0].source == "part-0.parquet, row group 0"
    assert out[1].source == "part-0.parquet, row group 0; part-1.parquet, row group 0"


def test_the_request_bound_closes_batches_early():
    gs = groups(SIZES)
    out = list(ShufflePool(batch_size=8, max_requests=2, buffer_rows=0, rng=None).batches(span_lists(gs)))
    for b in out:
        assert b.requests.num_requests <= 2
    assert any(b.num_rows < 8 and not b.last for b in out)
    assert [r for b in out for r in rows_of(b)] == all_rows(gs)


def test_shuffling_keeps_requests_whole_and_reads_every_row_once():
    gs = groups(SIZES)
    pool = ShufflePool(batch_size=5, max_requests=5, buffer_rows=10, rng=np.random.default_rng(0))
    out = list(pool.batches(span_lists(gs)))
    rows = [r for b in out for r in rows_of(b)]
    assert collections.Counter(rows) == collections.Counter(all_rows(gs))
    assert rows != all_rows(gs), "the order changed"
    for b in out:  # within a batch a request's rows are together and in order
        batch_rows = rows_of(b)
        req = [r // 100 for r in batch_rows]
        for q in set(req):
            at = [i for i, x in enumerate(req) if x == q]
            assert at == list(range(at[0], at[0] + len(at))), q
            assert [batch_rows[i] for i in at] == sorted(batch_rows[i] for i in at), q


def test_the_same_generator_gives_the_same_batches():
    def run(seed):
        pool = ShufflePool(batch_size=5, max_requests=3, buffer_rows=10, rng=np.random.default_rng(seed))
        return [rows_of(b) for b in pool.batches(span_lists(groups(SIZES)))]

    assert run(1) == run(1) and run(1) != run(2)


def test_the_pool_holds_at_most_the_buffer_plus_one_row_group():
    gs = groups(SIZES)
    pool = ShufflePool(batch_size=4, max_requests=4, buffer_rows=6, rng=np.random.default_rng(0))
    largest = max(t.num_rows for _, t in gs)
    seen = 0
    for _ in pool.batches(span_lists(gs)):
        assert pool.waiting_rows <= 6 + largest
        assert pool.waiting_rows == sum(s.length for s in pool.waiting)
        seen += 1
    assert seen and pool.waiting == [] and pool.drawn == []


def test_compact_copies_the_waiting_requests_of_a_drawn_row_group():
    (g, block), (h, untouched) = groups([[3, 1, 4], [2, 2]])
    spans = request_spans(block, g)
    kept = compact([spans[0], spans[2]] + request_spans(untouched, h))
    assert [(s.request, s.start, s.length) for s in kept[:2]] == [(0, 0, 3), (1, 3, 4)]
    assert kept[0].block is not block and kept[0].block.num_rows == 7 and kept[0].block.num_requests == 2
    assert kept[1].block.rows.column("row").to_pylist()[3:] == block.rows.column("row").to_pylist()[4:]
    assert kept[1].block.request_table.column("history").to_pylist() == [[0] * 3, [2] * 3]
    assert all(s.block is untouched for s in kept[2:])  # nothing drawn from it: not copied
