"""Long histories (modules/sequence.py with ``padding: buckets``, ``window``, ``retrieval`` and
``hstu``): the bucketed path gives the padded path's outputs, padding never changes an output, the
hard search finds the newest matching events, the window hides older events from every encoder but
the retrieval."""

import pytest
import torch
from conftest import REPO, train_few_steps

from pinads_rec import config
from pinads_rec.config import (
    RetrievalConfig,
    SequenceEncoderConfig,
    SequenceFeatureConfig,
    SequenceGroupConfig,
)
from pinads_rec.modules.retrieval import TargetRetrieval, hard_search
from pinads_rec.modules.sequence import GroupEncoder
from pinads_rec.modules.transformer import TransformerEncoder

D, DQ = 8, 5


def _group(max_length: int) -> SequenceGroupConfig:
    return SequenceGroupConfig(
        name="g",
        timestamp_column="ts",
        max_length=max_length,
        features=[
            SequenceFeatureConfig(name="item", column="item", table="t"),
            SequenceFeatureConfig(name="topic", column="topic", table="t"),
        ],
    )


def _inputs(lengths, rows_per_request=3, topics=4, seed=0):
    """Plain-tensor inputs of ``GroupEncoder.encode``: attributes, offsets, deltas, request_index,
    query, and the (event topic ids, candidate topic ids) pair."""
    g = torch.Generator().manual_seed(seed)
    n, U = sum(lengths), len(lengths)
    offsets = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    attributes = [torch.randn(n, D, generator=g) for _ in range(2)]
    # Newest first: time deltas grow along each sequence.
    deltas = torch.cat([torch.sort(torch.rand(k, generator=g) * 1e6).values for k in lengths])
    request_index = torch.arange(U).repeat_interleave(rows_per_request)
    query = torch.randn(len(request_index), DQ, generator=g)
    event_topics = torch.randint(1, topics + 1, (n,), generator=g)
    candidate_topics = torch.randint(1, topics + 1, (len(request_index),), generator=g)
    return attributes, offsets, deltas, request_index, query, (event_topics, candidate_topics)


def _encode(enc, inputs):
    attributes, offsets, deltas, request_index, query, search = inputs
    return enc.encode(attributes, offsets, deltas, None, request_index, query, None, search)


FULL = dict(
    encoders=["transformer", "din", "long_short", "sum", "period_sum", "hstu", "retrieval"],
    poolings=["summary", "mean", "transact", "target"],
    num_layers=2,
    num_heads=2,
    d_model=16,
    retrieval=RetrievalConfig(attribute="topic", candidate="item_topic", max_events=4),
)


@pytest.mark.parametrize("window", [0, 20])
def test_bucketed_equals_padded_and_padding_never_changes_an_output(window):
    lengths = [0, 1, 7, 60, 33, 180, 2, 120]
    torch.manual_seed(0)
    padded = GroupEncoder(_group(200), SequenceEncoderConfig(**FULL, window=window), D, DQ, 0).eval()
    bucketed = GroupEncoder(_group(200), SequenceEncoderConfig(**FULL, window=window, padding="buckets"), D, DQ, 0)
    bucketed.load_state_dict(padded.state_dict())
    longer = GroupEncoder(_group(450), SequenceEncoderConfig(**FULL, window=window), D, DQ, 0)
    longer.load_state_dict(padded.state_dict())
    inputs = _inputs(lengths)
    with torch.no_grad():
        reference = _encode(padded, inputs)
        assert torch.isfinite(reference).all()
        assert torch.allclose(_encode(bucketed.eval(), inputs), reference, atol=1e-5)
        # Padding every request to 450 instead of 200 changes nothing either.
        assert torch.allclose(_encode(longer.eval(), inputs), reference, atol=1e-5)


def test_transformer_ignores_what_the_padding_holds():
    torch.manual_seed(0)
    enc = TransformerEncoder(D, 2, 2, 16, 0.0, ["summary", "mean", "transact"], 2, bucketed=True).eval()
    mask = torch.arange(50)[None, :] < torch.tensor([3, 50, 0, 17])[:, None]
    events = torch.randn(4, 50, D)
    garbage = torch.where(mask.unsqueeze(-1), events, torch.full_like(events, 1e3))
    with torch.no_grad():
        (a, ea), (b, eb) = enc(events, mask), enc(garbage, mask)
    assert torch.allclose(a, b, atol=1e-5)
    assert torch.allclose(ea * mask.unsqueeze(-1), eb * mask.unsqueeze(-1), atol=1e-5)


