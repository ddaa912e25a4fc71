"""Contract Parquet files rewritten in the other storage layout, row group by row group: what tests and
benchmarks compare the two layouts on (docs/storage_layout.md).

A module of its own, beside ``storage_layout``: the files are read and written with page checksums
(data/page_checksums.py), whose errors are the contract's, and the contract reads ``storage_layout``;
in one module the three would import one another.
"""

from __future__ import annotations

import pyarrow.parquet as pq

from pinads_rec.config import FeaturesConfig
from pinads_rec.data import page_checksums
from pinads_rec.data.loader.storage_layout import to_per_request, to_per_row


def rewrite_per_request(src: str, dst: str, features: FeaturesConfig, **parquet_options) -> int:
    """Rewrites a per-row Parquet file per request, row group by row group (each keeps its
    requests; they must not span row groups); ``parquet_options`` go to ``pq.ParquetWriter`` (page
    checksums always written, ``src``'s verified).
    Returns the requests written."""
    return _rewrite(src, dst, lambda t: to_per_request(t, features), **parquet_options)


def rewrite_per_row(src: str, dst: str, features: FeaturesConfig, **parquet_options) -> int:
    """Rewrites a per-request Parquet file per row, row group by row group. Returns the rows written."""
    return _rewrite(src, dst, lambda t: to_per_row(t, features), **parquet_options)


def _rewrite(src: str, dst: str, convert, **parquet_options) -> int:
    f = page_checksums.CheckedParquetFile(src)
    written, writer = 0, None
    try:
        for i in range(f.metadata.num_row_groups):
            table = convert(f.read_row_group(i))
            if writer is None:
                writer = pq.ParquetWriter(dst, table.schema, **{**parquet_options, **page_checksums.WRITE})
            writer.write_table(table, row_group_size=max(table.num_rows, 1))
            written += table.num_rows
    finally:
        if writer is not None:
            writer.close()
    return written
