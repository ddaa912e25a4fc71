"""The report: a scan's ``Report`` as text tables (``format_report``, what the command prints) and
as JSON (``report_json``, what ``--json`` writes)."""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Iterable, Sequence

from pinads_rec.config import FeaturesConfig
from pinads_rec.data.inspect.files import Place
from pinads_rec.data.inspect.scan import Report
from pinads_rec.data.loader.contract import contract_columns
from pinads_rec.text_table import format_table


def report_json(r: Report) -> dict:
    """The report as plain data; each problem's place also as one readable ``where`` string."""
    out = asdict(r)
    for p in out["problems"]:
        if p["place"] is not None:
            p["place"]["where"] = str(Place(**p["place"]))
    return out


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return f"{v:,.4g}" if abs(v) < 1e6 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def text_table(header: Sequence[str], rows: Iterable[Sequence]) -> str:
    """``pinads_rec.text_table.format_table`` of the cells as this report writes values (``_fmt``)."""
    return format_table(header, [[_fmt(v) for v in r] for r in rows])


def format_report(r: Report, features: FeaturesConfig) -> str:
    cpr = r.candidates_per_request
    layouts = ", ".join(f"{k}: {v}" for k, v in sorted(r.layouts.items()))
    out = [
        f"Dataset {r.data}: {r.files} file(s) ({layouts}), {r.rows:,} rows (candidates), {r.requests:,} requests",
    ]
    if cpr.get("n"):
        out.append(
            f"Candidates per request: mean {cpr['mean']:.2f}, p50 {cpr['p50']}, p90 {cpr['p90']}, "
            f"min {cpr['min']}, max {cpr['max']}"
        )
    out.append("")
    if r.problems:
        out.append(f"PROBLEMS: {len(r.problems)} (the loader stops at the first of those marked 'error')")
        out.append(
            text_table(
                ["problem", "column", "count", "first at", "loader", "detail"],
                [
                    [
                        p.kind,
                        p.column,
                        f"{p.count:,} {p.unit if p.count != 1 else p.unit[:-1]}",
                        str(p.place) if p.place else "-",
                        p.loader,
                        p.detail,
                    ]
                    for p in r.problems
                ],
            )
        )
    else:
        out.append("No problem found: the loader reads this data as it is.")
    out.append("")
    for w in r.warnings:
        out.append(f"WARNING: {w}")
    if r.warnings:
        out.append("")
    roles = {c.name: c.role for c in contract_columns(features)}
    id_rows, value_rows = [], []
    for name, st in r.columns.items():
        role = roles.get(name, "item id (duplicates check)")
        if "distinct" in st or "table_size" in st:
            id_rows.append(
                [
                    name,
                    role,
                    st.get("nulls"),
                    st.get("min"),
                    st.get("max"),
                    st.get("distinct"),
                    st.get("table_size"),
                    st.get("hash"),
                ]
            )
        else:
            value_rows.append(
                [name, role, st.get("nulls"), st.get("min"), st.get("max"), st.get("mean", st.get("rate"))]
            )
    if id_rows:
        out.append("Id columns (distinct: exact)")
        out.append(text_table(["column", "role", "nulls", "min", "max", "distinct", "table size", "hash"], id_rows))
        out.append("")
    if value_rows:
        out.append("Other columns (min/max/mean of the finite values; a label's mean is its rate)")
        out.append(text_table(["column", "role", "nulls", "min", "max", "mean"], value_rows))
        out.append("")
    if r.sequence_lengths:
        max_len = {g.name: g.max_length for g in features.sequence_groups}
        out.append(f"Sequence lengths (per stored {r.sequence_unit[:-1]}, exact)")
        out.append(
            text_table(
                ["group", "mean", "p50", "p90", "p99", "max", "max_length"],
                [
                    [g, q.get("mean"), q.get("p50"), q.get("p90"), q.get("p99"), q.get("max"), max_len.get(g)]
                    for g, q in r.sequence_lengths.items()
                ],
            )
        )
        out.append("")
    if r.label_rates:
        tasks = [t.name for t in features.tasks]
        out.append("Label rate per surface x task")
        out.append(
            text_table(
                ["surface", "rows"] + tasks,
                [[s, e["rows"]] + [e.get(t) for t in tasks] for s, e in r.label_rates.items()],
            )
        )
        out.append("")
    if r.unknown_ids:
        # The tables with an unknown id in some split, in every split (a training split's 0 shows too).
        some = {
            (t, k)
            for tables in r.unknown_ids.values()
            for t, kinds in tables.items()
            for k, c in kinds.items()
            if c["unknown"]
        }
        rows = [
            [split, table, kind, c["ids"], c["unknown"], f"{c['share']:.1%}"]
            for split, tables in r.unknown_ids.items()
            for table, kinds in tables.items()
            for kind, c in kinds.items()
            if (table, kind) in some
        ]
        out.append(f"Unknown ids per split (id 0: out of the build's vocabulary; {r.unknown_ids_from})")
        out.append(
            text_table(["split", "table", "of", "ids", "unknown", "share"], rows) if rows else "none in any split"
        )
        out.append("")
    for n in r.notes:
        out.append(f"Note: {n}")
    return "\n".join(out).rstrip() + "\n"
