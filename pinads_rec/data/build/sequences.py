"""The sequence groups' steps, as functions over the build (``build``: full_build.Build): each
group's events read (a behaviour log, or the impression log itself) and checked into a table of
their own (user, time, the group's columns), and each request's sequence cut point in time: the
newest ``max_length`` events strictly before (its time - ``min_gap_s``), newest first.
"""

from __future__ import annotations

from pinads_rec.config import SequenceGroupConfig, SequenceSourceConfig
from pinads_rec.data.build.checks import check_binds, check_no_nulls, check_session_names, check_times
from pinads_rec.data.build.config_checks import embedding_columns
from pinads_rec.data.build.impressions import side_join, where_clause
from pinads_rec.data.build.time_sql import seconds
from pinads_rec.data.loader.contract import ContractError
from pinads_rec.data.sql_text import identifier, sql_name


def read_events(build, source: SequenceSourceConfig) -> None:
    """The group's events (filtered, checked) as a table: user, time (seconds), the group's columns."""
    i = build.b.sequences.index(source)
    where = f"build.sequences[{i}]"
    group = next(g for g in build.features.sequence_groups if g.name == source.group)
    name = identifier(group.name)
    if source.path:
        raw = build.raw_source(source, where)
        scan = f"(SELECT *, filename AS __file FROM {build.scan(raw)})"
        if source.side_tables:  # the events' own keys into the side tables (as of their own date)
            plain = f"__events_raw_{name}"
            build.engine.execute(f"CREATE TEMP VIEW {plain} AS SELECT * FROM {scan}")
            t = seconds(build, source.time, plain, f"{where}.time", raw)
            joins, structs = [], []
            for side, key in source.side_tables.items():
                join, struct = side_join(build, side, key, t)
                joins.append(join)
                structs.append(struct)
            scan = f"(SELECT {plain}.*, {', '.join(structs)} FROM {plain} {' '.join(joins)})"
    else:  # the impression log is the event log (KuaiRand: earlier clicks are the history)
        raw, scan = build.imp_source, "impressions_joined"
    view = f"__events_{name}"
    try:
        build.engine.execute(f"CREATE TEMP VIEW {view} AS SELECT * FROM {scan}{where_clause(source.filter)}")
    except build.engine.errors:
        check_binds(build, scan, {f"{where}.filter": source.filter}, raw)
        raise
    read = {f"{where}.filter": source.filter, f"{where}.user": source.user, f"{where}.time": source.time}
    read.update({f"{where}.columns.{c}": e for c, e in source.columns.items()})
    check_session_names(build, scan, read, raw)
    t = seconds(build, source.time, view, f"{where}.time", raw)
    ids = [f.column for f in group.features]
    cols = ids + embedding_columns(group)
    exprs = []
    for c in cols:
        expr = source.columns[c]
        if c == group.embedding_column:
            expr = f"CAST(({expr}) AS FLOAT[{group.embedding_dim}])"
        exprs.append(f"({expr}) AS {sql_name(c)}")
    user_type = build.scalar("SELECT typeof(__user) FROM imp LIMIT 1")
    events = f"ev_{name}"
    try:
        build.sql(
            f"reading the events of sequence group {group.name!r}",
            f"""CREATE TEMP TABLE {events} AS
            SELECT TRY_CAST(({source.user}) AS {user_type}) AS __user, ({source.user}) IS NULL AS __no_user,
                   {t} AS __t, __file, {", ".join(exprs)}
            FROM {view}""",
        )
    except ContractError:
        named = {f"{where}.columns.{c}": source.columns[c] for c in cols}
        check_binds(build, view, {f"{where}.user": source.user, **named}, raw)
        raise
    no_user = build.scalar(f"SELECT count(*) FROM {events} WHERE __no_user")
    if no_user and source.missing_user == "error":
        path = build.scalar(f"SELECT any_value(__file) FROM {events} WHERE __no_user")
        first = raw.place(path, f"({source.user}) IS NULL", reads=source.user)
        raise ContractError(
            f"{where}.user: {no_user} event(s) without a user, first at {first}; fix the log or set missing_user: drop"
        )
    build.counts[f"sequence group {group.name}: events without a user (dropped)"] = no_user
    build.engine.execute(f"DELETE FROM {events} WHERE __no_user")
    check_times(build, events, "__t", raw, t, f"{where}.time")
    check_no_nulls(build, events, cols, f"{where}.columns", raw, source.columns)
    for f in group.features:
        c = f.column
        vocabulary = any(v.table == f.table for v in build.b.vocabularies)
        if vocabulary:
            continue
        if f.multi_valued and not build.column_type(events, c).endswith("[]"):
            raise ContractError(
                f"{where}.columns.{c}: gives {build.column_type(events, c)} values; feature {f.name!r} is "
                f"multi-valued (max_values {f.max_values}): give a list of ids per event (e.g. "
                f"string_split(...) cast to BIGINT[])"
            )
        if not build.is_integer_column(events, c, lists_ok=f.multi_valued):
            what = "a list of integers" if f.multi_valued else "an integer"
            raise ContractError(
                f"{where}.columns.{c}: gives {build.column_type(events, c)} values; a sequence id must be "
                f"{what} (map it, or declare a vocabulary for table {f.table!r})"
            )
    build.prune_events(events)
    for f in group.features:
        if f.multi_valued:  # a counted repair, as the loader's overlong_sequence: truncate does
            col = sql_name(f.column)
            over = build.scalar(f"SELECT count(*) FROM {events} WHERE array_length({col}) > {f.max_values}")
            if over:
                build.counts[
                    f"sequence group {group.name} feature {f.name}: bags cut to their first {f.max_values} ids"
                ] = over
                build.engine.execute(
                    f"UPDATE {events} SET {col} = list_slice({col}, 1, {f.max_values}) "
                    f"WHERE array_length({col}) > {f.max_values}"
                )
    build.group_sources[group.name] = (events, source, group)


