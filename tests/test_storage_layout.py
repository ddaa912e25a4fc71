"""Storage layouts (data/loader/storage_layout.py): per row and per request hold the same data, and the loader gives
the same batches from either -- shuffled or in file order, with the request bound, the row filter,
the calibration holdout, padding, loader workers, two ranks and serving -- while holding a request's
sequences once; per-request files get the contract's checks, errors naming file, row group, column,
row (the request) and candidate."""

from __future__ import annotations

import collections
import dataclasses
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from conftest import load_tiny
from test_loader import _assert_same_batch, _fingerprints

from pinads_rec.data.loader.contract import ContractError
from pinads_rec.data.loader.dataset import LoaderSettings, ParquetBatches, make_loader
from pinads_rec.data.loader.layout_rewrite import rewrite_per_request, rewrite_per_row
from pinads_rec.data.loader.reader import list_files, list_row_groups
from pinads_rec.data.loader.shuffle import ShufflePool, read_requests
from pinads_rec.data.loader.storage_layout import (
    LAYOUT_KEY,
    PER_REQUEST,
    is_per_request,
    request_level_columns,
    to_per_request,
    to_per_row,
)

SEQUENCE_COLUMNS = [
    "seq_pin_ts",
    "seq_pin_item",
    "seq_pin_action",
    "seq_pin_topic",
    "seq_pin_emb",
    "seq_ad_ts",
    "seq_ad_item",
    "seq_ad_action",
    "seq_ad_topic",
    "seq_query_ts",
    "seq_query_token",
    "seq_query_topic",
]


@pytest.fixture(scope="module")
def both(tiny_data, tmp_path_factory):
    """(config, {"per_request": the generator's data, "per_row": the same data rewritten per row})."""
    cfg, data = tiny_data
    out = tmp_path_factory.mktemp("per_row")
    for split in ("train", "eval", "calibration"):
        (out / split).mkdir()
        for path in list_files(f"{data}/{split}"):
            rewrite_per_row(path, str(out / split / Path(path).name), cfg.features)
    return cfg, {"per_row": out, "per_request": Path(data)}


def _settings(cfg, **data):
    return LoaderSettings.of(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **data)))


def _batches(directory, settings, **kw):
    return list(ParquetBatches(str(directory), settings, **kw))


def _same_source(batch):
    """The batch with its source's file names only (the two layouts are in two directories)."""
    return dataclasses.replace(batch, source=re.sub(r"[^;]*/", "", batch.source))


def _assert_same_batches(a, b):
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        _assert_same_batch(_same_source(x), _same_source(y))


# --------------------------------------------------------------------------------------------
# The layouts and their conversions.
# --------------------------------------------------------------------------------------------


def test_demo_request_level_columns(tiny_data):
    cfg, _ = tiny_data
    assert request_level_columns(cfg.features) == ["request_id", "timestamp", "user_id", "query_tokens"] + [
        c for c in SEQUENCE_COLUMNS
    ]


def test_per_row_to_per_request_and_back(both):
    cfg, dirs = both
    table = pq.read_table(list_files(str(dirs["per_row"] / "train"))[0])
    per_request = to_per_request(table, cfg.features)
    requests = len(np.unique(table["request_id"].to_numpy()))
    assert per_request.num_rows == requests and per_request.column_names == table.column_names
    assert per_request.schema.metadata[LAYOUT_KEY] == PER_REQUEST
    assert is_per_request(per_request.schema, cfg.features) and not is_per_request(table.schema, cfg.features)
    assert per_request.schema.field("seq_pin_item").type == table.schema.field("seq_pin_item").type
    assert per_request.schema.field("item_embedding").type == pa.list_(table.schema.field("item_embedding").type)
    assert per_request.schema.field("surface").type == pa.list_(pa.string())
    back = to_per_row(per_request, cfg.features)
    assert back.equals(table.replace_schema_metadata(None)) or back.equals(table)
    with pytest.raises(ValueError, match="not contiguous"):
        to_per_request(table.take(pa.array([0, table.num_rows - 1, 1])), cfg.features)


