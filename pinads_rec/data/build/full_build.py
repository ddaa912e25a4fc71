"""The build's run: ``build`` and ``Build``, its state -- the engine (engine.py), the config's
``build:`` and ``features:`` sections, the columns it makes, and what each step finds for the next
(the impression log, the side tables, the sequence groups' events tables, the repairs counted) --
and the order of the steps (the package docstring tells them), each a function over the build in
its module: impressions.py, sequences.py, vocabularies.py; the candidates grouped and each split
written are here. A day build (days.py) and a live batch (live.py) change the steps through the
methods under "what a day build or a live batch does otherwise".
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

from pinads_rec.config import ExperimentConfig
from pinads_rec.data import build_output
from pinads_rec.data.build.checks import case_else_value, check_id_ranges, check_label
from pinads_rec.data.build.config_checks import check_build, embedding_columns
from pinads_rec.data.build.engine import Engine
from pinads_rec.data.build.engines import open_engine
from pinads_rec.data.build.impressions import (
    build_impressions,
    drop_outside_splits,
    group_requests,
    read_side_table,
    split_columns,
    split_filters,
)
from pinads_rec.data.build.queries import Queries
from pinads_rec.data.build.sequences import cut_sequences, keep_users_built, read_events
from pinads_rec.data.build.vocabularies import fit_vocabulary, unknown_ids
from pinads_rec.data.build.writer import SplitWriter, build_manifest, summarize_outputs
from pinads_rec.data.loader.contract import ContractError, contract_columns
from pinads_rec.data.raw_sources import RawSource
from pinads_rec.data.sql_text import first_line, identifier, sql_name, sql_string


def build(
    cfg: ExperimentConfig,
    raw_dir: str,
    out_dir: str,
    memory_limit: Optional[str] = None,
    threads: Optional[int] = None,
    engine: str = "duckdb",
) -> dict:
    """Builds every split of ``cfg.build`` from the files under ``raw_dir`` into ``out_dir``, which
    it replaces whole, or not at all on an error, on ``engine`` (engines.py); returns the summary
    (also ``out_dir/summary.json``)."""
    with build_output.replacing(out_dir) as work:
        return Build(cfg, raw_dir, str(work), memory_limit, threads, engine).run()


class Build(Queries):
    """One build of the raw files into ``out_dir`` (``run``): an engine, a temp table a step."""

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
        # What the steps find on the way, read by the later ones (and by checks.py, writer.py).
        self.imp_source: Optional[RawSource] = None  # the impression log (build_impressions)
        self.imp_columns: List[str] = []  # its columns
        self.imp_time = ""  # SQL: an impression's time in epoch seconds
        self.side_sources: Dict[str, dict] = {}  # side table name -> what its joins need (read_side_table)
        self.group_sources: Dict[str, tuple] = {}  # group -> (events table, source, group)

    def check_config(self) -> None:
        check_build(self.cfg.build, self.cfg.features)

    def summarize(self, outputs: Dict[str, dict], seconds: float, root=None, impressions: str = "imp") -> dict:
        """The summary (writer.py), with the rows each CASE gave its ELSE beside the repairs."""
        summary = {**summarize_outputs(self, outputs, seconds, root, impressions), "case_else": self.case_else}
        summary["unknown_ids"] = unknown_ids(self, list(outputs))  # per split and vocabulary (vocabulary section)
        return summary

    # --- the steps (impressions.py, sequences.py, vocabularies.py, and the output below) -------

    def run(self) -> dict:
        start = time.time()
        outputs = self.steps()
        summary = self.summarize(outputs, time.time() - start)
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        manifest = build_manifest(self, outputs, summary)
        self.engine.close()  # no query left that could spill again into the files the manifest lists
        shutil.rmtree(self.tmp, ignore_errors=True)
        build_output.write_manifest(self.out, manifest, self.splits)
        return summary

    def steps(self) -> Dict[str, dict]:
        """Every step, each split's files written; returns what ``write`` returned per split."""
        try:
            build_impressions(self)
            group_requests(self)
            for source in self.b.sequences:
                read_events(self, source)
            for vocab in self.b.vocabularies:
                self.vocabulary(vocab)
            check_id_ranges(self)
            for events, source, group in self.group_sources.values():
                cut_sequences(self, events, source, group)
            self.candidates()
            return {split: self.write(split) for split in self.splits}
        except self.engine.errors as e:  # a raw file DuckDB refused: its file, line, column and value
            raise ContractError(self.explain(e) or f"build: {first_line(e)}") from None
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)

    # --- what a day build (days.py) or a live batch (live.py) does otherwise ---------------------

    def raw_source(self, cfg, where: str) -> RawSource:
        """The raw table ``cfg`` configures (its files under ``raw_dir``)."""
        return RawSource.of(cfg, self.raw_dir, where)

    def check_labels(self) -> None:
        for task in self.features.tasks:
            check_label(self, task.label_column)

    def split_columns(self) -> Tuple[str, str]:
        """SQL over the joined impression row: ``__split`` and ``__n_splits`` (impressions.py)."""
        return split_columns(self)

    def split_filters(self) -> Dict[str, str]:
        return split_filters(self.b)

    def drop_outside_splits(self) -> None:
        drop_outside_splits(self)

    def keep_built_requests(self) -> None:
        """Every numbered request is built (a day build keeps those of its days: days.py)."""

    def side_table(self, i: int, side) -> dict:
        return read_side_table(self, i, side)

    def prune_events(self, events: str) -> None:
        keep_users_built(self, events)

    def vocabulary(self, vocab) -> None:
        fit_vocabulary(self, vocab)

    def else_value(self, expr: str) -> Optional[str]:
        """The ELSE of an id column's CASE, as SQL (checks.case_else_value; a live batch asks once)."""
        return case_else_value(expr)

    def sampled(self) -> str:
        """SQL over an impression: whether its negatives are downsampled (its split is listed)."""
        return f"__split IN ({', '.join(sql_string(s) for s in self.b.negative_downsampling.splits)})"

    # --- the output ---------------------------------------------------------------------------

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
                raise ContractError(f"build: writing split {split!r}: {first_line(e)}") from None
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
            alias = f"__s_{identifier(g.name)}"
            seq_joins.append(f"LEFT JOIN __seq_{identifier(g.name)} {alias} USING (__req)")
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
