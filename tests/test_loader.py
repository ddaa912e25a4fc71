"""Streaming loader: batches equal the Parquet contents, every row is read exactly once across ranks
and workers, shuffling keeps a request's rows together, memory stays bounded by the buffer."""

import collections

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from conftest import load_tiny, read_rows, rows_of

from pinads_rec.data.loader.dataset import LoaderSettings, ParquetBatches, make_loader
from pinads_rec.features import FeatureLayout


def _all_rows(directory):
    return read_rows(directory)


def _fingerprints(batch):
    """Row identity from continuous values (true probabilities and dense features are unique per row)."""
    keep = batch.valid
    cols = torch.cat([batch.true_probs, batch.dense], dim=1)[keep]
    return [tuple(np.round(r, 5)) for r in cols.double().numpy().tolist()]


def _file_fingerprints(cfg, table):
    f = cfg.features
    parts = [table.column(t.true_probability_column).to_numpy()[:, None] for t in f.tasks]
    for d in f.dense:
        col = table.column(d.column).combine_chunks()
        v = (col.flatten() if d.dim > 1 else col).to_numpy(zero_copy_only=False)
        parts.append(v.reshape(table.num_rows, d.dim))
    rows = np.concatenate([p.astype(np.float32).astype(np.float64) for p in parts], axis=1)
    return [tuple(np.round(r, 5)) for r in rows.tolist()]


def test_round_trip_equals_parquet(tiny_data):
    cfg, data = tiny_data
    f = cfg.features
    layout = FeatureLayout.of(f)
    table = _all_rows(f"{data}/train")
    ds = ParquetBatches(f"{data}/train", LoaderSettings.of(cfg), shuffle=False)
    row = 0
    for batch in ds:
        n = int(batch.valid.sum())
        part = table.slice(row, n)
        row += n
        # labels, surface, dense
        for j, t in enumerate(f.tasks):
            assert batch.labels[:n, j].tolist() == part.column(t.label_column).to_numpy().astype(float).tolist()
        surfaces = [f.surfaces.index(s) for s in part.column(f.columns.surface).to_pylist()]
        assert batch.surface[:n].tolist() == surfaces
        emb = np.stack(part.column("item_embedding").to_pylist())
        at = sum(d.dim for d in f.dense[:2])
        np.testing.assert_allclose(batch.dense[:n, at : at + 32].numpy(), emb, rtol=0, atol=0)
        # pooled sparse features, including the multi-hot query tokens
        jt = batch.sparse.to_dict()
        for s in map(layout.sparse_feature, layout.row_keys):
            got = [x.tolist() for x in jt[s.name].to_dense()[:n]]
            want = part.column(s.column).to_pylist()
            want = [w if isinstance(w, list) else [w] for w in want]
            size = f.table(s.table).num_embeddings
            assert got == [[v % size for v in w] for w in want], s.name
        # candidate ids sharing a sequence table ride in the per-request KJT, in row order
        for s in map(layout.sparse_feature, layout.shared_keys):
            got = batch.sequences[f"candidate.{s.name}"].values()[:n].tolist()
            assert got == part.column(s.column).to_pylist(), s.name
            assert int(batch.sequences[f"candidate.{s.name}"].lengths().sum()) == batch.batch_size
        # sequences: one per request, equal to the request's first row; deltas = request - event time
        req = part.column(f.columns.request_id).to_numpy()
        first = np.flatnonzero(np.r_[True, req[1:] != req[:-1]])
        # padding repeats the last row: it joins the last request, no extra slot
        assert batch.sequences.stride() == len(first)
        assert batch.user_sparse.stride() == ds.user_slots >= len(first)  # fixed slots, the rest empty
        users = batch.user_sparse.to_dict()
        for s in map(
            layout.sparse_feature, layout.user_keys
        ):  # user-side features: once per request, from its first row
            got = [x.tolist() for x in users[s.name].to_dense()]
            assert not any(got[len(first) :])
            got = got[: len(first)]
            want = [part.column(s.column)[int(i)].as_py() for i in first]
            want = [w if isinstance(w, list) else [w] for w in want]
            assert got == [[v % f.table(s.table).num_embeddings for v in w] for w in want], s.name
        assert batch.request_index[:n].tolist() == (np.cumsum(np.r_[True, req[1:] != req[:-1]]) - 1).tolist()
        seq = batch.sequences.to_dict()
        for g in f.sequence_groups:
            for sf in g.features:
                got = [x.tolist() for x in seq[f"{g.name}.{sf.name}"].to_dense()][: len(first)]
                want = [part.column(sf.column)[int(i)].as_py()[: g.max_length] for i in first]
                assert got == want, sf.column
            ts = [part.column(g.timestamp_column)[int(i)].as_py()[: g.max_length] for i in first]
            rt = part.column(f.columns.timestamp).to_numpy()[first]
            want = np.concatenate([np.asarray(rt[k] - np.asarray(t, float), np.float32) for k, t in enumerate(ts)])
            np.testing.assert_allclose(batch.sequence_time_deltas[g.name].numpy()[: len(want)], want)
            assert (batch.sequence_time_deltas[g.name] > 0).all(), "events precede the request"
    assert row == table.num_rows


