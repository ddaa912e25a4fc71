"""Live requests built as the build builds a log: the online service's feature path.

A live ad request arrives raw, as the logs would hold it: the impression log's fields of the
request (surface, time, user, user features) and of each candidate ad (raw ids), and the user's
recent rows of each behaviour log. ``LiveBuild`` runs the build's own steps on them (full_build.py, every
statement as it is, on DuckDB): the side tables joined with their defaults, the vocabularies of the
run's build applied, each sequence group's events cut point in time to its ``max_length``, newest
first, the candidates in order -- so a request served online and the same request built offline
into the contract are the same row, and no transform has a second implementation to drift. The
loader's ``BatchBuilder`` then does the rest as in training (id hashing, managed-collision id
spreading, time deltas).

``LiveFeatures`` holds what every request shares, read once: the raw logs' column types (what a
request's fields must be), the side tables and the vocabularies, in one in-memory DuckDB database.
``LiveFeatures.build(requests)`` builds a batch of requests in one pass (one set of statements for
the whole batch: the fixed cost of the SQL is paid once per batch, not per request) and returns the
contract's per-request rows in request order.

A request is a dict::

    {"request": {<impression log field>: value, ...},        # shared by its candidates
     "candidates": [{<impression log field>: value, ...}],  # one per ad; request fields may be here too
     "events": {"<behaviour log>": [{<field>: value, ...}]}}  # a log by its file's stem, e.g. pin_events

Every field the build's expressions read must be given, with the raw log's type; a candidate's
field wins over the request's. Bad input raises ``RequestError`` naming the field and the value;
nothing of it reaches DuckDB.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import duckdb
import pyarrow as pa

from pinads_rec.config import ConfigError, ExperimentConfig
from pinads_rec.data.build.config_checks import check_build
from pinads_rec.data.build.days import vocabulary_source
from pinads_rec.data.build.engine import DuckDBEngine
from pinads_rec.data.build.full_build import Build
from pinads_rec.data.build.impressions import split_test
from pinads_rec.data.build.request_values import RawColumn, RequestError, check_value, raw_table
from pinads_rec.data.build.time_sql import seconds
from pinads_rec.data.build.vocabularies import apply_vocabulary
from pinads_rec.data.build.writer import request_rows_schema
from pinads_rec.data.loader.contract import ContractError
from pinads_rec.data.page_checksums import check_pages
from pinads_rec.data.raw_sources import RawSource, is_remote
from pinads_rec.data.sql_text import first_line, identifier, sql_name, sql_string

REQUEST = "__live_request"  # the impression rows' column numbering the batch's requests 0..n-1
CANDIDATE = "__live_candidate"  # and their candidates 0..c-1: the build orders them so, as the request did


def require_intact_pages(source: RawSource) -> None:
    """Every page of ``source``'s local Parquet files read with its checksum verified, where its
    writer stored one; the first that fails is a one-line ContractError naming file and row group."""
    if source.format != "parquet":
        return
    for path in source.files:
        problem = None if is_remote(path) else check_pages(path)
        if problem:
            raise ContractError(f"{source.where}: {problem}")


class LiveEngine(DuckDBEngine):
    """A cursor on the service's database: its side tables and vocabularies seen, temp tables its own."""

    def __init__(self, database: duckdb.DuckDBPyConnection):
        self.con = database.cursor()
        self.con.execute("SET preserve_insertion_order = true")

    def explain(self, error, sources):
        return None  # no file behind a live request: the build names the step that refused it


