"""The feature layout (pinads_rec/features.py): which collection looks up each feature, the KJT keys
in order, the tables each collection holds, and widths -- derived once from FeaturesConfig."""

import dataclasses

import pytest
import torch
from conftest import DEMO
from torchrec.modules.embedding_configs import PoolingType

from pinads_rec import config
from pinads_rec.features import FeatureLayout
from pinads_rec.models.sparse_arch import sparse_collections


@pytest.fixture(scope="module")
def demo():
    return config.load(DEMO).features


def test_demo_layout_keys(demo):
    layout = FeatureLayout.of(demo)
    assert layout.row_keys == ["advertiser_id", "ad_type"]
    assert layout.user_keys == ["user_id", "query_tokens"]
    assert layout.shared_keys == ["item_id", "item_topic", "context_topic"]
    assert layout.event_keys == [f"{g.name}.{f.name}" for g in demo.sequence_groups for f in g.features]
    assert layout.sequence_keys == layout.event_keys + [
        "candidate.item_id",
        "candidate.item_topic",
        "candidate.context_topic",
    ]
    assert layout.sequence_tables == ["action", "item", "seq_query_token", "topic"]
    assert layout.sparse_keys == [s.name for s in demo.sparse]
    assert layout.candidate_keys == [s.name for s in demo.sparse if not s.user_side]
    assert layout.user_side_keys == [s.name for s in demo.sparse if s.user_side]
    assert layout.dense_dim == sum(d.dim for d in demo.dense) == 34


def test_candidate_feature_may_share_a_sequence_table(demo):
    layout = FeatureLayout.of(demo)
    assert layout.shared_keys == ["item_id", "item_topic", "context_topic"]
    assert "candidate.item_topic" in layout.sequence_keys
    assert "item_topic" not in layout.row_keys + layout.user_keys  # not pooled by an EmbeddingBagCollection


def test_every_sparse_feature_is_looked_up_by_exactly_one_collection(demo):
    layout = FeatureLayout.of(demo)
    keys = layout.row_keys + layout.user_keys + layout.shared_keys
    assert sorted(keys) == sorted(layout.sparse_keys) and len(set(keys)) == len(keys)


def test_demo_tables_per_collection(demo):
    layout = FeatureLayout.of(demo)
    rows = [(t.name, t.feature_names, t.pooling) for t in layout.embedding_bag_configs()]
    assert rows == [("advertiser", ["advertiser_id"], PoolingType.SUM), ("ad_type", ["ad_type"], PoolingType.SUM)]
    users = [(t.name, t.feature_names, t.pooling) for t in layout.embedding_bag_configs(user_side=True)]
    assert users == [("user", ["user_id"], PoolingType.SUM), ("query_token", ["query_tokens"], PoolingType.SUM)]
    events = [(t.name, t.feature_names) for t in layout.embedding_configs()]
    assert events == [
        ("item", ["pins.item", "ads.item", "candidate.item_id"]),
        ("action", ["pins.action", "ads.action"]),
        ("topic", ["pins.topic", "ads.topic", "queries.topic", "candidate.item_topic", "candidate.context_topic"]),
        ("seq_query_token", ["queries.token"]),
    ]
    names = [t.name for t in layout.all_table_configs()]
    assert names == [n for n, *_ in rows + users + events] and len(set(names)) == len(names)
    for t in layout.all_table_configs():  # sizes come from the declared table
        assert (t.num_embeddings, t.embedding_dim) == (
            demo.table(t.name).num_embeddings,
            demo.table(t.name).embedding_dim,
        )


def test_a_user_side_feature_in_a_candidate_table_is_looked_up_per_row(demo):
    """A table lives in one collection: a user-side feature sharing its table with a candidate-side
    one is pooled per row with it, not once per request."""
    advertiser = next(s for s in demo.sparse if s.name == "advertiser_id")
    shared = dataclasses.replace(
        demo, sparse=demo.sparse + [dataclasses.replace(advertiser, name="liked_advertiser", user_side=True)]
    )
    layout = FeatureLayout.of(shared)
    assert "liked_advertiser" in layout.row_keys and "liked_advertiser" not in layout.user_keys
    table = next(t for t in layout.embedding_bag_configs() if t.name == "advertiser")
    assert table.feature_names == ["advertiser_id", "liked_advertiser"]


def test_mean_pooling_comes_from_the_tables_first_feature(demo):
    sparse = [dataclasses.replace(s, pooling="mean") if s.name == "query_tokens" else s for s in demo.sparse]
    layout = FeatureLayout.of(dataclasses.replace(demo, sparse=sparse))
    table = next(t for t in layout.embedding_bag_configs(user_side=True) if t.name == "query_token")
    assert table.pooling == PoolingType.MEAN


def test_widths(demo):
    layout = FeatureLayout.of(demo)
    assert layout.feature_dims == {s.name: demo.table(s.table).embedding_dim for s in demo.sparse}
    assert layout.width(layout.candidate_keys) == sum(layout.feature_dims[k] for k in layout.candidate_keys)
    user, other = layout.dense_indices(user_side=True), layout.dense_indices(user_side=False)
    assert sorted(user + other) == list(range(layout.dense_dim)) and not set(user) & set(other)
    at = 0
    for d in demo.dense:
        assert set(range(at, at + d.dim)) <= set(user if d.user_side else other), d.name
        at += d.dim
    assert layout.sequence_dim == demo.table("item").embedding_dim
    assert layout.columns(["item_id", "user_id"]) == [layout.sparse_feature(k).column for k in ("item_id", "user_id")]


def test_sequence_tables_of_different_widths_are_refused_when_the_collections_are_built(demo):
    tables = [
        dataclasses.replace(t, embedding_dim=t.embedding_dim * 2) if t.name == "action" else t for t in demo.tables
    ]
    layout = FeatureLayout.of(dataclasses.replace(demo, tables=tables))  # the layout itself builds
    with pytest.raises(ValueError, match="sequence tables must share one embedding_dim"):
        sparse_collections(layout, torch.device("meta"))


def test_a_config_without_sequences_has_no_embedding_collection(demo):
    layout = FeatureLayout.of(dataclasses.replace(demo, sequence_groups=[]))
    assert layout.sequence_keys == [] and layout.shared_keys == [] and layout.sequence_dim == 0
    assert sorted(layout.row_keys + layout.user_keys) == sorted(layout.sparse_keys)  # all pooled
    collections = sparse_collections(layout, torch.device("meta"))
    assert collections.ec is None and collections.sequence_dim == 0


def test_the_collections_hold_the_layouts_tables_and_keys(demo):
    layout = FeatureLayout.of(demo)
    ebc, user_ebc, ec, dim = sparse_collections(layout, torch.device("meta"))
    assert [t.name for t in ebc.embedding_bag_configs()] == [t.name for t in layout.embedding_bag_configs()]
    assert [t.name for t in user_ebc.embedding_bag_configs()] == [
        t.name for t in layout.embedding_bag_configs(user_side=True)
    ]
    assert [k for t in ec.embedding_configs() for k in t.feature_names] == [
        k for t in layout.embedding_configs() for k in t.feature_names
    ]
    assert dim == layout.sequence_dim
