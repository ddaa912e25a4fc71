"""The draft: a starting config (a ``features:`` section and ``data.train_dir``) guessed from the
Parquet schema and statistics of a dataset alone (``draft_config``); comments in it mark each guess.
Where the data holds negative outcomes and no history group carries an action, it proposes one of
every event with its action (``_history_design``; docs/datasets.md, "Designing history groups").
The command checks the data with the draft right after writing it."""

from __future__ import annotations

import math
import os
import re
from typing import Dict, List, Optional, Tuple

import duckdb
import pyarrow as pa
import yaml

from pinads_rec import config as config_lib
from pinads_rec.data.inspect.files import PER_REQUEST, FileInfo, open_files
from pinads_rec.data.loader.contract import is_list_type
from pinads_rec.data.sql_text import sql_name, sql_string

_TIME = re.compile(r"(^|_)(ts|time|times|timestamp|timestamps|time_ms)(_|$)")
_LABEL = re.compile(r"(^|_)(click|clk|label|conv|conversion|save|like|buy|purchase|follow|is)(_|$)|^y$")
_PROB = re.compile(r"(^|_)(p|prob|probability|pctr|true_p)(_|$)")
# An event attribute saying what the user did (a like or a dislike, a click or a skip, a view or a buy).
_ACTION = re.compile(r"(^|_)(action|actions|btag|behavior|behaviour|feedback|event|rating|label|click|clk)(_|$)")
# A rating on the impression row: its outcome (a label is derived from it), never a feature.
_RATING = re.compile(r"(^|_)(rating|ratings|stars)(_|$)")
HISTORY_DOCS = 'docs/datasets.md, "Designing history groups"'
SEQUENCE_DIM = 32  # one width for every sequence table (one EmbeddingCollection)
MAX_TABLE = 10_000_000  # ids up to this size get an exact table; beyond it, a hashed one


def _table_dim(n: int) -> int:
    return 8 if n <= 100 else 16 if n <= 10_000 else 32 if n <= 1_000_000 else 64