def keep_users_built(build, events: str) -> None:
    """Every event may precede a request (a day build keeps those that can: days.py), unless
    build.impressions.event_users: built keeps only the users with a request built (what the
    impressions' filter, the splits and the drops left; the others' events counted): a filter
    that samples users then samples the event logs, and the vocabularies fitted on them, too."""
    if build.b.impressions.event_users != "built":
        return
    group = next(g.name for g in build.features.sequence_groups if events == f"ev_{identifier(g.name)}")
    before = build.scalar(f"SELECT count(*) FROM {events}")
    build.sql(
        f"keeping the events of the users built (sequence group {group!r})",
        f"CREATE OR REPLACE TEMP TABLE {events} AS SELECT * FROM {events} WHERE __user IN (SELECT __user FROM req)",
    )
    dropped = before - build.scalar(f"SELECT count(*) FROM {events}")
    build.counts[f"sequence group {group}: events of users with no request built (dropped)"] = dropped


def cut_sequences(build, events: str, source: SequenceSourceConfig, group: SequenceGroupConfig) -> None:
    """``__seq_<group>``: per request, the newest max_length events strictly before (request
    time - min_gap_s), newest first, as the group's list columns."""
    name = identifier(group.name)
    cols = [f.column for f in group.features] + embedding_columns(group)
    # Requests and events of a user in time order, requests first at equal times: a request's
    # running count of events is the number strictly before it.
    build.sql(
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
    build.sql(
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
    build.sql(
        f"cutting the sequences of group {group.name!r}",
        f"""CREATE TEMP TABLE __seq_{name} AS
        SELECT __r.__req AS __req, {", ".join(lists)} FROM (
            SELECT unnest(list_transform(__requests, lambda r: struct_pack(__req := r.__req, __s := {cut})))
                   AS __r
            FROM __timeline_{name} WHERE array_length(__requests) > 0)""",
    )
