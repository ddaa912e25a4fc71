"""The data contract, one bad input at a time.

Each case reads one tiny train file, spoils one column (or the schema, or the bytes), writes it back
with several row groups and iterates ``ParquetBatches`` over it. The ``ContractError`` must say
where: the file, the column and -- for the per-row-group checks -- the row group (and row). The
documented repairs (``hash: true``, ``nonfinite_dense: replace``, ``overlong_sequence: truncate``)
are checked on the batch values and on the checker's ``repairs`` counter.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import re
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import DEMO, load_tiny, rows_of, tiny_overrides

from pinads_rec import config
from pinads_rec.data.loader.contract import ContractError
from pinads_rec.data.loader.dataset import LoaderSettings, ParquetBatches, make_loader
from pinads_rec.features import FeatureLayout

RG = 500  # rows per row group of the rewritten files
BAD = 700  # the row we spoil: row group 1, row 200 within it
BAD_RG, BAD_ROW = BAD // RG, BAD % RG
PINS = ["seq_pin_ts", "seq_pin_item", "seq_pin_action", "seq_pin_topic", "seq_pin_emb"]
ALL_GROUPS = {
    "pins": PINS,
    "ads": ["seq_ad_ts", "seq_ad_item", "seq_ad_action", "seq_ad_topic"],
    "queries": ["seq_query_ts", "seq_query_token", "seq_query_topic"],
}
HANG_S = 120.0  # a single case never takes close to this: past it, it is hung


# --------------------------------------------------------------------------------------------
# Fixtures and helpers.
# --------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _no_hang():
    """A hung test dumps every thread's stack and ends the run instead of blocking it forever."""
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="module")
def base(tiny_data):
    """(config, data dir, one tiny train file as a table) -- the file every case spoils."""
    cfg, data_dir = tiny_data
    src = sorted((Path(data_dir) / "train").glob("*.parquet"))[0]
    table = rows_of(pq.read_table(src), cfg.features)
    assert table.num_rows > 2 * RG, "the tiny file must span several row groups"
    return cfg, Path(data_dir), table


def demo_cfg(
    data_dir, tables: Optional[Dict[str, dict]] = None, groups: Optional[Dict[str, dict]] = None, overrides=()
):
    """The tiny config with some tables / sequence groups edited (lists cannot be overridden)."""
    raw = yaml.safe_load(Path(DEMO).read_text())
    for t in raw["features"]["tables"]:
        t.update((tables or {}).get(t["name"], {}))
    for g in raw["features"]["sequence_groups"]:
        g.update((groups or {}).get(g["name"], {}))
    return config.from_dict(raw, tiny_overrides(data_dir) + list(overrides))


def write(tmp_path: Path, table: pa.Table, name: str = "x.parquet", good: Optional[pa.Table] = None):
    """Writes ``table`` (and optionally a good file sorting before it) to a fresh directory."""
    d = tmp_path / "data"
    d.mkdir(parents=True, exist_ok=True)
    if good is not None:
        pq.write_table(good, d / "a_good.parquet", row_group_size=RG)
    path = d / name
    pq.write_table(table, path, row_group_size=RG)
    return d, str(path)


def read_all(cfg, d):
    ds = ParquetBatches(d, LoaderSettings.of(cfg), shuffle=False)
    return ds, list(ds)


def where(path: str, group: Optional[int] = None, column: Optional[str] = None) -> str:
    """Regex for the location prefix of a ContractError message."""
    out = re.escape(path)
    if group is not None:
        out += f", row group {group}"
    if column is not None:
        out += f", column '{column}'"
    return out


def assert_rejected(cfg, d, pattern: str) -> str:
    with pytest.raises(ContractError, match=pattern) as info:
        read_all(cfg, d)
    return str(info.value)


def replace_rows(table: pa.Table, name: str, rows: Dict[int, object], type: Optional[pa.DataType] = None):
    """``table`` with the given rows of column ``name`` replaced (optionally cast to ``type`` first)."""
    col = table[name].combine_chunks()
    if type is not None:
        col = col.cast(type)
    pieces, at = [], 0
    for r in sorted(rows):
        pieces += [col.slice(at, r - at), pa.array([rows[r]], type=col.type)]
        at = r + 1
    pieces.append(col.slice(at))
    return table.set_column(table.schema.get_field_index(name), name, pa.concat_arrays(pieces))


