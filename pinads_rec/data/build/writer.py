"""What a build writes besides its steps' SQL: the split's Parquet files (``SplitWriter``, the
contract's canonical Arrow types), ``summary.json`` (``summarize_outputs``: counts read back from the
written files) and the manifest (``build_manifest``: inputs, config, outputs), each of a build
(``build``: full_build.Build, its state and engine).
"""

from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path
from typing import Dict, List, Optional
from zoneinfo import ZoneInfo

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pinads_rec.config import to_dict
from pinads_rec.data import page_checksums
from pinads_rec.data.loader import storage_layout
from pinads_rec.data.raw_sources import RawSource, is_remote
from pinads_rec.data.sql_text import sql_name, sql_string


def summarize_outputs(
    build, outputs: Dict[str, dict], seconds: float, root: Optional[Path] = None, impressions: str = "imp"
) -> dict:
    """Counts read back from the written files (their paths relative to ``root``, default the
    output directory) by DuckDB on the driver, whatever the engine: what the build produced, not
    what it meant to. The join misses are those of ``impressions`` (SQL on the engine: the
    impressions written)."""
    f = build.features
    files = duckdb.connect()
    root = build.out if root is None else root
    out = {"splits": {}, "repairs": build.counts, "seconds": round(seconds, 2), "threads": build.threads}
    for split, o in outputs.items():
        entry = {"requests": o["requests"], "rows": o["rows"], "files": len(o["files"])}
        if o["files"]:
            scan = "read_parquet([" + ", ".join(sql_string(str(root / p)) for p in o["files"]) + "])"
            surface = sql_name(f.columns.surface)
            labels = ", ".join(
                f"avg(CAST(unnest_l.{sql_name(t.label_column)} AS DOUBLE)) AS {sql_name(t.name)}" for t in f.tasks
            )
            unnested = ", ".join(
                f"unnest({sql_name(c)}) AS {sql_name(c)}"
                for c in [f.columns.surface] + [t.label_column for t in f.tasks]
            )
            rows = files.execute(
                f"SELECT CAST(unnest_l.{surface} AS VARCHAR), count(*), {labels} "
                f"FROM (SELECT {unnested} FROM {scan}) unnest_l GROUP BY ALL ORDER BY 1"
            ).fetchall()
            entry["surfaces"] = {
                r[0]: {"rows": r[1], "label_rate": {t.name: round(v, 6) for t, v in zip(f.tasks, r[2:])}} for r in rows
            }
            entry["sequence_lengths"] = {}
            for g in f.sequence_groups:
                c = sql_name(g.timestamp_column)
                q = files.execute(
                    f"SELECT avg(len({c})), quantile_disc(len({c}), [0.5, 0.9, 0.99]), max(len({c})), "
                    f"count(*) FILTER (WHERE len({c}) = 0) FROM {scan}"
                ).fetchone()
                entry["sequence_lengths"][g.name] = {
                    "mean": round(q[0], 2),
                    "p50": q[1][0],
                    "p90": q[1][1],
                    "p99": q[1][2],
                    "max": q[2],
                    "empty": q[3],
                }
        out["splits"][split] = entry
    files.close()
    out["join_misses"] = {
        s.name: build.scalar(f"SELECT count(*) FROM {impressions} WHERE NOT {sql_name('__hit_' + s.name)}")
        for s in build.b.side_tables
    }
    return out


def build_manifest(build, outputs: Dict[str, dict], summary: dict, impressions: str = "imp") -> dict:
    def describe(files) -> List[dict]:
        return [
            {"path": p}  # object storage: its listing is the engine's
            if is_remote(p)
            else {
                "path": p,
                "bytes": os.path.getsize(p),
                "modified": datetime.fromtimestamp(os.path.getmtime(p)).isoformat(timespec="seconds"),
            }
            for p in files
        ]

    inputs = {"impressions": describe(build.imp_source.files)}
    for side in build.b.side_tables:
        inputs[f"side_table:{side.name}"] = describe(RawSource.of(side, build.raw_dir, "").files)
    for s in build.b.sequences:
        if s.path:
            inputs[f"sequence:{s.group}"] = describe(RawSource.of(s, build.raw_dir, "").files)
    span = build.one(f"SELECT min(__t), max(__t) FROM {impressions}")
    cfg = to_dict(build.cfg)
    return {
        "inputs": inputs,
        "impression_time_range": [_iso(span[0], build.b.timezone), _iso(span[1], build.b.timezone)],
        "config": {"build": cfg["build"], "features": cfg["features"]},
        "negative_downsampling": cfg["build"]["negative_downsampling"],
        "outputs": outputs,
        "memory_limit": build.memory_limit,
        "engine": build.engine.name,
        "versions": {**build.engine.versions(), "pyarrow": pa.__version__},
        "built": datetime.now().isoformat(timespec="seconds"),
    }