def test_footers_count_candidates_and_requests(both):
    cfg, dirs = both
    rows = list_row_groups(list_files(str(dirs["per_row"] / "train")), cfg.features)
    reqs = list_row_groups(list_files(str(dirs["per_request"] / "train")), cfg.features)
    assert [(g.index, g.num_rows) for g in rows] == [(g.index, g.num_rows) for g in reqs]
    for g in reqs:
        f = pq.ParquetFile(g.path)
        assert g.num_requests == f.metadata.row_group(g.index).num_rows
        assert g.num_requests < g.num_rows
    assert rows[0].num_requests is None


def test_reader_reads_both_layouts_alike(both):
    cfg, dirs = both
    ds = {k: ParquetBatches(str(d / "train"), LoaderSettings.of(cfg), shuffle=False) for k, d in dirs.items()}
    g_row, g_req = ds["per_row"].row_groups[1], ds["per_request"].row_groups[1]
    a, b = ds["per_row"].reader.read(g_row), ds["per_request"].reader.read(g_req)
    assert a.num_rows == b.num_rows
    for name in a.column_names:
        assert a.column(name).combine_chunks().equals(b.column(name).combine_chunks()), name
    # in memory, the sequences are held once per request, whatever the file's layout
    for k, g in (("per_row", g_row), ("per_request", g_req)):
        block = ds[k].reader.read_requests(g)
        assert block.num_requests == len(np.unique(a["request_id"].to_numpy())) and block.num_rows == a.num_rows
        assert set(SEQUENCE_COLUMNS) <= set(block.request_table.column_names)
        assert not set(SEQUENCE_COLUMNS) & set(block.rows.column_names)


def test_batches_hold_each_requests_sequences_once(both):
    cfg, dirs = both
    ds = ParquetBatches(str(dirs["per_request"] / "train"), LoaderSettings.of(cfg), shuffle=True)
    pool = ShufflePool(ds.batch_size, ds.max_requests, cfg.data.shuffle_buffer_rows, np.random.default_rng(0))
    for rows in pool.batches(read_requests(ds.reader, ds.row_groups)):
        assert rows.requests.request_table.num_rows == rows.requests.num_requests < rows.num_rows
        assert "seq_pin_item" in rows.requests.request_table.column_names


# --------------------------------------------------------------------------------------------
# The same batches from either layout.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "split,shuffle,overrides",
    [
        ("train", True, {}),
        ("train", False, {}),
        ("eval", False, {}),  # the last batch padded
        ("train", True, {"max_unique_users_per_batch": 4}),
        ("train", True, {"shuffle_buffer_rows": 300}),
    ],
    ids=["shuffled", "file-order", "eval-padded", "request-bound", "small-buffer"],
)
def test_same_batches_from_either_layout(both, split, shuffle, overrides):
    cfg, dirs = both
    settings = _settings(cfg, **overrides)
    got = {k: _batches(d / split, settings, shuffle=shuffle, drop_last=False) for k, d in dirs.items()}
    _assert_same_batches(got["per_row"], got["per_request"])


def test_same_batches_without_broadcasting(both):
    cfg, dirs = both
    off = LoaderSettings.of(load_tiny(dirs["per_row"], ["model.broadcast=false"]))
    got = {k: _batches(d / "eval", off, shuffle=False) for k, d in dirs.items()}
    _assert_same_batches(got["per_row"], got["per_request"])
    assert got["per_request"][0].num_requests == got["per_request"][0].batch_size


