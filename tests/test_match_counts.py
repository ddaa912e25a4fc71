"""Target-aware counting (modules/match_counts.py, the ``counts`` encoder): the counts equal a
count made by hand from the same events; padding, other requests' events and events past a window
never count; bags match on any shared id; the config names what is wrong; the encoder trains in
the full model on 2 gloo ranks (test_sequence's ablation variants include it)."""

import math
import os

import pytest
import torch
from conftest import REPO

from pinads_rec import config
from pinads_rec.config import SequenceEncoderConfig, SequenceFeatureConfig, SequenceGroupConfig
from pinads_rec.modules import encoders
from pinads_rec.modules.encoders import CountPair, MatchCountsConfig
from pinads_rec.modules.match_counts import SINCE_CAP_S, MatchCounts
from pinads_rec.modules.sequence import GroupEncoder

DEMO = os.path.join(REPO, "configs", "demo.yaml")
L = 6
LENGTHS = [4, 0, 6]  # events per request
REQUEST_INDEX = torch.tensor([0, 0, 1, 2, 2])


def _events(seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(LENGTHS)
    return (
        torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist()),
        torch.randint(0, 3, (n,), generator=g),  # the attribute's ids
        torch.randint(1, 3, (n,), generator=g),  # the action's ids
        torch.rand(n, generator=g) * 3 * 86400,  # ages
        torch.randint(0, 3, (REQUEST_INDEX.shape[0],), generator=g),  # the candidates' ids
    )


def _by_hand(offsets, ids, actions, ages, candidates, windows, half_life, values):
    """Each feature as the module's docstring states it: log1p of the count over log1p of its most."""
    rows = []
    for b, u in enumerate(REQUEST_INDEX.tolist()):
        events = list(range(offsets[u], offsets[u + 1]))  # newest first
        hits = [e for e in events if ids[e] == candidates[b]]
        position = {e: i for i, e in enumerate(events)}
        f = [math.log1p(sum(position[e] < w for e in hits)) / math.log1p(w) for w in windows]
        f += [
            math.log1p(sum(position[e] < w and actions[e] == v for e in hits)) / math.log1p(w)
            for w in windows
            for v in values
        ]
        f.append(math.log1p(sum(2 ** (-float(ages[e]) / half_life) for e in hits)) / math.log1p(L))
        since = min(float(ages[e]) for e in hits) if hits else 0.0
        f += [math.log1p(since) / math.log1p(SINCE_CAP_S), 1.0 if hits else 0.0]
        rows.append(f)
    return torch.tensor(rows)


def test_counts_equal_a_count_by_hand():
    offsets, ids, actions, ages, candidates = _events()
    windows, values = [2, 0], [1, 2]
    m = MatchCounts([("g.a", "candidate.c")], "g.act", windows, [86400.0], values, L, dim=0)
    mask = torch.arange(L) < torch.tensor(LENGTHS)[:, None]
    padded_ages = torch.zeros(3, L)
    for u in range(3):
        padded_ages[u, : LENGTHS[u]] = ages[offsets[u] : offsets[u + 1]]
    got = m(
        {"g.a": (ids, None), "g.act": (actions, None), "candidate.c": (candidates, torch.arange(5))},
        offsets,
        mask,
        padded_ages,
        REQUEST_INDEX,
    )
    want = _by_hand(offsets, ids, actions, ages, candidates, [2, L], 86400.0, values)
    assert got.shape == (5, m.num_features) == (5, 2 + 2 * 2 + 1 + 2)
    torch.testing.assert_close(got, want)
    assert (got[2] == 0).all()  # the request without events counts nothing


def test_a_bag_matches_on_any_shared_id_and_the_encoding_is_learned():
    """A candidate with two ids (a multi-hot feature) matches an event holding either; an event's
    bag (padded with -1) matches when it holds the candidate's id; every feature is in [0, 1]."""
    offsets = torch.tensor([0, 3])
    bags = torch.tensor([[5, -1], [7, 8], [9, -1]])  # three events' ids
    m = MatchCounts([("g.tags", "candidate.tags")], None, [0], [], [], 4, dim=4)
    mask = torch.tensor([[True, True, True, False]])
    ids = {"g.tags": (bags, None), "candidate.tags": (torch.tensor([8, 5, 1]), torch.tensor([0, 0, 1]))}
    out = m(ids, offsets, mask, torch.zeros(1, 4), torch.tensor([0, 0]))
    assert out.shape == (2, m.num_features + 4)
    assert out[:, 0].tolist() == pytest.approx([math.log1p(2) / math.log1p(4), 0.0])  # row 0: ids 8, 5; row 1: 1
    out.sum().backward()
    assert m.encode.weight.grad.abs().sum() > 0
    assert ((out[:, : m.num_features] >= 0) & (out[:, : m.num_features] <= 1)).all()  # bounded inputs of the DCN