def test_two_ranks_two_workers_cover_every_row_once(tiny_data):
    cfg, data = tiny_data
    table = _all_rows(f"{data}/train")
    seen = collections.Counter()
    for rank in range(2):
        loader = make_loader(
            f"{data}/train", LoaderSettings.of(cfg), rank=rank, world_size=2, shuffle=True, num_workers=2
        )
        loader.dataset.drop_last = False
        for batch in loader:
            seen.update(_fingerprints(batch))
    assert seen == collections.Counter(_file_fingerprints(cfg, table))


def _assert_same_batch(a, b):
    from dataclasses import fields

    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, KeyedJaggedTensor):
            assert x.keys() == y.keys() and x.stride() == y.stride(), f.name
            for get in (KeyedJaggedTensor.values, KeyedJaggedTensor.lengths, KeyedJaggedTensor.offsets):
                assert torch.equal(get(x), get(y)), f.name
            assert (x.weights_or_none() is None) == (y.weights_or_none() is None), f.name
        elif isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), f.name
        elif isinstance(x, dict):
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), f.name
        else:
            assert x == y, f.name


def test_a_batch_crosses_processes_as_one_buffer_and_arrives_unchanged(tiny_data):
    import pickle

    cfg, data = tiny_data
    local = next(iter(ParquetBatches(f"{data}/train", LoaderSettings.of(cfg), shuffle=False)))
    _, (buffer, layout, _) = local.__reduce__()
    # one shared-memory segment per batch, whatever the number of tensors (~20)
    assert buffer.dtype == torch.uint8 and len(layout) > 15
    _assert_same_batch(local, pickle.loads(pickle.dumps(local)))
    # through a real DataLoader worker
    _assert_same_batch(
        local, next(iter(make_loader(f"{data}/train", LoaderSettings.of(cfg), shuffle=False, num_workers=1)))
    )


def test_a_batch_with_a_variable_batch_kjt_crosses_whole(tiny_data):
    """A KJT with a batch size per key is not packed (its layout is more than values + lengths): it
    is pickled as itself and arrives unchanged beside the packed fields."""
    import dataclasses
    import pickle

    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    cfg, data = tiny_data
    local = next(iter(ParquetBatches(f"{data}/train", LoaderSettings.of(cfg), shuffle=False)))
    vbe = KeyedJaggedTensor(
        keys=["a", "b"],
        values=torch.arange(5),
        lengths=torch.tensor([2, 1, 2], dtype=torch.int32),
        stride_per_key_per_rank=[[2], [1]],
    )
    batch = dataclasses.replace(local, sequences=vbe)
    back = pickle.loads(pickle.dumps(batch))
    assert back.sequences.variable_stride_per_key() and back.sequences.stride_per_key() == [2, 1]
    assert torch.equal(back.sequences.values(), vbe.values()) and torch.equal(back.sequences.lengths(), vbe.lengths())
    assert torch.equal(back.dense, local.dense) and torch.equal(back.sparse.values(), local.sparse.values())


def test_shuffle_keeps_requests_together_and_changes_order(tiny_data):
    cfg, data = tiny_data
    ds = ParquetBatches(f"{data}/train", LoaderSettings.of(cfg), shuffle=True)
    orders = []
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        firsts = []
        for batch in ds:
            assert batch.batch_size == cfg.data.batch_size  # drop_last in training: full batches only
            ri = batch.request_index
            assert (ri[1:] - ri[:-1] >= 0).all() and (ri[1:] - ri[:-1] <= 1).all()
            assert int(ri[-1]) + 1 == batch.sequences.stride()
            firsts.append(tuple(batch.true_probs[0].tolist()))
        orders.append(firsts)
    assert orders[0] != orders[1], "each epoch reshuffles"


def test_eval_pads_last_batch_and_marks_it(tiny_data):
    cfg, data = tiny_data
    ds = ParquetBatches(f"{data}/eval", LoaderSettings.of(cfg), shuffle=False)
    batches = list(ds)
    assert all(b.batch_size == cfg.data.batch_size for b in batches)
    assert sum(int(b.valid.sum()) for b in batches) == ds.num_rows
    assert not batches[-1].valid.all() or ds.num_rows % cfg.data.batch_size == 0


