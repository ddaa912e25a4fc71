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
score-sized tensor). The stack ends with a LayerNorm, as ``TransformerStack``.

Memory: queries run in blocks of ``QUERY_BLOCK``, each against the keys it may see (its own
position on), so the causal half of the L x L scores is never built. A layer keeps two score-sized
tensors for backward (before SiLU; after the mask) plus one transient bias gather; the bias indices
(int64) and the mask-times-1/n weights are built once per forward and shared by the layers. At
L = 4,000 that is about 0.4 GB per unit for 2 layers and 2 heads, forward and backward: hence the
length buckets, so that only the few longest units pay it.

The candidate does not join as appended target tokens (the paper's ranking setup): here the history
is encoded once per request and broadcast to its ~12 candidates, which attend to it (target
attention over ``encoded``); appended targets would make the encoding per candidate, or need a
target-aware mask so targets see the history but not each other.

In: events [U, L, W], mask [U, L] bool (True = real event, a prefix), time deltas [U, L] seconds.
Out (``HSTUEncoder``): pooled [U, 2W] = newest event's output (zeros for an empty unit) ++ masked
mean over events; encoded [U, L, W] (zeros at padding). ``HSTUStack`` alone: [U, L, W].
"""

import math
from typing import List, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from pinads_rec.modules.length_buckets import run_by_length
from pinads_rec.modules.precision import LargeLayer


def log2_bucket_(x: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """``time_delta_bucket`` of non-negative float ``x`` in place, as float: floor(log2(1 + x))
    clamped to num_buckets - 1 (no int64 copies of a [U, L, L] tensor)."""
    return x.add_(1.0).log2_().floor_().clamp_(max=num_buckets - 1)


# Queries are taken QUERY_BLOCK at a time, each block against the keys it may see (its own
# position on): the causal half of the L x L scores is never built, halving work and memory.
QUERY_BLOCK = 256
# (start, end, bias index [U, end - start, L - start] int64, weight [U, end - start, L - start])
Block = Tuple[int, int, torch.Tensor, torch.Tensor]


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

    def forward(self, x: torch.Tensor, blocks: List[Block]) -> torch.Tensor:
        """x [U, L, W]; blocks: ``HSTUStack.blocks`` of this batch."""
        U, L, W = x.shape
        H = self.num_heads
        d = W // H
        uvqk = F.silu(self.f1(self.norm_in(x)))
        # Heads first ([H, U, B, L'] scores): the bias gather and its backward then need no
        # transposed copy of an L x L tensor.
        v, q, k = uvqk[..., W:].view(U, L, 3, H, d).permute(2, 3, 0, 1, 4)  # each [H, U, L, d]
        q = q * (1.0 / math.sqrt(d))
        # Both biases in one gather from the table of every (time bucket, position bucket) pair's
        # sum. index_select, not F.embedding: its backward is one index_add pass, where the
        # embedding backward sorts all U * L * L indices (the layer's largest cost by far).
        table = (self.rab_time[:, :, None] + self.rab_pos[:, None, :]).view(H, -1)
        ys = []
        for start, end, bias_index, weight in blocks:
            scores = torch.matmul(q[:, :, start:end], k[:, :, start:].transpose(-1, -2))
            scores.add_(table.index_select(1, bias_index.view(-1)).view(scores.shape))  # matmul keeps q, k
            # In place on SiLU's output (its backward keeps its input): no third L x L tensor.
            attn = F.silu(scores).mul_(weight.to(scores.dtype))
            ys.append(torch.matmul(attn, v[:, :, start:]))
        y = torch.cat(ys, dim=2).permute(1, 2, 0, 3).reshape(U, L, W)
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

    def blocks(self, mask: torch.Tensor, deltas: torch.Tensor, dtype: torch.dtype) -> List[Block]:
        """Per block of QUERY_BLOCK queries [start, end): the keys it may see start at ``start``
        (causal), so each block holds (bias index, weight) [U, end - start, L - start]: the
        bias index = time bucket * position_buckets + position bucket, int64 (index_add, the
        gather's backward, is 10x+ slower on CPU with int32 indices); the weight = 1/n where the key
        is real and at or after the query (the same event or an older one), else 0 -- n the unit's
        own count of events, not the padded length."""
        U, L = mask.shape
        pos = torch.arange(L, device=mask.device)
        count = mask.sum(dim=1).clamp(min=1).to(dtype)
        # Padding may hold anything (even inf/NaN): zeroed, so every bucket index is in range.
        deltas = deltas.masked_fill(~mask, 0)
        out = []
        for start in range(0, L, QUERY_BLOCK):
            end = min(start + QUERY_BLOCK, L)
            gap = (deltas[:, start:end, None] - deltas[:, None, start:]).abs_().float()  # exact for integer seconds
            distance = (pos[None, start:] - pos[start:end, None]).float()  # j - i, negative = masked
            index = log2_bucket_(gap, self.time_buckets).mul_(self.position_buckets)
            index = index.add_(log2_bucket_(distance.abs(), self.position_buckets)).long()
            weight = ((distance >= 0)[None] & mask[:, None, start:]).to(dtype).div_(count[:, None, None])
            out.append((start, end, index, weight))
        return out

    def forward(self, x: torch.Tensor, mask: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
        """x [U, L, W], mask [U, L] bool, deltas [U, L] seconds (float, or integer seconds) -> [U, L, W]."""
        with torch.no_grad():
            blocks = self.blocks(mask, deltas, x.dtype)
        # Padding may hold anything: zeroed, so a masked key's value is finite and its zero weight
        # removes it exactly.
        x = x.masked_fill(~mask.unsqueeze(-1), 0.0)
        for layer in self.layers:
            x = layer(x, blocks)
        return self.norm(x)


class HSTUEncoder(nn.Module):
    def __init__(
        self,
        width: int,
        num_layers: int,
        num_heads: int,
        dropout: float,
        position_buckets: int,
        time_buckets: int,
        bucketed: bool = True,
    ):
        super().__init__()
        self.width, self.bucketed = width, bucketed
        self.stack = LargeLayer(HSTUStack(width, num_layers, num_heads, dropout, position_buckets, time_buckets))
        self.output_dim = 2 * width

    def forward(
        self, events: torch.Tensor, mask: torch.Tensor, deltas: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        # Whole seconds, as integers: a LargeLayer with BF16 weights casts every float input, and
        # BF16 keeps 3 significant digits of a time delta; log2 buckets need no finer than seconds.
        seconds = deltas.round().long()
        m = mask.unsqueeze(-1).to(events.dtype)
        # bucketed: per length bucket (padding-free up to the bucket's growth); else one padded block.
        encoded = (
            run_by_length(self.stack, events, mask, seconds) if self.bucketed else self.stack(events, mask, seconds)
        ) * m
        # Position 0 is the newest event: under the causal mask it has seen the whole history.
        newest = encoded[:, 0]
        mean = encoded.sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
        return torch.cat([newest, mean], dim=1), encoded
