"""The sequence-encoder registry (modules/encoders.py): an encoder registered from outside (here a
toy masked max pooling) is built, sized and run by ``GroupEncoder`` and accepted by config
validation; one registered with settings of its own (the mean of the newest ``k`` events) is
configured by its keys (``model.sequence.settings.newest.k``) and checked by its entry, with no
change to the config; every built-in combination the configs use gives ``output_dim`` columns."""

import glob
import os
import re
from dataclasses import dataclass

import pytest
import torch
import yaml
from conftest import REPO

from pinads_rec import config
from pinads_rec.config import SequenceEncoderConfig, SequenceFeatureConfig, SequenceGroupConfig
from pinads_rec.modules import encoders
from pinads_rec.modules.encoder_io import EncoderInputs, Parts
from pinads_rec.modules.sequence import GroupEncoder

L, D, DQ, B = 6, 8, 5, 5
LENGTHS = [4, 0, 6]  # events per request
REQUEST_INDEX = torch.tensor([0, 0, 1, 2, 2])  # the request of each row


def _group() -> SequenceGroupConfig:
    return SequenceGroupConfig(
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


def _inputs(query_dim: int = DQ, seed: int = 0):
    """``GroupEncoder.encode``'s arguments, with the ids a retrieval compares."""
    g = torch.Generator().manual_seed(seed)
    n = sum(LENGTHS)
    offsets = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist())
    attributes = [torch.randn(n, D, generator=g) for _ in range(2)]
    query = torch.randn(B, query_dim, generator=g) if query_dim else None
    search = (torch.randint(0, 3, (n,), generator=g), torch.randint(0, 3, (B,), generator=g))
    deltas, pretrained = torch.rand(n, generator=g) * 1e6, torch.randn(n, 4, generator=g)
    # Every key the counts' pairs read (COUNTS): the events' ids, the candidates' with their rows.
    ids = {"g.a": (search[0], None), "g.b": (search[0].flip(0), None), "candidate.c": (search[1], torch.arange(B))}
    return attributes, offsets, deltas, pretrained, REQUEST_INDEX, query, None, search, ids


COUNTS = encoders.MatchCountsConfig(pairs=[encoders.CountPair("a", "c")], by="b", by_values=[1])


def _masked_max(m, i: EncoderInputs) -> Parts:
    # An empty history gives zeros, not -inf.
    x = i.content.masked_fill(~i.mask.unsqueeze(-1), float("-inf")).amax(dim=1)
    return Parts([torch.where(i.mask.any(1, keepdim=True), x, torch.zeros_like(x))])


@pytest.fixture
def max_pooling():
    encoders.register(
        encoders.Encoder(
            "max",
            build=lambda c: {"max_norm": torch.nn.LayerNorm(c.width, bias=False)},
            widths=lambda m, c: (c.width, 0),
            run=lambda m, i: Parts([m["max_norm"](t) for t in _masked_max(m, i).unit]),
        )
    )
    yield
    encoders.unregister("max")


def test_an_encoder_registered_outside_is_built_sized_and_run(max_pooling):
    cfg = SequenceEncoderConfig(d_model=D, encoders=["max", "sum"])
    torch.manual_seed(0)
    enc = GroupEncoder(_group(), cfg, attr_dim=D, query_dim=DQ, user_dim=0).eval()
    assert enc.output_dim == 2 * D
    assert "max_norm.weight" in dict(enc.named_parameters())
    args = _inputs()
    out = enc.encode(*args)
    assert out.shape == (B, 2 * D)
    # Registry order: "sum" (built in) comes first, the registered "max" after it.
    content, mask, _ = enc.events(args[0], args[1], args[2], args[3])
    expected = enc.max_norm(_masked_max(None, EncoderInputs(content, content, mask, None, None, None, None)).unit[0])
    torch.testing.assert_close(out[:, D:], expected.index_select(0, REQUEST_INDEX))
    assert (out[2, D:] == 0).all()  # row 2's request has no event


def test_config_validation_goes_through_the_registry(max_pooling):
    demo = os.path.join(REPO, "configs", "demo.yaml")
    cfg = config.load(demo, ["model.sequence.encoders=[transformer, max]"])
    assert cfg.model.sequence.encoders == ["transformer", "max"]
    with pytest.raises(
        config.ConfigError, match=r"model\.sequence\.encoders\[1\]: must be one of \[.*'max'\], got 'mx'"
    ):
        config.load(demo, ["model.sequence.encoders=[transformer, mx]"])


@dataclass
class NewestSettings:
    # Events averaged, the newest.
    k: int = 2


