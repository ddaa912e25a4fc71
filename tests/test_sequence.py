"""Sequence arch modules (modules/sequence.py and the modules it assembles): shapes, padding never
changing an output, empty and length-1 sequences, period boundaries, DIN and attention masks,
cosine features, and every variant of the sequence ablation training on 2 gloo ranks."""

import os

import pytest
import torch
import torch.nn.functional as F
import yaml
from conftest import REPO, train_few_steps

from pinads_rec import config
from pinads_rec.config import SequenceEncoderConfig, SequenceFeatureConfig, SequenceGroupConfig
from pinads_rec.modules.din import DINAttention
from pinads_rec.modules.early_interaction import EarlyInteraction
from pinads_rec.modules.event_representation import EventRepresentation, time_delta_bucket
from pinads_rec.modules.long_short import ShortTermInterest
from pinads_rec.modules.pooling import PeriodSumPooling, sum_pooling
from pinads_rec.modules.sequence import GroupEncoder
from pinads_rec.modules.target_attention import TargetAttention
from pinads_rec.modules.transformer import (
    ALL_BACKENDS,
    TransformerEncoder,
    automatic_backends,
    set_attention_backends,
)

ABLATION = os.path.join(REPO, "configs", "ablations", "sequence.yaml")
W, L = 8, 6


def _padded(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]
    events = torch.randn(len(lengths), L, W, generator=g) * mask.unsqueeze(-1)
    return events, mask


def _perturb_padding(events, mask, value=1e3):
    out = events.clone()
    out[~mask] = value
    return out


def test_time_delta_buckets_are_log2_and_clamped():
    seconds = torch.tensor([-5.0, 0.0, 1.0, 3.0, 1000.0, 1e12])
    assert time_delta_bucket(seconds, 24).tolist() == [0, 0, 1, 2, 9, 23]


@pytest.mark.parametrize("combine,width", [("sum", 16), ("concat", 2 * 8 + 4)])
def test_event_representation_widths_and_padding(combine, width):
    torch.manual_seed(0)
    rep = EventRepresentation([8, 8], 4, L, combine, 16, 24)
    lengths = [3, 0, 6, 1]
    n = sum(lengths)
    offsets = torch.tensor([0, 3, 3, 9, 10])
    attrs = [torch.randn(n, 8), torch.randn(n, 8)]
    content, mask, deltas = rep(attrs, offsets, torch.arange(n, dtype=torch.float32) + 1, torch.randn(n, 4))
    assert rep.width == width and content.shape == (4, L, width)
    assert mask.sum(1).tolist() == lengths
    assert (content[~mask] == 0).all() and (deltas[~mask] == 0).all()
    assert deltas[2, :6].tolist() == [4.0, 5.0, 6.0, 7.0, 8.0, 9.0]  # each unit's events in order
    if combine == "concat":  # side by side, unprojected
        torch.testing.assert_close(content[0, :3, :8], attrs[0][:3])


def test_transformer_encoder_shapes_padding_and_empty_sequences():
    torch.manual_seed(0)
    enc = TransformerEncoder(W, 2, 2, 16, 0.0, ["summary", "mean", "transact"], transact_recent=2).eval()
    assert enc.output_dim == (1 + 1 + 1 + 2) * W
    events, mask = _padded([3, 0, 6, 1])
    tokens = torch.randn(4, 2, W)
    pooled, encoded = enc(events, mask, tokens)
    assert pooled.shape == (4, enc.output_dim) and encoded.shape == (4, L, W)
    assert torch.isfinite(pooled).all()
    again, again_encoded = enc(_perturb_padding(events, mask), mask, tokens)
    torch.testing.assert_close(again, pooled)
    torch.testing.assert_close(again_encoded[mask], encoded[mask])
    # empty sequence: TransAct's max-pool and latest tokens are zeros
    assert (pooled[1, 2 * W :] == 0).all()
    # the extra tokens are attended to
    assert not torch.allclose(enc(events, mask, torch.randn(4, 2, W))[0], pooled)


