"""Raw impression and behaviour logs -> the training contract, point in time, beyond memory.

    python -m pinads_rec.data.build --config X.yaml --raw RAW_DIR --out DIR [--memory-limit 2GB] [--threads N]

The ``build:`` section of the config (``BuildConfig``; docs/data_build.md) says which raw file is what.
The build runs as SQL on DuckDB, which streams the files, uses every core and spills to disk under
``--memory-limit``; the same statements are plain SQL a distributed engine runs too. Steps:

1. **Impressions**: the impression log, filtered, joined with the side tables by key (a missing key
   gets the declared default and is counted; a table with ``as_of`` joins the row of the
   impression's date), each contract column computed from its ``build.columns`` expression, each row
   given its split by time window. Timestamps, labels, users and duplicated impressions are checked;
   an error names the file, column and row.
2. **Sequences**, per group: the group's events (a behaviour log, or the impression log itself),
   numbered per user in time order; requests and events sorted together per user, requests first at
   equal times, so each request counts the events strictly before (its time - ``min_gap_s``); the
   newest ``max_length`` of them, newest first.
3. **Vocabularies** (optional): raw ids -> 1..V by frequency on the fitting split, 0 out of vocabulary.
4. **Output**: one row per request (the per-request layout, data/layout.py): the request-level columns
   once, the candidates' columns as lists, requests in time order, in ``<out>/<split>/part-*.parquet``;
   ``summary.json`` (rows per split and surface, label rates, sequence lengths, join misses, every
   repair counted) and, last, ``manifest.json`` (inputs, config, outputs, every file's sha256, the
   completion marker). All of it goes to a temporary directory beside ``<out>`` that replaces
   ``<out>`` in one step once complete (data/build_output.py): a failed or killed build leaves the
   previous output as it was.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Dict, List, Optional, Tuple
from zoneinfo import ZoneInfo

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pinads_rec.config import (
    ConfigError,
    ExperimentConfig,
    SequenceGroupConfig,
    SequenceSourceConfig,
    add_overrides_flag,
    load,
    to_dict,
)
from pinads_rec.data import build_output, layout, rules
from pinads_rec.data.contract import ID, ID_ROLES, ContractError, contract_columns
from pinads_rec.data.raw_sources import RawSource, configured, explain, first_line, sql_name, sql_string


def build(
    cfg: ExperimentConfig,
    raw_dir: str,
    out_dir: str,
    memory_limit: Optional[str] = None,
    threads: Optional[int] = None,
) -> dict:
    """Builds every split of ``cfg.build`` from the files under ``raw_dir`` into ``out_dir``, which
    it replaces whole, or not at all on an error; returns the summary (also ``out_dir/summary.json``)."""
    with build_output.replacing(out_dir) as work:
        return Build(cfg, raw_dir, str(work), memory_limit, threads).run()


def _time_of_day(text: str, tz: str, where: str) -> float:
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ConfigError(f"{where}: {text!r} is not a date or datetime (YYYY-MM-DD[THH:MM[:SS]])") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=ZoneInfo(tz))
    return moment.timestamp()


class Build:
    def __init__(
        self, cfg: ExperimentConfig, raw_dir: str, out_dir: str, memory_limit: Optional[str], threads: Optional[int]
    ):
        self.cfg, self.b, self.features = cfg, cfg.build, cfg.features
        check_build(cfg)
        self.raw_dir, self.out = raw_dir, Path(out_dir)  # build() gives it its temporary directory
        self.threads = threads or os.cpu_count() or 1
        self.memory_limit = memory_limit
        self.tmp = self.out / ".build_tmp"  # DuckDB's spill files
        self.con = duckdb.connect()
        self.con.execute(f"SET threads = {int(self.threads)}")
        self.con.execute(f"SET temp_directory = {sql_string(str(self.tmp))}")
        self.con.execute("SET preserve_insertion_order = false")
        if memory_limit:
            try:
                self.con.execute(f"SET memory_limit = {sql_string(memory_limit)}")
            except duckdb.Error as e:
                raise ConfigError(f"--memory-limit {memory_limit!r}: {str(e).splitlines()[0]}") from None
        self.counts: Dict[str, int] = {}  # every repair and drop, by what it was
        self.columns = {c.name: c for c in contract_columns(self.features)}
        names = self.features.columns
        self.user_side = [s.column for s in self.features.sparse if s.user_side]
        self.sequence_columns = {
            g.name: [g.timestamp_column] + [f.column for f in g.features] + _embedding(g)
            for g in self.features.sequence_groups
        }
        made_here = {names.request_id, names.timestamp} | {c for cols in self.sequence_columns.values() for c in cols}
        self.candidate = [c for c in self.columns if c not in made_here and c not in self.user_side]
        self.computed = [c for c in self.columns if c not in made_here]  # from build.columns
        self.splits = [s.name for s in self.b.splits]
        self.group_sources: Dict[str, tuple] = {}  # group -> (events table, source, group)

    # --- the steps ---------------------------------------------------------------------------

    def run(self) -> dict:
        start = time.time()
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
            outputs = {split: self.write(split) for split in self.splits}
        except duckdb.Error as e:  # a raw file DuckDB refused: its file, line, column and value
            raise ContractError(self.explain(e) or f"build: {first_line(e)}") from None
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)
        summary = self.summarize(outputs, time.time() - start)
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        manifest = self.manifest(outputs, summary)
        self.con.close()  # no query left that could spill again into the files the manifest lists
        shutil.rmtree(self.tmp, ignore_errors=True)
        build_output.write_manifest(self.out, manifest, self.splits)
        return summary

    def impressions(self) -> None:
        imp = self.b.impressions
        self.imp_source = RawSource.of(imp, self.raw_dir, "build.impressions")
        self.imp_columns = self.imp_source.columns(self.con)
        base = f"(SELECT *, filename AS __file FROM {self.imp_source.scan()}{_where(imp.filter)})"
        try:
            self.con.execute(f"CREATE TEMP VIEW impressions AS SELECT * FROM {base}")
        except duckdb.Error:
            self.check_binds(
                f"(SELECT * FROM {self.imp_source.scan()})", {"build.impressions.filter": imp.filter}, self.imp_source
            )
            raise
        self.imp_time = self.seconds(imp.time, "impressions", "build.impressions.time")
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
            self.con.execute(f"CREATE TEMP VIEW impressions_joined AS {joined}")
        except duckdb.Error as e:
            raise ContractError(self.explain(e) or f"build: joining the side tables: {first_line(e)}") from None
        split_tests = [self.split_test(i) for i in range(len(self.b.splits))]
        split_case = "CASE " + " ".join(f"WHEN {t} THEN {sql_string(s)}" for t, s in zip(split_tests, self.splits))
        keys = self.request_keys()
        key_columns = ", ".join(f"({k}) AS __key{i}" for i, k in enumerate(keys))
        order = imp.order or imp.item
        outputs = ", ".join(f"({self.b.columns[c]}) AS {sql_name(c)}" for c in self.computed)
        hits = "".join(f", {sql_name(s.name)}.__hit AS {sql_name('__hit_' + s.name)}" for s in self.b.side_tables)
        try:
            self.sql(
                "building the impressions",
                f"""CREATE TEMP TABLE imp AS
                SELECT {key_columns}, {self.imp_time} AS __t, ({imp.user}) AS __user, ({imp.item}) AS __item,
                       ({order}) AS __order, {split_case} END AS __split,
                       {" + ".join(f"CAST(coalesce({t}, false) AS INTEGER)" for t in split_tests)} AS __n_splits,
                       __file, {outputs}{hits}
                FROM ({joined})""",
            )
        except ContractError:
            exprs = {f"build.columns.{c}": self.b.columns[c] for c in self.computed}
            exprs.update({"build.impressions.user": imp.user, "build.impressions.item": imp.item})
            exprs.update({"build.impressions.order": order})
            key_names = (
                ["build.impressions.request"]
                if imp.request
                else [f"build.impressions.request_key[{i}]" for i in range(len(keys))]
            )
            exprs.update(zip(key_names, keys))
            exprs.update({f"build.splits[{i}].filter": s.filter for i, s in enumerate(self.b.splits) if s.filter})
            self.check_binds("impressions_joined", exprs, self.imp_source)
            raise
        self.check_times("imp", "__t", self.imp_source, self.imp_time, "build.impressions.time")
        self.check_not_null("imp", "__user", self.imp_source, imp.user, "build.impressions.user", "user")
        for task in self.features.tasks:
            self.check_label(task.label_column)
        self.check_no_nulls("imp", self.computed, "build.columns", self.imp_source, self.b.columns)
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
        self.check_surfaces()
        self.number_requests(keys)
        self.check_id_types()
        self.drop_duplicates()
        if self.b.negative_downsampling:
            self.downsample()

    def request_keys(self) -> List[str]:
        imp = self.b.impressions
        return [imp.request] if imp.request else list(imp.request_key)

    def number_requests(self, keys: List[str]) -> None:
        """``__req``: the log's integer request id as it is; otherwise each distinct key numbered
        1, 2, ... in key order (only the keys are sorted, not the impressions)."""
        if len(keys) == 1 and self.is_integer(keys[0]):
            self.sql("taking the request ids", "ALTER TABLE imp RENAME COLUMN __key0 TO __req")
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
            f"CREATE OR REPLACE TEMP TABLE imp AS SELECT imp.* EXCLUDE ({listed}), r.__req "
            f"FROM imp JOIN __request_ids r ON {same}",
        )

    def side_table(self, i: int, side) -> dict:
        """One side table read and checked (one row per key, and date if dated) into a temp table."""
        where = f"build.side_tables[{i}]"
        if side.name in self.imp_columns:
            raise ConfigError(
                f"{where}.name: {side.name!r} is also a column of the impression log; name the side table otherwise"
            )
        source = RawSource.of(side, self.raw_dir, where)
        columns = source.columns(self.con)
        for col in list(side.key) + ([side.as_of] if side.as_of else []):
            if col not in columns:
                raise ContractError(f"{where}: {source.files[0]} has no column {col!r} (its columns: {columns})")
        alias = f"__side{i}"
        keys = list(side.key)
        key_select = ", ".join(f"{sql_name(k)} AS __k{j}" for j, k in enumerate(keys))
        dated = ""
        if side.as_of:
            key_select += f", {self.date_sql(sql_name(side.as_of), source, where + '.as_of')} AS __date"
            keys.append(side.as_of)
            dated = ", __date"
        filtered = f"(SELECT * FROM {source.scan()}{_where(side.filter)})"
        fields = [c for c in columns if c not in side.key]
        # The side columns travel in one struct, so no name of theirs can clash with the impressions'.
        packed = ", ".join(f"{sql_name(c)} := {sql_name(c)}" for c in fields)
        self.con.execute(
            f"CREATE TEMP TABLE {alias} AS SELECT {key_select}, struct_pack({packed}) AS __fields FROM {filtered}"
        )
        dup = self.one(
            f"SELECT {', '.join(f'__k{j}' for j in range(len(side.key)))}{dated}, count(*) FROM {alias} "
            f"GROUP BY ALL HAVING count(*) > 1 LIMIT 1"
        )
        if dup:
            raise ContractError(
                f"{where}: key {dict(zip(keys, dup[:-1]))} has {dup[-1]} rows in {', '.join(source.files)}; "
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
            date = f"CAST(timezone({sql_string(self.b.timezone)}, to_timestamp({time})) AS DATE)"
            on += f" AND {alias}.__date = {date}"
        values = {c: f"{alias}.__fields.{sql_name(c)}" for c in info["fields"]}
        packed = ", ".join(
            f"{sql_name(c)} := " + (f"coalesce({v}, {side.defaults[c]})" if c in side.defaults else v)
            for c, v in values.items()
        )
        struct = f"struct_pack({packed}, __hit := {alias}.__k0 IS NOT NULL) AS {sql_name(side.name)}"
        return f"LEFT JOIN {alias} ON {on}", struct

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
                f"build.impressions: request {bad[0]} has impressions of {bad[1]} users; a request is one user's "
                f"(check build.impressions.request / request_key)"
            )
        self.counts["requests with impressions at several times (request time = the earliest)"] = self.scalar(
            "SELECT count(*) FROM req WHERE __times > 1"
        )
        moved = self.scalar("SELECT count(*) FROM req WHERE __splits > 1")
        if moved:
            self.counts["requests across a split boundary (put in the split of their earliest impression)"] = moved
            self.sql(
                "moving requests to one split",
                "UPDATE imp SET __split = req.__split FROM req WHERE imp.__req = req.__req",
            )
        for col in self.user_side:
            bad = self.one(
                f"SELECT __req, count(DISTINCT {sql_name(col)}) FROM imp GROUP BY __req "
                f"HAVING count(DISTINCT {sql_name(col)}) > 1 LIMIT 1"
            )
            if bad:
                raise ContractError(
                    f"build.columns.{col}: a user-side feature, but request {bad[0]} has {bad[1]} different values "
                    f"among its impressions (it must be one per request)"
                )

    def events(self, source: SequenceSourceConfig) -> None:
        """The group's events (filtered, checked) as a table: user, time (seconds), the group's columns."""
        i = self.b.sequences.index(source)
        where = f"build.sequences[{i}]"
        group = next(g for g in self.features.sequence_groups if g.name == source.group)
        name = _ident(group.name)
        if source.path:
            raw = RawSource.of(source, self.raw_dir, where)
            scan = f"(SELECT *, filename AS __file FROM {raw.scan()})"
            if source.side_tables:  # the events' own keys into the side tables (as of their own date)
                plain = f"__events_raw_{name}"
                self.con.execute(f"CREATE TEMP VIEW {plain} AS SELECT * FROM {scan}")
                t = self.seconds(source.time, plain, f"{where}.time")
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
            self.con.execute(f"CREATE TEMP VIEW {view} AS SELECT * FROM {scan}{_where(source.filter)}")
        except duckdb.Error:
            self.check_binds(scan, {f"{where}.filter": source.filter}, raw)
            raise
        t = self.seconds(source.time, view, f"{where}.time")
        ids = [f.column for f in group.features]
        cols = ids + _embedding(group)
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
            first = raw.place(path, f"({source.user}) IS NULL")
            raise ContractError(
                f"{where}.user: {no_user} event(s) without a user, first at {first}; "
                "fix the log or set missing_user: drop"
            )
        self.counts[f"sequence group {group.name}: events without a user (dropped)"] = no_user
        self.con.execute(f"DELETE FROM {events} WHERE __no_user")
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
        for f in group.features:
            if f.multi_valued:  # a counted repair, as the loader's overlong_sequence: truncate does
                col = sql_name(f.column)
                over = self.scalar(f"SELECT count(*) FROM {events} WHERE len({col}) > {f.max_values}")
                if over:
                    self.counts[
                        f"sequence group {group.name} feature {f.name}: bags cut to their first {f.max_values} ids"
                    ] = over
                    self.con.execute(
                        f"UPDATE {events} SET {col} = {col}[1:{f.max_values}] WHERE len({col}) > {f.max_values}"
                    )
        self.group_sources[group.name] = (events, source, group)

    def vocabulary(self, vocab) -> None:
        """Maps every column feeding ``vocab.table`` (candidate and sequence ones) to 1..V by
        frequency on the fitting split; 0 is out of vocabulary."""
        table = self.features.table(vocab.table)
        imp_cols = [s.column for s in self.features.sparse if s.table == vocab.table]
        event_cols = [
            (events, f.column)
            for events, _, g in self.group_sources.values()
            for f in g.features
            if f.table == vocab.table
        ]
        end = self.scalar(f"SELECT max(__t) FROM imp WHERE __split = {sql_string(vocab.fit_split)}")
        if end is None:
            raise ContractError(f"build.vocabularies: split {vocab.fit_split!r} has no impression to fit on")

        def raw_values(table: str, column: str) -> str:  # a list column (multi-hot, bags) counts each id
            col = sql_name(column)
            return (
                f"CAST(unnest({col}) AS VARCHAR)" if self.is_list_column(table, column) else f"CAST({col} AS VARCHAR)"
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
        # Each column once (two features may read one), then what it mapped to 0: out of vocabulary
        # is a default too, and the summary shows it.
        out_of_vocabulary = 0
        for table_name, c in dict.fromkeys([("imp", c) for c in imp_cols] + event_cols):
            self.remap(table_name, c, name)
            col = sql_name(c)
            zero = f"len(list_filter({col}, lambda x: x = 0))" if self.is_list_column(table_name, c) else f"{col} = 0"
            out_of_vocabulary += self.scalar(f"SELECT coalesce(sum(CAST({zero} AS BIGINT)), 0) FROM {table_name}")
        self.counts[f"vocabulary {vocab.table}: ids out of vocabulary (mapped to 0)"] = int(out_of_vocabulary)
        vocab_dir = self.out / "vocabularies"
        vocab_dir.mkdir(exist_ok=True)
        self.con.execute(
            f"COPY (SELECT * FROM {name} ORDER BY idx) TO {sql_string(str(vocab_dir / (vocab.table + '.parquet')))} "
            f"(FORMAT parquet)"
        )
        self.counts[f"vocabulary {vocab.table}: ids kept"] = self.scalar(f"SELECT count(*) FROM {name}")

    def remap(self, table: str, column: str, vocab: str) -> None:
        col = sql_name(column)
        if not self.is_list_column(table, column):
            self.con.execute(
                f"CREATE OR REPLACE TEMP TABLE {table} AS SELECT {table}.* REPLACE (coalesce(__v.idx, 0) AS {col}) "
                f"FROM {table} LEFT JOIN {vocab} AS __v ON __v.raw = CAST({table}.{col} AS VARCHAR)"
            )
            return
        # A list per row: each id mapped in place (its position kept), an empty list stays empty.
        self.con.execute(
            f"""CREATE OR REPLACE TEMP TABLE {table} AS
            WITH numbered AS (SELECT *, row_number() OVER () AS __row FROM {table}),
            ids AS (SELECT __row, unnest({col}) AS __id, generate_subscripts({col}, 1) AS __pos FROM numbered),
            mapped AS (SELECT __row, list(coalesce(__v.idx, 0) ORDER BY __pos) AS __ids
                       FROM ids LEFT JOIN {vocab} AS __v ON __v.raw = CAST(ids.__id AS VARCHAR) GROUP BY __row)
            SELECT numbered.* EXCLUDE (__row) REPLACE (coalesce(mapped.__ids, []) AS {col})
            FROM numbered LEFT JOIN mapped USING (__row)"""
        )

    def sequences(self, events: str, source: SequenceSourceConfig, group: SequenceGroupConfig) -> None:
        """``__seq_<group>``: per request, the newest max_length events strictly before (request
        time - min_gap_s), newest first, as the group's list columns."""
        name = _ident(group.name)
        cols = [f.column for f in group.features] + _embedding(group)
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
            FROM (SELECT __user, __t, {", ".join(sql_name(c) for c in cols)} FROM {events}
                  UNION ALL BY NAME SELECT __user, __req, __n FROM __before_{name})
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
                FROM __timeline_{name} WHERE len(__requests) > 0)""",
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
        (relative to the output directory: they stay true once it is moved in) and counts. Only the
        keys are sorted; each file's requests are then read by their rank."""
        out = self.out / split
        out.mkdir()
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
        select = (
            f"SELECT CAST(r.__req AS BIGINT) AS {sql_name(names.request_id)}, "
            f"CAST(floor(r.__t) AS BIGINT) AS {sql_name(names.timestamp)}"
            + "".join(f", c.{sql_name(col)}" for col in self.user_side)
            + "".join(f", {s}" for s in seq_cols)
            + "".join(f", [x.{sql_name(col)} FOR x IN c.__c] AS {sql_name(col)}" for col in self.candidate)
            + " FROM __ranks k JOIN req r USING (__req) JOIN __candidates c USING (__req) "
            + " ".join(seq_joins)
        )
        writer = _SplitWriter(out, self.b.requests_per_row_group, self.b.requests_per_file, self.features)
        total, per_file = self.scalar("SELECT count(*) FROM __ranks"), self.b.requests_per_file
        for first in range(0, total, per_file):
            chunk = f"{select} WHERE k.__rank > {first} AND k.__rank <= {first + per_file} ORDER BY k.__rank"
            try:
                for batch in self.con.sql(chunk).to_arrow_reader(self.b.requests_per_row_group):
                    writer.add(batch)
            except duckdb.Error as e:
                raise ContractError(f"build: writing split {split!r}: {str(e).strip().splitlines()[0]}") from None
        written = writer.close()
        written["files"] = [Path(f).relative_to(self.out).as_posix() for f in written["files"]]
        build_output.kill_point(f"split:{split}")
        return written

    # --- checks ------------------------------------------------------------------------------

    def check_times(self, table: str, column: str, source: RawSource, expr: str, where: str) -> None:
        bad = self.one(f"SELECT __file, count(*) FROM {table} WHERE {column} IS NULL GROUP BY __file LIMIT 1")
        if bad:
            total = self.scalar(f"SELECT count(*) FROM {table} WHERE {column} IS NULL")
            raise ContractError(
                f"{where}: {total} timestamp(s) missing or unparsable, first at "
                f"{source.place(bad[0], f'({expr}) IS NULL')}"
            )
        stamp = rules.TIMESTAMP
        bad = self.one(
            f"SELECT __file, count(*), min({column}), max({column}) FROM {table} "
            f"WHERE {stamp.where(column)} GROUP BY __file LIMIT 1"
        )
        if bad:
            hint = " (milliseconds? divide by 1000 in the expression)" if bad[3] >= rules.LATEST else ""
            raise ContractError(
                f"{where}: {bad[1]} timestamp(s) outside 1990..2100 in {bad[0]}, first at "
                f"{source.place(bad[0], stamp.where(f'({expr})'))}{hint}",
                stamp,
            )

    def check_not_null(self, table: str, column: str, source: RawSource, expr: str, where: str, what: str) -> None:
        bad = self.one(f"SELECT __file, count(*) FROM {table} WHERE {column} IS NULL GROUP BY __file")
        if bad:
            raise ContractError(
                f"{where}: {bad[1]} impression(s) with no {what}, first at {source.place(bad[0], f'({expr}) IS NULL')}"
            )

    def check_no_nulls(self, table: str, columns: List[str], where: str, source: RawSource, exprs: dict) -> None:
        """A null in a contract column (a blank field, a side table's missing key without a default)."""
        if not columns:
            return
        counts = self.one(
            f"SELECT {', '.join(f'count(*) FILTER (WHERE {sql_name(c)} IS NULL)' for c in columns)} FROM {table}"
        )
        for c, n in zip(columns, counts):
            if n:
                path = self.scalar(f"SELECT any_value(__file) FROM {table} WHERE {sql_name(c)} IS NULL")
                raise ContractError(
                    f"{where}.{c}: {n} null value(s), first at {source.place(path, f'({exprs[c]}) IS NULL')}; "
                    f"give a value with coalesce(...) in the expression (or a side table's defaults)"
                )
        self.count_else(table, columns, where, exprs)

    def check_label(self, column: str) -> None:
        col = sql_name(column)
        label = rules.LABEL
        bad = self.one(
            f"SELECT __file, count(*), any_value({col}) FROM imp WHERE {col} IS NULL OR {label.where(col)} "
            f"GROUP BY __file LIMIT 1"
        )
        if bad:
            expr = f"({self.b.columns[column]})"
            raise ContractError(
                f"build.columns.{column}: {bad[1]} label(s) not 0/1 (e.g. {bad[2]!r}), first at "
                f"{self.imp_source.place(bad[0], f'{expr} IS NULL OR {label.where(expr)}')}",
                label if bad[2] is not None else None,
            )

    def check_id_types(self) -> None:
        for name, c in self.columns.items():
            if name not in self.computed or c.role != ID:
                continue
            if not self.is_integer_column("imp", name, lists_ok=True) and not self.vocab_for(name):
                raise ContractError(
                    f"build.columns.{name}: gives {self.column_type('imp', name)} values; an id must be an integer "
                    f"(map it with CASE, or declare a vocabulary for its table)"
                )

    def check_id_ranges(self) -> None:
        """Ids (after the vocabularies) inside their tables, unless the table hashes: found here,
        naming the row, rather than by the loader at training time."""
        places = {c: ("imp", "build.columns", self.imp_source, self.b.columns) for c in self.computed}
        for i, (events, source, group) in enumerate(self.group_sources.values()):
            raw = RawSource.of(source, self.raw_dir, "") if source.path else self.imp_source
            for f in group.features:
                places[f.column] = (events, f"build.sequences[{i}].columns", raw, source.columns)
        for name, (table, where, raw, exprs) in places.items():
            c = self.columns[name]
            if not c.table_size or c.hashed:
                continue
            col = sql_name(name)
            is_list = self.column_type(table, name).endswith("[]")
            low, high = (f"list_min({col})", f"list_max({col})") if is_list else (col, col)
            bad = self.one(
                f"SELECT __file, {low}, {high} FROM {table} WHERE {low} < 0 OR {high} >= {c.table_size} LIMIT 1"
            )
            if bad:
                value = bad[1] if bad[1] < 0 else bad[2]
                expr = exprs[name]
                test = (
                    f"list_min({expr}) < 0 OR list_max({expr}) >= {c.table_size}"
                    if is_list
                    else (f"({expr}) < 0 OR ({expr}) >= {c.table_size}")
                )
                at = self.side_place(expr, test) or raw.place(bad[0], test)
                raise ContractError(
                    f"{where}.{name}: id {value} at {at} is outside [0, {c.table_size}), the "
                    f"table of {c.uses[0].what}; enlarge the table, set hash: true, or declare a vocabulary",
                    rules.NEGATIVE_ID if value < 0 else rules.id_beyond(c.table_size),
                )

    def check_binds(self, relation: str, exprs: Dict[str, str], source: RawSource) -> None:
        """After a step failed: the first expression that fails alone over ``relation``, named by its
        config key (DuckDB's message names no file, and blames an output alias -- "referenced that
        exists in the SELECT clause" -- for a column the file lacks)."""
        for key, expr in exprs.items():
            if not expr:  # an optional expression not given
                continue
            try:
                self.con.execute(f"SELECT ({expr}) FROM {relation} LIMIT 0").fetchall()
            except duckdb.Error as e:
                missing = re.search(r'Referenced column "(.+?)" not found', str(e))
                if not missing:
                    raise ContractError(self.explain(e) or f"{key}: {expr!r}: {first_line(e)}") from None
                described = self.con.execute(f"DESCRIBE SELECT * FROM {relation}").fetchall()
                have = [f"{r[0]}.<column>" if r[1].startswith("STRUCT") else r[0] for r in described]
                files = source.files[0] + (" ..." if len(source.files) > 1 else "")
                raise ContractError(
                    f"{key}: {expr!r} reads column {missing.group(1)!r}, which {files} does not have (its columns: "
                    f"{', '.join(h for h in have if not h.startswith('__'))})"
                ) from None

    def check_default_types(self, side, source: RawSource, where: str) -> None:
        """A number for the default of a column DuckDB reads as text (one text value makes it so)
        names that value; DuckDB would say only "Cannot mix values of type VARCHAR and ..."."""
        if not side.defaults:
            return
        kinds = dict(
            self.con.execute(
                f"SELECT column_name, column_type FROM (DESCRIBE SELECT * FROM {source.scan()})"
            ).fetchall()
        )
        for col, default in side.defaults.items():
            try:
                kind = self.scalar(f"SELECT typeof({default})")
            except duckdb.Error:
                continue
            if kinds[col] != "VARCHAR" or not (kind in _INTEGERS or kind.startswith(("DECIMAL", "DOUBLE", "FLOAT"))):
                continue
            name = sql_name(col)
            for path in source.files:
                found = source.find(path, f"{name} IS NOT NULL AND TRY_CAST({name} AS DOUBLE) IS NULL", name)
                if found:
                    raise ContractError(
                        f"{where}.defaults.{col}: {source.at(path, found[0])}, column {col!r}: value {found[1]!r} "
                        f"makes the column text, and its default {default} is a number; fix the value, or quote the "
                        f"default"
                    )
            raise ContractError(
                f"{where}.defaults.{col}: column {col!r} of {source.files[0]} is read as text (blank throughout?) "
                f"but its default {default} is a number; quote the default"
            )

    def check_surfaces(self) -> None:
        """Every impression's surface is one of features.surfaces (else the loader refuses the
        output at training time): an error naming the row, or dropped and counted (unknown_surface)."""
        name, surfaces = self.features.columns.surface, self.features.surfaces
        if self.is_integer_column("imp", name):  # surfaces as indices

            def unknown(x: str) -> str:
                return f"({x}) < 0 OR ({x}) >= {len(surfaces)}"
        else:

            def unknown(x: str) -> str:
                return f"CAST(({x}) AS VARCHAR) NOT IN ({', '.join(sql_string(s) for s in surfaces)})"

        bad = unknown(sql_name(name))
        n = self.scalar(f"SELECT count(*) FROM imp WHERE {bad}")
        if n and self.b.impressions.unknown_surface == "error":
            path, value = self.one(f"SELECT __file, {sql_name(name)} FROM imp WHERE {bad} LIMIT 1")
            raise ContractError(
                f"build.columns.{name}: {n} impression(s) on a surface not in features.surfaces {surfaces} (e.g. "
                f"{value!r}), first at {self.imp_source.place(path, unknown(self.b.columns[name]))}; add it to "
                f"features.surfaces, or set build.impressions.unknown_surface: drop"
            )
        self.counts["impressions on a surface not in features.surfaces (dropped)"] = n
        if n:
            self.con.execute(f"DELETE FROM imp WHERE {bad}")

    def count_else(self, table: str, columns: List[str], where: str, exprs: Dict[str, str]) -> None:
        """Counts the rows a CASE gave its ELSE in an id column (a mapping's default: an unknown
        behaviour type becomes id 0), so the summary shows what no WHEN matched. A label's ELSE is
        its negative class, and a surface's is checked by check_surfaces: neither is counted."""
        what = "impressions" if table == "imp" else "events"
        for c in columns:
            if self.columns[c].role not in ID_ROLES:
                continue
            default = self.else_value(exprs[c])
            if default is not None and not self.is_list_column(table, c):
                n = self.scalar(f"SELECT count(*) FROM {table} WHERE {sql_name(c)} = {default}")
                self.counts[f"{where}.{c}: {what} given the CASE's ELSE value {default}"] = n

    def else_value(self, expr: str) -> Optional[str]:
        """The ELSE of ``expr`` as SQL when ``expr`` is a CASE whose ELSE is a constant that no THEN
        gives too (then its rows are exactly the unmatched ones); None otherwise."""
        tree = json.loads(self.scalar(f"SELECT json_serialize_sql({sql_string('SELECT ' + expr)})"))
        try:
            node = tree["statements"][0]["node"]
            case = node["select_list"][0]
        except (KeyError, IndexError):
            return None  # not parsed: the step itself says why
        otherwise = case.get("else_expr") or {}
        if case.get("class") != "CASE" or otherwise.get("class") != "CONSTANT":
            return None
        if otherwise.get("literal", {}).get("kind") == "NULL_LITERAL":
            return None

        def sql(e: dict) -> str:
            node["select_list"] = [e]
            return self.scalar(f"SELECT json_deserialize_sql({sql_string(json.dumps(tree))})")[len("SELECT ") :]

        value = sql(otherwise)
        return None if any(sql(check["then_expr"]) == value for check in case["case_checks"]) else value

    def side_place(self, expr: str, test: str) -> Optional[str]:
        """Where ``test`` first holds in a side table's file when ``expr`` reads that one side table
        alone (``profile.cms_segid + 1``): the value is there, not in the impression log."""
        read = [s.name for s in self.b.side_tables if re.search(rf"\b{re.escape(s.name)}\s*\.", expr)]
        if len(read) != 1 or read[0] not in self.side_sources:
            return None
        source = self.side_sources[read[0]]["source"]
        fields = set(re.findall(rf"\b{re.escape(read[0])}\s*\.\s*(\w+)", expr))
        column = f", column {fields.pop()!r}" if len(fields) == 1 else ""
        for path in source.files:
            row = source.locate(path, test, row_as=read[0])
            if row is not None:
                return f"{source.at(path, row)}{column} (side table {read[0]})"
        return None

    def vocab_for(self, column: str) -> bool:
        tables = {s.table for s in self.features.sparse if s.column == column}
        return any(v.table in tables for v in self.b.vocabularies)

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
            raise ContractError(
                f"build.impressions: {total} duplicated impression(s); request {dup[0]} shows item {dup[1]} "
                f"{dup[2]} times (in {', '.join(dup[3])}); set build.impressions.duplicates: drop to keep the first"
            )
        labels = ", ".join(f"{sql_name(t.label_column)} DESC" for t in self.features.tasks)
        self.con.execute(
            f"""CREATE OR REPLACE TEMP TABLE imp AS SELECT * EXCLUDE (__dup) FROM (
                SELECT *, row_number() OVER (PARTITION BY __req, __item ORDER BY __order, {labels}) AS __dup FROM imp)
            WHERE __dup = 1"""
        )
        self.counts["duplicated impressions (dropped)"] = int(total)

    def downsample(self) -> None:
        d = self.b.negative_downsampling
        label = sql_name(next(t.label_column for t in self.features.tasks if t.name == d.task))
        surface = sql_name(self.features.columns.surface)
        rate = "CASE " + " ".join(
            f"WHEN CAST({surface} AS VARCHAR) IN ({sql_string(s)}, {sql_string(str(self.features.surfaces.index(s)))}) "
            f"THEN {float(r)}"
            for s, r in d.rates.items()
        )
        rate += " ELSE 1.0 END"
        splits = ", ".join(sql_string(s) for s in d.splits)
        drop = (
            f"__split IN ({splits}) AND {label} = 0 AND "
            f"(hash(__req, __item, {int(d.seed)}) % 1000000) / 1000000.0 >= {rate}"
        )
        self.counts[f"negatives of {d.task} downsampled away"] = self.scalar(f"SELECT count(*) FROM imp WHERE {drop}")
        self.con.execute(f"DELETE FROM imp WHERE {drop}")

    # --- helpers -----------------------------------------------------------------------------

    def seconds(self, expr: str, relation: str, where: str) -> str:
        """SQL giving ``expr`` as epoch seconds (DOUBLE): numbers as they are; timestamps without a
        zone and dates in build.timezone; text as a number, else as a timestamp."""
        try:
            kind = self.one(f"SELECT typeof({expr}) FROM {relation} LIMIT 1")
        except duckdb.Error as e:
            raise ContractError(f"{where}: {expr!r}: {str(e).strip().splitlines()[0]}") from None
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
        kind = self.one(f"SELECT typeof({expr}) FROM {source.scan()} LIMIT 1")
        kind = kind[0] if kind else "DATE"
        if kind == "DATE" or kind.startswith("TIMESTAMP"):
            return f"CAST({expr} AS DATE)"
        if kind == "VARCHAR":
            return f"coalesce(TRY_CAST({expr} AS DATE), CAST(try_strptime({expr}, '%Y%m%d') AS DATE))"
        return f"CAST(try_strptime(CAST({expr} AS VARCHAR), '%Y%m%d') AS DATE)"

    def is_integer(self, expr: str) -> bool:
        kind = self.one(f"SELECT typeof({expr}) FROM impressions LIMIT 1")
        return bool(kind) and kind[0] in _INTEGERS

    def column_type(self, table: str, column: str) -> str:
        row = self.one(f"SELECT typeof({sql_name(column)}) FROM {table} LIMIT 1")
        return row[0] if row else "BIGINT"

    def is_list_column(self, table: str, column: str) -> bool:
        return self.column_type(table, column).endswith("[]")

    def is_integer_column(self, table: str, column: str, lists_ok: bool = False) -> bool:
        kind = self.column_type(table, column)
        return kind in _INTEGERS or (lists_ok and kind.endswith("[]") and kind[:-2] in _INTEGERS)

    def scalar(self, sql: str):
        row = self.one(sql)
        return row[0] if row else None

    def one(self, sql: str) -> Optional[tuple]:
        """The first row (the whole result is fetched: DuckDB refuses new work beside an open one)."""
        rows = self.con.execute(sql).fetchall()
        return rows[0] if rows else None

    def sql(self, what: str, statement: str) -> None:
        """Runs one step, naming it in the error when DuckDB refuses (an unknown column in an
        expression, a type that does not convert, the memory limit)."""
        try:
            self.con.execute(statement)
        except duckdb.Error as e:
            raise ContractError(self.explain(e) or f"build: {what}: {first_line(e)}") from None

    def explain(self, e: duckdb.Error) -> Optional[str]:
        """DuckDB's error about a raw file as one line naming file, line, column and value."""
        return explain(e, configured(self.b, self.raw_dir))

    # --- reports -----------------------------------------------------------------------------

    def summarize(self, outputs: Dict[str, dict], seconds: float) -> dict:
        """Counts read back from the written files: what the build produced, not what it meant to."""
        f = self.features
        out = {"splits": {}, "repairs": self.counts, "seconds": round(seconds, 2), "threads": self.threads}
        for split, o in outputs.items():
            entry = {"requests": o["requests"], "rows": o["rows"], "files": len(o["files"])}
            if o["files"]:
                scan = "read_parquet([" + ", ".join(sql_string(str(self.out / p)) for p in o["files"]) + "])"
                surface = sql_name(f.columns.surface)
                labels = ", ".join(
                    f"avg(CAST(unnest_l.{sql_name(t.label_column)} AS DOUBLE)) AS {sql_name(t.name)}" for t in f.tasks
                )
                unnested = ", ".join(
                    f"unnest({sql_name(c)}) AS {sql_name(c)}"
                    for c in [f.columns.surface] + [t.label_column for t in f.tasks]
                )
                rows = self.con.execute(
                    f"SELECT CAST(unnest_l.{surface} AS VARCHAR), count(*), {labels} "
                    f"FROM (SELECT {unnested} FROM {scan}) unnest_l GROUP BY ALL ORDER BY 1"
                ).fetchall()
                entry["surfaces"] = {
                    r[0]: {"rows": r[1], "label_rate": {t.name: round(v, 6) for t, v in zip(f.tasks, r[2:])}}
                    for r in rows
                }
                entry["sequence_lengths"] = {}
                for g in f.sequence_groups:
                    c = sql_name(g.timestamp_column)
                    q = self.one(
                        f"SELECT avg(len({c})), quantile_disc(len({c}), [0.5, 0.9, 0.99]), max(len({c})), "
                        f"count(*) FILTER (WHERE len({c}) = 0) FROM {scan}"
                    )
                    entry["sequence_lengths"][g.name] = {
                        "mean": round(q[0], 2),
                        "p50": q[1][0],
                        "p90": q[1][1],
                        "p99": q[1][2],
                        "max": q[2],
                        "empty": q[3],
                    }
            out["splits"][split] = entry
        out["join_misses"] = {
            s.name: self.scalar(f"SELECT count(*) FROM imp WHERE NOT {sql_name('__hit_' + s.name)}")
            for s in self.b.side_tables
        }
        return out

    def manifest(self, outputs: Dict[str, dict], summary: dict) -> dict:
        def describe(files) -> List[dict]:
            return [
                {
                    "path": p,
                    "bytes": os.path.getsize(p),
                    "modified": datetime.fromtimestamp(os.path.getmtime(p)).isoformat(timespec="seconds"),
                }
                for p in files
            ]

        inputs = {"impressions": describe(self.imp_source.files)}
        for side in self.b.side_tables:
            inputs[f"side_table:{side.name}"] = describe(RawSource.of(side, self.raw_dir, "").files)
        for s in self.b.sequences:
            if s.path:
                inputs[f"sequence:{s.group}"] = describe(RawSource.of(s, self.raw_dir, "").files)
        span = self.one("SELECT min(__t), max(__t) FROM imp")
        cfg = to_dict(self.cfg)
        return {
            "inputs": inputs,
            "impression_time_range": [_iso(span[0], self.b.timezone), _iso(span[1], self.b.timezone)],
            "config": {"build": cfg["build"], "features": cfg["features"]},
            "negative_downsampling": cfg["build"]["negative_downsampling"],
            "outputs": outputs,
            "memory_limit": self.memory_limit,
            "versions": {"duckdb": duckdb.__version__, "pyarrow": pa.__version__},
            "built": datetime.now().isoformat(timespec="seconds"),
        }


