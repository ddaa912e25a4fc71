"""Transformer encoder of a user action sequence (sequence-modeling article, the baseline: layers
and heads configurable, time-delta position embeddings added by the caller).

A learned summary token is prepended (so an empty sequence still has one valid token and never
yields NaN), then any extra tokens (early feature interaction: user / candidate representations
joining the self-attention); a pre-norm encoder runs ``scaled_dot_product_attention`` with the
padding masked out of every key. Poolings of the encoded events, per unit (request or row):
"summary" (the summary token's output), "mean" (masked mean), "transact" (TransAct-style:
max-pool over the events plus the latest ``transact_recent`` tokens, newest first).

In: events [U, L, W], mask [U, L], extra tokens [U, X, W] or None. Out: pooled [U, output_dim],
encoded events [U, L, W].

``bucketed``: the layers run per length bucket (modules/length_buckets.py), each bucket padded only
to its own longest unit instead of every unit to L; outputs are the same.

The attention kernel is SDPA's choice among all it has, except in CPU BF16 training (MATH, see
``automatic_backends``); ``set_attention_backends(model, backends)`` pins another list, for a
benchmark comparing kernels.
"""

from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from pinads_rec.modules.length_buckets import run_by_length
from pinads_rec.modules.precision import LargeLayer

# Every SDPA kernel, in SDPA's own order of preference: it runs the first that supports the inputs.
ALL_BACKENDS = (
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.MATH,
)


def automatic_backends(q: torch.Tensor, training: bool) -> List[SDPBackend]:
    """The kernels attention may use when none are pinned: MATH alone in CPU BF16 training (there
    the flash-attention backward is slower than the math kernel; benchmarks/inference_precision.py
    measures both), elsewhere all of them (SDPA picks its fastest)."""
    if q.dtype == torch.bfloat16 and training and q.device.type == "cpu":
        return [SDPBackend.MATH]
    return list(ALL_BACKENDS)


class SelfAttention(nn.Module):
    def __init__(self, d_model: int, num_heads: int, dropout: float):
        super().__init__()
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.num_heads, self.dropout = num_heads, dropout
        # The SDPA kernels this layer may use; None: automatic_backends (set_attention_backends pins a list).
        self.backends: Optional[List[SDPBackend]] = None

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        U, L, D = x.shape
        q, k, v = self.qkv(x).view(U, L, 3, self.num_heads, D // self.num_heads).permute(2, 0, 3, 1, 4)
        backends = self.backends if self.backends is not None else automatic_backends(q, self.training)
        with sdpa_kernel(backends):
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=key_mask[:, None, None, :], dropout_p=self.dropout if self.training else 0.0
            )
        return self.out(y.transpose(1, 2).reshape(U, L, D))


def set_attention_backends(model: nn.Module, backends: Optional[Sequence[SDPBackend]]) -> int:
    """Pins the SDPA kernels of every self-attention layer in ``model`` (sharded or not) to
    ``backends``; None gives them back the automatic choice. Returns how many layers it set."""
    layers = [m for m in model.modules() if isinstance(m, SelfAttention)]
    for layer in layers:
        layer.backends = None if backends is None else list(backends)
    return len(layers)


class TransformerLayer(nn.Module):
    """Pre-norm encoder layer: x + attn(LN(x)), then x + FFN(LN(x))."""

    def __init__(self, d_model: int, num_heads: int, ffn_dim: int, dropout: float):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = SelfAttention(d_model, num_heads, dropout)
        self.ffn = nn.Sequential(nn.Linear(d_model, ffn_dim), nn.GELU(), nn.Linear(ffn_dim, d_model))

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), key_mask)
        return x + self.ffn(self.norm2(x))


class TransformerStack(nn.Module):
    """The encoder's layers: the large part of the sequence arch (run in BF16 when configured)."""

    def __init__(self, d_model: int, num_layers: int, num_heads: int, ffn_dim: int, dropout: float):
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(d_model, num_heads, ffn_dim, dropout) for _ in range(num_layers))
        self.norm = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, key_mask)
        return self.norm(x)


class TransformerEncoder(nn.Module):
    def __init__(
        self,
        width: int,
        num_layers: int,
        num_heads: int,
        ffn_dim: int,
        dropout: float,
        poolings: List[str],
        transact_recent: int,
        bucketed: bool = False,
    ):
        super().__init__()
        self.width, self.recent, self.bucketed = width, transact_recent, bucketed
        self.summary_token = nn.Parameter(torch.randn(1, 1, width) * 0.02)
        self.stack = LargeLayer(TransformerStack(width, num_layers, num_heads, ffn_dim, dropout))
        self.summary, self.mean, self.transact = ("summary" in poolings, "mean" in poolings, "transact" in poolings)
        self.output_dim = (self.summary + self.mean + self.transact * (1 + transact_recent)) * width

    def forward(
        self, events: torch.Tensor, mask: torch.Tensor, extra_tokens: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        U, L, W = events.shape
        head = self.summary_token.expand(U, 1, W).to(events.dtype)
        if extra_tokens is not None:
            head = torch.cat([head, extra_tokens.to(events.dtype)], dim=1)
        H = head.shape[1]
        tokens = torch.cat([head, events], dim=1)
        key_mask = torch.cat([torch.ones_like(mask[:, :1]).expand(U, H), mask], dim=1)
        x = run_by_length(self.stack, tokens, key_mask) if self.bucketed else self.stack(tokens, key_mask)
        encoded = x[:, H:]
        m = mask.unsqueeze(-1).to(x.dtype)
        pooled = []
        if self.summary:
            pooled.append(x[:, 0])
        if self.mean:
            pooled.append((encoded * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0))
        if self.transact:
            # Max over real events (0 for an empty sequence), then the newest K tokens (0 past the end).
            peak = encoded.masked_fill(~mask.unsqueeze(-1), float("-inf")).amax(dim=1)
            pooled.append(torch.where(mask.any(dim=1, keepdim=True), peak, torch.zeros_like(peak)))
            pooled.append((encoded[:, : self.recent] * m[:, : self.recent]).reshape(U, -1))
        return torch.cat(pooled, dim=1), encoded