def test_hard_search_keeps_the_newest_matches_and_counts_all():
    g = torch.Generator().manual_seed(3)
    U, L, k = 5, 40, 3
    ids = torch.randint(0, 4, (U, L), generator=g)
    lengths = torch.tensor([0, 1, 40, 25, 9])
    mask = torch.arange(L)[None, :] < lengths[:, None]
    request_index = torch.tensor([0, 1, 1, 2, 2, 2, 3, 4, 4])
    cand = torch.randint(0, 4, (len(request_index),), generator=g)
    position, found, count = hard_search(ids, mask, cand, request_index, k)
    for b, u in enumerate(request_index.tolist()):
        expected = [p for p in range(int(lengths[u])) if ids[u, p] == cand[b]]
        assert count[b] == len(expected)
        assert position[b][found[b]].tolist() == expected[:k]


def test_retrieval_attends_only_to_matching_events():
    torch.manual_seed(0)
    ret = TargetRetrieval(DQ, D, max_events=2).eval()
    events = torch.randn(1, 6, D)
    ids = torch.tensor([[1, 2, 1, 1, 2, 3]])
    mask = torch.ones(1, 6, dtype=torch.bool)
    query, request_index = torch.randn(3, DQ), torch.zeros(3, dtype=torch.long)
    with torch.no_grad():
        out = ret(events, ids, mask, torch.tensor([1, 7, 3]), query, request_index)
        # Changing an event that matches no candidate's id, or a match past the newest two, changes nothing.
        changed = events.clone()
        changed[0, 3] += 10.0  # the third topic-1 event: past max_events
        changed[0, 1] += 10.0  # topic 2: no candidate
        again = ret(changed, ids, mask, torch.tensor([1, 7, 3]), query, request_index)
    assert torch.allclose(out, again)
    assert out[1, :D].abs().max() == 0  # no match: attends to nothing
    assert out[:, D].tolist() == pytest.approx([torch.log1p(torch.tensor(3.0)).item(), 0.0, 0.6931472])


def test_the_window_hides_old_events_from_every_encoder_but_the_retrieval():
    lengths = [60, 45]
    cfg = dict(FULL, encoders=["transformer", "din", "sum", "hstu"])
    torch.manual_seed(0)
    windowed = GroupEncoder(_group(100), SequenceEncoderConfig(**cfg, window=10), D, DQ, 0).eval()
    searching = GroupEncoder(_group(100), SequenceEncoderConfig(**FULL, window=10, padding="buckets"), D, DQ, 0).eval()
    inputs = _inputs(lengths)
    attributes, offsets, deltas, request_index, query, (topics, cand) = inputs
    # Make event 30 of the first request match its first candidate, then change it.
    topics = topics.clone()
    topics[:30] = cand[0] % 4 + 1  # no newer match: event 30 is the newest one
    topics[30] = cand[0]
    old = [a.clone() for a in attributes]
    old[0][30] += 5.0
    changed = (old, offsets, deltas, request_index, query, (topics, cand))
    base = (attributes, offsets, deltas, request_index, query, (topics, cand))
    with torch.no_grad():
        assert torch.equal(_encode(windowed, base), _encode(windowed, changed))
        a, b = _encode(searching, base), _encode(searching, changed)
    assert not torch.allclose(a[0], b[0])  # the retrieval found it


def test_overrides_reach_a_group_by_name_or_index():
    demo = f"{REPO}/configs/demo.yaml"
    cfg = config.load(
        demo, ["features.sequence_groups.pins.max_length=1000", "features.sequence_groups.2.max_length=7"]
    )
    assert [g.max_length for g in cfg.features.sequence_groups] == [1000, 50, 7]
    with pytest.raises(config.ConfigError, match=r"features\.sequence_groups has no element named 'clicks'"):
        config.load(demo, ["features.sequence_groups.clicks.max_length=5"])
    with pytest.raises(config.ConfigError, match=r"features\.sequence_groups has 3 elements, no index 3"):
        config.load(demo, ["features.sequence_groups.3.max_length=5"])


def test_retrieval_config_names_what_is_wrong():
    demo = f"{REPO}/configs/demo.yaml"
    on = "model.sequence_groups={pins: {encoders: [transformer, retrieval], window: 100}}"
    cfg = config.load(demo, [on])
    assert cfg.model.sequence_for("pins").retrieval.attribute == "topic"
    with pytest.raises(config.ConfigError, match=r"model\.sequence_groups\.pins\.retrieval\.attribute: 'color' is not"):
        config.load(demo, [on, "model.sequence_groups.pins.retrieval.attribute=color"])
    with pytest.raises(config.ConfigError, match=r"retrieval\.candidate: 'advertiser_id' uses table 'advertiser'"):
        config.load(demo, [on, "model.sequence_groups.pins.retrieval.candidate=advertiser_id"])
    with pytest.raises(config.ConfigError, match=r"retrieval\.candidate: 'query_tokens' is not a candidate-side"):
        config.load(demo, [on, "model.sequence_groups.pins.retrieval.candidate=query_tokens"])
    with pytest.raises(
        config.ConfigError,
        match=r"model\.sequence\.window: 500 is more than the max_length 100 of sequence group 'pins'",
    ):
        config.load(demo, ["model.sequence.window=500"])