class _SplitWriter:
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
            stored_once = layout.request_level_columns(self.features)
            self.schema = _canonical_schema(batch.schema).with_metadata(
                layout.per_request_metadata(batch.schema.names, stored_once)
            )
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
            self.writer = pq.ParquetWriter(path, self.schema, compression="lz4", use_dictionary=False)
        self.writer.write_table(table.combine_chunks(), row_group_size=table.num_rows)
        self.requests += table.num_rows
        self.rows += int(pc.sum(pc.list_value_length(table.column(self.label))).as_py() or 0)
        self.in_file += table.num_rows
        if self.in_file >= self.per_file:
            self.writer.close()
            self.writer, self.in_file = None, 0


_INTEGERS = {"TINYINT", "SMALLINT", "INTEGER", "BIGINT", "HUGEINT", "UTINYINT", "USMALLINT", "UINTEGER", "UBIGINT"}


def _embedding(g: SequenceGroupConfig) -> List[str]:
    return [g.embedding_column] if g.embedding_column else []


def _ident(name: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in name)


def _where(predicate: Optional[str]) -> str:
    return f" WHERE ({predicate})" if predicate else ""


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


def _canonical_schema(schema: pa.Schema) -> pa.Schema:
    return pa.schema([pa.field(f.name, _canonical_type(f.type)) for f in schema])