def test_without_broadcasting_every_row_is_its_own_request(tiny_data):
    cfg, data = tiny_data
    on = next(iter(ParquetBatches(f"{data}/eval", LoaderSettings.of(cfg), shuffle=False)))
    cfg_off = load_tiny(data, ["model.broadcast=false"])
    off = next(iter(ParquetBatches(f"{data}/eval", LoaderSettings.of(cfg_off), shuffle=False)))
    assert on.num_requests < on.batch_size
    assert off.num_requests == off.batch_size == on.batch_size
    assert off.request_index.tolist() == list(range(off.batch_size))
    # the per-row copies are the request's own user-side values
    for key in ("pins.item", "queries.token"):
        per_row = [x.tolist() for x in off.sequences[key].to_dense()]
        per_request = [x.tolist() for x in on.sequences[key].to_dense()]
        assert per_row == [per_request[i] for i in on.request_index.tolist()], key


def test_unique_user_bound_closes_batches_early(tiny_data):
    cfg, data = tiny_data
    bounded = load_tiny(data, ["data.max_unique_users_per_batch=4"])
    table = _all_rows(f"{data}/train")
    seen = collections.Counter()
    ds = ParquetBatches(f"{data}/train", LoaderSettings.of(bounded), shuffle=True, drop_last=False)
    batches = list(ds)
    for b in batches:
        assert b.num_requests <= 4 and b.batch_size == bounded.data.batch_size
        assert int(b.request_index.max()) < b.num_requests
        seen.update(_fingerprints(b))
    assert any(not b.valid.all() for b in batches[:-1]), "the bound closed batches before batch_size rows"
    assert seen == collections.Counter(_file_fingerprints(bounded, table)), "no row lost or repeated"


def test_row_filter_keeps_only_the_segment(tiny_data):
    cfg, data = tiny_data
    table = _all_rows(f"{data}/train")
    for ad_type in (0, 1):
        seg = load_tiny(data, [f"data.row_filter={{column: ad_type, values: [{ad_type}]}}"])
        rows = 0
        for b in ParquetBatches(f"{data}/train", LoaderSettings.of(seg), shuffle=False):
            types = b.sparse["ad_type"].values()[b.valid]
            assert (types == ad_type).all()
            rows += int(b.valid.sum())
        assert rows == int((table.column("ad_type").to_numpy() == ad_type).sum()) > 0


def test_batches_name_their_row_groups(tiny_data):
    cfg, data = tiny_data
    batch = next(iter(ParquetBatches(f"{data}/train", LoaderSettings.of(cfg), shuffle=True)))
    assert "part-0000" in batch.source and "row group" in batch.source


def test_calibration_holdout_is_the_last_row_groups_whatever_the_world_size(tiny_data):
    cfg, data = tiny_data
    held = load_tiny(data, ["data.calibration_holdout=0.25", "data.calibration_dir=null"])
    every = ParquetBatches(f"{data}/train", LoaderSettings.of(held), shuffle=False).row_groups
    for world in (1, 2):
        train = ParquetBatches(f"{data}/train", LoaderSettings.of(held), world_size=world, part="train").row_groups
        holdout = ParquetBatches(f"{data}/train", LoaderSettings.of(held), world_size=world, part="holdout").row_groups
        assert train + holdout == every and holdout == every[-round(0.25 * len(every)) :]
    tiny_fraction = load_tiny(data, ["data.calibration_holdout=0.01", "data.calibration_dir=null"])
    assert (
        ParquetBatches(f"{data}/train", LoaderSettings.of(tiny_fraction), part="holdout").row_groups == every[-1:]
    )  # at least one


def test_calibration_split_is_unseen_and_from_the_end_of_training(tiny_data):
    cfg, data = tiny_data
    assert cfg.data.calibration_holdout == 0.0  # the demo fits on its calibration split
    train = ParquetBatches(f"{data}/train", LoaderSettings.of(cfg), shuffle=False, part="train")
    assert (
        train.row_groups == ParquetBatches(f"{data}/train", LoaderSettings.of(cfg), shuffle=False).row_groups
    )  # nothing held out

    def column(directory, name):
        return read_rows(directory, cfg.features, [name])[name].to_numpy()

    ids = {s: column(f"{data}/{s}", "request_id") for s in ("train", "eval", "calibration")}
    assert not set(ids["calibration"]) & (set(ids["train"]) | set(ids["eval"]))
    ts = {s: column(f"{data}/{s}", "timestamp") for s in ("train", "calibration", "eval")}
    # The latest part of the training period: after every training request, before every eval one.
    assert ts["train"].max() <= ts["calibration"].min() and ts["calibration"].max() <= ts["eval"].min()


