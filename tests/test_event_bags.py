"""Bags of ids: a multi-valued event attribute (an event's several genres) and a multi-hot candidate
feature on a sequence table -- their checks (data/loader/row_group_checker.py), their tensors
(data/loader/batch.py), their pooling (modules/jagged.py) and the retrieval's matching on them
(modules/retrieval.py)."""

from __future__ import annotations

import os

import pyarrow as pa
import pytest
import torch
from conftest import REPO

from pinads_rec.config import DataConfig, load
from pinads_rec.data.loader.batch import BatchBuilder
from pinads_rec.data.loader.contract import ContractError
from pinads_rec.data.loader.row_group_checker import RowGroupChecker
from pinads_rec.features import FeatureLayout
from pinads_rec.modules.jagged import pad_bags, pool_bags
from pinads_rec.modules.retrieval import hard_search


def test_pool_bags_sums_or_averages_each_bag_and_an_empty_bag_is_zeros():
    values = torch.arange(12, dtype=torch.float32).view(6, 2)
    sizes = torch.tensor([2, 0, 3, 1])
    mean = pool_bags(values, sizes, mean=True)
    total = pool_bags(values, sizes, mean=False)
    assert total.tolist() == [[2, 4], [0, 0], [18, 21], [10, 11]]
    assert mean.tolist() == [[1, 2], [0, 0], [6, 7], [10, 11]]
    values.requires_grad_(True)
    pool_bags(values, sizes, mean=True).sum().backward()
    assert values.grad[:, 0].tolist() == pytest.approx([0.5, 0.5, 1 / 3, 1 / 3, 1 / 3, 1.0])


def test_pad_bags_lays_each_bag_out_in_a_row():
    ids = torch.tensor([4, 5, 7, 8, 9, 1])
    assert pad_bags(ids, torch.tensor([2, 0, 3, 1]), 3, fill=-1).tolist() == [
        [4, 5, -1],
        [-1, -1, -1],
        [7, 8, 9],
        [1, -1, -1],
    ]


def test_hard_search_on_bags_matches_events_sharing_an_id():
    g = torch.Generator().manual_seed(0)
    U, L, K = 3, 12, 3
    events = torch.randint(0, 6, (U, L, K), generator=g)
    events[:, :, 2] = -1  # bags of two
    lengths = torch.tensor([12, 5, 0])
    mask = torch.arange(L)[None, :] < lengths[:, None]
    request_index = torch.tensor([0, 0, 1, 2])
    candidate = [[1, 2], [5], [0, 3, 4], [2]]  # each row's bag
    ids = torch.tensor([x for bag in candidate for x in bag])
    rows = torch.tensor([r for r, bag in enumerate(candidate) for _ in bag])
    position, found, count = hard_search(events, mask, ids, request_index, 4, rows)
    for b, u in enumerate(request_index.tolist()):
        expected = [p for p in range(int(lengths[u])) if set(events[u, p].tolist()) & set(candidate[b])]
        assert count[b] == len(expected)
        assert position[b][found[b]].tolist() == expected[:4]


T0 = 880_000_000  # 1997-11-20 (epoch seconds)


@pytest.fixture
def movielens_features():
    # The likes-only design: the tables below hold the liked_* columns alone.
    return load(os.path.join(REPO, "configs", "datasets", "movielens_100k_likes.yaml")).features


def _table(genres, candidate_genres=None):
    """Two requests of one candidate each, as the build writes them (per request, lists)."""
    n = [len(g) for g in genres]
    return pa.table(
        {
            "request_id": pa.array([1, 2], pa.int64()),
            "user_id": pa.array([1, 2], pa.int64()),
            "timestamp": pa.array([T0 + 1000, T0 + 2000], pa.int64()),
            "surface": pa.array(["movielens"] * 2),
            "like": pa.array([1, 0], pa.int64()),
            "item_id": pa.array([3, 4], pa.int64()),
            "genres": pa.array(candidate_genres or [[2, 9], [6]], pa.list_(pa.int64())),
            "gender": pa.array([1, 2], pa.int64()),
            "occupation": pa.array([1, 2], pa.int64()),
            "age_bucket": pa.array([2, 3], pa.int64()),
            "movie_age_years": pa.array([1.0, 2.0]),
            "liked_ts": pa.array([list(range(T0 + 900, T0 + 900 - k, -1)) for k in n], pa.list_(pa.int64())),
            "liked_movie": pa.array([list(range(1, k + 1)) for k in n], pa.list_(pa.int64())),
            "liked_genres": pa.array(genres, pa.list_(pa.list_(pa.int64()))),
        }
    )


def test_a_bag_column_becomes_ids_per_request_and_sizes_per_event(movielens_features):
    f = movielens_features
    checker = RowGroupChecker(f, DataConfig())
    table = checker(_table([[[2, 9], [0], [6, 15, 16]], [[]]]), "test.parquet, row group 0")
    layout = FeatureLayout.of(f)
    batch = BatchBuilder(layout, user_slots=2).build(table)
    seq = batch.sequences["liked.genres"]
    assert seq.lengths().tolist() == [6, 0]  # every id of every event, per request
    assert seq.values().tolist() == [2, 9, 0, 6, 15, 16]
    assert batch.sequence_bag_sizes["liked.genres"].tolist() == [2, 1, 3, 0]  # per event (the empty one too)
    assert batch.sequences["liked.movie"].lengths().tolist() == [3, 1]  # events per request
    # The candidate's genres (a multi-hot feature on the sequence table genre): a bag per row.
    assert batch.sequences["candidate.genres"].values().tolist() == [2, 9, 6]
    assert batch.sequence_bag_sizes["candidate.genres"].tolist() == [2, 1]


def test_a_bag_longer_than_max_values_is_an_error_or_cut_and_counted(movielens_features):
    f = movielens_features
    long = [[[1, 2, 3, 4, 5, 6, 7], [2]], [[3]]]  # max_values 6
    with pytest.raises(ContractError, match=r"column 'liked_genres': row 0 has an event .* with 7 ids, more than"):
        RowGroupChecker(f, DataConfig(overlong_sequence="error"))(_table(long), "f.parquet, row group 0")
    checker = RowGroupChecker(f, DataConfig(overlong_sequence="truncate"))
    table = checker(_table(long), "f.parquet, row group 0")
    assert table.column("liked_genres").to_pylist()[0] == [[1, 2, 3, 4, 5, 6], [2]]
    assert dict(checker.repairs) == {"sequence group liked feature genres: bags cut to their first 6 ids": 1}


def test_a_bag_id_beyond_its_table_names_the_row(movielens_features):
    with pytest.raises(ContractError, match=r"column 'liked_genres': id 25 is beyond its table's size 20 \(row 1"):
        RowGroupChecker(movielens_features, DataConfig())(_table([[[2]], [[3, 25]]]), "f.parquet, row group 0")