class NewestMean(torch.nn.Module):
    """The mean of the newest k events (events come newest first): [U, L, W] -> [U, W]."""

    def __init__(self, k: int):
        super().__init__()
        self.k = k

    def forward(self, content: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        keep = mask[:, : self.k].unsqueeze(-1).to(content.dtype)
        return (content[:, : self.k] * keep).sum(1) / keep.sum(1).clamp(min=1)


def _check_newest(c: encoders.CheckContext) -> None:
    config.positive(f"{c.path}.settings.newest.k", c.enc.settings_for("newest").k)


@pytest.fixture
def newest_mean():
    encoders.register(
        encoders.Encoder(
            "newest",
            build=lambda c: {"newest": NewestMean(c.cfg.settings_for("newest").k)},
            widths=lambda m, c: (c.width, 0),
            run=lambda m, i: Parts([m["newest"](i.content, i.mask)]),
            check=_check_newest,
            settings=NewestSettings,
        )
    )
    yield
    encoders.unregister("newest")


def test_an_encoder_registered_outside_with_settings_is_configured_by_its_keys(newest_mean):
    demo = os.path.join(REPO, "configs", "demo.yaml")
    listed = "model.sequence.encoders=[transformer, newest]"
    cfg = config.load(demo, [listed, "model.sequence.settings.newest.k=3"])
    assert cfg.model.sequence.settings_for("newest") == NewestSettings(k=3)
    assert config.from_dict(config.to_dict(cfg)).model.sequence.settings_for("newest").k == 3  # a checkpoint's
    assert config.load(demo, [listed]).model.sequence.settings_for("newest").k == 2  # the defaults
    with pytest.raises(config.ConfigError, match=r"model\.sequence\.settings\.newest\.k: must be > 0, got 0"):
        config.load(demo, [listed, "model.sequence.settings.newest.k=0"])
    with pytest.raises(config.ConfigError, match=r"model\.sequence\.settings\.newest\.j: unknown key"):
        config.load(demo, [listed, "model.sequence.settings.newest.j=1"])
    with pytest.raises(config.ConfigError, match=r"model\.sequence\.settings\.max: no registered encoder 'max'"):
        config.load(demo, [listed, "model.sequence.settings.max.k=1"])

    seq = SequenceEncoderConfig(d_model=D, encoders=["newest"], settings={"newest": NewestSettings(k=3)})
    enc = GroupEncoder(_group(), seq, attr_dim=D, query_dim=DQ, user_dim=0).eval()
    assert enc.output_dim == D and enc.newest.k == 3
    args = _inputs()
    content, mask, _ = enc.events(args[0], args[1], args[2], args[3])
    expected = NewestMean(3)(content, mask).index_select(0, REQUEST_INDEX)
    torch.testing.assert_close(enc.encode(*args), expected)


def _config_combinations():
    """Every ``encoders`` list in configs/ (loaded configs, and the ablations' overrides)."""
    found = set()
    for path in glob.glob(os.path.join(REPO, "configs", "**", "*.yaml"), recursive=True):
        text = open(path).read()
        for m in re.finditer(r"encoders[=:] ?\[([^\]]*)\]", text):
            found.add(tuple(sorted(n.strip() for n in m.group(1).split(",") if n.strip())))
        raw = yaml.safe_load(text)
        sequence = ((raw or {}).get("model") or {}).get("sequence") if isinstance(raw, dict) else None
        if isinstance(sequence, dict):
            found.add(tuple(sorted(sequence.get("encoders", ["transformer"]))))
    found.add(("transformer",))  # the default
    return sorted(found)


@pytest.mark.parametrize("names", _config_combinations(), ids="+".join)
@pytest.mark.parametrize("query_dim", [DQ, 0], ids=["ranker", "user_tower"])
def test_registry_widths_add_up_to_output_dim(names, query_dim):
    assert set(names) <= set(encoders.names())
    cfg = SequenceEncoderConfig(d_model=D, encoders=list(names), window=4, counts=COUNTS)
    context = encoders.BuildContext(_group(), cfg, D, query_dim, 0)
    try:
        enc = GroupEncoder(_group(), cfg, attr_dim=D, query_dim=query_dim, user_dim=0).eval()
    except ValueError:  # only candidate-dependent encoders: nothing to give the user tower
        assert query_dim == 0 and all(encoders.REGISTRY[n].needs_query for n in names)
        return
    total = 0
    for name, modules in enc.encoders:
        total += sum(encoders.REGISTRY[name].widths({n: getattr(enc, n) for n in modules}, context))
    assert total == enc.output_dim
    assert enc.encode(*_inputs(query_dim)).shape == (B, enc.output_dim)


@pytest.mark.slow
def test_loading_a_config_imports_no_torch():
    """Config validation runs the registry's checks; the data tools (build, inspect) load configs
    without torch, so the registry must not import it."""
    import subprocess
    import sys

    code = (
        "import sys; from pinads_rec import config; "
        "config.load('configs/datasets/taobao_ad.yaml'); config.load('configs/demo.yaml'); "
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
