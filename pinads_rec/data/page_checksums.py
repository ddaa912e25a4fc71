"""Parquet page checksums: every writer of the project's data stores a CRC32 in each page header, every
reader verifies it, so bytes changed after writing (a disk, a copy, an edit that keeps the size) stop
the read with one line instead of being read as data (docs/data_build.md, "Verified bytes").

- ``WRITE``: the options that make a ``pq.ParquetWriter`` / ``pq.write_table`` store the checksums.
- ``CheckedParquetFile(path)``: a ``pq.ParquetFile`` whose reads verify each page's checksum where its
  writer stored one (a file written before, or by a tool that stores none, reads as before); a
  mismatch, or a page that does not decode (a changed page header: no checksum covers it), is a
  one-line ``ContractError`` naming the file and the row group.
- ``check_pages(path)``: every page of every row group read and verified; the first row group that
  fails its checksum, as one line, or None (``python -m pinads_rec.data.inspect --verify``).

DuckDB (2.0) writes no page checksums and has no option to: the files its ``COPY`` writes (a build's
vocabularies) are guarded by the build manifest's sha256 only (data/build_output.py).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional, Sequence, Tuple

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


class ChecksumMismatch(ContractError):
    """A page whose bytes fail the checksum its writer stored."""


def unreadable_message(path: str, row_group: Optional[int], error: Exception) -> str:
    """A row group that does not decode (a changed page header, which no checksum covers, or a page
    written without one), as one line: Arrow's own text ends in lines of its context."""
    where = f"{path}, row group {row_group}" if row_group is not None else f"{path}, a row group"
    return (
        f"{where}: cannot be read ({one_line(error)}): the file is damaged or was not written as Parquet; "
        f"restore it from a good copy, or rebuild / regenerate it"
    )


def one_line(error: Exception) -> str:
    """An Arrow error's first line (what failed; the lines after it say where in Arrow's code)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0].strip()


def _is_mismatch(error: Exception) -> bool:
    return _MISMATCH in str(error)


class CheckedParquetFile(pq.ParquetFile):
    """A Parquet file read with page checksum verification. A read that fails (``read_row_group``
    or ``read``, the reads the project makes) is a one-line ``ContractError`` naming the file and
    the row group: a checksum mismatch, or a page that does not decode. A footer that cannot be
    read is one naming the file."""

    def __init__(self, path: str):
        try:
            super().__init__(path, page_checksum_verification=True)
        except (pa.ArrowException, OSError) as e:
            raise ContractError(
                f"{path}: not a readable Parquet file ({one_line(e)}); restore it from a good copy, or rebuild / "
                f"regenerate it"
            ) from None
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
        except (pa.ArrowException, OSError) as e:
            failing = self._failing(row_groups, columns)
            if failing is not None and _is_mismatch(failing[1]):
                raise ChecksumMismatch(mismatch_message(self.path, failing[0])) from None
            row_group, error = failing if failing is not None else (None, e)
            raise ContractError(unreadable_message(self.path, row_group, error)) from None

    def _failing(self, row_groups: Sequence[int], columns) -> Optional[Tuple[int, Exception]]:
        """The first of ``row_groups`` whose read (of ``columns``) fails, with its error: a read of
        several row groups does not say which one did."""
        for i in row_groups:
            try:
                pq.ParquetFile.read_row_group(self, i, columns=columns)
            except (pa.ArrowException, OSError) as e:
                return i, e
        return None


def check_pages(path: str) -> Optional[str]:
    """Every page of ``path`` read with its checksum verified, one row group at a time (a row
    group's memory at most): the first row group that fails its checksum, as one line; None when
    all pass. A file or row group that cannot be read at all (a footer, or a page header, which no
    checksum covers) is a ContractError saying so."""
    f = CheckedParquetFile(path)
    for i in range(f.num_row_groups):
        try:
            f.read_row_group(i)
        except ChecksumMismatch as e:
            return str(e)
    return None