def test_the_group_encoder_runs_counts_from_the_sequence_ids():
    group = SequenceGroupConfig(
        name="g",
        timestamp_column="ts",
        max_length=L,
        features=[
            SequenceFeatureConfig(name="a", column="a", table="t"),
            SequenceFeatureConfig(name="act", column="act", table="u"),
        ],
    )
    settings = MatchCountsConfig(pairs=[CountPair("a", "c")], by="act", by_values=[1, 2], windows=[2, 0])
    cfg = SequenceEncoderConfig(d_model=8, encoders=["counts"], counts=settings)
    assert encoders.REGISTRY["counts"].id_keys(group, cfg) == ["g.a", "candidate.c", "g.act"]
    enc = GroupEncoder(group, cfg, attr_dim=8, query_dim=5, user_dim=0).eval()
    offsets, ids, actions, ages, candidates = _events()
    n = ids.shape[0]
    attributes = [torch.randn(n, 8), torch.randn(n, 8)]
    by_key = {"g.a": (ids, None), "g.act": (actions, None), "candidate.c": (candidates, torch.arange(5))}
    out = enc.encode(attributes, offsets, ages, None, REQUEST_INDEX, torch.randn(5, 5), None, None, by_key)
    assert out.shape == (5, enc.output_dim)
    want = _by_hand(offsets, ids, actions, ages, candidates, [2, L], 86400.0, [1, 2])
    torch.testing.assert_close(out[:, : want.shape[1]], want)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["{pairs: [{attribute: nope, candidate: item_id}]}"],
            r"pairs\[0\]\.attribute: 'nope' is not a feature of any",
        ),
        (["{pairs: [{attribute: item, candidate: user_id}]}"], r"pairs\[0\]\.candidate: 'user_id' is not a candid"),
        (["{pairs: [{attribute: topic, candidate: item_id}]}"], r"uses table 'item' but pins\.topic uses 'topic'"),
        (["{by: action, by_values: []}"], r"by_values: give the ids of .*\.by to count apart"),
        (["{windows: [-1]}"], r"windows\[0\]: must be >= 0"),
    ],
)
def test_a_bad_counts_config_names_the_key(overrides, message):
    sets = ["model.sequence.encoders=[transformer, counts]"]
    with pytest.raises(config.ConfigError, match=message):
        config.load(DEMO, sets + [f"model.sequence.counts={o}" for o in overrides])


def test_a_match_indicator_is_one_where_the_two_features_share_an_id():
    """Per row against per row, and per row against a request's bag of ids (user-side)."""
    from pinads_rec.modules.id_match import IdMatches, shared_id

    request_index = torch.tensor([0, 0, 1])
    candidate = (torch.tensor([4, 5, 4]), torch.tensor([0, 1, 2]))  # one id per row
    context = (torch.tensor([4, 4, 9]), torch.tensor([0, 1, 2]))
    assert shared_id(candidate, context, False, request_index).tolist() == [True, False, False]
    query = (torch.tensor([5, 7, 4]), torch.tensor([0, 0, 1]))  # request 0 holds {5, 7}, request 1 {4}
    assert shared_id(candidate, query, True, request_index).tolist() == [False, True, True]
    two = (torch.tensor([1, 5, 9]), torch.tensor([0, 0, 2]))  # row 0 holds {1, 5}, row 1 none
    assert shared_id(two, query, True, request_index).tolist() == [True, False, False]
    out = IdMatches([("a", "b"), ("a", "q")])([(candidate, context, False), (candidate, query, True)], request_index)
    assert out.tolist() == [[1.0, 0.0], [0.0, 1.0], [0.0, 1.0]]


@pytest.mark.parametrize(
    "pair, message",
    [
        ("{candidate: query_tokens, other: item_topic}", r"id_matches\[0\]\.candidate: 'query_tokens' is not a cand"),
        ("{candidate: item_topic, other: nope}", r"id_matches\[0\]\.other: 'nope' is not another sparse feature"),
        ("{candidate: item_topic, other: item_id}", r"uses table 'item' but 'item_topic' uses 'topic'"),
    ],
)
def test_a_bad_match_pair_names_the_key(pair, message):
    with pytest.raises(config.ConfigError, match=message):
        config.load(DEMO, [f"model.id_matches=[{pair}]"])


def test_a_group_without_the_pairs_attributes_counts_nothing():
    """model.sequence serves every group: one without a pair's attribute (the demo's query history
    has no items) counts the pairs it has, and one with none of them counts nothing."""
    group = SequenceGroupConfig(
        name="q",
        timestamp_column="ts",
        max_length=L,
        features=[SequenceFeatureConfig(name="token", column="t", table="t")],
    )
    cfg = SequenceEncoderConfig(d_model=8, encoders=["transformer", "counts"])
    enc = GroupEncoder(group, cfg, attr_dim=8, query_dim=5, user_dim=0)
    assert enc.counts is None and enc.id_keys == []
    demo = config.load(DEMO)
    pins, queries = (
        GroupEncoder(g, demo.model.sequence_for(g.name), 32, 5, 0) for g in demo.features.sequence_groups[::2]
    )
    assert pins.counts.pair_keys == [("pins.item", "candidate.item_id"), ("pins.topic", "candidate.item_topic")]
    assert pins.counts.by_key == "pins.action"
    assert queries.counts.pair_keys == [("queries.topic", "candidate.item_topic")] and queries.counts.by_key is None
