"""The vocabularies' step, as functions over the build (``build``: full_build.Build): raw ids ->
1..V by frequency on the fitting split, 0 out of vocabulary, fitted (``fit_vocabulary``) or given
(a day build's, a live batch's: ``apply_vocabulary``), every column feeding the table mapped; and
the summary's count of the ids each vocabulary did not keep (``unknown_ids``).
"""

from __future__ import annotations

from typing import Dict, List, Tuple

from pinads_rec.data.loader.contract import ContractError
from pinads_rec.data.sql_text import identifier, sql_name, sql_string


def fit_vocabulary(build, vocab) -> None:
    """Maps every column feeding ``vocab.table`` (candidate and sequence ones) to 1..V by
    frequency on the fitting split; 0 is out of vocabulary."""
    table = build.features.table(vocab.table)
    imp_cols, event_cols = vocabulary_columns(build, vocab.table)
    end = build.scalar(f"SELECT max(__t) FROM imp WHERE __split = {sql_string(vocab.fit_split)}")
    if end is None:
        raise ContractError(f"build.vocabularies: split {vocab.fit_split!r} has no impression to fit on")

    def raw_values(table: str, column: str) -> str:  # a list column (multi-hot, bags) counts each id
        col = sql_name(column)
        return f"unnest(CAST({col} AS VARCHAR[]))" if build.is_list_column(table, column) else f"CAST({col} AS VARCHAR)"

    values = [
        f"SELECT {raw_values('imp', c)} AS v FROM imp WHERE __split = {sql_string(vocab.fit_split)}" for c in imp_cols
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
    name = f"vocab_{identifier(vocab.table)}"
    build.sql(
        f"fitting the vocabulary of table {vocab.table!r}",
        f"""CREATE TEMP TABLE {name} AS
        SELECT v AS raw, CAST(row_number() OVER (ORDER BY n DESC, v) AS BIGINT) AS idx, n AS count
        FROM (SELECT v, count(*) AS n FROM ({" UNION ALL ".join(values)}) WHERE v IS NOT NULL GROUP BY v
              HAVING count(*) >= {int(vocab.min_count)})
        QUALIFY idx < {table.num_embeddings}""",
    )
    apply_vocabulary(build, vocab.table, name)
    vocab_dir = build.out / "vocabularies"
    vocab_dir.mkdir(exist_ok=True)
    build.engine.copy_parquet(f"SELECT * FROM {name} ORDER BY idx", str(vocab_dir / (vocab.table + ".parquet")))


def vocabulary_columns(build, table: str) -> Tuple[List[str], List[Tuple[str, str]]]:
    """The columns feeding ``table``: those of the impressions, and (events table, column) of the groups."""
    imp_cols = [s.column for s in build.features.sparse if s.table == table]
    event_cols = [
        (events, f.column) for events, _, g in build.group_sources.values() for f in g.features if f.table == table
    ]
    return imp_cols, event_cols


def apply_vocabulary(build, table: str, name: str) -> None:
    """Every column feeding ``table`` mapped by the vocabulary table ``name`` (raw, idx, count)."""
    imp_cols, event_cols = vocabulary_columns(build, table)
    # Each column once (two features may read one), then what it mapped to 0: out of vocabulary
    # is a default too, and the summary shows it.
    out_of_vocabulary = 0
    for table_name, c in dict.fromkeys([("imp", c) for c in imp_cols] + event_cols):
        remap(build, table_name, c, name)
        col = sql_name(c)
        zero = (
            f"array_length(list_filter({col}, lambda x: x = 0))"
            if build.is_list_column(table_name, c)
            else f"{col} = 0"
        )
        out_of_vocabulary += build.scalar(f"SELECT coalesce(sum(CAST({zero} AS BIGINT)), 0) FROM {table_name}")
    build.counts[f"vocabulary {table}: ids out of vocabulary (mapped to 0)"] = int(out_of_vocabulary)
    build.counts[f"vocabulary {table}: ids kept"] = build.scalar(f"SELECT count(*) FROM {name}")


def unknown_ids(build, splits: List[str]) -> Dict[str, Dict[str, dict]]:
    """split -> vocabulary table -> the ids its vocabulary did not keep (0: a user or item new
    since the fitting split, or rarer than min_count), of the ``impressions`` (the impression
    columns feeding the table: a row each, or each id of a list) and of the ``events`` of the
    split's sequences (each id of a bag), each {"ids", "unknown", "share"}; counted once the
    sequences are cut, on what is written. {} without vocabularies."""
    if not build.b.vocabularies:
        return {}
    out: Dict[str, Dict[str, dict]] = {split: {} for split in splits}
    for vocab in build.b.vocabularies:
        imp_cols, _ = vocabulary_columns(build, vocab.table)
        counted: Dict[str, List[str]] = {"impressions": [], "events": []}
        for c in dict.fromkeys(imp_cols):
            col = sql_name(c)
            if build.is_list_column("imp", c):
                ids, zero = f"array_length({col})", f"array_length(list_filter({col}, lambda x: x = 0))"
            else:
                ids, zero = "1", f"CAST({col} = 0 AS BIGINT)"
            counted["impressions"].append(
                f"SELECT __split, sum(coalesce({ids}, 0)) AS n, sum(coalesce({zero}, 0)) AS z FROM imp GROUP BY __split"
            )
        for _, _, group in build.group_sources.values():
            for f in group.features:
                if f.table == vocab.table:  # a bag per event: its ids
                    col = sql_name(f.column)
                    col = f"flatten({col})" if f.multi_valued else col
                    counted["events"].append(
                        f"SELECT r.__split, sum(coalesce(array_length({col}), 0)) AS n, "
                        f"sum(coalesce(array_length(list_filter({col}, lambda x: x = 0)), 0)) AS z "
                        f"FROM __seq_{identifier(group.name)} JOIN req r USING (__req) GROUP BY r.__split"
                    )
        for kind, parts in counted.items():
            if not parts:
                continue
            totals = dict.fromkeys(splits, (0, 0))
            for split, n, z in build.rows(
                f"SELECT __split, sum(n), sum(z) FROM ({' UNION ALL '.join(parts)}) GROUP BY __split"
            ):
                if split in totals:
                    totals[split] = (int(n or 0), int(z or 0))
            for split, (n, z) in totals.items():
                share = round(z / n, 6) if n else 0.0
                out[split].setdefault(vocab.table, {})[kind] = {"ids": n, "unknown": z, "share": share}
    return out


def remap(build, table: str, column: str, vocab: str) -> None:
    col = sql_name(column)
    if not build.is_list_column(table, column):
        mapped = build.select_list(table, {column: "coalesce(__v.idx, 0)"}, qualifier=table)
        build.engine.execute(
            f"CREATE OR REPLACE TEMP TABLE {table} AS SELECT {mapped} "
            f"FROM {table} LEFT JOIN {vocab} AS __v ON __v.raw = CAST({table}.{col} AS VARCHAR)"
        )
        return
    # A list per row: each id mapped in place (its position kept), an empty list stays empty. The
    # rows are numbered in a table of their own (a number any engine keeps once given).
    build.engine.execute(
        f"CREATE OR REPLACE TEMP TABLE __numbered AS SELECT *, row_number() OVER () AS __row FROM {table}"
    )
    kept = build.select_list("__numbered", {column: "coalesce(mapped.__ids, [])"}, ["__row"], "__numbered")
    build.engine.execute(
        f"""CREATE OR REPLACE TEMP TABLE {table} AS
        WITH ids AS (SELECT __row, unnest({col}) AS __id, generate_subscripts({col}, 1) AS __pos FROM __numbered),
        mapped AS (SELECT __row, list(coalesce(__v.idx, 0) ORDER BY __pos) AS __ids
                   FROM ids LEFT JOIN {vocab} AS __v ON __v.raw = CAST(ids.__id AS VARCHAR) GROUP BY __row)
        SELECT {kept} FROM __numbered LEFT JOIN mapped USING (__row)"""
    )
