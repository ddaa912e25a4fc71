"""The sequence arch (pinads_rec/modules/sequence.py): a group's encoder assembling the encoders,
poolings and early interaction its config lists -- empty and length-1 sequences, rows never seeing
other requests, per-group configs, the representations the model has -- and every variant of the
sequence ablation training on 2 gloo ranks. The modules it assembles have their own test files
(test_transformer.py, test_din.py, test_pooling.py, ...)."""

import os

import pytest
import torch
import yaml
from conftest import REPO, train_few_steps
from sequence_inputs import L

from pinads_rec import config
from pinads_rec.config import SequenceEncoderConfig, SequenceFeatureConfig, SequenceGroupConfig
from pinads_rec.modules.sequence import GroupEncoder

ABLATION = os.path.join(REPO, "configs", "ablations", "sequence.yaml")


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
    assert pins.encoders == ["transformer", "counts"] and pins.d_model == 32  # the demo's model.sequence
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