def test_row_filter_on_a_candidate_or_a_request_column(both):
    cfg, dirs = both
    users = pq.read_table(list_files(str(dirs["per_row"] / "train"))[0], columns=["user_id"])["user_id"].to_numpy()
    some_users = sorted({int(u) % cfg.features.table("user").num_embeddings for u in users[:300]})
    for keep in ("{column: ad_type, values: [1]}", f"{{column: user_id, values: {some_users}}}"):
        seg = LoaderSettings.of(load_tiny(dirs["per_row"], [f"data.row_filter={keep}"]))
        got = {k: _batches(d / "train", seg, shuffle=True, drop_last=False) for k, d in dirs.items()}
        _assert_same_batches(got["per_row"], got["per_request"])
        assert (
            sum(int(b.valid.sum()) for b in got["per_request"])
            < ParquetBatches(str(dirs["per_request"] / "train"), seg).num_rows
        )


def test_calibration_holdout_and_parts(both):
    cfg, dirs = both
    held = _settings(cfg, calibration_holdout=0.25, calibration_dir=None)
    for part in ("train", "holdout"):
        ds = {k: ParquetBatches(str(d / "train"), held, part=part, shuffle=False) for k, d in dirs.items()}
        assert [(g.index, g.num_rows) for g in ds["per_row"].row_groups] == [
            (g.index, g.num_rows) for g in ds["per_request"].row_groups
        ]
        _assert_same_batches(list(ds["per_row"]), list(ds["per_request"]))


def test_loader_workers_give_the_same_batches(both):
    cfg, dirs = both
    for rank in (0, 1):
        got = {
            k: list(make_loader(str(d / "train"), LoaderSettings.of(cfg), rank=rank, world_size=2, num_workers=2))
            for k, d in dirs.items()
        }
        _assert_same_batches(got["per_row"], got["per_request"])


