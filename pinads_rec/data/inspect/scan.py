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
The column roles and the types they accept come from the contract (``data/contract.py``), the
SQL of each check from ``checks.py``. The files and places here are shared with the draft
(``draft.py``).
"""

from __future__ import annotations

import bisect
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import duckdb
import pyarrow as pa

from pinads_rec.config import DataConfig, FeaturesConfig
from pinads_rec.data import storage_layout
from pinads_rec.data.contract import (
    FLOAT,
    ID,
    LABEL,
    PROB,
    REQUEST,
    SEQ_BAG,
    SEQ_ID,
    TIME,
    Column,
    ContractError,
    check_schema,
    contract_columns,
)
from pinads_rec.data.inspect.checks import (
    ERROR,
    UNCHECKED,
    Check,
    column_checks,
    count_if,
    group_checks,
    is_list,
    sql_literal,
    sql_name,
)
from pinads_rec.data.reader import list_files, open_parquet

PER_ROW, PER_REQUEST = "per_row", "per_request"

# --------------------------------------------------------------------------------------------
# Files, layouts, places.
# --------------------------------------------------------------------------------------------


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


@dataclass
class Problem:
    kind: str
    column: str
    count: int
    unit: str  # what is counted: values, rows, requests, files
    place: Optional[Place]
    loader: str  # what the loader does: error, repaired (how), read unchecked
    detail: str = ""


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


# --------------------------------------------------------------------------------------------
# One scan of a set of files sharing a layout and schema.
# --------------------------------------------------------------------------------------------


@dataclass
class Scan:
    """Totals of one or more file groups, merged."""

    problems: Dict[Tuple[str, str], Problem] = field(default_factory=dict)
    rows: int = 0
    requests: int = 0
    candidates_hist: Dict[int, int] = field(default_factory=dict)
    columns: Dict[str, dict] = field(default_factory=dict)
    sequence_lengths: Dict[str, Dict[int, int]] = field(default_factory=dict)
    sequence_unit: str = "rows"
    label_rates: Dict[str, dict] = field(default_factory=dict)
    layouts: Dict[str, int] = field(default_factory=dict)
    schema_groups: int = 0
    file_order: Dict[str, int] = field(default_factory=dict)  # file -> its place in the scan's order

    def add_problem(self, p: Problem) -> None:
        key = (p.kind, p.column)
        old = self.problems.get(key)
        if old is None:
            self.problems[key] = p
            return
        old.count += p.count
        if old.place is None or (p.place is not None and self.place_key(p.place) < self.place_key(old.place)):
            old.place = p.place

    def place_key(self, p: Place) -> tuple:
        """Where ``p`` is in the order the data is read: file, row group, row, candidate."""
        row_group = -1 if p.row_group is None else p.row_group
        return (self.file_order.get(p.file, 0), row_group, p.row or 0, p.candidate or -1)


class GroupScanner:
    """Runs the SQL over one group of files (same layout, same types of the usable columns)."""

    def __init__(
        self,
        con: duckdb.DuckDBPyConnection,
        files: List[FileInfo],
        kind: str,
        usable: Dict[str, Column],
        view_types: Dict[str, pa.DataType],
        features: FeaturesConfig,
        data: DataConfig,
        scan: Scan,
    ):
        self.con, self.files, self.layout = con, files, kind
        self.usable, self.view_types, self.features, self.data, self.scan = (
            usable,
            view_types,
            features,
            data,
            scan,
        )
        request_cols = storage_layout.stored_request_level(files[0].schema, features)  # as the writer stored them
        names = list(usable)
        item = features.columns.item_id
        self.item = item if item in view_types else None
        if self.item and self.item not in names:
            names.append(self.item)
        self.names = names
        if kind == PER_ROW:
            self.request_names = names
            self.candidate_names: List[str] = []
        else:
            self.request_names = [n for n in names if n in request_cols]
            self.candidate_names = [n for n in names if n not in request_cols]
        self.cand: Optional[str] = None
        self.ref: Optional[str] = None
        paths = ", ".join(sql_literal(f.path) for f in files)
        offsets, acc = [], 0
        for f in files:
            offsets.append(acc)
            acc += sum(f.row_group_rows)
        cols = ", ".join(sql_name(n) for n in names)
        sep = ", " if cols else ""
        self.src = (
            f"(SELECT file_index::BIGINT AS __f, file_row_number::BIGINT AS __r, NULL::BIGINT AS __k, "
            f"[{', '.join(map(str, offsets)) or '0'}][file_index::BIGINT + 1] + file_row_number::BIGINT AS __g"
            f"{sep}{cols} "
            f"FROM read_parquet([{paths}], file_row_number = true))"
        )
        if kind == PER_REQUEST:
            cand = self.candidate_names
            label = features.tasks[0].label_column
            self.ref = label if label in cand else (cand[0] if cand else None)
            if self.ref is None:
                self.cand = None
            else:
                ok = " AND ".join(
                    [f"{sql_name(n)} IS NOT NULL" for n in cand]
                    + [f"len({sql_name(n)}) = len({sql_name(self.ref)})" for n in cand]
                )
                req = ", ".join(sql_name(n) for n in self.request_names)
                unn = ", ".join(f"unnest({sql_name(n)}) AS {sql_name(n)}" for n in cand)
                self.cand = (
                    f"(SELECT __f, __r, unnest(range(len({sql_name(self.ref)}))) AS __k, __g, "
                    f"{req + ', ' if req else ''}{unn} FROM {self.src} WHERE {ok})"
                )

    # --- places ------------------------------------------------------------------------------

    def place(self, pos: Optional[dict]) -> Optional[Place]:
        if pos is None:
            return None
        f = self.files[pos["f"]]
        g, r = f.locate(pos["r"])
        return Place(f.path, g, r, pos["k"])

    def found(
        self, kind: str, column: str, count, unit: str, first: Optional[dict], loader: str, detail: str = ""
    ) -> None:
        """A problem a query counted (``first``: where its first case sits), if it counted any."""
        if count:
            self.scan.add_problem(Problem(kind, column, int(count), unit, self.place(first), loader, detail))

    def run_checks(self, view: str, checks: List[Check]) -> None:
        if not checks or view is None:
            return
        counts = ", ".join(f"({c.count_sql}) AS c{i}" for i, c in enumerate(checks))
        sel = ", ".join(f"sum(c{i}), min(p) FILTER (WHERE c{i} > 0)" for i in range(len(checks)))
        row = self.con.execute(
            f"SELECT {sel} FROM (SELECT {{'f': __f, 'r': __r, 'k': __k}} AS p, {counts} FROM {view})"
        ).fetchone()
        for i, c in enumerate(checks):
            self.found(c.kind, c.column, row[2 * i], c.unit, row[2 * i + 1], c.loader, c.detail)

    # --- the passes ----------------------------------------------------------------------------

    def run(self) -> None:
        features, data = self.features, self.data
        per_request = self.layout == PER_REQUEST
        req_checks, cand_checks = [], []
        nulls_seen = set()
        for name, c in self.usable.items():
            checks = []
            if name not in nulls_seen:
                nulls_seen.add(name)
                checks.append(Check("null", name, "rows", ERROR, count_if(f"{sql_name(name)} IS NULL")))
            checks += column_checks(c, self.view_types[name], data, features)
            (cand_checks if name in self.candidate_names else req_checks).extend(checks)
        req_checks += group_checks(features, data, self.usable)
        if per_request:
            # A candidate list that is null, or of another length than the others, drops the request
            # from the candidate-level checks (it is counted here once).
            for n in self.candidate_names:
                if n in self.usable:
                    req_checks.append(Check("null", n, "rows", ERROR, count_if(f"{sql_name(n)} IS NULL")))
                if n != self.ref and self.ref is not None:
                    req_checks.append(
                        Check(
                            "candidate lists of unequal lengths",
                            n,
                            "requests",
                            ERROR,
                            count_if(f"len({sql_name(n)}) != len({sql_name(self.ref)})"),
                            f"its length differs from {self.ref!r}'s",
                        )
                    )
            self.run_checks(self.src, req_checks)
            self.run_checks(self.cand, cand_checks)
        else:
            self.run_checks(self.src, req_checks + cand_checks)
        self.requests()
        self.duplicates()
        self.stats()

    def _view(self, name: str) -> Optional[str]:
        return self.cand if name in self.candidate_names else self.src

    def requests(self) -> None:
        """Rows, requests, candidates per request; requests not contiguous or split over row groups."""
        scan, req = self.scan, self.features.columns.request_id
        per_request = self.layout == PER_REQUEST
        if not per_request:
            scan.rows += sum(sum(f.row_group_rows) for f in self.files)
        elif self.ref is not None:  # rows = candidates
            scan.rows += int(
                self.con.execute(f"SELECT coalesce(sum(len({sql_name(self.ref)})), 0) FROM {self.src}").fetchone()[0]
            )
        if req not in self.usable:
            return
        r = sql_name(req)
        if per_request:
            n_sql = f"len({sql_name(self.ref)})" if self.ref else "0"
            agg = (
                f"SELECT {r} AS req, count(*) AS n, sum({n_sql}) AS cands, min({{'f': __f, 'r': __r, 'k': __k}}) AS p "
                f"FROM {self.src} WHERE {r} IS NOT NULL GROUP BY {r}"
            )
            self.con.execute(f"CREATE OR REPLACE TEMP TABLE __req AS {agg}")
            row = self.con.execute(
                "SELECT count(*), count(*) FILTER (WHERE n > 1), min(p) FILTER (WHERE n > 1) FROM __req"
            ).fetchone()
            scan.requests += int(row[0])
            self.found("request in several rows", req, row[1], "requests", row[2], UNCHECKED)
            for k, v in self.con.execute("SELECT cands, count(*) FROM __req GROUP BY 1").fetchall():
                scan.candidates_hist[int(k or 0)] = scan.candidates_hist.get(int(k or 0), 0) + int(v)
            self.con.execute("DROP TABLE __req")
            return
        # Per row: a request is contiguous iff its rows span exactly its count of global row numbers.
        starts, acc = [], 0
        for f in self.files:
            for n in f.row_group_rows:
                starts.append(acc)
                acc += n
        rgs = ", ".join(f"({s}, {i})" for i, s in enumerate(starts)) or "(0, 0)"
        agg = (
            f"SELECT {r} AS req, count(*) AS n, min(__g) AS g0, max(__g) AS g1, "
            f"min({{'f': __f, 'r': __r, 'k': __k}}) AS p FROM {self.src} WHERE {r} IS NOT NULL GROUP BY {r}"
        )
        self.con.execute(f"CREATE OR REPLACE TEMP TABLE __req AS {agg}")
        self.con.execute(f"CREATE OR REPLACE TEMP TABLE __rg AS SELECT * FROM (VALUES {rgs}) t(s, i)")
        row = self.con.execute(
            "SELECT count(*), count(*) FILTER (WHERE n != g1 - g0 + 1), min(p) FILTER (WHERE n != g1 - g0 + 1) "
            "FROM __req"
        ).fetchone()
        scan.requests += int(row[0])
        self.found("request rows not contiguous", req, row[1], "requests", row[2], ERROR, "sort the rows by request")
        row = self.con.execute(
            "SELECT count(*), min(q.p) FROM __req q ASOF JOIN __rg a ON q.g0 >= a.s ASOF JOIN __rg b ON q.g1 >= b.s "
            "WHERE q.n = q.g1 - q.g0 + 1 AND a.i != b.i"
        ).fetchone()
        self.found(
            "request split across row groups",
            req,
            row[0],
            "requests",
            row[1],
            "read as separate requests",
            "write whole requests per row group",
        )
        for k, v in self.con.execute("SELECT n, count(*) FROM __req GROUP BY 1").fetchall():
            scan.candidates_hist[int(k)] = scan.candidates_hist.get(int(k), 0) + int(v)
        self.con.execute("DROP TABLE __req")
        self.con.execute("DROP TABLE __rg")

    def duplicates(self) -> None:
        req, item = self.features.columns.request_id, self.item
        if item is None or req not in self.usable:
            return
        view = self._view(item)
        if view is None:
            return
        r, i = sql_name(req), sql_name(item)
        # A build maps the ids its vocabulary left out to 0 (unknown): two unknown candidates of a
        # request are two items, not one shown twice.
        unknown = f" AND {i} != 0" if self._item_has_vocabulary() else ""
        row = self.con.execute(
            f"SELECT sum(n - 1), min(p2) FROM (SELECT count(*) AS n, "
            f"list_sort(list({{'f': __f, 'r': __r, 'k': __k}}))[2] AS p2 FROM {view} "
            f"WHERE {r} IS NOT NULL AND {i} IS NOT NULL{unknown} GROUP BY {r}, {i} HAVING count(*) > 1)"
        ).fetchone()
        self.found(
            "duplicated (request, item) row",
            item,
            row[0],
            "rows",
            row[1],
            UNCHECKED,
            f"rows repeating an earlier ({req}, {item}) pair",
        )

    def _item_has_vocabulary(self) -> bool:
        """The item column's ids come through a build vocabulary (``<build>/vocabularies/<table>.parquet``
        beside the split directory), so 0 is its unknown id."""
        tables = {s.table for s in self.features.sparse if s.column == self.item}
        return any(
            (Path(f.path).parent.parent / "vocabularies" / f"{t}.parquet").exists() for f in self.files for t in tables
        )

    def stats(self) -> None:
        features, scan = self.features, self.scan
        for view, names in ((self.src, self.request_names), (self.cand, self.candidate_names)):
            if view is None:
                continue
            sel, keys = [], []
            lists = []
            for n in names:
                c = self.usable.get(n)
                t = self.view_types[n]
                x = sql_name(n)
                sel.append(f"count(*) FILTER (WHERE {x} IS NULL)")
                keys.append((n, "nulls"))
                role = c.role if c else ID  # the item column, when it is no feature
                if role in (ID, SEQ_ID, SEQ_BAG, REQUEST):
                    if is_list(t):
                        sel += [f"min(list_min({x}))", f"max(list_max({x}))"]
                        keys += [(n, "min"), (n, "max")]
                        lists.append(n)
                    else:
                        sel += [f"min({x})", f"max({x})", f"count(DISTINCT {x})"]
                        keys += [(n, "min"), (n, "max"), (n, "distinct")]
                elif role in (FLOAT, TIME, PROB):
                    sel += [
                        f"min({x}) FILTER (WHERE isfinite({x}::DOUBLE))",
                        f"max({x}) FILTER (WHERE isfinite({x}::DOUBLE))",
                        f"avg({x}::DOUBLE) FILTER (WHERE isfinite({x}::DOUBLE))",
                    ]
                    keys += [(n, "min"), (n, "max"), (n, "mean")]
                elif role == LABEL:
                    sel.append(f"avg({x}::DOUBLE)")
                    keys.append((n, "rate"))
            for g in features.sequence_groups:
                if g.timestamp_column in names and g.timestamp_column in self.usable:
                    sel.append(f"histogram(len({sql_name(g.timestamp_column)}))")
                    keys.append((g.name, "lengths"))
            if not sel:
                continue
            row = self.con.execute(f"SELECT {', '.join(sel)} FROM {view}").fetchone()
            for (name, what), v in zip(keys, row):
                if what == "lengths":
                    hist = scan.sequence_lengths.setdefault(name, {})
                    for k, cnt in (v or {}).items():
                        hist[int(k)] = hist.get(int(k), 0) + int(cnt)
                    scan.sequence_unit = "requests" if self.layout == PER_REQUEST else "rows"
                    continue
                _merge_stat(scan.columns.setdefault(name, {}), what, v)
            if lists:
                distinct = self.con.execute(
                    f"SELECT {', '.join(f'count(DISTINCT u{i})' for i in range(len(lists)))} FROM "
                    f"(SELECT {', '.join(f'unnest({sql_name(n)}) AS u{i}' for i, n in enumerate(lists))} FROM {view})"
                ).fetchone()
                for n, v in zip(lists, distinct):
                    _merge_stat(scan.columns.setdefault(n, {}), "distinct", v)
        self.label_rates()

    def label_rates(self) -> None:
        features, scan = self.features, self.scan
        surface = features.columns.surface
        labels = [t for t in features.tasks if t.label_column in self.usable]
        if surface not in self.usable or not labels:
            return
        view = self._view(surface)
        if view is None or any(self._view(t.label_column) != view for t in labels):
            return
        s = sql_name(surface)
        if pa.types.is_integer(self.view_types[surface]):
            names = ", ".join(sql_literal(x) for x in features.surfaces)
            s = f"coalesce([{names}][{s} + 1], {s}::VARCHAR)"
        label_sql = [sql_name(t.label_column) for t in labels]
        sums = ", ".join(f"sum({x}::DOUBLE) FILTER (WHERE {x} = 0 OR {x} = 1)" for x in label_sql)
        for row in self.con.execute(f"SELECT {s}::VARCHAR, count(*), {sums} FROM {view} GROUP BY 1").fetchall():
            entry = scan.label_rates.setdefault(str(row[0]), {"rows": 0, **{t.name: 0.0 for t in labels}})
            entry["rows"] += int(row[1])
            for t, v in zip(labels, row[2:]):
                entry[t.name] = entry.get(t.name, 0.0) + float(v or 0.0)


def _merge_stat(entry: dict, what: str, v) -> None:
    if v is None:
        entry.setdefault(what, None)
        return
    v = v.item() if hasattr(v, "item") else v
    old = entry.get(what)
    if old is None:
        entry[what] = v
    elif what == "min":
        entry[what] = min(old, v)
    elif what == "max":
        entry[what] = max(old, v)
    elif what in ("nulls", "distinct"):
        entry[what] = old + v  # over several file schemas: the distinct count is an upper bound
    else:
        entry[what] = v  # a mean or rate of the last group: exact with one file schema (the usual case)


# --------------------------------------------------------------------------------------------
# The whole dataset.
# --------------------------------------------------------------------------------------------


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
        elif is_list(fld.type):
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
        con.execute(f"SET temp_directory = {sql_literal(tmp)}")
        con.execute("SET enable_progress_bar = false")
        if memory_limit:
            con.execute(f"SET memory_limit = {sql_literal(memory_limit)}")
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
