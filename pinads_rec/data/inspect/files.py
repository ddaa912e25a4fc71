"""The dataset's files as the scan and the draft read them: each file's storage layout (per row or
per request: docs/storage_layout.md), its schema and row groups (``open_files`` -> ``FileInfo``),
and a place in them (``Place``: file, row group, row, candidate) that a problem points to.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

import pyarrow as pa

from pinads_rec.config import FeaturesConfig
from pinads_rec.data.loader import storage_layout
from pinads_rec.data.loader.reader import list_files, open_parquet

PER_ROW, PER_REQUEST = "per_row", "per_request"


@dataclass
class FileInfo:
    path: str
    layout: str
    schema: pa.Schema
    row_group_rows: List[int]

    def locate(self, row: int) -> Tuple[int, int]:
        """(row group, row within it) of the file's row ``row``."""
        starts = [0]
        for n in self.row_group_rows[:-1]:
            starts.append(starts[-1] + n)
        g = bisect.bisect_right(starts, row) - 1
        return g, row - starts[g]


@dataclass
class Place:
    file: str
    row_group: Optional[int] = None  # None: the whole file (a schema problem)
    row: Optional[int] = None  # within the row group (a request's row in the per-request layout)
    candidate: Optional[int] = None  # per-request layout: the candidate's index in its lists

    def __str__(self) -> str:
        if self.row_group is None:
            return self.file
        s = f"{self.file}, row group {self.row_group}, row {self.row}"
        return s + (f", candidate {self.candidate}" if self.candidate is not None else "")


def file_layout(schema: pa.Schema, features: Optional[FeaturesConfig]) -> str:
    """The loader's rule (``storage_layout.is_per_request``); without a config, the writer's schema metadata."""
    if features is not None and features.tasks:
        return PER_REQUEST if storage_layout.is_per_request(schema, features) else PER_ROW
    meta = schema.metadata or {}
    return PER_REQUEST if meta.get(storage_layout.LAYOUT_KEY) == storage_layout.PER_REQUEST else PER_ROW


def open_files(data: str, features: Optional[FeaturesConfig]) -> List[FileInfo]:
    """The dataset's Parquet files; a build's saved vocabularies (``vocabularies/``) are not data."""
    out = []
    for path in list_files(data):
        if os.path.basename(os.path.dirname(path)) == "vocabularies":
            continue
        f = open_parquet(path)
        md = f.metadata
        rows = [md.row_group(i).num_rows for i in range(md.num_row_groups)]
        out.append(FileInfo(path, file_layout(f.schema_arrow, features), f.schema_arrow, rows))
    return out