def test_reader_keeps_columns_as_read_beside_the_checked_ones(tiny_data):
    from pinads_rec.data.loader.reader import AS_READ_PREFIX, RowGroupReader, list_files, list_row_groups

    cfg, data = tiny_data
    group = list_row_groups(list_files(f"{data}/train"), cfg.features)[0]
    table = RowGroupReader(cfg.features, cfg.data, keep_as_read=["user_id"]).read(group)
    stored = pq.ParquetFile(group.path).read_row_group(group.index)
    raw = rows_of(stored, cfg.features).column("user_id").to_numpy()
    size = cfg.features.table("user").num_embeddings
    assert (raw >= size).any(), "some ids need hashing"
    assert table.column(AS_READ_PREFIX + "user_id").to_numpy().tolist() == raw.tolist()
    assert table.column("user_id").to_numpy().tolist() == (raw % size).tolist()
    plain = RowGroupReader(cfg.features, cfg.data).read(group)
    assert AS_READ_PREFIX + "user_id" not in plain.column_names


def test_batch_builder_pads_with_the_last_row_marked_invalid(tiny_data):
    from pinads_rec.data.loader.batch import BatchBuilder
    from pinads_rec.data.loader.reader import RowGroupReader, list_files, list_row_groups

    cfg, data = tiny_data
    group = list_row_groups(list_files(f"{data}/train"), cfg.features)[0]
    table = RowGroupReader(cfg.features, cfg.data).read(group).slice(0, 10)
    builder = BatchBuilder(FeatureLayout.of(cfg.features), user_slots=16)
    plain, padded = builder.build(table), builder.build(table, "here", pad_to=13)
    assert plain.batch_size == 10 and plain.valid.all() and plain.source == ""
    assert padded.batch_size == 13 and padded.valid.tolist() == [True] * 10 + [False] * 3 and padded.source == "here"
    assert padded.num_requests == plain.num_requests  # the padding joins the last request
    assert padded.request_index[10:].tolist() == [int(plain.request_index[-1])] * 3
    assert torch.equal(padded.dense[:10], plain.dense) and torch.equal(
        padded.dense[10:], plain.dense[-1:].expand(3, -1)
    )
    assert padded.user_sparse.stride() == 16


def test_batch_builder_zero_filled_allocations_build_the_same_batch(tiny_data):
    """BatchBuilder.zero_fill (a benchmark's comparison) changes how tensors are allocated, not what
    the batch holds: every allocated tensor is written whole."""
    from pinads_rec.data.loader.batch import BatchBuilder
    from pinads_rec.data.loader.reader import RowGroupReader, list_files, list_row_groups

    cfg, data = tiny_data
    group = list_row_groups(list_files(f"{data}/train"), cfg.features)[0]
    table = RowGroupReader(cfg.features, cfg.data).read(group).slice(0, 40)
    layout = FeatureLayout.of(cfg.features)
    empty, zeroed = (BatchBuilder(layout, 16, zero_fill=z).build(table, pad_to=48) for z in (False, True))
    _assert_same_batch(empty, zeroed)


def test_loader_workers_prefetch_data_prefetch_factor_batches(tiny_data):
    _, data = tiny_data
    cfg = load_tiny(data, ["data.prefetch_factor=2"])
    assert make_loader(f"{data}/train", LoaderSettings.of(cfg), num_workers=1).prefetch_factor == 2
    assert make_loader(f"{data}/train", LoaderSettings.of(cfg), num_workers=1, prefetch_factor=3).prefetch_factor == 3
    assert make_loader(f"{data}/train", LoaderSettings.of(cfg), num_workers=0).prefetch_factor is None


# --- empty and tiny splits (docs/reliability.md, "Empty or tiny data") -----------------------


def _write_split(directory, table, sizes, row_group_size=None):
    """Files of ``sizes`` rows taken in order from ``table`` (0: an empty file)."""
    directory.mkdir(parents=True)
    at = 0
    for i, n in enumerate(sizes):
        pq.write_table(table.slice(at, n), directory / f"part-{i}.parquet", row_group_size=row_group_size)
        at += n
    return str(directory)


def _settings(cfg, **data):
    from dataclasses import replace

    return LoaderSettings.of(replace(cfg, data=replace(cfg.data, **data)))


