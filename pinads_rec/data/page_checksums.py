"""Parquet page checksums: every writer of the project's data stores a CRC32 in each page header, every
reader verifies it, so bytes changed after writing (a disk, a copy, an edit that keeps the size) stop
the read with one line instead of being read as data (docs/data_build.md, "Verified bytes").

- ``WRITE``: the options that make a ``pq.ParquetWriter`` / ``pq.write_table`` store the checksums.
- ``CheckedParquetFile(path)``: a ``pq.ParquetFile`` whose reads verify each page's checksum where its
  writer stored one (a file written before, or by a tool that stores none, reads as before); a
  mismatch is a ``ContractError`` naming the file and the row group.
- ``check_pages(path)``: every page of every row group read and verified; the first row group that
  fails its checksum, as one line, or None (``python -m pinads_rec.data.inspect --verify``).

DuckDB (2.0) writes no page checksums and has no option to: the files its ``COPY`` writes (a build's
vocabularies) are guarded by the build manifest's sha256 only (data/build_output.py).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from pinads_rec.data.loader.contract import ContractError

WRITE = {"write_page_checksum": True}
# What Arrow's ParquetException says on a mismatch (it reaches Python as a plain OSError); a page
# that fails to decompress or decode is another error, left as it is.
_MISMATCH = "CRC checksum verification failed"


def mismatch_message(path: str, row_group: Optional[int]) -> str:
    where = f"row group {row_group}" if row_group is not None else "a row group"
    return (
        f"{path}: {where} fails its page checksum (the file's bytes changed after it was written: disk, copy or "
        f"edit); restore the file from a good copy, or rebuild / regenerate it"
    )


def _is_mismatch(error: OSError) -> bool:
    return _MISMATCH in str(error)


class CheckedParquetFile(pq.ParquetFile):
    """A Parquet file read with page checksum verification; a mismatch in ``read_row_group`` or
    ``read`` (the reads the project makes) is a ``ContractError`` naming the row group."""

    def __init__(self, path: str):
        super().__init__(path, page_checksum_verification=True)
        self.path = str(path)

    def read_row_group(self, i, columns=None, **kwargs):
        with self._named([i], columns):
            return super().read_row_group(i, columns=columns, **kwargs)

    def read(self, columns=None, **kwargs):
        with self._named(range(self.num_row_groups), columns):
            return super().read(columns=columns, **kwargs)

    @contextmanager
    def _named(self, row_groups: Sequence[int], columns) -> Iterator[None]:
        try:
            yield
        except OSError as e:
            if not _is_mismatch(e):
                raise
            raise ContractError(mismatch_message(self.path, self._failing(row_groups, columns))) from None

    def _failing(self, row_groups: Sequence[int], columns) -> Optional[int]:
        """The first of ``row_groups`` whose pages (of ``columns``) fail their checksum: a read of
        several row groups does not say which one did."""
        for i in row_groups:
            try:
                pq.ParquetFile.read_row_group(self, i, columns=columns)
            except OSError as e:
                if _is_mismatch(e):
                    return i
        return None


def check_pages(path: str) -> Optional[str]:
    """Every page of ``path`` read with its checksum verified, one row group at a time (a row
    group's memory at most): the first row group that fails its checksum, as one line; None when
    all pass. A file or row group that cannot be read at all (a page written without a checksum that
    no longer decodes) is a ContractError saying so."""
    try:
        f = CheckedParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ContractError(f"{path}: not a readable Parquet file ({_first_line(e)})") from None
    for i in range(f.num_row_groups):
        try:
            f.read_row_group(i)
        except ContractError as e:
            return str(e)
        except (pa.ArrowException, OSError) as e:
            raise ContractError(f"{path}: row group {i} cannot be read ({_first_line(e)})") from None
    return None


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