class SplitWriter:
    """Request rows (Arrow batches, in order) -> row groups of ``per_group`` requests, files of
    ``per_file`` requests; the schema in the contract's canonical Arrow types."""

    def __init__(self, out: Path, per_group: int, per_file: int, features):
        self.out, self.per_group, self.per_file = out, per_group, per_file
        self.features = features
        self.label = features.tasks[0].label_column
        self.schema: Optional[pa.Schema] = None
        self.buffer: Optional[pa.Table] = None
        self.writer: Optional[pq.ParquetWriter] = None
        self.files: List[str] = []
        self.in_file = self.requests = self.rows = 0

    def add(self, batch: pa.RecordBatch) -> None:
        if self.schema is None:
            self.schema = request_rows_schema(batch.schema, self.features)
        table = pa.Table.from_batches([batch]).cast(self.schema)
        self.buffer = table if self.buffer is None else pa.concat_tables([self.buffer, table])
        while self.buffer.num_rows >= self.per_group:
            self._write(self.buffer.slice(0, self.per_group))
            self.buffer = self.buffer.slice(self.per_group)

    def close(self) -> dict:
        if self.buffer is not None and self.buffer.num_rows:
            self._write(self.buffer)
        if self.writer is not None:
            self.writer.close()
        return {"files": self.files, "requests": self.requests, "rows": self.rows}

    def _write(self, table: pa.Table) -> None:
        if self.writer is None:
            path = self.out / f"part-{len(self.files):05d}.parquet"
            self.files.append(str(path))
            self.writer = pq.ParquetWriter(
                path, self.schema, compression="lz4", use_dictionary=False, **page_checksums.WRITE
            )
        self.writer.write_table(table.combine_chunks(), row_group_size=table.num_rows)
        self.requests += table.num_rows
        self.rows += int(pc.sum(pc.list_value_length(table.column(self.label))).as_py() or 0)
        self.in_file += table.num_rows
        if self.in_file >= self.per_file:
            self.writer.close()
            self.writer, self.in_file = None, 0


def request_rows_schema(schema: pa.Schema, features) -> pa.Schema:
    """The schema of the build's request rows (``schema``, as the engine gives them) in the
    contract's canonical types, with the per-request layout's metadata (data/loader/storage_layout.py)."""
    stored_once = storage_layout.request_level_columns(features)
    embeddings = {g.embedding_column: g.embedding_dim for g in features.sequence_groups if g.embedding_column}
    return _canonical_schema(schema, embeddings).with_metadata(
        storage_layout.per_request_metadata(schema.names, stored_once)
    )


def _iso(seconds: Optional[float], tz: str) -> Optional[str]:
    if seconds is None:
        return None
    return datetime.fromtimestamp(seconds, ZoneInfo(tz)).isoformat(timespec="seconds")


def _canonical_type(t: pa.DataType) -> pa.DataType:
    """DuckDB names list children ``l``; the contract's writers use pyarrow's ``item``."""
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return pa.list_(_canonical_type(t.value_type))
    if pa.types.is_fixed_size_list(t):
        return pa.list_(_canonical_type(t.value_type), t.list_size)
    if pa.types.is_string_view(t) or pa.types.is_large_string(t):
        return pa.string()
    return t


def _canonical_schema(schema: pa.Schema, embeddings: Dict[str, int]) -> pa.Schema:
    """The contract's types: lists as pyarrow writes them, and each sequence event's embedding a
    fixed-size list of its declared width (an engine without fixed-size arrays gives a plain list)."""
    fields = []
    for f in schema:
        if f.name in embeddings:
            fields.append(pa.field(f.name, pa.list_(pa.list_(pa.float32(), embeddings[f.name]))))
        else:
            fields.append(pa.field(f.name, _canonical_type(f.type)))
    return pa.schema(fields)
