"""The scan: a dataset checked against a config, every contract problem with its count and first
place, and the statistics a user needs to size a config (``scan_dataset`` -> ``Report``).

The loader stops at the first problem of a row group; this scans everything and counts. Each
problem says what the loader would do with it: stop with an error, repair it (the config's
``data.nonfinite_dense`` / ``data.overlong_sequence`` policies) or read it unchecked (a sequence
event at or after its impression, duplicated impressions, ...). Ids beyond a ``hash: true`` table
are hashed by design: a statistic, not a problem.

The scan is DuckDB SQL over the Parquet files (out of core: aggregates stream, groupings spill), a
few passes over the data. Both storage layouts are read: per row (one row per candidate) and per
request (candidate columns stored as lists, one value per candidate; docs/storage_layout.md).
The column roles and the types they accept come from the contract (``data/loader/contract.py``), the
SQL of each check from ``checks.py``, the files and places (shared with the draft) from
``files.py``; each group of files of one layout and schema is scanned by ``group_scan.py``. Here:
the files grouped, the totals turned into a ``Report``.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import duckdb
import pyarrow as pa

from pinads_rec.config import DataConfig, FeaturesConfig
from pinads_rec.data.inspect.checks import ERROR
from pinads_rec.data.inspect.files import PER_ROW, FileInfo, Place, open_files
from pinads_rec.data.inspect.group_scan import GroupScanner, Problem, Scan
from pinads_rec.data.loader import storage_layout
from pinads_rec.data.loader.contract import Column, ContractError, check_schema, contract_columns, is_list_type
from pinads_rec.data.sql_text import sql_string


def _quantiles(hist: Dict[int, int], qs=(0.5, 0.9, 0.99)) -> Dict[str, float]:
    """Exact mean, quantiles and max of a histogram {value: count}."""
    total = sum(hist.values())
    if not total:
        return {"n": 0}
    out = {"n": total, "mean": sum(k * v for k, v in hist.items()) / total}
    keys = sorted(hist)
    for q in qs:
        need, acc = q * total, 0
        for k in keys:
            acc += hist[k]
            if acc >= need:
                out[f"p{round(q * 100)}"] = k
                break
    out["min"], out["max"] = keys[0], keys[-1]
    return out


@dataclass
class Report:
    data: str
    files: int
    layouts: Dict[str, int]
    rows: int
    requests: int
    candidates_per_request: dict
    problems: List[Problem]
    columns: Dict[str, dict]
    sequence_lengths: Dict[str, dict]
    sequence_unit: str
    label_rates: Dict[str, dict]
    notes: List[str]
    # split -> vocabulary table -> "impressions" / "events" -> {"ids", "unknown", "share"}: the
    # build's summary.json beside the data (build_unknown_ids), {} when the data is no build's
    unknown_ids: Dict[str, Dict[str, dict]] = field(default_factory=dict)
    unknown_ids_from: Optional[str] = None  # that summary.json
    warnings: List[str] = field(default_factory=list)  # worth a look, not a problem: the exit code ignores them


# A split is dominated by unknown ids from this share of a vocabulary table's ids (its impressions'
# or its events'): most of its rows then see one row, 0, trained on no id of theirs, so the split's
# metrics -- and a calibration fitted on it -- speak for the unknown row more than for the ids.
UNKNOWN_DOMINATES = 0.5


def build_unknown_ids(files: List[FileInfo]) -> Tuple[Dict[str, Dict[str, dict]], Optional[str]]:
    """The unknown-id shares of the build the files come from (its ``summary.json``'s
    ``unknown_ids``: a split's files sit under ``<out>/<split>/``, a day's at the top of its
    partition), and that file's path; ({}, None) for data no build wrote."""
    seen = set()
    for f in files:
        for d in (Path(f.path).parent, Path(f.path).parent.parent):
            summary = d / "summary.json"
            if summary in seen or not summary.is_file():
                continue
            seen.add(summary)
            try:
                unknown = json.loads(summary.read_text()).get("unknown_ids")
            except (OSError, ValueError):
                continue
            if isinstance(unknown, dict) and unknown:
                return unknown, str(summary)
    return {}, None


def unknown_id_warnings(unknown: Dict[str, Dict[str, dict]]) -> List[str]:
    """One line per (split, table, impressions or events) whose share of unknown ids is at least
    ``UNKNOWN_DOMINATES``."""
    out = []
    for split, tables in unknown.items():
        for table, kinds in tables.items():
            for kind, c in kinds.items():
                if c.get("ids") and c["share"] >= UNKNOWN_DOMINATES:
                    out.append(
                        f"split {split!r} is dominated by unknown ids: {c['share']:.1%} of the {kind}' {table} ids "
                        f"({c['unknown']:,} of {c['ids']:,}) are 0, out of the vocabulary; its metrics and a "
                        f"calibration fitted on it are mostly the unknown row's"
                    )
    return out


