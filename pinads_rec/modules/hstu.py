"""HSTU encoder of a user action sequence (Zhai et al. 2024, "Actions Speak Louder than Words":
Hierarchical Sequential Transduction Units, as in Meta's generative-recommenders).

One HSTU layer, per head h (d = width / num_heads), with x the events [U, L, W]:

    U, V, Q, K = split(SiLU(f1(LN(x))))                                  each [U, H, L, d]
    A[i, j]    = SiLU(Q_i . K_j / sqrt(d) + rab_pos(|i - j|) + rab_time(|t_i - t_j|)) * M[i, j] / n
    Y          = f2(LN(A V) * U)
    x          = x + dropout(Y)

- pointwise SiLU, no softmax: the weights need not sum to 1, so "how much" of a behaviour a user
  shows survives (the paper's argument for it on non-stationary vocabularies);
- M[i, j] = (j >= i) and j is a real event. Sequences are stored NEWEST FIRST, so j >= i is
  "this event and older ones": HSTU's causal mask, and position 0 (the newest event) sees the whole
  history;
- n = the unit's own number of events (at least 1). generative-recommenders divides by the padded
  length N instead; here outputs must not depend on how much padding follows a unit (length
  buckets pad each unit to a different length), so the normalizer is the unit's own count;
- rab_pos, rab_time: relative attention biases, one learned scalar per (head, bucket): the position
  bias over log2 buckets of |i - j| (``position_buckets``), the time bias over log2 buckets of
  |t_i - t_j| seconds, t the events' time deltas before the request (``time_buckets``); both
  bucketed as ``event_representation.time_delta_bucket``, floor(log2(1 + x)).

Choices against generative-recommenders, stated: the scale 1/sqrt(d) (its later kernels take a
scale ``alpha``; its first release had none); biases per head (it shares one across heads) and
bucketed positions (it learns one weight per signed offset up to a fixed max length, which ties the
model to a max length); time bucketed on |t_i - t_j| between any two events (it buckets the gap to
the next event); dropout on the layer output only (no attention dropout: that would be one more
[U, H, L, L] tensor). The stack ends with a LayerNorm, as ``TransformerStack``.

Memory: a layer keeps two [U, H, L, L] tensors for backward (scores before SiLU, weights after the
mask) plus one transient bias gather; the bias indices (int64) and the mask-times-1/n weights
[U, L, L] are built once per forward and shared by the layers. At L = 4,000 that is 64 MB per
(unit, head) per tensor in float32, hence the length buckets: only the few longest units pay it.

The candidate does not join as appended target tokens (the paper's ranking setup): here the history
is encoded once per request and broadcast to its ~12 candidates, which attend to it (target
attention over ``encoded``); appended targets would make the encoding per candidate, or need a
target-aware mask so targets see the history but not each other.

In: events [U, L, W], mask [U, L] bool (True = real event, a prefix), time deltas [U, L] seconds.
Out (``HSTUEncoder``): pooled [U, 2W] = newest event's output (zeros for an empty unit) ++ masked
mean over events; encoded [U, L, W] (zeros at padding). ``HSTUStack`` alone: [U, L, W].
"""

import math
from typing import Tuple

import torch
import torch.nn.functional as F
from torch import nn

from pinads_rec.modules.length_buckets import run_by_length
from pinads_rec.modules.precision import LargeLayer