@dataclasses.dataclass(frozen=True)
class LiveSource(RawSource):
    """A raw log whose rows are a live request's, registered on the build's connection."""

    relation: str = ""
    con: Any = None

    def check_files(self) -> None:
        pass

    def scan(self, files: Optional[Tuple[str, ...]] = None) -> str:
        return f"(SELECT *, {sql_string(self.files[0])} AS filename FROM {self.relation})"

    def find(self, path: str, condition: str, values: str = "", row_as: Optional[str] = None) -> Optional[tuple]:
        columns = f"{sql_name(row_as)} FROM {self.scan()} AS {sql_name(row_as)}" if row_as else f"* FROM {self.scan()}"
        try:
            row = self.con.execute(
                f"SELECT __row{', ' + values if values else ''} FROM (SELECT row_number() OVER () - 1 AS __row, "
                f"{columns}) WHERE {condition} ORDER BY __row LIMIT 1"
            ).fetchone()
        except duckdb.Error:
            return None
        return None if row is None else (int(row[0]), *row[1:])

    def at(self, path: str, row: int) -> str:
        return f"{path}[{row}]"


class LiveFeatures:
    """The run's feature path for live requests: ``build(requests)`` -> contract rows.

    ``raw_dir``: the raw logs the run's data was built from (their column types, the side tables);
    ``vocabularies``: the build that fitted ``build.vocabularies`` (when the config declares any).
    ``max_candidates`` / ``max_events``: the bounds a request is refused beyond."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        raw_dir: str,
        vocabularies: Optional[str] = None,
        max_candidates: int = 1000,
        max_events: int = 10000,
    ):
        if (Path(raw_dir) / "days").is_dir() and (Path(raw_dir) / "history").is_dir():
            # The generator's drifting world keeps its raw logs a directory a day (the daily loop's):
            # read them as its day builds do.
            from pinads_rec.data.synth import days_build_config

            cfg = dataclasses.replace(cfg, build=days_build_config(cfg.build, cfg.synth))
        self.cfg, self.b = cfg, cfg.build
        self.max_candidates, self.max_events = max_candidates, max_events
        if any(not s.path for s in self.b.sequences):
            group = next(s.group for s in self.b.sequences if not s.path)
            raise ConfigError(
                f"build.sequences: group {group!r} reads its history from the impression log itself; a live "
                f"request carries no past impressions, so it cannot be served online (give it a behaviour log)"
            )
        self.db = duckdb.connect()
        self.db.execute("SET threads = 1")  # a request batch is small: one thread, no scheduling between them
        self.loader = loader = RawLogs(cfg, raw_dir, os.devnull, None, 1, engine=LiveEngine(self.db))
        self.impressions = self._columns(loader, loader.raw_source(self.b.impressions, "build.impressions"))
        loader.imp_columns = list(self.impressions)
        # Each behaviour log by its file's stem, shared by the groups reading it.
        self.logs: Dict[str, Dict[str, RawColumn]] = {}
        self.log_of: Dict[int, str] = {}
        for i, s in enumerate(self.b.sequences):
            name = log_name(s.path)
            self.log_of[i] = name
            if name not in self.logs:
                self.logs[name] = self._columns(loader, loader.raw_source(s, f"build.sequences[{i}]"))
        # Side tables and vocabularies: read and checked once, kept as tables of the shared database.
        self.side_tables: Dict[str, dict] = {}
        for i, side in enumerate(self.b.side_tables):
            # DuckDB verifies no page checksum: the pages of a side table in Parquet are read with
            # theirs first, once (its rows are then kept in memory for every request).
            require_intact_pages(loader.raw_source(side, f"build.side_tables[{i}]"))
            info = loader.side_table(i, side)
            kept = f"__live_side{i}"
            loader.engine.execute(f"CREATE TABLE {kept} AS SELECT * FROM {info['alias']}")
            self.side_tables[side.name] = {**info, "alias": kept}
        source = vocabulary_source(self.b, vocabularies)
        self.vocabularies: Dict[str, str] = {}
        for v in self.b.vocabularies:
            kept = f"__live_vocab_{identifier(v.table)}"
            path = Path(source) / "vocabularies" / f"{v.table}.parquet"
            loader.engine.execute(
                f"CREATE TABLE {kept} AS SELECT CAST(raw AS VARCHAR) AS raw, CAST(idx AS BIGINT) AS idx, count "
                f"FROM read_parquet({sql_string(str(path))})"
            )
            self.vocabularies[v.table] = kept
        # Outcomes (labels, the generator's truth): columns a live request has none of.
        self.label_columns = {t.label_column for t in cfg.features.tasks} | {
            t.true_probability_column for t in cfg.features.tasks if t.true_probability_column
        }
        self.required = self._required_fields()
        self.types: Dict[Any, Any] = {}  # LiveBuild's type questions, the same for every batch

    @staticmethod
    def _columns(loader: Build, source: RawSource) -> Dict[str, RawColumn]:
        described = loader.engine.describe(f"SELECT * FROM {loader.scan(source)}")
        return {n: RawColumn(n, t) for n, t in described if n != "filename"}

    def _required_fields(self) -> Dict[str, Dict[str, str]]:
        """Per raw log ("impressions" or a behaviour log), each column an expression the served
        build runs reads -> the config key of the first such expression."""
        b = self.b
        imp_exprs = {f"build.columns.{c}": e for c, e in b.columns.items() if c not in self.label_columns}
        imp = b.impressions
        imp_exprs["build.impressions.time"] = imp.time
        imp_exprs["build.impressions.item"] = imp.item
        if imp.order:
            imp_exprs["build.impressions.order"] = imp.order
        if imp.filter:
            imp_exprs["build.impressions.filter"] = imp.filter
        for i, side in enumerate(b.side_tables):
            imp_exprs.update({f"build.side_tables[{i}].key.{k}": e for k, e in side.key.items()})
        out = {"impressions": _reads(imp_exprs, self.impressions)}
        for i, s in enumerate(b.sequences):
            exprs = {f"build.sequences[{i}].columns.{c}": e for c, e in s.columns.items()}
            exprs[f"build.sequences[{i}].time"] = s.time
            if s.filter:
                exprs[f"build.sequences[{i}].filter"] = s.filter
            for side, key in s.side_tables.items():
                exprs.update({f"build.sequences[{i}].side_tables.{side}.{k}": e for k, e in key.items()})
            log = self.log_of[i]
            reads = _reads(exprs, self.logs[log])
            out[log] = {**reads, **out.get(log, {})}
        return out

    # --- a batch of requests -------------------------------------------------------------------------

    def build(self, requests: Sequence[dict], where: str = "request", checked: bool = False) -> pa.Table:
        """The contract's per-request rows of ``requests`` (dicts, module docstring), in their order.
        The request id column holds each request's index in ``requests``. ``checked``: every value's
        type was checked already (``raw_tables`` on arrival): not again."""
        impressions, events = self.raw_tables(requests, where, check_values=not checked)
        built = LiveBuild(self, impressions, events)
        try:
            table = built.run()
        finally:
            built.engine.close()
        order = table.column(self.cfg.features.columns.request_id).to_numpy()
        if len(order) != len(requests):
            raise RequestError(where, f"{len(requests) - len(order)} request(s) built no row")
        return table.take(pa.array(order.argsort()))

    def raw_tables(
        self, requests: Sequence[dict], where: str, check_values: bool = True
    ) -> Tuple[pa.Table, Dict[str, pa.Table]]:
        """The requests' raw rows, typed as their logs are: impressions (one per candidate, numbered
        by request in ``REQUEST``) and each behaviour log's events (the user's own)."""
        if not isinstance(requests, (list, tuple)) or not requests:
            raise RequestError(where, "give a non-empty list of requests")
        imp_rows: List[dict] = []
        log_rows: Dict[str, List[dict]] = {name: [] for name in self.logs}
        imp_fields = self.required["impressions"]
        for r, request in enumerate(requests):
            at = where if len(requests) == 1 else f"{where}[{r}]"
            if not isinstance(request, dict):
                raise RequestError(at, f"a request is a JSON object, got {type(request).__name__}")
            unknown = set(request) - {"request", "candidates", "events"}
            if unknown:
                raise RequestError(
                    f"{at}.{sorted(unknown)[0]}", "not a field of a request (request, candidates, events)"
                )
            shared = request.get("request", {})
            if not isinstance(shared, dict):
                raise RequestError(f"{at}.request", "must be an object of impression-log fields")
            candidates = request.get("candidates")
            if not isinstance(candidates, list) or not candidates:
                raise RequestError(f"{at}.candidates", "missing or empty: give at least one candidate ad")
            if len(candidates) > self.max_candidates:
                raise RequestError(
                    f"{at}.candidates", f"{len(candidates)} candidates, more than the configured {self.max_candidates}"
                )
            for c, cand in enumerate(candidates):
                if not isinstance(cand, dict):
                    raise RequestError(f"{at}.candidates[{c}]", "a candidate is an object of impression-log fields")
                row = {**shared, **cand}
                for name, value in row.items():
                    place = f"{at}.candidates[{c}].{name}" if name in cand else f"{at}.request.{name}"
                    column = self.impressions.get(name)
                    if column is None:
                        raise RequestError(place, f"not a column of the impression log ({', '.join(self.impressions)})")
                    if check_values:
                        check_value(value, column.duck_type, place)
                for name, key in imp_fields.items():
                    if name not in row:
                        raise RequestError(f"{at}.candidates[{c}].{name}", f"missing (read by {key})")
                row[REQUEST], row[CANDIDATE] = r, c
                imp_rows.append(row)
            given = request.get("events", {})
            if not isinstance(given, dict):
                raise RequestError(f"{at}.events", "must be an object: behaviour log -> its rows")
            for log, rows in given.items():
                if log not in self.logs:
                    raise RequestError(
                        f"{at}.events.{log}", f"not a behaviour log of the build ({', '.join(self.logs)})"
                    )
                if not isinstance(rows, list):
                    raise RequestError(f"{at}.events.{log}", "must be a list of event rows")
                if len(rows) > self.max_events:
                    raise RequestError(
                        f"{at}.events.{log}", f"{len(rows)} events, more than the configured {self.max_events}"
                    )
                columns = self.logs[log]
                for e, event in enumerate(rows):
                    place = f"{at}.events.{log}[{e}]"
                    if not isinstance(event, dict):
                        raise RequestError(place, "an event is an object of the log's fields")
                    for name, value in event.items():
                        if name not in columns:
                            raise RequestError(f"{place}.{name}", f"not a column of {log} ({', '.join(columns)})")
                        if check_values:
                            check_value(value, columns[name].duck_type, f"{place}.{name}")
                    for name, key in self.required[log].items():
                        if name not in event:
                            raise RequestError(f"{place}.{name}", f"missing (read by {key})")
                    log_rows[log].append({**event, REQUEST: r})
        numbering = {REQUEST: RawColumn(REQUEST, "BIGINT"), CANDIDATE: RawColumn(CANDIDATE, "BIGINT")}
        imp_columns = {**self.impressions, **numbering}
        impressions = raw_table(imp_rows, imp_columns)
        return impressions, {
            log: raw_table(rows, {**self.logs[log], REQUEST: RawColumn(REQUEST, "BIGINT")})
            for log, rows in log_rows.items()
        }

    def requests_from_logs(self, split: Optional[str] = None, limit: int = 100) -> List[dict]:
        """The first ``limit`` requests (in time order) of the raw impression log -- of build split
        ``split``'s window, or all -- as live requests: the fields every request of them holds once
        under ``request``, the others per candidate (in the build's order), and each behaviour
        log's rows of the user before the request's time (the newest ``max_events``). Only the
        fields the served build reads."""
        loader, imp = self.loader, self.b.impressions
        source = loader.raw_source(imp, "build.impressions")
        loader.engine.execute(f"CREATE OR REPLACE TEMP VIEW __raw_imp AS SELECT * FROM {loader.scan(source)}")
        t = seconds(loader, imp.time, "__raw_imp", "build.impressions.time")
        loader.imp_time = t
        where = "true"
        if split is not None:
            names = [s.name for s in self.b.splits]
            if split not in names:
                raise ConfigError(f"split {split!r}: not one of build.splits ({', '.join(names)})")
            where = split_test(loader, names.index(split))
        keys = [imp.request] if imp.request else list(imp.request_key)
        key_sql = ", ".join(f"CAST(({k}) AS VARCHAR)" for k in keys)
        filtered = (
            f"(SELECT *, ({imp.user}) AS __u, {t} AS __t, CAST([{key_sql}] AS VARCHAR) AS __key, "
            f"({imp.order or imp.item}) AS __o, ({imp.item}) AS __i FROM __raw_imp"
        )
        filtered += f" WHERE ({imp.filter or 'true'}) AND {where})"
        rows = (
            loader.engine.con.sql(
                f"""WITH chosen AS (SELECT __key, min(__t) AS __first FROM {filtered} GROUP BY __key
                               ORDER BY __first, __key LIMIT {int(limit)})
            SELECT f.* FROM {filtered} f JOIN chosen USING (__key) ORDER BY chosen.__first, f.__key, f.__o, f.__i"""
            )
            .to_arrow_table()
            .to_pylist()
        )
        fields = list(self.required["impressions"])
        grouped: Dict[str, List[dict]] = {}
        for row in rows:
            grouped.setdefault(row["__key"], []).append(row)
        shared = [f for f in fields if all(len({repr(r[f]) for r in g}) == 1 for g in grouped.values())]
        users = sorted({g[0]["__u"] for g in grouped.values()}, key=repr)
        events: Dict[str, List[dict]] = {}
        for i, s in enumerate(self.b.sequences):
            log = self.log_of[i]
            if log in events:
                continue
            raw = loader.raw_source(s, f"build.sequences[{i}]")
            loader.engine.execute(f"CREATE OR REPLACE TEMP VIEW __raw_log AS SELECT * FROM {loader.scan(raw)}")
            et = seconds(loader, s.time, "__raw_log", f"build.sequences[{i}].time")
            loader.engine.con.register("__users", pa.table({"u": users}))
            events[log] = (
                loader.engine.con.sql(
                    f"SELECT *, ({s.user}) AS __u, {et} AS __t FROM __raw_log "
                    f"WHERE ({s.user}) IN (SELECT u FROM __users) ORDER BY __t DESC"
                )
                .to_arrow_table()
                .to_pylist()
            )
        out = []
        for g in grouped.values():
            user, time_s = g[0]["__u"], min(r["__t"] for r in g)
            request = {
                "request": {f: g[0][f] for f in shared},
                "candidates": [{f: r[f] for f in fields if f not in shared} for r in g],
                "events": {},
            }
            for log, rows_of_log in events.items():
                kept = [e for e in rows_of_log if e["__u"] == user and e["__t"] < time_s][: self.max_events]
                needed = list(self.required[log])
                request["events"][log] = [{f: e[f] for f in needed} for e in kept]
            out.append(json.loads(json.dumps(request, default=str)))
        return out


class RawLogs(Build):
    """The build's steps over the raw logs themselves (their scans, types, side tables), never run
    whole: what ``LiveFeatures`` reads once."""

    def check_config(self) -> None:
        check_build(self.b, self.features, by_day=True)


class LiveBuild(Build):
    """The build's steps over one batch of live requests: one split (``live``), the side tables and
    vocabularies of ``LiveFeatures``, no labels, no downsampling; the rows returned, not written."""

    SPLIT = "live"

    def __init__(self, live: LiveFeatures, impressions: pa.Table, events: Dict[str, pa.Table]):
        # Each request its own "user": its events are its own, whoever else in the batch is the same
        # user; its candidates scored in the order it gave them.
        cfg = dataclasses.replace(
            live.cfg,
            build=dataclasses.replace(
                live.b,
                impressions=dataclasses.replace(
                    live.b.impressions, request=REQUEST, request_key=[], user=REQUEST, order=CANDIDATE
                ),
                sequences=[dataclasses.replace(s, user=REQUEST) for s in live.b.sequences],
                negative_downsampling=None,
            ),
        )
        engine = LiveEngine(live.db)
        super().__init__(cfg, "", os.devnull, None, 1, engine=engine)
        self.live, self.splits = live, [self.SPLIT]
        self.relations: Dict[str, LiveSource] = {}
        engine.con.register("__live_impressions", impressions)
        self.relations["impressions"] = LiveSource(
            "request.candidates", ("candidates",), "parquet", ",", (), relation="__live_impressions", con=engine.con
        )
        for log, table in events.items():
            relation = f"__live_events_{identifier(log)}"
            engine.con.register(relation, table)
            self.relations[log] = LiveSource(
                f"request.events.{log}", (f"events.{log}",), "parquet", ",", (), relation=relation, con=engine.con
            )
        self.columns = {c: v for c, v in self.columns.items() if c not in live.label_columns}
        self.candidate = [c for c in self.candidate if c not in live.label_columns]
        self.computed = [c for c in self.computed if c not in live.label_columns]

    def raw_source(self, cfg, where: str) -> RawSource:
        if cfg is self.b.impressions:
            return self.relations["impressions"]
        i = self.b.sequences.index(cfg)
        return self.relations[self.live.log_of[i]]

    def side_table(self, i: int, side) -> dict:
        return self.live.side_tables[side.name]

    def vocabulary(self, vocab) -> None:
        apply_vocabulary(self, vocab.table, self.live.vocabularies[vocab.table])

    def check_config(self) -> None:
        check_build(self.b, self.features, by_day=True)  # no splits: a live batch is one

    # Every batch's tables have the same columns and types (the raw logs'), so the build's questions
    # about types are asked once: a fifth of a small batch's statements.
    def type_of(self, expr: str, relation: Optional[str] = None) -> str:
        key = (expr, relation)
        if key not in self.live.types:
            self.live.types[key] = super().type_of(expr, relation)
        return self.live.types[key]

    def else_value(self, expr: str) -> Optional[str]:
        key = ("else", expr)
        if key not in self.live.types:
            self.live.types[key] = super().else_value(expr)
        return self.live.types[key]

    def one(self, sql: str) -> Optional[tuple]:
        if not sql.startswith("SELECT typeof("):
            return super().one(sql)
        if sql not in self.live.types:
            row = super().one(sql)
            if row is None or row[0] is None:
                return row  # no row to tell the type by (a request without such events): asked again next time
            self.live.types[sql] = row
        return self.live.types[sql]

    def explain(self, e: Exception) -> Optional[str]:
        return None  # no raw file to point into: the step's name says what refused

    def check_labels(self) -> None:
        """A live request has no outcome yet."""

    def split_filters(self) -> Dict[str, str]:
        return {}

    def drop_outside_splits(self) -> None:
        """Every live impression is in the one split."""

    def split_columns(self) -> Tuple[str, str]:
        return sql_string(self.SPLIT), "1"

    def keep_built_requests(self) -> None:
        """Every request of the batch is built."""

    def prune_events(self, events: str) -> None:
        """A request carries its own user's events only."""

    def run(self) -> pa.Table:
        return self.steps()[self.SPLIT]

    def write(self, split: str) -> pa.Table:
        query = self.split_query(split) + " ORDER BY k.__rank"
        try:
            batches = list(self.engine.batches(query, 1 << 20))
        except self.engine.errors as e:
            raise ContractError(f"building the requests: {first_line(e)}") from None
        schema = request_rows_schema(batches[0].schema, self.features)
        return pa.Table.from_batches(batches).cast(schema)


def _reads(exprs: Dict[str, str], columns: Dict[str, RawColumn]) -> Dict[str, str]:
    """Each of ``columns`` some expression names (as a word) -> the first expression's config key."""
    out: Dict[str, str] = {}
    for key, expr in exprs.items():
        words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", re.sub(r"'[^']*'", "", expr or "")))
        for name in columns:
            if name in words and name not in out:
                out[name] = key
    return out


def log_name(paths: Sequence[str]) -> str:
    """A behaviour log's name in a request: its first file's stem (``pin_events.parquet`` -> pin_events)."""
    stem = os.path.basename(paths[0])
    return stem.split(".")[0] or stem