def _flow(value) -> str:
    """One YAML value on one line (a flow mapping or list, or a scalar)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9, sort_keys=False)
    return text.removesuffix("\n...\n").strip()


def _draft_stats(files: List[FileInfo]) -> Tuple[str, Dict[str, pa.DataType], Dict[str, dict], List[str]]:
    """(layout, per-row column types, stats per column, request-level columns) of the first file's schema."""
    f0 = files[0]
    schema = f0.schema
    same = [f for f in files if f.schema.equals(schema, check_metadata=False)]
    paths = ", ".join(sql_string(f.path) for f in same)
    src = f"(SELECT file_index AS __f, file_row_number AS __r, * FROM read_parquet([{paths}], file_row_number = true))"
    con = duckdb.connect()
    try:
        lists = [fld.name for fld in schema if is_list_type(fld.type)]
        sig = {}
        if lists:
            # A row's length signature: equal signatures mean equal lengths on every row (a string hash:
            # DuckDB's multi-argument hash combines linearly, and the xor over rows would cancel).
            sigs = [f"bit_xor(hash(concat(__f, ':', __r, ':', len({sql_name(n)}))))" for n in lists]
            row = con.execute(f"SELECT {', '.join(sigs)} FROM {src}").fetchone()
            sig = dict(zip(lists, row))
        request_cols = [fld.name for fld in schema]
        candidate: List[str] = []
        if f0.layout == PER_REQUEST and lists:
            strings = [n for n in lists if pa.types.is_string(schema.field(n).type.value_type)]
            ref_sig = sig[strings[0]] if strings else max(sig.values(), key=list(sig.values()).count)
            candidate = [n for n in lists if sig[n] == ref_sig]
            request_cols = [n for n in request_cols if n not in candidate]
        types = {}
        for fld in schema:
            types[fld.name] = fld.type.value_type if fld.name in candidate else fld.type
        if candidate:
            req = ", ".join(sql_name(n) for n in request_cols)
            unn = ", ".join(f"unnest({sql_name(n)}) AS {sql_name(n)}" for n in candidate)
            view = f"(SELECT __f, __r, {req + ', ' if req else ''}{unn} FROM {src})"
        else:
            view = src
        stats: Dict[str, dict] = {}
        for name, t in types.items():
            x = sql_name(name)
            v = src if name in request_cols else view
            st = stats.setdefault(name, {"signature": sig.get(name) if name not in candidate else None})
            if pa.types.is_integer(t) or pa.types.is_boolean(t):
                row = con.execute(
                    f"SELECT min({x}::BIGINT), max({x}::BIGINT), count(DISTINCT {x}), "
                    f"count(*) FILTER (WHERE {x}::BIGINT NOT IN (0, 1)) FROM {v}"
                ).fetchone()
                st.update(min=row[0], max=row[1], distinct=row[2], binary=row[3] == 0)
            elif pa.types.is_floating(t):
                row = con.execute(f"SELECT min({x}), max({x}) FROM {v} WHERE isfinite({x})").fetchone()
                st.update(min=row[0], max=row[1])
            elif pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_dictionary(t):
                vals = [
                    r[0]
                    for r in con.execute(
                        f"SELECT DISTINCT {x}::VARCHAR FROM {v} WHERE {x} IS NOT NULL ORDER BY 1 LIMIT 101"
                    ).fetchall()
                ]
                st.update(values=vals)
            elif is_list_type(t):
                inner = t.value_type
                row = con.execute(f"SELECT min(len({x})), max(len({x})) FROM {v}").fetchone()
                st.update(min_len=row[0], max_len=row[1])
                if pa.types.is_integer(inner):
                    row = con.execute(
                        f"SELECT min(u), max(u), count(DISTINCT u) FROM (SELECT unnest({x}) AS u FROM {v})"
                    ).fetchone()
                    st.update(min=row[0], max=row[1], distinct=row[2])
                elif is_list_type(inner):
                    row = con.execute(
                        f"SELECT min(len(u)), max(len(u)) FROM (SELECT unnest({x}) AS u FROM {v})"
                    ).fetchone()
                    st.update(inner_min=row[0], inner_max=row[1])
        return f0.layout, types, stats, request_cols
    finally:
        con.close()


def _table_for(name: str, st: dict, comments: List[str]) -> dict:
    lo, hi, distinct = st.get("min") or 0, st.get("max") or 0, st.get("distinct") or 1
    if hi + 1 <= MAX_TABLE:
        size, hashed = max(hi + 1, 1), False
        if size > 20 * distinct and size > 10_000:
            comments.append(
                f"{name}: {distinct:,} distinct ids spread over [0, {hi:,}]: sparse ids; a vocabulary would "
                "make the table smaller"
            )
    else:
        size, hashed = min(max(2 ** math.ceil(math.log2(2 * distinct)), 1024), MAX_TABLE), True
        comments.append(f"{name}: ids up to {hi:,}: hashed into {size:,} rows (about 2x the distinct ids)")
    if lo < 0:
        comments.append(f"{name}: negative ids (min {lo}): remap them, the loader refuses them")
    out = {"name": name, "num_embeddings": int(size), "embedding_dim": _table_dim(distinct)}
    if hashed:
        out["hash"] = True
    return out