def log2_bucket_(x: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """``time_delta_bucket`` of non-negative float ``x`` in place, as float: floor(log2(1 + x))
    clamped to num_buckets - 1 (no int64 copies of a [U, L, L] tensor)."""
    return x.add_(1.0).log2_().floor_().clamp_(max=num_buckets - 1)


class HSTULayer(nn.Module):
    def __init__(self, width: int, num_heads: int, dropout: float, position_buckets: int, time_buckets: int):
        super().__init__()
        if width % num_heads:
            raise ValueError(f"hstu: width {width} is not divisible by num_heads {num_heads}")
        self.num_heads, self.dropout, self.position_buckets = num_heads, dropout, position_buckets
        self.norm_in, self.norm_attn = nn.LayerNorm(width), nn.LayerNorm(width)
        self.f1 = nn.Linear(width, 4 * width)
        self.f2 = nn.Linear(width, width)
        self.rab_pos = nn.Parameter(torch.randn(num_heads, position_buckets) * 0.02)
        self.rab_time = nn.Parameter(torch.randn(num_heads, time_buckets) * 0.02)

    def forward(self, x: torch.Tensor, bias_index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [U, L, W]; bias_index [U, L, L] int64 (time bucket * position_buckets + position bucket);
        weight [U, L, L] = mask / n (0 where a key is masked out)."""
        U, L, W = x.shape
        H = self.num_heads
        d = W // H
        uvqk = F.silu(self.f1(self.norm_in(x)))
        # Heads first ([H, U, L, L] scores): the bias gather and its backward then need no
        # transposed copy of an L x L tensor.
        v, q, k = uvqk[..., W:].view(U, L, 3, H, d).permute(2, 3, 0, 1, 4)  # each [H, U, L, d]
        scores = torch.matmul(q * (1.0 / math.sqrt(d)), k.transpose(-1, -2))
        # Both biases in one gather from the table of every (time bucket, position bucket) pair's
        # sum. index_select, not F.embedding: its backward is one index_add pass, where the
        # embedding backward sorts all U * L * L indices (the layer's largest cost by far).
        table = (self.rab_time[:, :, None] + self.rab_pos[:, None, :]).view(H, -1)
        scores.add_(table.index_select(1, bias_index.view(-1)).view(H, U, L, L))  # matmul keeps q, k; not this
        # In place on SiLU's output (its backward keeps its input): no third [H, U, L, L] tensor.
        attn = F.silu(scores).mul_(weight.to(scores.dtype))
        y = torch.matmul(attn, v).permute(1, 2, 0, 3).reshape(U, L, W)
        y = self.f2(self.norm_attn(y) * uvqk[..., :W])
        return x + F.dropout(y, self.dropout, self.training)


class HSTUStack(nn.Module):
    """HSTU layers and a final LayerNorm: the large part of the encoder (run in BF16 when configured).

    Outputs at a unit's real positions depend only on its real events (never on how much padding
    follows, nor on what the padding holds); an empty unit gives finite outputs."""

    def __init__(
        self, width: int, num_layers: int, num_heads: int, dropout: float, position_buckets: int, time_buckets: int
    ):
        super().__init__()
        self.position_buckets, self.time_buckets = position_buckets, time_buckets
        self.layers = nn.ModuleList(
            HSTULayer(width, num_heads, dropout, position_buckets, time_buckets) for _ in range(num_layers)
        )
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
        """x [U, L, W], mask [U, L] bool, deltas [U, L] seconds (float, or integer seconds) -> [U, L, W]."""
        U, L, _ = x.shape
        with torch.no_grad():
            # Padding may hold anything (even inf/NaN): zeroed, so a masked key's value is finite
            # and its zero weight removes it exactly.
            deltas = deltas.masked_fill(~mask, 0)
            gap = (deltas[:, :, None] - deltas[:, None, :]).abs_().float()  # exact for integer seconds
            pos = torch.arange(L, device=x.device)
            distance = (pos[None, :] - pos[:, None]).abs().float()
            # time bucket * position_buckets + position bucket, built in place in the [U, L, L] buffer.
            index = log2_bucket_(gap, self.time_buckets).mul_(self.position_buckets)
            # int64: index_add (the gather's backward) is 10x+ slower on CPU with int32 indices.
            index = index.add_(log2_bucket_(distance, self.position_buckets)).long()
            # Causal (key j at or after query i: the same event or an older one) and real keys,
            # over the unit's own count of events, not the padded length L.
            causal = pos[None, :] >= pos[:, None]  # [L, L]: query i, key j
            count = mask.sum(dim=1).clamp(min=1).to(x.dtype)
            weight = (causal[None] & mask[:, None, :]).to(x.dtype).div_(count[:, None, None])
        x = x.masked_fill(~mask.unsqueeze(-1), 0.0)
        for layer in self.layers:
            x = layer(x, index, weight)
        return self.norm(x)


class HSTUEncoder(nn.Module):
    def __init__(
        self, width: int, num_layers: int, num_heads: int, dropout: float, position_buckets: int, time_buckets: int
    ):
        super().__init__()
        self.width = width
        self.stack = LargeLayer(HSTUStack(width, num_layers, num_heads, dropout, position_buckets, time_buckets))
        self.output_dim = 2 * width

    def forward(
        self, events: torch.Tensor, mask: torch.Tensor, deltas: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        # Whole seconds, as integers: a LargeLayer with BF16 weights casts every float input, and
        # BF16 keeps 3 significant digits of a time delta; log2 buckets need no finer than seconds.
        seconds = deltas.round().long()
        m = mask.unsqueeze(-1).to(events.dtype)
        encoded = run_by_length(self.stack, events, mask, seconds) * m
        # Position 0 is the newest event: under the causal mask it has seen the whole history.
        newest = encoded[:, 0]
        mean = encoded.sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
        return torch.cat([newest, mean], dim=1), encoded
