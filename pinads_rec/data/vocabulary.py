"""The build's id vocabularies, applied outside the build: serving maps raw ids exactly as training saw them.

``python -m pinads_rec.data.build`` writes ``<out>/vocabularies/<table>.parquet`` (``raw`` as text,
``idx``, ``count``) for every table in ``build.vocabularies``; 0 is the out-of-vocabulary bucket.
``Vocabularies.load(out_dir, features).apply(rows)`` maps every column that feeds such a table
(candidate ids, user-side ids, sequence ids; one id or a list per row) in an Arrow table of raw rows,
before ``Predictor.score_request`` (docs/serving.md).
"""

from __future__ import annotations

import os
from typing import Dict

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pinads_rec.config import FeaturesConfig
from pinads_rec.data.build_output import require_complete, require_unchanged
from pinads_rec.data.loader.contract import ContractError
from pinads_rec.data.loader.reader import open_parquet

OUT_OF_VOCABULARY = 0


class Vocabularies:
    def __init__(self, tables: Dict[str, pa.Table], features: FeaturesConfig):
        self.tables = tables  # table name -> (raw: string, idx: int64)
        self.columns: Dict[str, str] = {}  # column -> the table whose vocabulary maps it
        for s in features.sparse:
            if s.table in tables:
                self.columns[s.column] = s.table
        for g in features.sequence_groups:
            for f in g.features:
                if f.table in tables:
                    self.columns[f.column] = f.table

    @classmethod
    def load(cls, build_dir: str, features: FeaturesConfig) -> "Vocabularies":
        """The vocabularies a build wrote under ``build_dir`` (none: nothing is mapped)."""
        require_complete(build_dir)
        directory = os.path.join(build_dir, "vocabularies")
        tables = {}
        if os.path.isdir(directory):
            names = [n for n in sorted(os.listdir(directory)) if n.endswith(".parquet")]
            # DuckDB writes them without page checksums: their sha256 in the manifest guards them.
            require_unchanged(os.path.join(directory, n) for n in names)
            for name in names:
                path = os.path.join(directory, name)
                t = open_parquet(path).read(columns=["raw", "idx"])
                if t.column("raw").null_count:
                    raise ContractError(f"{path}: null raw id in a vocabulary")
                tables[name[: -len(".parquet")]] = t
        return cls(tables, features)

    def apply(self, rows: pa.Table) -> pa.Table:
        """``rows`` with every mapped column's raw ids replaced by their indices (0 when unseen)."""
        for column, table in self.columns.items():
            if column in rows.column_names:
                mapped = self._map(rows.column(column).combine_chunks(), self.tables[table])
                rows = rows.set_column(rows.schema.get_field_index(column), column, mapped)
        return rows

    @staticmethod
    def _map(values: pa.Array, vocab: pa.Table) -> pa.Array:
        if pa.types.is_list(values.type) or pa.types.is_large_list(values.type):
            inner = Vocabularies._map(values.flatten(), vocab)
            lengths = pc.list_value_length(values).to_numpy(zero_copy_only=False)
            return pa.ListArray.from_arrays(pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)), inner)
        position = pc.index_in(pc.cast(values, pa.string()), value_set=vocab.column("raw"))
        index = vocab.column("idx").combine_chunks().take(position)
        return pc.fill_null(index, OUT_OF_VOCABULARY).cast(pa.int64())
