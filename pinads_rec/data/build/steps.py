"""The build's steps, as SQL on DuckDB: the impressions joined with the side tables, the requests,
each sequence group's events, the vocabularies, the sequences cut point in time, the candidates,
and each split written (the package docstring tells them in order). Every statement of the build
is here; the checks on the way (checks.py) and the files' writing (writer.py) are mixed in.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from datetime import datetime
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union
from zoneinfo import ZoneInfo

from pinads_rec.config import ConfigError, ExperimentConfig, SequenceGroupConfig, SequenceSourceConfig
from pinads_rec.data import build_output
from pinads_rec.data.build.checks import Checks
from pinads_rec.data.build.config_checks import check_build, embedding_columns
from pinads_rec.data.build.engine import Engine, open_engine
from pinads_rec.data.build.queries import INTEGERS
from pinads_rec.data.build.writer import Reports, SplitWriter
from pinads_rec.data.contract import ContractError, contract_columns
from pinads_rec.data.raw_sources import RawSource, columns_read, first_line, sql_literal, sql_name, sql_string


def build(
    cfg: ExperimentConfig,
    raw_dir: str,
    out_dir: str,
    memory_limit: Optional[str] = None,
    threads: Optional[int] = None,
    engine: str = "duckdb",
) -> dict:
    """Builds every split of ``cfg.build`` from the files under ``raw_dir`` into ``out_dir``, which
    it replaces whole, or not at all on an error, on ``engine`` (engine.py); returns the summary
    (also ``out_dir/summary.json``)."""
    with build_output.replacing(out_dir) as work:
        return Build(cfg, raw_dir, str(work), memory_limit, threads, engine).run()


def _time_of_day(text: str, tz: str, where: str) -> float:
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ConfigError(f"{where}: {text!r} is not a date or datetime (YYYY-MM-DD[THH:MM[:SS]])") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=ZoneInfo(tz))
    return moment.timestamp()


class Build(Checks, Reports):
    """One build of the raw files into ``out_dir`` (``run``): an engine (engine.py), a temp table a step."""

    # The count of requests whose impressions fall in two splits.
    ACROSS = "requests across a split boundary (put in the split of their earliest impression)"

    def __init__(
        self,
        cfg: ExperimentConfig,
        raw_dir: str,
        out_dir: str,
        memory_limit: Optional[str],
        threads: Optional[int],
        engine: Union[str, Engine] = "duckdb",
    ):
        self.cfg, self.b, self.features = cfg, cfg.build, cfg.features
        self.check_config()
        self.raw_dir, self.out = raw_dir, Path(out_dir)  # build() gives it its temporary directory
        self.threads = threads or os.cpu_count() or 1
        self.memory_limit = memory_limit
        self.tmp = self.out / ".build_tmp"  # the engine's spill files
        # An open engine is taken as it is (the online feature path: data/build/live.py).
        self.engine = (
            engine if isinstance(engine, Engine) else open_engine(engine, self.threads, str(self.tmp), memory_limit)
        )
        self.counts: Dict[str, int] = {}  # every repair and drop, by what it was
        # Rows an id CASE gave its ELSE: the config's own value, so reported apart from the repairs.
        self.case_else: Dict[str, int] = {}
        self.columns = {c.name: c for c in contract_columns(self.features)}
        names = self.features.columns
        self.user_side = [s.column for s in self.features.sparse if s.user_side]
        self.sequence_columns = {
            g.name: [g.timestamp_column] + [f.column for f in g.features] + embedding_columns(g)
            for g in self.features.sequence_groups
        }
        made_here = {names.request_id, names.timestamp} | {c for cols in self.sequence_columns.values() for c in cols}
        self.candidate = [c for c in self.columns if c not in made_here and c not in self.user_side]
        self.computed = [c for c in self.columns if c not in made_here]  # from build.columns
        self.splits = [s.name for s in self.b.splits]
        self.group_sources: Dict[str, tuple] = {}  # group -> (events table, source, group)

    def check_config(self) -> None:
        check_build(self.cfg.build, self.cfg.features)

    def summarize(self, outputs: Dict[str, dict], seconds: float, root=None, impressions: str = "imp") -> dict:
        """The summary (writer.py), with the rows each CASE gave its ELSE beside the repairs."""
        summary = {**super().summarize(outputs, seconds, root, impressions), "case_else": self.case_else}
        summary["unknown_ids"] = self.unknown_ids(list(outputs))  # per split and vocabulary (vocabulary section)
        return summary

    # --- the steps ---------------------------------------------------------------------------

    def run(self) -> dict:
        start = time.time()
        outputs = self.steps()
        summary = self.summarize(outputs, time.time() - start)
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        manifest = self.manifest(outputs, summary)
        self.engine.close()  # no query left that could spill again into the files the manifest lists
        shutil.rmtree(self.tmp, ignore_errors=True)
        build_output.write_manifest(self.out, manifest, self.splits)
        return summary

    def steps(self) -> Dict[str, dict]:
        """Every step, each split's files written; returns what ``write`` returned per split."""
        try:
            self.impressions()
            self.requests()
            for source in self.b.sequences:
                self.events(source)
            for vocab in self.b.vocabularies:
                self.vocabulary(vocab)
            self.check_id_ranges()
            for events, source, group in self.group_sources.values():
                self.sequences(events, source, group)
            self.candidates()
            return {split: self.write(split) for split in self.splits}
        except self.engine.errors as e:  # a raw file DuckDB refused: its file, line, column and value
            raise ContractError(self.explain(e) or f"build: {first_line(e)}") from None
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def impressions(self) -> None:
        imp = self.b.impressions
        self.imp_source = self.raw_source(imp, "build.impressions")
        self.imp_columns = self.source_columns(self.imp_source)
        base = f"(SELECT *, filename AS __file FROM {self.scan(self.imp_source)}{_where(imp.filter)})"
        try:
            self.engine.execute(f"CREATE TEMP VIEW impressions AS SELECT * FROM {base}")
        except self.engine.errors:
            self.check_binds(
                f"(SELECT * FROM {self.scan(self.imp_source)})",
                {"build.impressions.filter": imp.filter},
                self.imp_source,
            )
            raise
        self.imp_time = self.seconds(imp.time, "impressions", "build.impressions.time", self.imp_source)
        joins, structs = [], []
        self.side_sources = {}  # side table name -> what its joins need (side_table)
        for i, side in enumerate(self.b.side_tables):
            self.side_sources[side.name] = self.side_table(i, side)
            join, struct = self.side_join(side.name, side.key, self.imp_time)
            joins.append(join)
            structs.append(struct)
        joined = "SELECT impressions.*" + "".join(", " + s for s in structs) + " FROM impressions " + " ".join(joins)
        # A history read from the impression log itself (a sequence source without a path) sees the
        # side tables too: a clicked video's author is ``video.author_id``, as in build.columns.
        try:
            self.engine.execute(f"CREATE TEMP VIEW impressions_joined AS {joined}")
        except self.engine.errors as e:
            keys = {
                f"build.side_tables[{i}].key.{k}": expr
                for i, s in enumerate(self.b.side_tables)
                for k, expr in s.key.items()
            }
            self.check_binds("impressions", keys, self.imp_source)
            raise ContractError(self.explain(e) or f"build: joining the side tables: {first_line(e)}") from None
        split, n_splits = self.split_columns()
        keys = self.request_keys()
        key_columns = ", ".join(f"({k}) AS __key{i}" for i, k in enumerate(keys))
        order = imp.order or imp.item
        outputs = ", ".join(f"({self.b.columns[c]}) AS {sql_name(c)}" for c in self.computed)
        hits = "".join(f", {sql_name(s.name)}.__hit AS {sql_name('__hit_' + s.name)}" for s in self.b.side_tables)
        exprs = {f"build.columns.{c}": self.b.columns[c] for c in self.computed}
        exprs.update({"build.impressions.user": imp.user, "build.impressions.item": imp.item})
        exprs.update({"build.impressions.order": order})
        key_names = (
            ["build.impressions.request"]
            if imp.request
            else [f"build.impressions.request_key[{i}]" for i in range(len(keys))]
        )
        exprs.update(zip(key_names, keys))
        exprs.update(self.split_filters())
        read = {"build.impressions.filter": imp.filter, "build.impressions.time": imp.time, **exprs}
        self.check_session_names("impressions_joined", read, self.imp_source)
        try:
            self.sql(
                "building the impressions",
                f"""CREATE TEMP TABLE imp AS
                SELECT {key_columns}, {self.imp_time} AS __t, ({imp.user}) AS __user, ({imp.item}) AS __item,
                       ({order}) AS __order, {split} AS __split, {n_splits} AS __n_splits,
                       __file, {outputs}{hits}
                FROM ({joined})""",
            )
        except ContractError:
            self.check_binds("impressions_joined", exprs, self.imp_source)
            raise
        self.check_times("imp", "__t", self.imp_source, self.imp_time, "build.impressions.time")
        self.check_not_null("imp", "__user", self.imp_source, imp.user, "build.impressions.user", "user")
        self.check_labels()
        self.check_no_nulls("imp", self.computed, "build.columns", self.imp_source, self.b.columns)
        self.drop_outside_splits()
        self.check_surfaces()
        self.number_requests(keys)
        self.keep_built_requests()
        self.check_id_types()
        self.drop_duplicates()
        if self.b.negative_downsampling:
            self.downsample()

    def raw_source(self, cfg, where: str) -> RawSource:
        """The raw table ``cfg`` configures (its files under ``raw_dir``)."""
        return RawSource.of(cfg, self.raw_dir, where)

    def check_labels(self) -> None:
        for task in self.features.tasks:
            self.check_label(task.label_column)

    def split_columns(self) -> Tuple[str, str]:
        """SQL over the joined impression row: ``__split``, the split it falls in (NULL: none), and
        ``__n_splits``, how many splits it falls in."""
        tests = [self.split_test(i) for i in range(len(self.b.splits))]
        case = "CASE " + " ".join(f"WHEN {t} THEN {sql_string(s)}" for t, s in zip(tests, self.splits)) + " END"
        return case, " + ".join(f"CAST(coalesce({t}, false) AS INTEGER)" for t in tests)

    def split_filters(self) -> Dict[str, str]:
        """The splits' filters by config key (to name the one DuckDB refused)."""
        return {f"build.splits[{i}].filter": s.filter for i, s in enumerate(self.b.splits) if s.filter}

    def drop_outside_splits(self) -> None:
        over = self.scalar("SELECT count(*) FROM imp WHERE __n_splits > 1")
        if over:
            raise ContractError(
                f"build.splits: {over} impression(s) fall in more than one split; make the windows and filters disjoint"
            )
        self.counts["impressions outside every split (dropped)"] = self.scalar(
            "SELECT count(*) FROM imp WHERE __split IS NULL"
        )
        self.sql("dropping the impressions outside every split", "DELETE FROM imp WHERE __split IS NULL")
        if not self.scalar("SELECT count(*) FROM imp"):
            raise ContractError(f"build.splits: no impression of {self.imp_source.files[0]}... falls in any split")

    def keep_built_requests(self) -> None:
        """Every numbered request is built (a day build keeps those of its days: days.py)."""

    def request_keys(self) -> List[str]:
        imp = self.b.impressions
        return [imp.request] if imp.request else list(imp.request_key)

    def number_requests(self, keys: List[str]) -> None:
        """``__req``: the log's integer request id as it is; otherwise each distinct key numbered
        1, 2, ... in key order (only the keys are sorted, not the impressions)."""
        if len(keys) == 1 and self.is_integer(keys[0]):
            self.sql(
                "taking the request ids",
                f"CREATE OR REPLACE TEMP TABLE imp AS SELECT {self.select_list('imp', exclude=['__key0'])}, "
                f"__key0 AS __req FROM imp",
            )
            return
        names = [f"__key{i}" for i in range(len(keys))]
        listed = ", ".join(names)
        self.sql(
            "numbering the requests",
            f"""CREATE TEMP TABLE __request_ids AS
            SELECT {listed}, CAST(row_number() OVER (ORDER BY {listed}) AS BIGINT) AS __req
            FROM (SELECT DISTINCT {listed} FROM imp)""",
        )
        same = " AND ".join(f"imp.{n} IS NOT DISTINCT FROM r.{n}" for n in names)
        self.sql(
            "numbering the requests",
            f"CREATE OR REPLACE TEMP TABLE imp AS SELECT {self.select_list('imp', exclude=names, qualifier='imp')}, "
            f"r.__req FROM imp JOIN __request_ids r ON {same}",
        )

    def side_table(self, i: int, side) -> dict:
        """One side table read and checked (one row per key, and date if dated) into a temp table."""
        where = f"build.side_tables[{i}]"
        if side.name in self.imp_columns:
            raise ConfigError(
                f"{where}.name: {side.name!r} is also a column of the impression log; name the side table otherwise"
            )
        source = self.raw_source(side, where)
        columns = self.source_columns(source)
        for col in list(side.key) + ([side.as_of] if side.as_of else []):
            if col not in columns:
                raise ContractError(f"{where}: {source.files[0]} has no column {col!r} (its columns: {columns})")
        alias = f"__side{i}"
        keys = list(side.key)
        key_select = ", ".join(f"{sql_name(k)} AS __k{j}" for j, k in enumerate(keys))
        dated = date = ""
        if side.as_of:
            date = self.date_sql(sql_name(side.as_of), source, where + ".as_of")
            key_select += f", {date} AS __date"
            keys.append(side.as_of)
            dated = ", __date"
        self.check_session_names(f"(SELECT * FROM {self.scan(source)})", {f"{where}.filter": side.filter}, source)
        filtered = f"(SELECT * FROM {self.scan(source)}{_where(side.filter)})"
        fields = [c for c in columns if c not in side.key]
        # The side columns travel in one struct, so no name of theirs can clash with the impressions'.
        packed = ", ".join(f"{sql_name(c)} := {sql_name(c)}" for c in fields)
        self.engine.execute(
            f"CREATE TEMP TABLE {alias} AS SELECT {key_select}, struct_pack({packed}) AS __fields FROM {filtered}"
        )
        dup = self.one(
            f"SELECT {', '.join(f'__k{j}' for j in range(len(side.key)))}{dated}, count(*) FROM {alias} "
            f"GROUP BY ALL HAVING count(*) > 1 LIMIT 1"
        )
        if dup:
            raw_keys = [sql_name(k) for k in side.key] + ([date] if side.as_of else [])
            same = " AND ".join(f"({k}) IS NOT DISTINCT FROM {sql_literal(v)}" for k, v in zip(raw_keys, dup[:-1]))
            rows = source.places(f"({side.filter or 'true'}) AND {same}")
            raise ContractError(
                f"{where}: key {dict(zip(keys, dup[:-1]))} has {dup[-1]} rows, at {' and '.join(rows)}; "
                f"a side table needs one row per key{' and date' if side.as_of else ''}"
            )
        for col in side.defaults:
            if col not in columns:
                raise ContractError(f"{where}.defaults.{col}: {source.files[0]} has no such column ({columns})")
        self.check_default_types(side, source, where)
        blank = [c for c in side.defaults if c in fields]
        if blank:  # a default stands in for a blank value too: counted, as a missing key is (join_misses)
            counts = self.one(
                f"SELECT {', '.join(f'count(*) FILTER (WHERE __fields.{sql_name(c)} IS NULL)' for c in blank)} "
                f"FROM {alias}"
            )
            for c, n in zip(blank, counts):
                self.counts[f"side table {side.name}: rows with a blank {c} (its default {side.defaults[c]} used)"] = n
        return {"alias": alias, "side": side, "fields": fields, "where": where, "source": source}

    def side_join(self, name: str, key: Dict[str, str], time: str) -> Tuple[str, str]:
        """The LEFT JOIN of side table ``name`` on ``key`` (side column -> SQL expression over the
        joining row; a dated table also on the date of ``time``, seconds) and the struct its columns
        are read through (``<name>.<column>``: a struct field), defaults applied."""
        info = self.side_sources[name]
        alias, side = info["alias"], info["side"]
        on = " AND ".join(f"{alias}.__k{j} = ({key[k]})" for j, k in enumerate(side.key))
        if side.as_of:
            on += f" AND {alias}.__date = {self.date_of(time)}"
        values = {c: f"{alias}.__fields.{sql_name(c)}" for c in info["fields"]}
        packed = ", ".join(
            f"{sql_name(c)} := " + (f"coalesce({v}, {side.defaults[c]})" if c in side.defaults else v)
            for c, v in values.items()
        )
        struct = f"struct_pack({packed}, __hit := {alias}.__k0 IS NOT NULL) AS {sql_name(side.name)}"
        return f"LEFT JOIN {alias} ON {on}", struct

    def date_of(self, seconds: str) -> str:
        """SQL: the DATE, in build.timezone, of ``seconds`` (SQL giving epoch seconds)."""
        return f"CAST(timezone({sql_string(self.b.timezone)}, to_timestamp({seconds})) AS DATE)"

    def split_test(self, i: int) -> str:
        s = self.b.splits[i]
        tests = []
        if s.start:
            tests.append(f"{self.imp_time} >= {_time_of_day(s.start, self.b.timezone, f'build.splits[{i}].start')}")
        if s.end:
            tests.append(f"{self.imp_time} < {_time_of_day(s.end, self.b.timezone, f'build.splits[{i}].end')}")
        if s.filter:
            tests.append(f"({s.filter})")
        return "(" + (" AND ".join(tests) or "true") + ")"

    def requests(self) -> None:
        """One row per request: its user, time (the earliest of its impressions) and split."""
        self.sql(
            "grouping the requests",
            """CREATE TEMP TABLE req AS
            SELECT __req, any_value(__user) AS __user, min(__t) AS __t, arg_min(__split, __t) AS __split,
                   count(DISTINCT __user) AS __users, count(DISTINCT __t) AS __times,
                   count(DISTINCT __split) AS __splits
            FROM imp GROUP BY __req""",
        )
        bad = self.one("SELECT __req, __users FROM req WHERE __users > 1 LIMIT 1")
        if bad:
            raise ContractError(
                f"build.impressions: request {bad[0]} has impressions of {bad[1]} users"
                f"{self.differing(bad[0], self.b.impressions.user)}; a request is one user's (check "
                f"build.impressions.request / request_key)"
            )
        self.counts["requests with impressions at several times (request time = the earliest)"] = self.scalar(
            "SELECT count(*) FROM req WHERE __times > 1"
        )
        moved = self.scalar("SELECT count(*) FROM req WHERE __splits > 1")
        if moved:
            self.counts[self.ACROSS] = moved
            self.sql(
                "moving requests to one split",
                "CREATE OR REPLACE TEMP TABLE imp AS SELECT "
                + self.select_list("imp", {"__split": "req.__split"}, qualifier="imp")
                + " FROM imp JOIN req USING (__req)",
            )
        for col in self.user_side:
            bad = self.one(
                f"SELECT __req, count(DISTINCT {sql_name(col)}) FROM imp GROUP BY __req "
                f"HAVING count(DISTINCT {sql_name(col)}) > 1 LIMIT 1"
            )
            if bad:
                raise ContractError(
                    f"build.columns.{col}: a user-side feature, but request {bad[0]} has {bad[1]} different values "
                    f"among its impressions{self.differing(bad[0], self.b.columns[col])} (it must be one per request)"
                )

    def events(self, source: SequenceSourceConfig) -> None:
        """The group's events (filtered, checked) as a table: user, time (seconds), the group's columns."""
        i = self.b.sequences.index(source)
        where = f"build.sequences[{i}]"
        group = next(g for g in self.features.sequence_groups if g.name == source.group)
        name = _ident(group.name)
        if source.path:
            raw = self.raw_source(source, where)
            scan = f"(SELECT *, filename AS __file FROM {self.scan(raw)})"
            if source.side_tables:  # the events' own keys into the side tables (as of their own date)
                plain = f"__events_raw_{name}"
                self.engine.execute(f"CREATE TEMP VIEW {plain} AS SELECT * FROM {scan}")
                t = self.seconds(source.time, plain, f"{where}.time", raw)
                joins, structs = [], []
                for side, key in source.side_tables.items():
                    join, struct = self.side_join(side, key, t)
                    joins.append(join)
                    structs.append(struct)
                scan = f"(SELECT {plain}.*, {', '.join(structs)} FROM {plain} {' '.join(joins)})"
        else:  # the impression log is the event log (KuaiRand: earlier clicks are the history)
            raw, scan = self.imp_source, "impressions_joined"
        view = f"__events_{name}"
        try:
            self.engine.execute(f"CREATE TEMP VIEW {view} AS SELECT * FROM {scan}{_where(source.filter)}")
        except self.engine.errors:
            self.check_binds(scan, {f"{where}.filter": source.filter}, raw)
            raise
        read = {f"{where}.filter": source.filter, f"{where}.user": source.user, f"{where}.time": source.time}
        read.update({f"{where}.columns.{c}": e for c, e in source.columns.items()})
        self.check_session_names(scan, read, raw)
        t = self.seconds(source.time, view, f"{where}.time", raw)
        ids = [f.column for f in group.features]
        cols = ids + embedding_columns(group)
        exprs = []
        for c in cols:
            expr = source.columns[c]
            if c == group.embedding_column:
                expr = f"CAST(({expr}) AS FLOAT[{group.embedding_dim}])"
            exprs.append(f"({expr}) AS {sql_name(c)}")
        user_type = self.scalar("SELECT typeof(__user) FROM imp LIMIT 1")
        events = f"ev_{name}"
        try:
            self.sql(
                f"reading the events of sequence group {group.name!r}",
                f"""CREATE TEMP TABLE {events} AS
                SELECT TRY_CAST(({source.user}) AS {user_type}) AS __user, ({source.user}) IS NULL AS __no_user,
                       {t} AS __t, __file, {", ".join(exprs)}
                FROM {view}""",
            )
        except ContractError:
            named = {f"{where}.columns.{c}": source.columns[c] for c in cols}
            self.check_binds(view, {f"{where}.user": source.user, **named}, raw)
            raise
        no_user = self.scalar(f"SELECT count(*) FROM {events} WHERE __no_user")
        if no_user and source.missing_user == "error":
            path = self.scalar(f"SELECT any_value(__file) FROM {events} WHERE __no_user")
            first = raw.place(path, f"({source.user}) IS NULL", reads=source.user)
            raise ContractError(
                f"{where}.user: {no_user} event(s) without a user, first at {first}; "
                "fix the log or set missing_user: drop"
            )
        self.counts[f"sequence group {group.name}: events without a user (dropped)"] = no_user
        self.engine.execute(f"DELETE FROM {events} WHERE __no_user")
        self.check_times(events, "__t", raw, t, f"{where}.time")
        self.check_no_nulls(events, cols, f"{where}.columns", raw, source.columns)
        for f in group.features:
            c = f.column
            vocabulary = any(v.table == f.table for v in self.b.vocabularies)
            if vocabulary:
                continue
            if f.multi_valued and not self.column_type(events, c).endswith("[]"):
                raise ContractError(
                    f"{where}.columns.{c}: gives {self.column_type(events, c)} values; feature {f.name!r} is "
                    f"multi-valued (max_values {f.max_values}): give a list of ids per event (e.g. "
                    f"string_split(...) cast to BIGINT[])"
                )
            if not self.is_integer_column(events, c, lists_ok=f.multi_valued):
                what = "a list of integers" if f.multi_valued else "an integer"
                raise ContractError(
                    f"{where}.columns.{c}: gives {self.column_type(events, c)} values; a sequence id must be "
                    f"{what} (map it, or declare a vocabulary for table {f.table!r})"
                )
        self.prune_events(events)
        for f in group.features:
            if f.multi_valued:  # a counted repair, as the loader's overlong_sequence: truncate does
                col = sql_name(f.column)
                over = self.scalar(f"SELECT count(*) FROM {events} WHERE array_length({col}) > {f.max_values}")
                if over:
                    self.counts[
                        f"sequence group {group.name} feature {f.name}: bags cut to their first {f.max_values} ids"
                    ] = over
                    self.engine.execute(
                        f"UPDATE {events} SET {col} = list_slice({col}, 1, {f.max_values}) "
                        f"WHERE array_length({col}) > {f.max_values}"
                    )
        self.group_sources[group.name] = (events, source, group)

    def prune_events(self, events: str) -> None:
        """Every event may precede a request (a day build keeps those that can: days.py), unless
        build.impressions.event_users: built keeps only the users with a request built (what the
        impressions' filter, the splits and the drops left; the others' events counted): a filter
        that samples users then samples the event logs, and the vocabularies fitted on them, too."""
        if self.b.impressions.event_users != "built":
            return
        group = next(g.name for g in self.features.sequence_groups if events == f"ev_{_ident(g.name)}")
        before = self.scalar(f"SELECT count(*) FROM {events}")
        self.sql(
            f"keeping the events of the users built (sequence group {group!r})",
            f"CREATE OR REPLACE TEMP TABLE {events} AS SELECT * FROM {events} WHERE __user IN (SELECT __user FROM req)",
        )
        dropped = before - self.scalar(f"SELECT count(*) FROM {events}")
        self.counts[f"sequence group {group}: events of users with no request built (dropped)"] = dropped

    def vocabulary(self, vocab) -> None:
        """Maps every column feeding ``vocab.table`` (candidate and sequence ones) to 1..V by
        frequency on the fitting split; 0 is out of vocabulary."""
        table = self.features.table(vocab.table)
        imp_cols, event_cols = self.vocabulary_columns(vocab.table)
        end = self.scalar(f"SELECT max(__t) FROM imp WHERE __split = {sql_string(vocab.fit_split)}")
        if end is None:
            raise ContractError(f"build.vocabularies: split {vocab.fit_split!r} has no impression to fit on")

        def raw_values(table: str, column: str) -> str:  # a list column (multi-hot, bags) counts each id
            col = sql_name(column)
            return (
                f"unnest(CAST({col} AS VARCHAR[]))" if self.is_list_column(table, column) else f"CAST({col} AS VARCHAR)"
            )

        values = [
            f"SELECT {raw_values('imp', c)} AS v FROM imp WHERE __split = {sql_string(vocab.fit_split)}"
            for c in imp_cols
        ]
        if event_cols:
            # An event read by several groups (every behaviour, and the carts among them) counts once:
            # the groups' rows of one raw event are equal in (file, user, time, value); equal events
            # of one group are told apart by their rank among them.
            ranked = [
                f"SELECT __file, __user, __t, v, row_number() OVER (PARTITION BY __file, __user, __t, v) AS __k "
                f"FROM (SELECT __file, __user, __t, {raw_values(e, c)} AS v FROM {e} WHERE __t <= {end})"
                for e, c in event_cols
            ]
            values.append(f"SELECT v FROM ({' UNION '.join(ranked)})")
        name = f"vocab_{_ident(vocab.table)}"
        self.sql(
            f"fitting the vocabulary of table {vocab.table!r}",
            f"""CREATE TEMP TABLE {name} AS
            SELECT v AS raw, CAST(row_number() OVER (ORDER BY n DESC, v) AS BIGINT) AS idx, n AS count
            FROM (SELECT v, count(*) AS n FROM ({" UNION ALL ".join(values)}) WHERE v IS NOT NULL GROUP BY v
                  HAVING count(*) >= {int(vocab.min_count)})
            QUALIFY idx < {table.num_embeddings}""",
        )
        self.apply_vocabulary(vocab.table, name)
        vocab_dir = self.out / "vocabularies"
        vocab_dir.mkdir(exist_ok=True)
        self.engine.copy_parquet(f"SELECT * FROM {name} ORDER BY idx", str(vocab_dir / (vocab.table + ".parquet")))

    def vocabulary_columns(self, table: str) -> Tuple[List[str], List[Tuple[str, str]]]:
        """The columns feeding ``table``: those of the impressions, and (events table, column) of the groups."""
        imp_cols = [s.column for s in self.features.sparse if s.table == table]
        event_cols = [
            (events, f.column) for events, _, g in self.group_sources.values() for f in g.features if f.table == table
        ]
        return imp_cols, event_cols

    def apply_vocabulary(self, table: str, name: str) -> None:
        """Every column feeding ``table`` mapped by the vocabulary table ``name`` (raw, idx, count)."""
        imp_cols, event_cols = self.vocabulary_columns(table)
        # Each column once (two features may read one), then what it mapped to 0: out of vocabulary
        # is a default too, and the summary shows it.
        out_of_vocabulary = 0
        for table_name, c in dict.fromkeys([("imp", c) for c in imp_cols] + event_cols):
            self.remap(table_name, c, name)
            col = sql_name(c)
            zero = (
                f"array_length(list_filter({col}, lambda x: x = 0))"
                if self.is_list_column(table_name, c)
                else f"{col} = 0"
            )
            out_of_vocabulary += self.scalar(f"SELECT coalesce(sum(CAST({zero} AS BIGINT)), 0) FROM {table_name}")
        self.counts[f"vocabulary {table}: ids out of vocabulary (mapped to 0)"] = int(out_of_vocabulary)
        self.counts[f"vocabulary {table}: ids kept"] = self.scalar(f"SELECT count(*) FROM {name}")

    def unknown_ids(self, splits: List[str]) -> Dict[str, Dict[str, dict]]:
        """split -> vocabulary table -> the ids its vocabulary did not keep (0: a user or item new
        since the fitting split, or rarer than min_count), of the ``impressions`` (the impression
        columns feeding the table: a row each, or each id of a list) and of the ``events`` of the
        split's sequences (each id of a bag), each {"ids", "unknown", "share"}; counted once the
        sequences are cut, on what is written. {} without vocabularies."""
        if not self.b.vocabularies:
            return {}
        out: Dict[str, Dict[str, dict]] = {split: {} for split in splits}
        for vocab in self.b.vocabularies:
            imp_cols, _ = self.vocabulary_columns(vocab.table)
            counted: Dict[str, List[str]] = {"impressions": [], "events": []}
            for c in dict.fromkeys(imp_cols):
                col = sql_name(c)
                if self.is_list_column("imp", c):
                    ids, zero = f"array_length({col})", f"array_length(list_filter({col}, lambda x: x = 0))"
                else:
                    ids, zero = "1", f"CAST({col} = 0 AS BIGINT)"
                counted["impressions"].append(
                    f"SELECT __split, sum(coalesce({ids}, 0)) AS n, sum(coalesce({zero}, 0)) AS z "
                    f"FROM imp GROUP BY __split"
                )
            for _, _, group in self.group_sources.values():
                for f in group.features:
                    if f.table == vocab.table:  # a bag per event: its ids
                        col = sql_name(f.column)
                        col = f"flatten({col})" if f.multi_valued else col
                        counted["events"].append(
                            f"SELECT r.__split, sum(coalesce(array_length({col}), 0)) AS n, "
                            f"sum(coalesce(array_length(list_filter({col}, lambda x: x = 0)), 0)) AS z "
                            f"FROM __seq_{_ident(group.name)} JOIN req r USING (__req) GROUP BY r.__split"
                        )
            for kind, parts in counted.items():
                if not parts:
                    continue
                totals = dict.fromkeys(splits, (0, 0))
                for split, n, z in self.rows(
                    f"SELECT __split, sum(n), sum(z) FROM ({' UNION ALL '.join(parts)}) GROUP BY __split"
                ):
                    if split in totals:
                        totals[split] = (int(n or 0), int(z or 0))
                for split, (n, z) in totals.items():
                    share = round(z / n, 6) if n else 0.0
                    out[split].setdefault(vocab.table, {})[kind] = {"ids": n, "unknown": z, "share": share}
        return out

    def remap(self, table: str, column: str, vocab: str) -> None:
        col = sql_name(column)
        if not self.is_list_column(table, column):
            mapped = self.select_list(table, {column: "coalesce(__v.idx, 0)"}, qualifier=table)
            self.engine.execute(
                f"CREATE OR REPLACE TEMP TABLE {table} AS SELECT {mapped} "
                f"FROM {table} LEFT JOIN {vocab} AS __v ON __v.raw = CAST({table}.{col} AS VARCHAR)"
            )
            return
        # A list per row: each id mapped in place (its position kept), an empty list stays empty. The
        # rows are numbered in a table of their own (a number any engine keeps once given).
        self.engine.execute(
            f"CREATE OR REPLACE TEMP TABLE __numbered AS SELECT *, row_number() OVER () AS __row FROM {table}"
        )
        kept = self.select_list("__numbered", {column: "coalesce(mapped.__ids, [])"}, ["__row"], "__numbered")
        self.engine.execute(
            f"""CREATE OR REPLACE TEMP TABLE {table} AS
            WITH ids AS (SELECT __row, unnest({col}) AS __id, generate_subscripts({col}, 1) AS __pos FROM __numbered),
            mapped AS (SELECT __row, list(coalesce(__v.idx, 0) ORDER BY __pos) AS __ids
                       FROM ids LEFT JOIN {vocab} AS __v ON __v.raw = CAST(ids.__id AS VARCHAR) GROUP BY __row)
            SELECT {kept} FROM __numbered LEFT JOIN mapped USING (__row)"""
        )

    def sequences(self, events: str, source: SequenceSourceConfig, group: SequenceGroupConfig) -> None:
        """``__seq_<group>``: per request, the newest max_length events strictly before (request
        time - min_gap_s), newest first, as the group's list columns."""
        name = _ident(group.name)
        cols = [f.column for f in group.features] + embedding_columns(group)
        # Requests and events of a user in time order, requests first at equal times: a request's
        # running count of events is the number strictly before it.
        self.sql(
            f"counting the events before each request for sequence group {group.name!r}",
            f"""CREATE TEMP TABLE __before_{name} AS
            SELECT __req, __user, __n FROM (
                SELECT __req, __user, __is_event,
                       CAST(sum(__is_event) OVER (PARTITION BY __user ORDER BY __t, __is_event
                                                  ROWS UNBOUNDED PRECEDING) AS BIGINT) AS __n
                FROM (SELECT __req, __user, __t - {float(source.min_gap_s)} AS __t, 0 AS __is_event FROM req
                      UNION ALL SELECT NULL, __user, __t, 1 FROM {events}))
            WHERE __is_event = 0 AND __n > 0""",
        )
        # Per user, one row: its events sorted once (by time, then the group's columns: ties) and
        # its requests with their counts. Each request's sequence is then a slice of its user's list,
        # cut in place -- no per-request sort, and no join copying a user's list onto each request.
        packed = ", ".join(["__t := __t"] + [f"{sql_name(c)} := {sql_name(c)}" for c in cols])
        self.sql(
            f"ordering the events of sequence group {group.name!r}",
            f"""CREATE TEMP TABLE __timeline_{name} AS
            SELECT __user,
                   list_sort(list(struct_pack({packed})) FILTER (WHERE __req IS NULL)) AS __events,
                   list(struct_pack(__req := __req, __n := __n)) FILTER (WHERE __req IS NOT NULL) AS __requests
            FROM (SELECT __user, __t, {", ".join(sql_name(c) for c in cols)}, NULL AS __req, NULL AS __n FROM {events}
                  UNION ALL SELECT __user, NULL, {", ".join("NULL" for _ in cols)}, __req, __n FROM __before_{name})
            GROUP BY __user""",
        )
        lists = [f"[CAST(floor(x.__t) AS BIGINT) FOR x IN __r.__s] AS {sql_name(group.timestamp_column)}"]
        lists += [f"[x.{sql_name(c)} FOR x IN __r.__s] AS {sql_name(c)}" for c in cols]
        cut = f"list_reverse(list_slice(__events, greatest(r.__n - {group.max_length}, 0) + 1, r.__n))"
        self.sql(
            f"cutting the sequences of group {group.name!r}",
            f"""CREATE TEMP TABLE __seq_{name} AS
            SELECT __r.__req AS __req, {", ".join(lists)} FROM (
                SELECT unnest(list_transform(__requests, lambda r: struct_pack(__req := r.__req, __s := {cut})))
                       AS __r
                FROM __timeline_{name} WHERE array_length(__requests) > 0)""",
        )

    def candidates(self) -> None:
        """``__candidates``: per request, the user-side columns once and the candidate columns as
        lists, candidates in (order, item) order."""
        packed = ", ".join(
            ["__order := __order", "__item := __item"] + [f"{sql_name(c)} := {sql_name(c)}" for c in self.candidate]
        )
        user_cols = "".join(f", any_value({sql_name(c)}) AS {sql_name(c)}" for c in self.user_side)
        self.sql(
            "grouping the candidates of each request",
            f"""CREATE TEMP TABLE __candidates AS
            SELECT __req{user_cols}, list_sort(list(struct_pack({packed}))) AS __c FROM imp GROUP BY __req""",
        )

    def write(self, split: str) -> dict:
        """The split's per-request Parquet files, requests in time order; returns their paths
        (relative to the output directory: they stay true once it is moved in) and counts."""
        out, root = self.split_dir(split)
        select = self.split_query(split)
        writer = SplitWriter(out, self.b.requests_per_row_group, self.b.requests_per_file, self.features)
        total, per_file = self.scalar("SELECT count(*) FROM __ranks"), self.b.requests_per_file
        for first in range(0, total, per_file):
            chunk = f"{select} WHERE k.__rank > {first} AND k.__rank <= {first + per_file} ORDER BY k.__rank"
            try:
                for batch in self.engine.batches(chunk, self.b.requests_per_row_group):
                    writer.add(batch)
            except self.engine.errors as e:
                raise ContractError(f"build: writing split {split!r}: {str(e).strip().splitlines()[0]}") from None
        written = writer.close()
        written["files"] = [Path(f).relative_to(root).as_posix() for f in written["files"]]
        build_output.kill_point(f"split:{split}")
        return written

    def split_query(self, split: str) -> str:
        """The query of the split's request rows (the contract's columns), ``__ranks`` made: each
        request's rank ``k.__rank`` in time order. Only the keys are sorted; rows are then read by rank."""
        names = self.features.columns
        self.sql(
            f"ordering the requests of split {split!r}",
            f"""CREATE OR REPLACE TEMP TABLE __ranks AS
            SELECT __req, row_number() OVER (ORDER BY floor(__t), __req) AS __rank
            FROM req WHERE __split = {sql_string(split)}""",
        )
        seq_joins, seq_cols = [], []
        for g in self.features.sequence_groups:
            alias = f"__s_{_ident(g.name)}"
            seq_joins.append(f"LEFT JOIN __seq_{_ident(g.name)} {alias} USING (__req)")
            seq_cols += [f"coalesce({alias}.{sql_name(c)}, []) AS {sql_name(c)}" for c in self.sequence_columns[g.name]]
        return (
            f"SELECT CAST(r.__req AS BIGINT) AS {sql_name(names.request_id)}, "
            f"CAST(floor(r.__t) AS BIGINT) AS {sql_name(names.timestamp)}"
            + "".join(f", c.{sql_name(col)}" for col in self.user_side)
            + "".join(f", {s}" for s in seq_cols)
            + "".join(f", [x.{sql_name(col)} FOR x IN c.__c] AS {sql_name(col)}" for col in self.candidate)
            + " FROM __ranks k JOIN req r USING (__req) JOIN __candidates c USING (__req) "
            + " ".join(seq_joins)
        )

    def split_dir(self, split: str) -> Tuple[Path, Path]:
        """The directory the split's files go to (made here) and the one their paths are relative to."""
        (self.out / split).mkdir()
        return self.out / split, self.out

    def drop_duplicates(self) -> None:
        """The same (request, item) twice: an error, or keep the first by order then labels."""
        dup = self.one(
            "SELECT __req, __item, count(*), list(DISTINCT __file) FROM imp GROUP BY __req, __item "
            "HAVING count(*) > 1 LIMIT 1"
        )
        if not dup:
            self.counts["duplicated impressions (dropped)"] = 0
            return
        total = self.scalar(
            "SELECT sum(n - 1) FROM (SELECT count(*) AS n FROM imp GROUP BY __req, __item HAVING count(*) > 1)"
        )
        if self.b.impressions.duplicates == "error":
            item = self.b.impressions.item
            rows = self.imp_source.places(f"{self.request_rows(dup[0])} AND ({item}) = {sql_literal(dup[1])}")
            named = columns_read(item)
            column = f" (column {named[0]!r})" if named == [item] else ""
            raise ContractError(
                f"build.impressions: {total} duplicated impression(s); request {dup[0]} shows item {dup[1]!r} {dup[2]} "
                f"times{column}, at {' and '.join(rows) or ', '.join(dup[3])}; set build.impressions.duplicates: "
                f"drop to keep the first"
            )
        # The first by order, then the highest labels (those built: a live request has none).
        order = ", ".join(
            ["__order"]
            + [f"{sql_name(t.label_column)} DESC" for t in self.features.tasks if t.label_column in self.computed]
        )
        self.engine.execute(
            f"""CREATE OR REPLACE TEMP TABLE imp AS SELECT {self.select_list("imp")} FROM (
                SELECT *, row_number() OVER (PARTITION BY __req, __item ORDER BY {order}) AS __dup FROM imp)
            WHERE __dup = 1"""
        )
        self.counts["duplicated impressions (dropped)"] = int(total)

    def request_rows(self, req) -> str:
        """SQL over the impression log's columns: its rows of request ``req`` (``__req``), as the
        filter kept them."""
        keys = self.request_keys()
        if len(keys) == 1 and self.is_integer(keys[0]):
            values = [req]
        else:
            listed = ", ".join(f"__key{i}" for i in range(len(keys)))
            found = self.one(f"SELECT {listed} FROM __request_ids WHERE __req = {sql_literal(req)}")
            if found is None:  # not numbered here: no raw row to name
                return "(false)"
            values = list(found)
        same = [f"({k}) IS NOT DISTINCT FROM {sql_literal(v)}" for k, v in zip(keys, values)]
        return "(" + " AND ".join([f"({self.b.impressions.filter or 'true'})"] + same) + ")"

    def differing(self, req, expr: str) -> str:
        """Where request ``req``'s impressions differ in SQL ``expr``: its first row and the first
        with another value, each with its value, as an error names them (empty if not found)."""
        rows, source = self.request_rows(req), self.imp_source

        def first(condition: str) -> Optional[tuple]:
            for path in source.files:
                found = source.find(path, condition, f"({expr})")
                if found:
                    return source.at(path, found[0]), found[1]
            return None

        one = first(rows)
        other = one and first(f"{rows} AND ({expr}) IS DISTINCT FROM {sql_literal(one[1])}")
        return f" ({expr!r} is {one[1]!r} at {one[0]} and {other[1]!r} at {other[0]})" if other else ""

    def downsample(self) -> None:
        d = self.b.negative_downsampling
        if self.engine.hashes_integers_only:
            for column, key in (("__req", "request"), ("__item", "item")):
                kind = self.column_type("imp", column)
                if kind not in INTEGERS:
                    raise ContractError(
                        f"build.negative_downsampling: on --engine {self.engine.name} the draw hashes (request, item) "
                        f"as DuckDB does for integers, and build.impressions.{key} gives {kind} values: give it as "
                        f"an integer (a vocabulary maps ids after the draw), or build on --engine duckdb"
                    )
        label = sql_name(next(t.label_column for t in self.features.tasks if t.name == d.task))
        surface = sql_name(self.features.columns.surface)
        rate = "CASE " + " ".join(
            f"WHEN CAST({surface} AS VARCHAR) IN ({sql_string(s)}, {sql_string(str(self.features.surfaces.index(s)))}) "
            f"THEN {float(r)}"
            for s, r in d.rates.items()
        )
        rate += " ELSE 1.0 END"
        # Integers hashed as BIGINTs (DuckDB hashes a negative INTEGER otherwise), as on every engine.
        keys = [f"CAST({c} AS BIGINT)" if self.is_integer_column("imp", c) else c for c in ("__req", "__item")]
        draw = f"hash({', '.join(keys)}, CAST({int(d.seed)} AS BIGINT))"
        drop = f"{self.sampled()} AND {label} = 0 AND ({draw} % 1000000) / 1000000.0 >= {rate}"
        self.counts[f"negatives of {d.task} downsampled away"] = self.scalar(f"SELECT count(*) FROM imp WHERE {drop}")
        self.engine.execute(f"DELETE FROM imp WHERE {drop}")

    def sampled(self) -> str:
        """SQL over an impression: whether its negatives are downsampled (its split is listed)."""
        return f"__split IN ({', '.join(sql_string(s) for s in self.b.negative_downsampling.splits)})"

    # --- times and dates as SQL --------------------------------------------------------------

    def seconds(self, expr: str, relation: str, where: str, source: Optional[RawSource] = None) -> str:
        """SQL giving ``expr`` as epoch seconds (DOUBLE): numbers as they are; timestamps without a
        zone and dates in build.timezone; text as a number, else as a timestamp. ``source``: the raw
        file ``relation`` reads, named when ``expr`` reads a column it lacks."""
        try:
            kind = self.one(f"SELECT typeof({expr}) FROM {relation} LIMIT 1")
        except self.engine.errors as e:
            missing = self.engine.missing_column(e)
            if missing and source is not None:
                raise self.missing(where, expr, missing, relation, source) from None
            hint = self.bare_name_hint(expr, relation)
            raise ContractError(f"{where}: {expr!r}: {str(e).strip().splitlines()[0]}{hint}") from None
        kind = kind[0] if kind else "DOUBLE"
        tz = sql_string(self.b.timezone)
        if kind == "TIMESTAMP WITH TIME ZONE":
            return f"epoch({expr})"
        if kind.startswith("TIMESTAMP") or kind == "DATE":
            return f"epoch(timezone({tz}, CAST(({expr}) AS TIMESTAMP)))"
        if kind == "VARCHAR":
            return f"coalesce(TRY_CAST(({expr}) AS DOUBLE), epoch(timezone({tz}, TRY_CAST(({expr}) AS TIMESTAMP))))"
        return f"CAST(({expr}) AS DOUBLE)"

    def date_sql(self, expr: str, source: RawSource, where: str) -> str:
        """A side table's date column as a DATE: DATE/TIMESTAMP, 20220408 or '2022-04-08'."""
        kind = self.one(f"SELECT typeof({expr}) FROM {self.scan(source)} LIMIT 1")
        kind = kind[0] if kind else "DATE"
        if kind == "DATE" or kind.startswith("TIMESTAMP"):
            return f"CAST({expr} AS DATE)"
        if kind == "VARCHAR":
            return f"coalesce(TRY_CAST({expr} AS DATE), CAST(try_strptime({expr}, '%Y%m%d') AS DATE))"
        return f"CAST(try_strptime(CAST({expr} AS VARCHAR), '%Y%m%d') AS DATE)"


def _ident(name: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in name)


def _where(predicate: Optional[str]) -> str:
    return f" WHERE ({predicate})" if predicate else ""