def _attention_kernels(module, *inputs):
    """The SDPA kernels (aten ops) one forward + backward of ``module`` ran."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        module(*inputs)[0].sum().backward()
    return {e.key for e in prof.key_averages() if e.key.startswith("aten::_scaled_dot_product")}


def test_attention_kernel_is_automatic_unless_pinned():
    """SDPA picks among all its kernels (MATH alone in CPU BF16 training); set_attention_backends
    pins a list on every layer (a benchmark's comparison) and None gives the choice back."""
    bf16 = torch.zeros(1, dtype=torch.bfloat16)
    assert automatic_backends(bf16, training=True) == [torch.nn.attention.SDPBackend.MATH]
    assert automatic_backends(bf16, training=False) == list(ALL_BACKENDS)
    assert automatic_backends(bf16.float(), training=True) == list(ALL_BACKENDS)

    torch.manual_seed(0)
    enc = TransformerEncoder(W, 2, 2, 16, 0.0, ["summary"], transact_recent=0)
    events, mask = _padded([3, 6])
    math = "aten::_scaled_dot_product_attention_math"
    automatic = _attention_kernels(enc, events, mask)
    assert automatic and math not in automatic  # FP32 on CPU: a fused kernel
    assert set_attention_backends(enc, [torch.nn.attention.SDPBackend.MATH]) == 2
    assert _attention_kernels(enc, events, mask) == {math}
    assert set_attention_backends(enc, None) == 2
    assert _attention_kernels(enc, events, mask) == automatic


def test_sum_and_period_sum_pooling_boundaries():
    deltas = torch.tensor([[-1.0, 0.0, 3599.0, 3600.0, 86399.0, 86400.0], [1e9, 10.0, 0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[True] * 6, [True, True, False, False, False, False]])
    pool = PeriodSumPooling([3600.0, 86400.0])
    assert pool.periods(deltas[0]).tolist() == [0, 0, 0, 1, 1, 2]
    events = torch.arange(1, 13, dtype=torch.float32).view(2, 6, 1).expand(2, 6, 2).contiguous()
    out = pool(events, mask, deltas).view(2, 3, 2)[..., 0]
    # row 0: the future event (-1 s) is left out; [0, 3600): 2 + 3; [3600, 86400): 4 + 5; [86400, inf): 6
    assert out[0].tolist() == [5.0, 9.0, 6.0]
    # row 1: [0, 3600) holds event 8, the last period event 7, the middle period is empty: zeros
    assert out[1].tolist() == [8.0, 0.0, 7.0]
    assert sum_pooling(events, mask)[:, 0].tolist() == [21.0, 15.0]
    torch.testing.assert_close(pool(_perturb_padding(events, mask), mask, deltas), pool(events, mask, deltas))


def _din_reference(din, query, events, mask, request_index):
    """DIN written out row by row: an MLP over the explicit [q, k, q - k, q * k] per event."""
    out = []
    for b in range(query.shape[0]):
        q = din.query(query[b])
        u = int(request_index[b])
        k = events[u][mask[u]]
        qq = q.expand_as(k)
        x = torch.cat([qq, k, qq - k, qq * k], dim=1)
        # from_query = q and q - k blocks' q part, from_key = k and q - k blocks' k part: one weight
        # on the concatenation that gives the same first layer.
        w = torch.cat(
            [
                din.from_query.weight,
                din.from_key.weight,
                torch.zeros_like(din.from_key.weight),
                din.from_product.weight,
            ],
            dim=1,
        )
        s = din.score(F.linear(x, w, din.from_query.bias)).squeeze(-1)
        weights = torch.cat([s, torch.zeros(1)]).softmax(0)[:-1]
        out.append(weights @ k if len(k) else torch.zeros(events.shape[-1]))
    return torch.stack(out)


def test_din_matches_the_explicit_mlp_and_masks_padding():
    torch.manual_seed(0)
    din = DINAttention(query_dim=5, width=W, hidden=[16, 8]).eval()
    events, mask = _padded([3, 0, 6])
    query, request_index = torch.randn(5, 5), torch.tensor([0, 0, 1, 2, 2])
    out = din(query, events, mask, request_index)
    assert out.shape == (5, W)
    torch.testing.assert_close(out, _din_reference(din, query, events, mask, request_index), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(din(query, _perturb_padding(events, mask), mask, request_index), out)
    assert (out[2] == 0).all(), "no events: zeros"


def test_short_term_interest_reads_only_the_latest_events():
    torch.manual_seed(0)
    short = ShortTermInterest(query_dim=5, width=W, short_length=2, hidden=[8]).eval()
    events, mask = _padded([5, 1])
    query, request_index = torch.randn(3, 5), torch.tensor([0, 0, 1])
    out = short(query, events, mask, request_index)
    older = events.clone()
    older[:, 2:] = torch.randn(2, L - 2, W)  # events past the newest two
    torch.testing.assert_close(short(query, older, mask, request_index), out)
    newer = events.clone()
    newer[0, 0] += 1.0
    assert not torch.allclose(short(query, newer, mask, request_index)[:2], out[:2])


def test_target_attention_ignores_masked_events_and_empty_is_zero():
    torch.manual_seed(0)
    att = TargetAttention(query_dim=5, d_model=W).eval()
    events, mask = _padded([2, 0])
    query, request_index = torch.randn(3, 5), torch.tensor([0, 0, 1])
    out = att(query, events, mask, request_index)
    torch.testing.assert_close(att(query, _perturb_padding(events, mask), mask, request_index), out)
    assert out.shape == (3, W) and torch.equal(out[2], torch.zeros(W))
    assert not torch.allclose(out[0], out[1])  # candidates of one request differ by their queries


def test_cosine_features_match_a_direct_computation():
    torch.manual_seed(0)
    early = EarlyInteraction(W, {"candidate": 5, "user": 3}, cosine=["candidate", "user"], tokens=["user"]).eval()
    events, mask = _padded([4, 2])
    reps = {"candidate": torch.randn(2, 5), "user": torch.randn(2, 3)}
    out, tokens = early(events, mask, reps)
    for u in range(2):
        cos = torch.stack(
            [
                F.cosine_similarity(events[u], early.cosine_projections[n](reps[n][u]).expand(L, W), dim=1)
                for n in ("candidate", "user")
            ],
            dim=1,
        )  # [L, 2]
        expected = events[u] + early.cosine_attributes(cos) * mask[u].unsqueeze(-1)
        torch.testing.assert_close(out[u], expected, rtol=1e-5, atol=1e-6)
    assert (out[~mask] == 0).all(), "padding stays zero"
    torch.testing.assert_close(tokens[:, 0], early.token_projections["user"](reps["user"]))


def _group(cfg: SequenceEncoderConfig):
    group = SequenceGroupConfig(
        name="g",
        timestamp_column="ts",
        max_length=L,
        embedding_column="emb",
        embedding_dim=4,
        features=[
            SequenceFeatureConfig(name="a", column="a", table="t"),
            SequenceFeatureConfig(name="b", column="b", table="t"),
        ],
    )
    torch.manual_seed(0)
    return GroupEncoder(group, cfg, attr_dim=8, query_dim=5, user_dim=3).eval()


def _group_inputs(lengths, seed=0):
    from torchrec.sparse.jagged_tensor import JaggedTensor

    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    offsets = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    events = {k: JaggedTensor(values=torch.randn(n, 8, generator=g), offsets=offsets) for k in ("g.a", "g.b")}
    return events, torch.rand(n, generator=g) * 1e6, torch.randn(n, 4, generator=g)


EVERYTHING = SequenceEncoderConfig(
    d_model=8,
    num_layers=2,
    num_heads=2,
    ffn_dim=16,
    encoders=["transformer", "sum", "period_sum", "din", "long_short"],
    poolings=["summary", "mean", "transact", "target"],
    transact_recent=2,
    short_length=2,
    early_interaction=config.EarlyInteractionConfig(cosine=["candidate", "user"], tokens=["candidate", "user"]),
    projection=config.SequenceProjectionConfig(dim=6, num_layers=1, low_rank=4),
)


@pytest.mark.parametrize(
    "cfg",
    [
        EVERYTHING,
        SequenceEncoderConfig(d_model=8, encoders=["transformer", "sum", "din"], combine="concat", num_heads=2),
    ],
    ids=["everything", "concat"],
)
def test_group_encoder_empty_and_length_one_sequences_are_finite(cfg):
    enc = _group(cfg)
    lengths = [0, 1, L]
    events, deltas, pre = _group_inputs(lengths)
    request_index = torch.tensor([0, 0, 1, 2, 2, 2])
    out = enc(events, deltas, pre, request_index, torch.randn(6, 5), torch.randn(4, 3))  # 4 user slots: 1 padding
    assert out.shape == (6, enc.output_dim) and torch.isfinite(out).all()


def test_group_encoder_rows_do_not_see_other_requests():
    """A request encoded alone or next to others (its padding and batch change) gives the same rows;
    with candidate early interaction each row is its own unit."""
    enc = _group(EVERYTHING)
    assert enc.per_candidate
    events, deltas, pre = _group_inputs([2, 5, 4])
    query, user = torch.randn(5, 5), torch.randn(3, 3)
    request_index = torch.tensor([0, 0, 1, 2, 2])
    together = enc(events, deltas, pre, request_index, query, user)
    from torchrec.sparse.jagged_tensor import JaggedTensor

    alone_events = {k: JaggedTensor(values=v.values()[2:7], offsets=torch.tensor([0, 5])) for k, v in events.items()}
    alone = enc(alone_events, deltas[2:7], pre[2:7], torch.tensor([0]), query[2:3], user[1:2])
    torch.testing.assert_close(together[2:3], alone, rtol=1e-4, atol=1e-5)


def test_per_group_encoder_configs_merge_over_model_sequence():
    cfg = config.load(
        os.path.join(REPO, "configs", "demo.yaml"),
        ["model.sequence.num_layers=2", "model.sequence_groups={queries: {encoders: [sum], d_model: 16}}"],
    )
    queries, pins = cfg.model.sequence_for("queries"), cfg.model.sequence_for("pins")
    assert queries.encoders == ["sum"] and queries.d_model == 16 and queries.num_layers == 2
    assert pins.encoders == ["transformer"] and pins.d_model == 32
    with pytest.raises(config.ConfigError, match=r"^.*model\.sequence_groups\.nope: no sequence group named 'nope'"):
        config.load(os.path.join(REPO, "configs", "demo.yaml"), ["model.sequence_groups={nope: {}}"])
    with pytest.raises(
        config.ConfigError,
        match=r"model\.sequence_groups\.pins\.num_heads: 3 does not divide the "
        r"concatenated event width 104",
    ):
        config.load(
            os.path.join(REPO, "configs", "demo.yaml"),
            ["model.sequence_groups={pins: {combine: concat, num_heads: 3}}"],
        )


# ---------------------------------------------------------------------------------------------
# Every variant of configs/ablations/sequence.yaml trains a few steps on 2 gloo ranks.
# ---------------------------------------------------------------------------------------------


def _variants():
    with open(ABLATION) as f:
        spec = yaml.safe_load(f)
    model_overrides = [o for o in spec["overrides"] if o.startswith("model.")]
    return [(v["name"], model_overrides + v["overrides"]) for v in spec["variants"]]


@pytest.mark.slow
def test_every_ablation_variant_trains_on_two_ranks(tiny_data, tmp_path):
    _, data_dir = tiny_data
    out = train_few_steps(tmp_path, data_dir, _variants())
    assert list(out) == [name for name, _ in _variants()]
    for name, r in out.items():
        assert r["steps"] == 3 and r["finite"], (name, r)
        expected = 2 if name == "no sequence" else 3  # ebc, user_ebc (+ ec with sequences)
        assert len(r["pipelined"]) == expected, (name, r["pipelined"])


def test_attention_mlps_need_a_hidden_width():
    with pytest.raises(config.ConfigError, match=r"model\.sequence\.din_hidden: list at least one hidden width"):
        config.load(os.path.join(REPO, "configs", "demo.yaml"), ["model.sequence.din_hidden=[]"])


def test_early_interaction_keeps_only_the_representations_the_model_has():
    """The two-tower user tower has no candidate query and may have no user features: the early
    interaction then uses what exists instead of failing inside the forward."""
    cfg = SequenceEncoderConfig(
        d_model=8,
        early_interaction=config.EarlyInteractionConfig(cosine=["candidate", "user"], tokens=["candidate", "user"]),
    )
    group = SequenceGroupConfig(
        name="g",
        timestamp_column="ts",
        max_length=L,
        features=[
            SequenceFeatureConfig(name="a", column="a", table="t"),
            SequenceFeatureConfig(name="b", column="b", table="t"),
        ],
    )
    enc = GroupEncoder(group, cfg, attr_dim=8, query_dim=0, user_dim=0).eval()
    assert enc.early is None and not enc.per_candidate and not enc.uses_user
    events, deltas, _ = _group_inputs([2, 0])
    out = enc(events, deltas, None, torch.tensor([0, 1]), None, None)
    assert out.shape == (2, enc.output_dim) and torch.isfinite(out).all()
    users_only = GroupEncoder(group, cfg, attr_dim=8, query_dim=0, user_dim=3).eval()
    assert users_only.uses_user and not users_only.per_candidate
    assert torch.isfinite(users_only(events, deltas, None, torch.tensor([0, 1]), None, torch.randn(2, 3))).all()