def _view_schema(f: FileInfo, features: FeaturesConfig) -> Tuple[pa.Schema, List[str]]:
    """The file's schema as the per-row contract sees it: candidate lists unwrapped in the
    per-request layout; and the candidate columns of a per-request file that are not lists."""
    if f.layout == PER_ROW:
        return f.schema, []
    request_cols = storage_layout.stored_request_level(f.schema, features)
    fields, not_lists = [], []
    for fld in f.schema:
        if fld.name in request_cols:
            fields.append(fld)
        elif is_list_type(fld.type):
            fields.append(pa.field(fld.name, fld.type.value_type))
        else:
            not_lists.append(fld.name)
    return pa.schema(fields), not_lists


def scan_dataset(
    features: FeaturesConfig, data_cfg: DataConfig, data: str, memory_limit: Optional[str] = None
) -> Report:
    """Scan ``data`` (a file or directory) against the features and data sections (their
    contract and validation rules); every problem, counted."""
    files = open_files(data, features)
    columns = contract_columns(features)
    scan = Scan(file_order={f.path: i for i, f in enumerate(files)})
    groups: Dict[tuple, List[Tuple[FileInfo, Dict[str, Column], Dict[str, pa.DataType]]]] = {}
    for f in files:
        scan.layouts[f.layout] = scan.layouts.get(f.layout, 0) + 1
        view, not_lists = _view_schema(f, features)
        usable: Dict[str, Column] = {}
        for c in columns:
            if c.name in not_lists:
                scan.add_problem(
                    Problem(
                        "wrong type",
                        c.name,
                        1,
                        "files",
                        Place(f.path),
                        ERROR,
                        f"a candidate column of a per-request file must be a list, got {f.schema.field(c.name).type}",
                    )
                )
                continue
            try:
                check_schema(f.path, view, [c])
            except ContractError as e:
                missing = view.get_field_index(c.name) < 0
                kind = "missing column" if missing else "wrong type"
                detail = f"used as {c.role}" if missing else str(e).split(": ", 1)[-1]
                scan.add_problem(Problem(kind, c.name, 1, "files", Place(f.path), ERROR, detail))
                continue
            usable.setdefault(c.name, c)
        types = {n: view.field(n).type for n in usable}
        item = features.columns.item_id
        if item not in types and view.get_field_index(item) >= 0 and pa.types.is_integer(view.field(item).type):
            types[item] = view.field(item).type
        key = (f.layout, tuple(sorted((n, str(t)) for n, t in types.items())))
        groups.setdefault(key, []).append((f, usable, types))
    scan.schema_groups = len(groups)
    tmp = tempfile.mkdtemp(prefix="pinads_inspect_")
    con = duckdb.connect()
    try:
        con.execute(f"SET temp_directory = {sql_string(tmp)}")
        con.execute("SET enable_progress_bar = false")
        if memory_limit:
            con.execute(f"SET memory_limit = {sql_string(memory_limit)}")
        for (kind, _), members in groups.items():
            _, usable, types = members[0]
            GroupScanner(con, [m[0] for m in members], kind, usable, types, features, data_cfg, scan).run()
    finally:
        con.close()
        shutil.rmtree(tmp, ignore_errors=True)
    notes = []
    if scan.schema_groups > 1:
        notes.append(
            f"{scan.schema_groups} different file schemas: each scanned on its own; requests and "
            "duplicates are checked within one, distinct counts are summed over them (an upper bound)"
        )
    hashed = []
    for c in columns:
        st = scan.columns.get(c.name)
        if c.hashed and st and st.get("max") is not None and st["max"] >= c.table_size:
            hashed.append(f"{c.name} (max id {st['max']} >= table size {c.table_size})")
    if hashed:
        notes.append("ids beyond hashed tables, hashed into range by design: " + ", ".join(hashed))
    for c in columns:
        st = scan.columns.get(c.name)
        if st is not None and c.table_size:
            st["table_size"], st["hash"] = c.table_size, c.hashed
    rates = {}
    for surface, e in sorted(scan.label_rates.items()):
        rates[surface] = {"rows": e["rows"], **{k: v / e["rows"] for k, v in e.items() if k != "rows" and e["rows"]}}
    # In the order the data meets them: file, row group, row (schema problems first in their file).
    problems = sorted(scan.problems.values(), key=lambda p: (scan.place_key(p.place) if p.place else (-1,), p.kind))
    unknown, unknown_from = build_unknown_ids(files)
    return Report(
        data=data,
        files=len(files),
        layouts=scan.layouts,
        rows=scan.rows,
        requests=scan.requests,
        candidates_per_request=_quantiles(scan.candidates_hist),
        problems=problems,
        columns=scan.columns,
        sequence_lengths={g: _quantiles(h) for g, h in scan.sequence_lengths.items()},
        sequence_unit=scan.sequence_unit,
        label_rates=rates,
        notes=notes,
        unknown_ids=unknown,
        unknown_ids_from=unknown_from,
        warnings=unknown_id_warnings(unknown),
    )
