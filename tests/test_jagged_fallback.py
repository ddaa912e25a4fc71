"""The torch fallbacks for a machine without TorchRec / fbgemm (modules/jagged.py,
modules/torchrec_layers.py) give the same bits as TorchRec and fbgemm, forward and backward; and the
sequence, cross and MMoE modules import and compute the same without them."""

import subprocess
import sys

import pytest
import torch
from conftest import REPO
from torchrec.modules.crossnet import CrossNet, LowRankCrossNet
from torchrec.modules.mlp import MLP

from pinads_rec.modules import jagged
from pinads_rec.modules.torchrec_layers import TorchCrossNet, TorchLowRankCrossNet, TorchMLP


def _equal_with_grads(a, b, x):
    """a(x) and b(x) bit for bit, and the gradients of their parameters and of x."""
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = a(xa), b(xb)
    assert torch.equal(ya, yb)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    assert torch.equal(xa.grad, xb.grad)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa.grad, pb.grad), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padding_matches_fbgemm_forward_and_backward(dtype):
    torch.manual_seed(0)
    lengths = torch.tensor([0, 3, 7, 1, 0, 5, 9])  # empty units, and units longer than L (cut off)
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    values = torch.randn(int(lengths.sum()), 4, dtype=dtype)
    for L in (1, 5, 12):
        va, vb = values.clone().requires_grad_(), values.clone().requires_grad_()
        ref = torch.ops.fbgemm.jagged_to_padded_dense(va, [offsets], [L], 0.0)
        out = jagged.pad_jagged_torch(vb, offsets, L)
        assert out.shape == ref.shape == (len(lengths), L, 4) and torch.equal(out, ref)
        g = torch.randn_like(ref)
        ref.backward(g)
        out.backward(g)
        assert torch.equal(va.grad, vb.grad)


def test_cross_layers_and_mlp_match_torchrec():
    x = torch.randn(16, 24)
    for ours, theirs in (
        (lambda: TorchCrossNet(24, 3), lambda: CrossNet(24, 3)),
        (lambda: TorchLowRankCrossNet(24, 3, 8), lambda: LowRankCrossNet(24, 3, 8)),
        (lambda: TorchMLP(24, [32, 8]), lambda: MLP(24, [32, 8])),
    ):
        torch.manual_seed(1)
        a = ours()
        torch.manual_seed(1)
        b = theirs()
        # The same seed gives the same weights under the same names (checkpoints load into either).
        sa, sb = a.state_dict(), b.state_dict()
        assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
        _equal_with_grads(a, b, x)


# Builds a sequence group encoder, a cross network and an MMoE from one seed and runs them on fixed
# inputs; prints whether TorchRec / fbgemm were used and writes the outputs. sys.modules[name] = None
# is Python's documented way to make a module absent (find_spec then says so, import raises).
_PROBE = """
import sys
if sys.argv[2] == "absent":
    sys.modules["torchrec"] = sys.modules["fbgemm_gpu"] = None
import torch
from pinads_rec.config import SequenceEncoderConfig, SequenceFeatureConfig, SequenceGroupConfig
from pinads_rec.modules import jagged, torchrec_layers
from pinads_rec.modules.cross_network import cross_network
from pinads_rec.modules.mmoe import MMoE
from pinads_rec.modules.sequence import GroupEncoder

torch.manual_seed(0)
group = SequenceGroupConfig("g", "ts", [SequenceFeatureConfig("a", "a", "t"), SequenceFeatureConfig("b", "b", "t")], 6)
cfg = SequenceEncoderConfig(encoders=["transformer", "din", "long_short"], short_length=3)
enc = GroupEncoder(group, cfg, 8, 5, 0)
cross, mmoe = cross_network(enc.output_dim, 2, 4), MMoE(enc.output_dim, 2, 3, 2, [16, 8], [4])
lengths = torch.tensor([0, 4, 9, 2])
offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
n = int(lengths.sum())
request_index = torch.tensor([0, 1, 1, 2, 2, 2, 3])
attributes, deltas, query = [torch.randn(n, 8), torch.randn(n, 8)], torch.rand(n) * 1e5, torch.randn(7, 5)
x = enc.encode(attributes, offsets, deltas, None, request_index, query, None)
out = mmoe(cross(x))
out.sum().backward()
grads = [p.grad for m in (enc, cross, mmoe) for p in m.parameters() if p.grad is not None]
torch.save({"x": x, "out": out, "grads": grads}, sys.argv[1])
imported = sorted({m.split(".")[0] for m, v in sys.modules.items() if v is not None} & {"torchrec", "fbgemm_gpu"})
print(jagged.HAVE_FBGEMM, torchrec_layers.HAVE_TORCHREC, imported)
"""


@pytest.mark.slow
def test_the_arch_runs_and_agrees_without_torchrec_and_fbgemm(tmp_path):
    results = {}
    for mode in ("installed", "absent"):
        path = tmp_path / f"{mode}.pt"
        proc = subprocess.run(
            [sys.executable, "-c", _PROBE, str(path), mode], capture_output=True, text=True, cwd=REPO, timeout=300
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[mode] = (proc.stdout.strip().splitlines()[-1], torch.load(path))
    assert results["installed"][0] == "True True ['fbgemm_gpu', 'torchrec']"
    assert results["absent"][0] == "False False []"
    a, b = results["installed"][1], results["absent"][1]
    assert torch.equal(a["x"], b["x"]) and torch.equal(a["out"], b["out"])
    assert len(a["grads"]) == len(b["grads"]) and all(torch.equal(g, h) for g, h in zip(a["grads"], b["grads"]))