def _history_design(groups: List[dict], negatives: Optional[str], items: Optional[int]) -> List[str]:
    """Comment lines (indented for the features section) on the history's design: a group that
    carries each event's action is said so; with negative outcomes in the data (``negatives``: a 0/1
    label with both values, or a rating) and no such group, a group of every earlier event with its
    action is proposed, ready to paste (the design ``HISTORY_DOCS`` measures). ``items``: the item
    table's size (the events' item table gets it)."""
    acting = [(g["name"], f["column"]) for g in groups for f in g["features"] if _ACTION.search(f["name"].lower())]
    if acting:
        held = ", ".join(f"{g!r} ({c})" for g, c in acting)
        return [
            f"  # History: {held} carries each event's action, negative feedback included",
            f"  # ({HISTORY_DOCS}).",
        ]
    if negatives is None:
        return []
    length = max((g["max_length"] for g in groups), default=50)
    had = "no history group carries an action" if groups else "there is no history group"
    action = negatives if negatives.startswith("CASE") else f"CASE WHEN {negatives} = 1 THEN 1 ELSE 2 END"
    return [
        f"  # History design ({HISTORY_DOCS}):",
        f"  # the data holds negative outcomes but {had},",
        "  # so the model never sees what a user skipped or disliked. Proposed: a group of every earlier",
        "  # event with its action (1 = positive, 2 = negative); on a real MovieLens-1M time split (a user's",
        "  # report) such a group took the model from 0.759 to 0.789 AUC. Its cost: one more group's events",
        "  # per request. Build it (build.sequences, docs/data_build.md; the SQL reads the contract's names:",
        "  # use your raw log's), then declare it:",
        "  #   features.tables:",
        f"  #     - {{name: action, num_embeddings: 3, embedding_dim: {SEQUENCE_DIM}}}",
        f"  #     - {{name: events_item, num_embeddings: {items or 100_000}, embedding_dim: {SEQUENCE_DIM}}}",
        "  #   features.sequence_groups:",
        "  #     - name: events",
        "  #       timestamp_column: events_ts",
        f"  #       max_length: {length}",
        "  #       features:",
        "  #         - {name: item, column: events_item, table: events_item}",
        "  #         - {name: action, column: events_action, table: action}",
        "  #   build.sequences:",
        "  #     - group: events",
        "  #       path: []  # the impression log itself, every row (no filter: the negatives too)",
        "  #       user: user_id",
        "  #       time: timestamp",
        f"  #       columns: {{events_item: item_id, events_action: {_flow(action)}}}",
    ]