def test_each_group_retrieves_by_its_own_attribute(tiny_data):
    """model.sequence lists the retrieval for every group; the queries group has no item attribute,
    so it names its own under model.sequence_groups (the error says where), and the model reads
    each group's own ids."""
    from conftest import load_tiny

    from pinads_rec.models import build_model
    from pinads_rec.serve.batching import file_order_batches

    _, data_dir = tiny_data
    shared = [
        "model.sequence.encoders=[transformer, retrieval]",
        "model.sequence.retrieval={attribute: item, candidate: item_id, max_events: 4}",
    ]
    with pytest.raises(
        config.ConfigError,
        match=r"model\.sequence\.retrieval\.attribute: 'item' is not a feature of sequence group 'queries' .*; "
        r"model\.sequence serves every group without an entry in model\.sequence_groups: set "
        r"model\.sequence_groups\.queries\.retrieval\.attribute for group 'queries' alone, or its encoders "
        r"without 'retrieval'",
    ):
        load_tiny(data_dir, shared)
    own = "model.sequence_groups={queries: {retrieval: {attribute: topic, candidate: item_topic}}}"
    cfg = load_tiny(data_dir, shared + [own])
    assert cfg.model.sequence_for("queries").retrieval.max_events == 4  # the rest is model.sequence's
    torch.manual_seed(0)
    model = build_model(cfg.features, cfg.model).eval()
    arch = model.sequence_arch
    assert {g: e.id_keys for g, e in arch.groups.items()} == {
        "pins": ["pins.item", "candidate.item_id"],
        "ads": ["ads.item", "candidate.item_id"],
        "queries": ["queries.topic", "candidate.item_topic"],
    }
    batch = next(iter(file_order_batches(cfg, f"{data_dir}/eval", 64)))
    with torch.no_grad():
        assert torch.isfinite(model(batch)).all()


LONG_VARIANTS = {
    "unpadded Transformer": ["model.sequence.padding=buckets"],
    "retrieval": [
        "model.sequence_groups={pins: {encoders: [transformer, retrieval], window: 10, padding: buckets}}",
    ],
    "HSTU": ["model.sequence_groups={pins: {encoders: [hstu]}}"],
}


@pytest.mark.slow
def test_long_history_variants_train_pipelined_on_two_ranks(tiny_data, tmp_path):
    """Every sharded collection stays pipelined: the new encoders live inside the sequence arch's
    leaf, and the retrieval's ids are read from the batch, not from a modified KJT."""
    _, data_dir = tiny_data
    cap = ["features.sequence_groups.pins.max_length=60"]
    out = train_few_steps(tmp_path, data_dir, [(name, cap + o) for name, o in LONG_VARIANTS.items()])
    assert list(out) == list(LONG_VARIANTS)
    for name, r in out.items():
        assert r["steps"] == 3 and r["finite"], (name, r)
        assert sorted(m.rsplit(".", 1)[-1] for m in r["pipelined"]) == ["ebc", "ec", "user_ebc"], (name, r)


@pytest.mark.slow
def test_export_traces_the_padded_path_with_the_same_scores(tiny_data):
    """torch.export cannot trace the bucket loop: while exporting, the encoders run on the whole
    padded block, and the exported program scores a batch as the eager (bucketed) model does."""
    from conftest import load_tiny

    from pinads_rec.models import build_model
    from pinads_rec.serve.batching import file_order_batches
    from pinads_rec.serve.export import FlatScorer, export_program, flat_inputs
    from pinads_rec.serve.loading import prepare

    _, data_dir = tiny_data
    cfg = load_tiny(
        data_dir,
        [
            "features.sequence_groups.pins.max_length=60",
            "model.sequence_groups={pins: {encoders: [transformer, retrieval, hstu], window: 10, padding: buckets}}",
        ],
    )
    torch.manual_seed(0)
    model = prepare(build_model(cfg.features, cfg.model), "fp32")
    batch = next(iter(file_order_batches(cfg, f"{data_dir}/eval", 64)))
    program = export_program(model, cfg.features, batch)
    eager = FlatScorer(model, cfg.features).eval()
    other = next(iter(file_order_batches(cfg, f"{data_dir}/train", 150)))  # other sizes, same program
    for b in (batch, other):
        with torch.no_grad():
            expected = eager(*flat_inputs(b))
            got = program.module()(*flat_inputs(b))
        assert got.shape == expected.shape
        assert float((got - expected).abs().max()) < 1e-5
