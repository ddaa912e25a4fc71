"""One group of files scanned (same layout, same types of the usable columns): ``GroupScanner``
runs the checks' SQL (``checks.py``) and the statistics' over it, a few DuckDB passes, into the
``Scan`` totals every group of the dataset adds to; each problem counted, with its first place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import duckdb
import pyarrow as pa

from pinads_rec.config import DataConfig, FeaturesConfig
from pinads_rec.data.inspect.checks import (
    ERROR,
    UNCHECKED,
    Check,
    column_checks,
    count_if,
    group_checks,
)
from pinads_rec.data.inspect.files import PER_REQUEST, PER_ROW, FileInfo, Place
from pinads_rec.data.loader import storage_layout
from pinads_rec.data.loader.contract import FLOAT, ID, LABEL, PROB, REQUEST, SEQ_BAG, SEQ_ID, TIME, Column, is_list_type
from pinads_rec.data.sql_text import sql_name, sql_string


@dataclass
class Problem:
    kind: str
    column: str
    count: int
    unit: str  # what is counted: values, rows, requests, files
    place: Optional[Place]
    loader: str  # what the loader does: error, repaired (how), read unchecked
    detail: str = ""


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
        paths = ", ".join(sql_string(f.path) for f in files)
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
                    if is_list_type(t):
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
            names = ", ".join(sql_string(x) for x in features.surfaces)
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