def draft_config(data: str) -> str:
    """A starting config (a ``features:`` section and ``data.train_dir``) guessed from the Parquet
    schema and statistics of ``data``; comments mark each guess."""
    files = open_files(data, None)
    kind, types, stats, request_cols = _draft_stats(files)
    guesses: List[str] = []
    names = list(types)
    used = set()

    def pick(cands: List[str]) -> Optional[str]:
        for n in cands:
            if n not in used:
                used.add(n)
                return n
        return None

    ints = [n for n in names if pa.types.is_integer(types[n])]
    floats = [n for n in names if pa.types.is_floating(types[n])]
    strings = [n for n in names if "values" in stats[n]]
    request_id = pick([n for n in ints if "request" in n.lower()])
    timestamp = pick(
        [n for n in ints + floats if n.lower() == "timestamp"] + [n for n in ints + floats if _TIME.search(n.lower())]
    )
    surface = pick(strings)
    if request_id is None:
        guesses.append("no request id column found (an integer column named *request*): add one")
    if timestamp is None:
        guesses.append("no timestamp column found (a number named timestamp/ts/time): add one")
    surfaces = stats[surface]["values"][:100] if surface else ["default"]
    if surface is None:
        guesses.append("no surface column (a string column) found: add one")
    elif len(stats[surface]["values"]) > 100:
        guesses.append(f"surface {surface!r} has more than 100 values: the first 100 are listed")

    # Sequence groups: list<int> columns of equal lengths on every row, around a timestamp list.
    seq_lists = [
        n
        for n in names
        if n in request_cols
        and is_list_type(types[n])
        and stats[n].get("signature") is not None
        and (pa.types.is_integer(types[n].value_type) or is_list_type(types[n].value_type))
    ]
    ts_lists = [n for n in seq_lists if pa.types.is_integer(types[n].value_type) and _TIME.search(n.lower())]
    groups: List[dict] = []
    members: Dict[str, List[str]] = {ts: [] for ts in ts_lists}
    for n in seq_lists:
        if n in ts_lists:
            continue
        same = [ts for ts in ts_lists if stats[ts]["signature"] == stats[n]["signature"]]
        if same:
            best = max(same, key=lambda ts: len(os.path.commonprefix([ts, n])))
            members[best].append(n)
    tables, sparse, dense, tasks = [], [], [], []
    comments: List[str] = []
    for ts, cols in members.items():
        id_cols = [c for c in cols if pa.types.is_integer(types[c].value_type)]
        if not id_cols:
            continue
        emb = [c for c in cols if is_list_type(types[c].value_type)]
        base = re.sub(r"(^|_)(ts|time|times|timestamp|timestamps|time_ms)$", "", ts) or ts
        gname = re.sub(r"^seq_", "", base) or base
        feats = []
        for c in id_cols:
            fname = c[len(base) :].lstrip("_") if c.startswith(base) and len(c) > len(base) else c
            t = _table_for(c, stats[c], comments)
            t["embedding_dim"] = SEQUENCE_DIM
            tables.append(t)
            feats.append({"name": fname, "column": c, "table": c})
            used.add(c)
        g = {"name": gname, "timestamp_column": ts, "max_length": max(int(stats[ts].get("max_len") or 1), 1)}
        if emb and stats[emb[0]].get("inner_min") == stats[emb[0]].get("inner_max") and stats[emb[0]].get("inner_max"):
            g["embedding_column"], g["embedding_dim"] = emb[0], int(stats[emb[0]]["inner_max"])
            used.add(emb[0])
        g["features"] = feats
        used.add(ts)
        groups.append(g)
    label_names = []
    for n in ints:
        if n in used:
            continue
        st = stats[n]
        if st.get("binary") and (types[n] != pa.int64() or _LABEL.search(n.lower())):
            tasks.append({"name": n, "label_column": n})
            label_names.append(n)
            used.add(n)
    for n in floats:
        if n in used or not (stats[n].get("min") is not None and 0 <= stats[n]["min"] and stats[n]["max"] <= 1):
            continue
        match = [
            t
            for t in tasks
            if n != t["label_column"]
            and n.endswith(t["label_column"])
            and _PROB.search(n[: -len(t["label_column"])].lower())
        ]
        if match:
            best = max(match, key=lambda t: len(t["label_column"]))
            if "true_probability_column" not in best:
                best["true_probability_column"] = n
                used.add(n)
    rating = next(
        (
            n
            for n in ints
            if n not in used and _RATING.search(n.lower()) and 0 <= (stats[n].get("min") or 0) <= stats[n]["max"] <= 10
        ),
        None,
    )
    if rating is not None:
        st = stats[rating]
        guesses.append(
            f"{rating}: a rating ({st['min']}..{st['max']}), the impression's outcome: left out of the features "
            f"(it would leak the label); build a 0/1 label from it (e.g. like: {rating} >= 4) and a history of "
            f"the earlier ratings with their action ({HISTORY_DOCS})"
        )
        used.add(rating)
    if not tasks:
        guesses.append("no 0/1 label column found: add a task")
        tasks.append({"name": "click", "label_column": "click"})
    sequence_tables = {t["name"] for t in tables}
    both = [t["label_column"] for t in tasks if stats.get(t["label_column"], {}).get("min") == 0]
    if rating is not None:
        negatives: Optional[str] = f"CASE WHEN {rating} >= 4 THEN 1 ELSE 2 END"
    else:
        negatives = next((n for n in both if stats[n].get("max") == 1), None)

    def id_feature(n: str) -> None:
        """A sparse feature of column ``n`` on a table of its own (renamed off a sequence table's name)."""
        t = _table_for(n, stats[n], comments)
        if t["name"] in sequence_tables:
            t["name"] = n + "_ids"
        tables.append(t)
        entry = {"name": n, "column": n, "table": t["name"]}
        if kind == PER_REQUEST and n in request_cols:
            entry["user_side"] = True
        sparse.append(entry)
        used.add(n)

    for n in ints:
        if n in used:
            continue
        id_feature(n)
        if stats[n].get("binary"):
            comments.append(f"{n}: only 0/1 values: a label? (kept as an id feature)")
    for n in names:  # multi-hot ids: list<int> columns in no sequence group
        if n in used or not (is_list_type(types[n]) and pa.types.is_integer(types[n].value_type)):
            continue
        id_feature(n)
        comments.append(f"{n}: a list of ids in no sequence group: a multi-hot feature (sum pooling)")
    for n in names:
        if n in used:
            continue
        t, st = types[n], stats[n]
        if pa.types.is_floating(t):
            dense.append({"name": n, "column": n})
            if st.get("min") is not None and st["min"] >= 0 and st["max"] > 100:
                dense[-1]["norm"] = "log"
                comments.append(f"{n}: values in [{st['min']:.4g}, {st['max']:.4g}]: log-normalized")
            used.add(n)
        elif is_list_type(t) and pa.types.is_floating(t.value_type):
            if st.get("min_len") == st.get("max_len") and st.get("max_len"):
                dense.append({"name": n, "column": n, "dim": int(st["max_len"]), "norm": "layer_norm"})
                used.add(n)
            else:
                comments.append(
                    f"{n}: float lists of varying lengths ({st.get('min_len')}..{st.get('max_len')}): left out"
                )
    left = [n for n in names if n not in used and n not in (request_id, timestamp, surface)]
    if left:
        guesses.append(f"columns left out: {', '.join(left)}")
    columns = {
        "request_id": request_id or "request_id",
        "user_id": "user_id",
        "item_id": "item_id",
        "surface": surface or "surface",
        "timestamp": timestamp or "timestamp",
    }
    lines = [
        f"# Draft config from the data in {data} ({kind} layout), by python -m pinads_rec.data.inspect.",
        "# Every choice below is a guess from the Parquet schema and statistics: review it.",
        "# Tables: exact size (max id + 1) where ids fit, hashed otherwise; widths 8/16/32/64 by distinct ids;",
        f"# sequence tables share one width ({SEQUENCE_DIM}); max_length = the longest sequence seen.",
        "# Labels: integer 0/1 columns of a narrow type or a label-like name. user_side: request-level columns.",
    ]
    lines += [f"# Guess: {g}" for g in guesses + comments]
    lines += ["features:", f"  columns: {_flow(columns)}", f"  surfaces: {_flow(surfaces)}", "  tasks:"]
    lines += [f"    - {_flow(t)}" for t in tasks]
    for key, items in (("tables", tables), ("sparse", sparse), ("dense", dense)):
        lines.append(f"  {key}:" + ("" if items else " []"))
        lines += [f"    - {_flow(x)}" for x in items]
    item_table = next((x["table"] for x in sparse if x["column"] == columns["item_id"]), None)
    items = next((t["num_embeddings"] for t in tables if t["name"] == item_table), None)
    lines += _history_design(groups, negatives, items)
    lines.append("  sequence_groups:" + ("" if groups else " []"))
    for g in groups:
        lines.append(f"    - name: {_flow(g['name'])}")
        for k in ("timestamp_column", "max_length", "embedding_column", "embedding_dim"):
            if k in g:
                lines.append(f"      {k}: {_flow(g[k])}")
        lines.append("      features:")
        lines += [f"        - {_flow(f)}" for f in g["features"]]
    lines += [
        "",
        "data:",
        f"  train_dir: {_flow(data)}",
        f"  eval_dir: {_flow(data)}  # point it at your evaluation split",
    ]
    text = "\n".join(lines) + "\n"
    config_lib.from_dict(yaml.safe_load(text))  # a draft the config loader refuses is a bug here
    return text