def test_too_few_rows_per_rank_is_judged_on_candidates(both, tmp_path):
    cfg, dirs = both
    # one per-request file of 2 row groups: ~12 candidates per request
    table = to_per_request(pq.read_table(list_files(str(dirs["per_row"] / "train"))[0]).slice(0, 400), cfg.features)
    (tmp_path / "split").mkdir()
    pq.write_table(table, tmp_path / "split" / "part-0.parquet", row_group_size=(table.num_rows + 1) // 2)
    rows = int(pc.sum(pc.list_value_length(table["click"])).as_py())
    assert rows == 400
    settings = _settings(cfg, batch_size=128, max_unique_users_per_batch=0, calibration_holdout=0.0)
    ds = ParquetBatches(str(tmp_path / "split"), settings, world_size=2)
    assert ds.num_rows == 400
    ds.require_a_batch_per_rank("data.train_dir", 0)
    with pytest.raises(ContractError, match=r"400 rows < data.batch_size 128 x 4 rank\(s\) = 512"):
        ParquetBatches(str(tmp_path / "split"), settings, world_size=4).require_a_batch_per_rank("data.train_dir", 0)
    with pytest.raises(
        ContractError,
        match=r"rank 0 is dealt 400 rows in 2 row group\(s\) in epoch 0 \(at most 2\d\d per loader worker, of 2\)",
    ):
        ParquetBatches(
            str(tmp_path / "split"),
            _settings(cfg, batch_size=300, max_unique_users_per_batch=0, calibration_holdout=0.0),
        ).require_a_batch_per_rank("data.train_dir", 2)


def _rank_fingerprints(rank, world, work_dir, cfg, dirs):
    import json

    out = {}
    for k, d in dirs.items():
        ds = ParquetBatches(str(Path(d) / "train"), LoaderSettings.of(cfg), rank=rank, world_size=world)
        ds.require_a_batch_per_rank("data.train_dir", 0)
        ds.drop_last = False
        out[k] = [list(f) for b in ds for f in _fingerprints(b)]
    (Path(work_dir) / f"fingerprints-{rank}.json").write_text(json.dumps(out))


@pytest.mark.slow
def test_two_ranks_read_every_row_once_from_either_layout(both, tmp_path):
    import json

    from pinads_rec.experiments.harness import run_ranks

    cfg, dirs = both
    run_ranks(_rank_fingerprints, 2, tmp_path, cfg, {k: str(d) for k, d in dirs.items()}, timeout_s=300)
    seen = collections.Counter()
    for rank in (0, 1):
        got = json.loads((tmp_path / f"fingerprints-{rank}.json").read_text())
        assert got["per_row"] == got["per_request"] and got["per_row"]
        seen.update(map(tuple, got["per_request"]))
    every = collections.Counter(
        tuple(f)
        for b in ParquetBatches(str(dirs["per_row"] / "train"), LoaderSettings.of(cfg), shuffle=False)
        for f in _fingerprints(b)
    )
    assert seen == every


# --------------------------------------------------------------------------------------------
# Serving reads per-request input; its output stays one row per candidate.
# --------------------------------------------------------------------------------------------


def test_scoring_batches_from_either_layout(both):
    from pinads_rec.serve.batching import RequestBatcher, ScoringBatches

    cfg, dirs = both
    got = {k: list(ScoringBatches(cfg, str(d / "eval"), batch_size=100)) for k, d in dirs.items()}
    assert len(got["per_row"]) == len(got["per_request"])
    for (ta, ba), (tb, bb) in zip(got["per_row"], got["per_request"]):
        assert ta.equals(tb) and ta.num_rows == int(ba.valid.sum())
        _assert_same_batch(_same_source(ba), _same_source(bb))
    # one request to score, as its rows or as its one per-request row (without labels)
    table = pq.read_table(list_files(str(dirs["per_row"] / "eval"))[0])
    rid = table["request_id"].to_numpy()
    rows = table.filter(pa.array(rid == rid[0]))
    labels = [c for t in cfg.features.tasks for c in (t.label_column, t.true_probability_column)]
    rows = rows.drop_columns(labels)
    batcher = RequestBatcher(cfg)
    one = to_per_request(rows.append_column("click", pa.array(np.zeros(rows.num_rows), pa.float32())), cfg.features)
    _assert_same_batch(batcher.batch(rows, "request"), batcher.batch(one.drop_columns(["click"]), "request"))
    with pytest.raises(ContractError, match="takes one request, got 2 per-request rows"):
        batcher.batch(pa.concat_tables([one, one]), "two")


# --------------------------------------------------------------------------------------------
# The contract on per-request files.
# --------------------------------------------------------------------------------------------

ROW = 7  # the request spoiled: row 7 of row group 1


@pytest.fixture(scope="module")
def per_request_table(both):
    cfg, dirs = both
    return to_per_request(pq.read_table(list_files(str(dirs["per_row"] / "train"))[0]), cfg.features)


def _write(tmp_path, table, rg=30):
    d = tmp_path / "data"
    d.mkdir(parents=True)
    pq.write_table(table, d / "x.parquet", row_group_size=rg)
    return d, re.escape(str(d / "x.parquet"))


def _replace(table, name, row, value):
    col = table[name].combine_chunks()
    values = col.to_pylist()
    values[row] = value
    return table.set_column(table.schema.get_field_index(name), name, pa.array(values, col.type))


def _rejected(cfg, d, pattern):
    with pytest.raises(ContractError, match=pattern) as info:
        list(ParquetBatches(str(d), LoaderSettings.of(cfg), shuffle=False))
    return str(info.value)


def _spoil(table, name, fn):
    r = 30 + ROW
    return _replace(table, name, r, fn(table[name][r].as_py()))


def test_per_request_checks_name_row_and_candidate(both, per_request_table, tmp_path):
    cfg, _ = both
    t = per_request_table
    at = lambda column: rf", row group 1, column '{column}'"  # noqa: E731

    def case(name, bad, pattern):
        d, path = _write(tmp_path / name, bad)
        message = _rejected(cfg, d, path + pattern)
        assert message.startswith(str(d / "x.parquet")) and "\n" not in message  # one line, the file first

    def set_at(values, j, v):
        values = list(values)
        values[j] = v
        return values

    case("label", _spoil(t, "click", lambda v: set_at(v, 1, 2)), at("click") + f": label 2 at row {ROW}, candidate 1 ")
    case(
        "item",
        _spoil(t, "item_id", lambda v: set_at(v, 2, -3)),
        at("item_id") + rf": negative id -3 \(row {ROW}, candidate 2",
    )
    case(
        "seq",
        _spoil(t, "seq_pin_item", lambda v: set_at(v, 0, -3)),
        at("seq_pin_item") + f": negative id -3 \\(row {ROW}, value",
    )
    case("ragged", _spoil(t, "advertiser_id", lambda v: v[:-1]), at("advertiser_id") + f": row {ROW} holds")
    empty = t
    for name in t.column_names:
        if name not in request_level_columns(cfg.features):
            empty = _spoil(empty, name, lambda v: [])
    case("empty", empty, at("click") + f": row {ROW} has no candidates")
    case("null", _spoil(t, "surface", lambda v: None), at("surface") + f": null value at row {ROW}")
    dup = _replace(t, "request_id", 30 + ROW, t["request_id"][30 + ROW - 1].as_py())
    case("duplicate", dup, at("request_id") + f": request \\d+ is on rows {ROW - 1} and {ROW}")
    plain = t.set_column(t.schema.get_field_index("item_ctr_prior"), "item_ctr_prior", pa.array(np.zeros(t.num_rows)))
    case("plain", plain, r": column 'item_ctr_prior' has type double, expected list<float>")


def test_per_request_repairs_count_as_per_row(both, per_request_table, tmp_path):
    cfg, dirs = both
    fix = LoaderSettings.of(load_tiny(dirs["per_row"], ["data.nonfinite_dense=replace"]))
    per_row = to_per_row(per_request_table, cfg.features)
    spoiled = {}
    for k, t in (("per_request", per_request_table), ("per_row", per_row)):
        if k == "per_request":
            t = _spoil(t, "item_ctr_prior", lambda v: [float("nan")] + v[1:])
        else:
            r = int(per_request_table["click"].combine_chunks().offsets[30 + ROW].as_py())
            t = _replace(t, "item_ctr_prior", r, float("nan"))
        d = tmp_path / k
        d.mkdir()
        pq.write_table(t, d / "x.parquet", row_group_size=30 if k == "per_request" else None)
        ds = ParquetBatches(str(d), fix, shuffle=False)
        spoiled[k] = ([int(b.valid.sum()) for b in ds], dict(ds.reader.checker.repairs))
    assert spoiled["per_row"][1] == spoiled["per_request"][1] == {"item_ctr_prior: non-finite replaced by 0": 1}


def test_a_reader_goes_by_what_the_writer_stored_once_per_request(both, tmp_path):
    """Per-request files record which columns they hold once per request; a config marking other
    features user-side reads them as it reads the per-row files. The generator stores context_topic
    once per request, the demo config reads it per candidate; files written the demo config's way
    (context_topic per candidate) are read by a config that marks it user-side."""
    cfg, dirs = both
    candidate_level = tmp_path / "train"
    candidate_level.mkdir()
    for path in list_files(str(dirs["per_row"] / "train")):
        rewrite_per_request(path, str(candidate_level / Path(path).name), cfg.features)
    sparse = [dataclasses.replace(s, user_side=True) if s.name == "context_topic" else s for s in cfg.features.sparse]
    other = dataclasses.replace(cfg, features=dataclasses.replace(cfg.features, sparse=sparse))
    for directory in (candidate_level, dirs["per_request"] / "train"):
        got = _batches(directory, LoaderSettings.of(other), shuffle=False)
        _assert_same_batches(got, _batches(dirs["per_row"] / "train", LoaderSettings.of(other), shuffle=False))