def check_build(cfg: ExperimentConfig) -> None:
    """What a build needs of the config beyond its types; ConfigError names the key."""
    b, f = cfg.build, cfg.features
    if not b.impressions.path:
        raise ConfigError("build.impressions.path: the config has no build section (no impression log given)")
    if not b.splits:
        raise ConfigError("build.splits: declare at least one split (e.g. train and eval by time)")
    names = [s.name for s in b.splits]
    for i, n in enumerate(names):
        if n in names[:i] or not n or "/" in n:
            raise ConfigError(f"build.splits[{i}].name: {n!r} is empty, repeated or not a directory name")
    if not b.impressions.request and not b.impressions.request_key:
        raise ConfigError(
            "build.impressions.request: give the request id column, or request_key (e.g. [user, time, placement])"
        )
    groups = {g.name: g for g in f.sequence_groups}
    sourced = [s.group for s in b.sequences]
    for i, s in enumerate(b.sequences):
        if s.group not in groups:
            raise ConfigError(f"build.sequences[{i}].group: no sequence group {s.group!r} in features.sequence_groups")
        if s.group in sourced[:i]:
            raise ConfigError(f"build.sequences[{i}].group: {s.group!r} has two sources")
        g = groups[s.group]
        need = [x.column for x in g.features] + _embedding(g)
        for c in need:
            if c not in s.columns:
                raise ConfigError(f"build.sequences[{i}].columns.{c}: no expression for the group's column {c!r}")
        for c in s.columns:
            if c not in need:
                raise ConfigError(f"build.sequences[{i}].columns.{c}: not a column of group {s.group!r} ({need})")
        if s.min_gap_s < 0:
            raise ConfigError(f"build.sequences[{i}].min_gap_s: must be >= 0, got {s.min_gap_s}")
        sides = {t.name: t for t in b.side_tables}
        for name, key in s.side_tables.items():
            where = f"build.sequences[{i}].side_tables.{name}"
            if not s.path:
                raise ConfigError(
                    f"{where}: the events come from the impression log, which sees every side table already "
                    f"(joined as the impressions are); remove side_tables"
                )
            if name not in sides:
                raise ConfigError(f"{where}: no side table {name!r} in build.side_tables ({sorted(sides)})")
            if sorted(key) != sorted(sides[name].key):
                raise ConfigError(
                    f"{where}: give an event expression for each key column of {name!r} "
                    f"({sorted(sides[name].key)}), got {sorted(key)}"
                )
    for g in f.sequence_groups:
        if g.name not in sourced:
            raise ConfigError(f"build.sequences: no source for sequence group {g.name!r}")
    made = {f.columns.request_id, f.columns.timestamp} | {
        c for g in f.sequence_groups for c in [g.timestamp_column] + [x.column for x in g.features] + _embedding(g)
    }
    for c in contract_columns(f):
        if c.name not in made and c.name not in b.columns:
            raise ConfigError(f"build.columns.{c.name}: no expression for contract column {c.name!r} ({c.role})")
    for i, side in enumerate(b.side_tables):
        if not side.name.isidentifier():
            raise ConfigError(f"build.side_tables[{i}].name: {side.name!r} must be a plain name (letters, digits, _)")
        if not side.key:
            raise ConfigError(f"build.side_tables[{i}].key: map at least one side column to an impression expression")
    try:
        ZoneInfo(b.timezone)
    except Exception:
        raise ConfigError(f"build.timezone: unknown time zone {b.timezone!r} (e.g. UTC, Asia/Shanghai)") from None
    d = b.negative_downsampling
    if d is not None:
        if d.task not in [t.name for t in f.tasks]:
            raise ConfigError(f"build.negative_downsampling.task: no task {d.task!r}")
        for s, r in d.rates.items():
            if s not in f.surfaces:
                raise ConfigError(f"build.negative_downsampling.rates.{s}: not one of features.surfaces")
            if not 0.0 < r <= 1.0:
                raise ConfigError(f"build.negative_downsampling.rates.{s}: must be in (0, 1], got {r}")
        for s in d.splits:
            if s not in names:
                raise ConfigError(f"build.negative_downsampling.splits: no split {s!r}")
    tables = {t.name for t in f.tables}
    for i, v in enumerate(b.vocabularies):
        if v.table not in tables:
            raise ConfigError(f"build.vocabularies[{i}].table: no table {v.table!r} in features.tables")
        if v.fit_split not in names:
            raise ConfigError(f"build.vocabularies[{i}].fit_split: no split {v.fit_split!r}")
        if v.min_count < 1:
            raise ConfigError(f"build.vocabularies[{i}].min_count: must be >= 1, got {v.min_count}")
    if b.requests_per_row_group < 1 or b.requests_per_file < 1:
        raise ConfigError("build.requests_per_row_group / requests_per_file: must be >= 1")