def with_column(table: pa.Table, name: str, array) -> pa.Table:
    return table.set_column(table.schema.get_field_index(name), name, array)


def a_request(table: pa.Table, lo: int = BAD, hi: int = 2 * RG, min_rows: int = 2):
    """(start, stop) rows of a request inside [lo, hi) with several rows and a non-empty pins sequence."""
    rid = table["request_id"].to_numpy()
    starts = np.flatnonzero(np.r_[True, rid[1:] != rid[:-1]])
    stops = np.r_[starts[1:], len(rid)]
    for a, b in zip(starts, stops):
        if a >= lo and b <= hi and b - a >= min_rows and len(table["seq_pin_item"][int(a)]) > 0:
            return int(a), int(b)
    raise AssertionError("no suitable request in the tiny file")


def a_row(table: pa.Table, column: str, min_len: int = 1, lo: int = BAD, anywhere: bool = False) -> int:
    """A row in [lo, end of lo's row group) -- or [lo, end of table) -- whose list in ``column`` has at
    least min_len values."""
    hi = table.num_rows if anywhere else (lo // RG + 1) * RG
    lengths = np.array([len(v) for v in table[column].slice(lo, hi - lo).to_pylist()])
    return lo + int(np.flatnonzero(lengths >= min_len)[0])


def lists(jt) -> List[list]:
    """A JaggedTensor as a list of python lists."""
    values, out, at = jt.values().tolist(), [], 0
    for n in jt.lengths().tolist():
        out.append(values[at : at + n])
        at += n
    return out


def slot_of(batches, row: int):
    """(batch, slot, event offset in 'pins') of file row ``row`` (shuffle=False keeps file order)."""
    B = batches[0].batch_size
    b = batches[row // B]
    slot = int(b.request_index[row % B])
    offset = int(b.sequences["pins.item"].lengths()[:slot].sum())
    return b, slot, offset


def assert_file_order(batches, table: pa.Table) -> None:
    """The helpers above rely on shuffle=False yielding the rows in file order."""
    got = np.concatenate([b.dense[b.valid, 0].numpy() for b in batches])
    np.testing.assert_array_equal(got, table["user_activity"].to_numpy())


# --------------------------------------------------------------------------------------------
# Control: the untouched file passes, with no repairs.
# --------------------------------------------------------------------------------------------


def test_untouched_file_loads(base, tmp_path):
    cfg, _, table = base
    d, _ = write(tmp_path, table)
    ds, batches = read_all(cfg, d)
    assert sum(int(b.valid.sum()) for b in batches) == table.num_rows
    assert not ds.reader.checker.repairs
    assert_file_order(batches, table)


# --------------------------------------------------------------------------------------------
# Schema: checked when the file is opened; the message names the file and the column.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "column",
    [
        "request_id",
        "surface",
        "timestamp",
        "item_id",
        "query_tokens",
        "user_activity",
        "item_embedding",
        "seq_pin_item",
        "seq_pin_ts",
        "seq_pin_emb",
        "click",
        "true_p_click",
    ],
)
def test_missing_column(base, tmp_path, column):
    cfg, _, table = base
    d, path = write(tmp_path, table.drop_columns([column]), name="b_bad.parquet", good=table)
    assert_rejected(cfg, d, where(path) + f": missing column '{column}'")


WRONG_TYPES = {
    "item_id as string": ("item_id", pa.string()),
    "advertiser_id as float": ("advertiser_id", pa.float64()),
    "query_tokens as list<string>": ("query_tokens", pa.list_(pa.string())),
    "dense as string": ("user_activity", pa.string()),
    "dense vector as list<string>": ("item_embedding", pa.list_(pa.string(), 32)),
    "sequence as list<string>": ("seq_pin_item", pa.list_(pa.string())),
    "sequence timestamps as list<double>": ("seq_ad_ts", pa.list_(pa.float64())),
    "sequence embedding as flat list<float>": ("seq_pin_emb", None),
    "label as string": ("click", pa.string()),
    "request id as double": ("request_id", pa.float64()),
    "surface as float": ("surface", None),
}


@pytest.mark.parametrize("case", list(WRONG_TYPES))
def test_wrong_dtype(base, tmp_path, case):
    cfg, _, table = base
    column, new_type = WRONG_TYPES[case]
    if column == "seq_pin_emb":  # drop the per-event vector level: list<float>
        outer = table[column].combine_chunks()
        array = pa.ListArray.from_arrays(outer.offsets, pa.array(np.zeros(len(outer.values), np.float32)))
    elif column == "surface":
        array = pa.array(np.zeros(table.num_rows, np.float64))
    else:
        array = table[column].cast(new_type)
    d, path = write(tmp_path, with_column(table, column, array), name="b_bad.parquet", good=table)
    msg = assert_rejected(cfg, d, where(path) + f": column '{column}' has type")
    assert "expected" in msg


# --------------------------------------------------------------------------------------------
# Ids: negative, beyond the table (error), beyond the table with hash: true (hashed).
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("column", ["item_id", "query_tokens", "seq_pin_item", "seq_query_topic"])
def test_negative_id(base, tmp_path, column):
    cfg, _, table = base
    if pa.types.is_list(table.schema.field(column).type):
        row = a_row(table, column)
        values = table[column][row].as_py()
        values[0] = -3
        bad = replace_rows(table, column, {row: values})
    else:
        bad = replace_rows(table, column, {BAD: -3})
    d, path = write(tmp_path, bad)
    assert_rejected(cfg, d, where(path, BAD_RG, column) + ": negative id -3")


@pytest.mark.parametrize(
    "column,size",
    [("ad_type", 2), ("advertiser_id", 2000), ("query_tokens", 1024), ("seq_pin_action", 8), ("seq_ad_topic", 33)],
)
def test_id_beyond_table_without_hash(base, tmp_path, column, size):
    cfg, _, table = base
    if pa.types.is_list(table.schema.field(column).type):
        row = a_row(table, column)
        values = table[column][row].as_py()
        values[-1] = size + 5
        bad = replace_rows(table, column, {row: values})
    else:
        bad = replace_rows(table, column, {BAD: size + 5})
    d, path = write(tmp_path, bad)
    msg = assert_rejected(cfg, d, where(path, BAD_RG, column) + f": id {size + 5} is beyond its table's size {size}")
    assert "hash: true" in msg


def test_id_beyond_table_with_hash_sparse(base, tmp_path):
    """ad_type's table has 2 rows: every id is written as id + 2k; the batch gets id + 2k mod 2."""
    _, data_dir, table = base
    cfg = demo_cfg(data_dir, tables={"ad_type": {"hash": True}, "query_token": {"hash": True}})
    original = table["ad_type"].to_numpy()
    written = original + 2 * (np.arange(table.num_rows) % 7)
    tokens = table["query_tokens"].combine_chunks()
    big_tokens = pa.ListArray.from_arrays(tokens.offsets, pa.array(tokens.values.to_numpy() + 3 * 1024))
    bad = with_column(with_column(table, "ad_type", pa.array(written)), "query_tokens", big_tokens)
    assert written.max() >= 2
    d, _ = write(tmp_path, bad)
    ds, batches = read_all(cfg, d)
    assert_file_order(batches, table)
    got = np.concatenate([b.sparse["ad_type"].values()[: int(b.valid.sum())].numpy() for b in batches])
    np.testing.assert_array_equal(got, written % 2)
    np.testing.assert_array_equal(got, original)
    # query_tokens is user-side: once per request in user_sparse, broadcast to rows by request_index
    got_tokens = [
        lists(b.user_sparse["query_tokens"])[i] for b in batches for i in b.request_index[: int(b.valid.sum())].tolist()
    ]
    assert got_tokens == tokens.to_pylist()  # (x + 3 * 1024) mod 1024 == x
    assert not ds.reader.checker.repairs  # hashing is the table's declared behaviour, not a repair


def test_id_beyond_table_with_hash_sequence(base, tmp_path):
    """seq_action's table has 8 rows: action ids written as id + 8 * 3 come back as id."""
    _, data_dir, table = base
    cfg = demo_cfg(data_dir, tables={"action": {"hash": True}})
    col = table["seq_pin_action"].combine_chunks()
    big = pa.ListArray.from_arrays(col.offsets, pa.array(col.values.to_numpy() + 24))
    d, _ = write(tmp_path, with_column(table, "seq_pin_action", big))
    _, batches = read_all(cfg, d)
    assert_file_order(batches, table)
    original = col.to_pylist()
    B = batches[0].batch_size
    for k, b in enumerate(batches):
        ri = b.request_index.numpy()
        firsts = np.flatnonzero(np.r_[True, ri[1:] != ri[:-1]])
        seqs = lists(b.sequences["pins.action"])
        for u, p in enumerate(firsts):
            if p < int(b.valid.sum()):
                assert seqs[u] == original[k * B + p]


# --------------------------------------------------------------------------------------------
# Dense: NaN / inf -- error, or replaced by 0.0 and counted.
# --------------------------------------------------------------------------------------------

NONFINITE = [float("nan"), float("inf"), float("-inf")]


def _spoil_dense(table: pa.Table, column: str, value: float):
    """(table, dense column index) with one value of ``column`` at row BAD set to ``value``."""
    if column == "item_embedding":
        vec = table[column][BAD].as_py()
        vec[3] = value
        return replace_rows(table, column, {BAD: vec}), 2 + 3
    return replace_rows(table, column, {BAD: value}), {"user_activity": 0, "item_ctr_prior": 1}[column]


@pytest.mark.parametrize("value", NONFINITE, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("column", ["user_activity", "item_embedding"])
def test_nonfinite_dense_error(base, tmp_path, column, value):
    _, data_dir, table = base
    cfg = load_tiny(data_dir, ["data.nonfinite_dense=error"])
    bad, _ = _spoil_dense(table, column, value)
    d, path = write(tmp_path, bad)
    msg = assert_rejected(cfg, d, where(path, BAD_RG, column) + ": non-finite value")
    assert "nonfinite_dense" in msg  # says how to opt into the repair


@pytest.mark.parametrize("value", NONFINITE, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("column", ["user_activity", "item_embedding"])
def test_nonfinite_dense_replace(base, tmp_path, column, value):
    _, data_dir, table = base
    cfg = load_tiny(data_dir, ["data.nonfinite_dense=replace"])
    bad, j = _spoil_dense(table, column, value)
    d, _ = write(tmp_path, bad)
    ds, batches = read_all(cfg, d)
    B = batches[0].batch_size
    dense = batches[BAD // B].dense
    assert dense[BAD % B, j].item() == 0.0
    assert bool(np.isfinite(np.concatenate([b.dense.numpy() for b in batches])).all())
    # Everything else is untouched.
    clean, _ = read_all(cfg, write(tmp_path / "clean", table)[0])
    for got, want in zip(batches, clean):
        mask = np.ones(tuple(got.dense.shape), bool)
        if got is batches[BAD // B]:
            mask[BAD % B, j] = False
        np.testing.assert_array_equal(got.dense.numpy()[mask], want.dense.numpy()[mask])
    assert dict(ds.reader.checker.repairs) == {f"{column}: non-finite replaced by 0": 1}


# --------------------------------------------------------------------------------------------
# Sequences: ragged groups, overlong sequences (error or truncate to the newest), empty ones.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "group,column",
    [("pins", "seq_pin_action"), ("pins", "seq_pin_emb"), ("ads", "seq_ad_item"), ("queries", "seq_query_topic")],
)
def test_ragged_sequence_group(base, tmp_path, group, column):
    cfg, _, table = base
    row = a_row(table, column)
    values = table[column][row].as_py()
    bad = replace_rows(table, column, {row: values[:-1]})
    d, path = write(tmp_path, bad)
    msg = assert_rejected(
        cfg,
        d,
        where(path, BAD_RG) + f": ragged sequence group '{group}' at row {row - RG}: "
        f"column '{column}' has {len(values) - 1} events",
    )
    assert f"has {len(values)}" in msg


def test_sequence_embedding_of_wrong_width(base, tmp_path):
    cfg, _, table = base
    row = a_row(table, "seq_pin_emb")
    events = table["seq_pin_emb"][row].as_py()
    col = table["seq_pin_emb"].combine_chunks()
    narrow = pa.list_(pa.list_(pa.float32()))
    width = cfg.features.sequence_groups[0].embedding_dim
    bad = replace_rows(table, "seq_pin_emb", {row: [e[: width // 2] for e in events]}, type=narrow)
    d, path = write(tmp_path, bad)
    assert col.type != narrow
    assert_rejected(
        cfg, d, where(path, BAD_RG, "seq_pin_emb") + f": event embeddings of width {width // 2}, config says {width}"
    )


LONG = 120  # events written for one request; the pins group keeps max_length = 100


def _overlong(table: pa.Table):
    """One request of row group 1 gets LONG pins events: ids 1000.., one every 10 s, embeddings j."""
    a, b = a_request(table)
    t0 = int(table["timestamp"][a].as_py())
    j = np.arange(LONG)
    new = {
        "seq_pin_item": (1000 + j).tolist(),
        "seq_pin_ts": (t0 - 10 * (j + 1)).tolist(),
        "seq_pin_action": (j % 8).tolist(),
        "seq_pin_topic": (j % 33).tolist(),
        "seq_pin_emb": [[float(x)] * len(table["seq_pin_emb"][a].as_py()[0]) for x in j],
    }
    for name, value in new.items():
        table = replace_rows(table, name, {r: value for r in range(a, b)})
    return table, a, b, new


def test_overlong_sequence_error(base, tmp_path):
    _, data_dir, table = base
    cfg = load_tiny(data_dir, ["data.overlong_sequence=error"])
    bad, a, _, _ = _overlong(table)
    d, path = write(tmp_path, bad)
    assert_rejected(
        cfg,
        d,
        where(path, BAD_RG) + r", column 'seq_pin_\w+': "
        f"row {a - RG} has a sequence of {LONG} events, more than the group's max_length 100",
    )


def test_overlong_sequence_truncate_keeps_newest(base, tmp_path):
    _, data_dir, table = base
    cfg = load_tiny(data_dir, ["data.overlong_sequence=truncate"])
    bad, a, b, new = _overlong(table)
    d, _ = write(tmp_path, bad)
    ds, batches = read_all(cfg, d)
    assert_file_order(batches, table)
    for row in (a, b - 1):  # first and last row of the request (it may straddle a batch boundary)
        batch, slot, at = slot_of(batches, row)
        for key, column in [
            ("pins.item", "seq_pin_item"),
            ("pins.action", "seq_pin_action"),
            ("pins.topic", "seq_pin_topic"),
        ]:
            assert lists(batch.sequences[key])[slot] == new[column][:100]  # the head = the newest
        t0 = float(table["timestamp"][a].as_py())
        deltas = batch.sequence_time_deltas["pins"][at : at + 100].numpy()
        np.testing.assert_allclose(deltas, t0 - np.asarray(new["seq_pin_ts"][:100], np.float64))
        emb = batch.sequence_embeddings["pins"][at : at + 100].numpy()
        np.testing.assert_array_equal(emb[:, 0], np.arange(100, dtype=np.float32))
    for bt in batches:
        assert int(bt.sequences["pins.item"].lengths().max()) <= 100
    assert ds.reader.checker.repairs["sequence group pins: truncated to newest 100"] > 0
    assert set(ds.reader.checker.repairs) == {"sequence group pins: truncated to newest 100"}


def test_overlong_sequence_truncate_counted_once(base, tmp_path):
    _, data_dir, table = base
    cfg = load_tiny(data_dir, ["data.overlong_sequence=truncate"])
    bad, a, b, _ = _overlong(table)
    d, _ = write(tmp_path, bad)
    ds, _ = read_all(cfg, d)
    # One truncated sequence per row of the request (sequences are stored per row).
    assert ds.reader.checker.repairs["sequence group pins: truncated to newest 100"] == b - a


def test_empty_sequences_are_fine(base, tmp_path):
    cfg, _, table = base
    a, b = a_request(table)
    bad = table
    for columns in ALL_GROUPS.values():
        for name in columns:
            bad = replace_rows(bad, name, {r: [] for r in range(a, b)})
    d, _ = write(tmp_path, bad)
    ds, batches = read_all(cfg, d)
    assert not ds.reader.checker.repairs
    batch, slot, _ = slot_of(batches, a)
    for key in FeatureLayout.of(cfg.features).event_keys:
        assert int(batch.sequences[key].lengths()[slot]) == 0, key
    for bt in batches:  # events, time deltas and embeddings stay aligned
        for g in cfg.features.sequence_groups:
            n = int(bt.sequences[f"{g.name}.{g.features[0].name}"].lengths().sum())
            assert bt.sequence_time_deltas[g.name].shape[0] == n
            if g.embedding_column:
                assert bt.sequence_embeddings[g.name].shape[0] == n


# --------------------------------------------------------------------------------------------
# Labels, probabilities, surfaces, nulls.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value,as_type",
    [(2, None), (-1, None), (0.5, pa.float64()), (float("nan"), pa.float64())],
    ids=["2", "-1", "0.5", "nan"],
)
def test_label_not_binary(base, tmp_path, value, as_type):
    cfg, _, table = base
    d, path = write(tmp_path, replace_rows(table, "good_click", {BAD: value}, type=as_type))
    assert_rejected(cfg, d, where(path, BAD_RG, "good_click") + f": label .* at row {BAD_ROW} is not 0 or 1")


@pytest.mark.parametrize("value", [1.5, -0.1, float("nan")], ids=["1.5", "-0.1", "nan"])
def test_probability_outside_unit_interval(base, tmp_path, value):
    cfg, _, table = base
    d, path = write(tmp_path, replace_rows(table, "true_p_save", {BAD: value}))
    assert_rejected(
        cfg, d, where(path, BAD_RG, "true_p_save") + f": probability .* at row {BAD_ROW} is outside \\[0, 1\\]"
    )


@pytest.mark.parametrize("encoding", ["string", "dictionary", "index"])
def test_unknown_surface(base, tmp_path, encoding):
    cfg, _, table = base
    if encoding == "index":  # an integer surface index beyond features.surfaces
        index = {"home_feed": 0, "related_pins": 1, "search": 2}
        idx = np.array([index[s] for s in table["surface"].to_pylist()])
        idx[BAD] = 3
        bad, shown = with_column(table, "surface", pa.array(idx)), "3"
    else:
        bad, shown = replace_rows(table, "surface", {BAD: "pinterest_tv"}), "'pinterest_tv'"
        if encoding == "dictionary":
            bad = with_column(bad, "surface", bad["surface"].dictionary_encode())
    d, path = write(tmp_path, bad)
    assert_rejected(cfg, d, where(path, BAD_RG, "surface") + f": unknown surface {shown} at row {BAD_ROW}")


def test_known_surfaces_as_dictionary_and_index_load(base, tmp_path):
    cfg, _, table = base
    want = None
    for enc in ["dictionary", "index"]:
        if enc == "dictionary":
            t = with_column(table, "surface", table["surface"].dictionary_encode())
        else:
            index = {s: j for j, s in enumerate(cfg.features.surfaces)}
            t = with_column(table, "surface", pa.array([index[s] for s in table["surface"].to_pylist()]))
        _, batches = read_all(cfg, write(tmp_path / enc, t)[0])
        got = np.concatenate([b.surface[b.valid].numpy() for b in batches])
        if want is not None:
            np.testing.assert_array_equal(got, want)
        want = got


@pytest.mark.parametrize("column", ["item_id", "user_id", "user_activity", "click", "surface", "seq_pin_item"])
def test_null_value(base, tmp_path, column):
    cfg, _, table = base
    d, path = write(tmp_path, replace_rows(table, column, {BAD: None}))
    assert_rejected(cfg, d, where(path, BAD_RG, column) + f": null value at row {BAD_ROW}")


@pytest.mark.parametrize("column", ["seq_pin_item", "query_tokens", "seq_ad_ts", "seq_pin_emb"])
def test_null_inside_id_list(base, tmp_path, column):
    cfg, _, table = base
    row = a_row(table, column, min_len=2, lo=RG, anywhere=True)  # query_tokens are mostly empty
    values = table[column][row].as_py()
    values[1] = None  # an element (for seq_pin_emb: a whole event vector) inside the list
    d, path = write(tmp_path, replace_rows(table, column, {row: values}))
    assert_rejected(cfg, d, where(path, row // RG, column) + ": null")


# --------------------------------------------------------------------------------------------
# Files and directories that are not data.
# --------------------------------------------------------------------------------------------


def _bytes_case(table: pa.Table, path: Path, case: str) -> None:
    if case == "empty file":
        path.write_bytes(b"")
    elif case == "cut in half":
        pq.write_table(table, path, row_group_size=RG)
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif case == "csv text":
        path.write_text("request_id,item_id,click\n1,10,0\n1,11,1\n2,12,0\n")
    elif case == "only the magic bytes":
        path.write_bytes(b"PAR1PAR1")


@pytest.mark.parametrize("case", ["empty file", "cut in half", "csv text", "only the magic bytes"])
def test_unreadable_file(base, tmp_path, case):
    cfg, _, table = base
    d = tmp_path / "data"
    d.mkdir()
    pq.write_table(table, d / "a_good.parquet", row_group_size=RG)
    path = d / "x.parquet"
    _bytes_case(table, path, case)
    assert_rejected(cfg, d, where(str(path)) + ": not a readable Parquet file")


@pytest.mark.parametrize("column", ["item_id", "seq_pin_emb", "click"])
def test_corrupt_column_chunk(base, tmp_path, column):
    """Footer intact, one column chunk of row group 1 overwritten: fails when that group is read."""
    cfg, _, table = base
    d, path = write(tmp_path, table)
    cc = pq.ParquetFile(path).metadata.row_group(1).column(table.schema.get_field_index(column))
    start = cc.dictionary_page_offset if cc.has_dictionary_page else cc.data_page_offset
    data = bytearray(Path(path).read_bytes())
    data[start : start + cc.total_compressed_size] = b"\xab" * cc.total_compressed_size
    Path(path).write_bytes(bytes(data))
    assert_rejected(cfg, d, where(path, 1) + ": cannot be read")


def test_empty_directory(base, tmp_path):
    cfg, _, _ = base
    (tmp_path / "notes.txt").write_text("no data here\n")
    assert_rejected(cfg, tmp_path, f"data directory {re.escape(str(tmp_path))} holds no .parquet files")


def test_nonexistent_directory(base, tmp_path):
    cfg, _, _ = base
    missing = tmp_path / "does" / "not" / "exist"
    assert_rejected(cfg, missing, f"data directory {re.escape(str(missing))} does not exist")


# --------------------------------------------------------------------------------------------
# Requests must be contiguous within a row group.
# --------------------------------------------------------------------------------------------


def _non_contiguous(table: pa.Table):
    """Moves the first row of a request of row group 1 to the end of that row group."""
    a, b = a_request(table)
    order = np.arange(table.num_rows)
    order = np.concatenate([order[:a], order[a + 1 : 2 * RG], [a], order[2 * RG :]])
    return table.take(pa.array(order))


def test_request_rows_not_contiguous(base, tmp_path):
    cfg, _, table = base
    d, path = write(tmp_path, _non_contiguous(table))
    assert_rejected(cfg, d, where(path, 1, "request_id") + ": .*contiguous")


# --------------------------------------------------------------------------------------------
# Errors cross DataLoader workers; nothing hangs.
# --------------------------------------------------------------------------------------------


@pytest.mark.slow  # its failed worker's shutdown waits 5 s, in whichever test frees the loader
def test_error_in_worker_process_is_raised(base, tmp_path):
    cfg, _, table = base
    d, path = write(tmp_path, replace_rows(table, "item_id", {BAD: -3}))
    with pytest.raises(ContractError, match=where(path, BAD_RG, "item_id") + ": negative id -3"):
        for _ in make_loader(d, LoaderSettings.of(cfg), shuffle=False, num_workers=1):
            pass


# --------------------------------------------------------------------------------------------
# A column may feed several features: checked once, hashed and cut per use.
# --------------------------------------------------------------------------------------------


def shared_cfg(data_dir, pooled_table="query_token"):
    """The tiny config plus a pooled user-side feature and a second sequence group (max_length 5, a
    hashed table of 100 ids) both reading the queries group's columns seq_query_token and seq_query_ts."""
    raw = yaml.safe_load(Path(DEMO).read_text())
    f = raw["features"]
    f["tables"] += [
        {"name": "short_token", "num_embeddings": 100, "embedding_dim": 32, "hash": True},
        {"name": "tiny_token", "num_embeddings": 10, "embedding_dim": 8},
    ]
    f["sparse"].append({"name": "query_history", "column": "seq_query_token", "table": pooled_table, "user_side": True})
    f["sequence_groups"].append(
        {
            "name": "recent_queries",
            "timestamp_column": "seq_query_ts",
            "max_length": 5,
            "features": [{"name": "token", "column": "seq_query_token", "table": "short_token"}],
        }
    )
    return config.from_dict(raw, tiny_overrides(data_dir))


def test_a_column_feeds_a_pooled_feature_and_two_sequence_groups(base, tmp_path):
    from pinads_rec.data.loader.contract import contract_columns

    _, data_dir, table = base
    cfg = shared_cfg(data_dir)
    (tokens,) = [c for c in contract_columns(cfg.features) if c.name == "seq_query_token"]
    assert [u.what for u in tokens.uses] == [
        "sparse feature 'query_history'",
        "sequence group 'queries' feature 'token'",
        "sequence group 'recent_queries' feature 'token'",
    ]
    d, _ = write(tmp_path, table)
    ds, batches = read_all(cfg, d)
    assert_file_order(batches, table)
    want = table["seq_query_token"].to_pylist()
    want_ts = table["seq_query_ts"].to_pylist()
    for k, b in enumerate(batches):
        n = int(b.valid.sum())
        ri = b.request_index.numpy()
        firsts = np.flatnonzero(np.r_[True, ri[1:] != ri[:-1]])
        pooled = lists(b.user_sparse["query_history"])
        full, recent = lists(b.sequences["queries.token"]), lists(b.sequences["recent_queries.token"])
        at = 0
        for u, p in enumerate(firsts):
            if p >= n:
                continue
            row = k * b.batch_size + p
            assert pooled[u] == want[row]  # as read: the pooled table holds 1024 ids, no cut
            assert full[u] == want[row][:50]
            assert recent[u] == [t % 100 for t in want[row][:5]]  # cut to 5, hashed into 100
            deltas = b.sequence_time_deltas["recent_queries"].numpy()[at : at + len(recent[u])]
            rt = float(table["timestamp"][row].as_py())
            np.testing.assert_allclose(deltas, rt - np.asarray(want_ts[row][:5], np.float64))
            at += len(recent[u])
    assert max(t for w in want for t in w) >= 100
    # the group's own cut is the documented repair, counted per row; the other uses see the whole list
    assert dict(ds.reader.checker.repairs) == {
        "sequence group recent_queries: truncated to newest 5": sum(len(w) > 5 for w in want)
    }


def test_a_shared_column_is_checked_against_the_smallest_table_that_does_not_hash(base, tmp_path):
    _, data_dir, table = base
    cfg = shared_cfg(data_dir, pooled_table="tiny_token")
    d, path = write(tmp_path, table)
    assert_rejected(
        cfg,
        d,
        where(path, 0, "seq_query_token") + r": id \d+ is beyond the table size 10 of sparse feature 'query_history'",
    )


def test_a_list_column_as_pooled_ids_and_a_sequence_is_accepted(base):
    """The case from the field: query_tokens both a pooled user-side feature and a sequence group's
    id list (its own timestamps)."""
    from pinads_rec.data.loader.contract import SEQ_ID, contract_columns

    _, data_dir, _ = base
    cfg = demo_cfg(data_dir)
    groups = list(cfg.features.sequence_groups)
    groups[2] = dataclasses.replace(
        groups[2], features=[dataclasses.replace(groups[2].features[0], column="query_tokens")] + groups[2].features[1:]
    )
    features = dataclasses.replace(cfg.features, sequence_groups=groups)
    (col,) = [c for c in contract_columns(features) if c.name == "query_tokens"]
    assert {u.role for u in col.uses} == {"id", SEQ_ID} and col.request_level


@pytest.mark.parametrize(
    "edit,pattern",
    [
        (
            {"dense": {"name": "leak", "column": "click"}},
            "config uses column 'click' as both float \\(dense feature 'leak'\\) and 0/1 label \\(task 'click' label\\)"
            ": a label read as a model input would leak the answer",
        ),
        (
            {"sequence": {"name": "pin_bag", "column": "seq_pin_topic", "table": "topic", "max_values": 4}},
            "config uses column 'seq_pin_topic' as both sequence id list \\(sequence group 'pins' feature 'topic'\\) "
            "and sequence id bag list \\(sequence group 'pins' feature 'pin_bag'\\): one needs list<int64>, the other "
            "list<list<int64>>",
        ),
        (
            {"dense": {"name": "when", "column": "seq_pin_emb", "dim": 8}},
            "config uses column 'seq_pin_emb' as both .*: a dense vector column feeds dense vectors of one width only",
        ),
    ],
    ids=["label-as-dense", "id-list-as-bags", "embedding-as-dense"],
)
def test_incompatible_uses_of_a_column_are_refused_naming_both(base, edit, pattern):
    from pinads_rec.data.loader.contract import contract_columns

    _, data_dir, _ = base
    raw = yaml.safe_load(Path(DEMO).read_text())
    if "dense" in edit:
        raw["features"]["dense"].append(edit["dense"])
    else:
        raw["features"]["sequence_groups"][0]["features"].append(edit["sequence"])
    cfg = config.from_dict(raw, tiny_overrides(data_dir))
    with pytest.raises(ContractError, match=pattern):
        contract_columns(cfg.features)