def test_a_split_without_rows_is_refused_naming_it(tiny_data, tmp_path):
    from pinads_rec.data.loader.contract import ContractError

    cfg, data = tiny_data
    empty = _write_split(tmp_path / "empty", _all_rows(f"{data}/train"), [0, 0])
    ds = ParquetBatches(empty, LoaderSettings.of(cfg), shuffle=True, part="train")  # holdout: nothing to split
    assert ds.num_rows == 0 and len(ds.files_without_rows) == 2
    with pytest.raises(
        ContractError, match=rf"data.train_dir {empty}: 0 rows \(2 .parquet file\(s\), none with a row\)"
    ):
        ds.require_a_batch_per_rank("data.train_dir", 0)
    with pytest.raises(ContractError, match=rf"data.eval_dir {empty}: 0 rows"):
        ParquetBatches(empty, LoaderSettings.of(cfg), shuffle=False).require_rows("data.eval_dir")


def test_an_empty_file_beside_others_is_listed_not_fatal(tiny_data, tmp_path):
    cfg, data = tiny_data
    split = _write_split(tmp_path / "split", _all_rows(f"{data}/train"), [0, 1000], row_group_size=250)
    ds = ParquetBatches(split, _settings(cfg, calibration_holdout=0.0), world_size=2, shuffle=True)
    assert [p.rsplit("/", 1)[-1] for p in ds.files_without_rows] == ["part-0.parquet"]
    ds.require_a_batch_per_rank("data.train_dir", 0)


def test_fewer_rows_than_a_batch_per_rank_is_refused(tiny_data, tmp_path):
    from pinads_rec.data.loader.contract import ContractError

    cfg, data = tiny_data
    split = _write_split(tmp_path / "split", _all_rows(f"{data}/train"), [200], row_group_size=50)
    settings = _settings(cfg, batch_size=128, max_unique_users_per_batch=0, calibration_holdout=0.0)
    ds = ParquetBatches(split, settings, rank=0, world_size=2, shuffle=True)
    with pytest.raises(ContractError) as e:
        ds.require_a_batch_per_rank("data.train_dir", 0)
    assert str(e.value) == (
        f"data.train_dir {split}: 200 rows < data.batch_size 128 x 2 rank(s) = 256: no full batch per rank"
    )
    ParquetBatches(split, settings, world_size=1, shuffle=True).require_a_batch_per_rank("data.train_dir", 0)
    # A request bound closes batches early (padded): then the fewest rows a batch keeps is the bound.
    capped = _settings(cfg, batch_size=128, max_unique_users_per_batch=16, calibration_holdout=0.0)
    ParquetBatches(split, capped, world_size=2, shuffle=True).require_a_batch_per_rank("data.train_dir", 0)
    with pytest.raises(ContractError, match=r"min\(data.batch_size 128, data.max_unique_users_per_batch 16\) x 16"):
        ParquetBatches(split, capped, world_size=16, shuffle=True).require_a_batch_per_rank("data.train_dir", 0)


def test_a_rank_dealt_no_full_batch_is_refused(tiny_data, tmp_path):
    """Enough rows in all, but in one row group: the other rank (or worker) gets nothing."""
    from pinads_rec.data.loader.contract import ContractError

    cfg, data = tiny_data
    split = _write_split(tmp_path / "split", _all_rows(f"{data}/train"), [1000], row_group_size=1000)
    settings = _settings(cfg, batch_size=128, max_unique_users_per_batch=0, calibration_holdout=0.0)
    ds = ParquetBatches(split, settings, world_size=2, shuffle=True)
    with pytest.raises(
        ContractError, match=r"rank [01] is dealt 0 rows in 0 row group\(s\) in epoch 0 .* no full batch"
    ):
        ds.require_a_batch_per_rank("data.train_dir", 0)
    ParquetBatches(split, settings, world_size=1, shuffle=True).require_a_batch_per_rank("data.train_dir", 1)
    # One rank, two loader workers, two row groups of 500: no worker reaches a batch of 800.
    halves = _write_split(tmp_path / "halves", _all_rows(f"{data}/train"), [1000], row_group_size=500)
    big = _settings(cfg, batch_size=800, max_unique_users_per_batch=0, calibration_holdout=0.0)
    with pytest.raises(
        ContractError,
        match=r"rank 0 is dealt 1000 rows in 2 row group\(s\) in epoch 0 \(at most 500 per loader worker, of 2\)",
    ):
        ParquetBatches(halves, big, shuffle=True).require_a_batch_per_rank("data.train_dir", 2)
    ParquetBatches(halves, big, shuffle=True).require_a_batch_per_rank("data.train_dir", 1)