def format_summary(summary: dict) -> str:
    lines = [f"built in {summary['seconds']} s on {summary['threads']} thread(s)"]
    for split, s in summary["splits"].items():
        lines.append(f"{split}: {s['requests']} requests, {s['rows']} rows, {s['files']} file(s)")
        for surface, v in (s.get("surfaces") or {}).items():
            rates = "  ".join(f"{t} {r:.4f}" for t, r in v["label_rate"].items())
            lines.append(f"  {surface:<14} {v['rows']:>10} rows  {rates}")
        for g, q in (s.get("sequence_lengths") or {}).items():
            lines.append(
                f"  sequence {g:<10} mean {q['mean']:.1f}  p50 {q['p50']}  p90 {q['p90']}  p99 {q['p99']}  "
                f"max {q['max']}  empty {q['empty']}"
            )
    for what, n in summary["repairs"].items():
        if n:
            lines.append(f"{what}: {n}")
    for name, n in summary["join_misses"].items():
        lines.append(f"side table {name}: {n} impression(s) without a row (defaults used)")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pinads_rec.data.build", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="experiment YAML with a build: section")
    ap.add_argument("--raw", required=True, help="directory the build's file paths are relative to")
    ap.add_argument(
        "--out",
        required=True,
        help="output directory (<split>/, vocabularies/, summary.json, manifest.json), replaced whole once the "
        "build is complete",
    )
    ap.add_argument("--memory-limit", default=None, help="DuckDB memory cap, e.g. 2GB (spills to disk beyond it)")
    ap.add_argument("--threads", type=int, default=None, help="worker threads (default: every core)")
    add_overrides_flag(ap, "override a config field, e.g. --set build.timezone=UTC (repeatable)")
    args = ap.parse_args(argv)
    try:
        cfg = load(args.config, args.overrides)
        summary = build(cfg, args.raw, args.out, args.memory_limit, args.threads)
    except (ConfigError, ContractError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
