"""Sequence arch for one group of user engagement events (sequence-modeling article).

Event representation: the sum of the event's attribute embeddings (item, action, taxonomy...; all
from one EmbeddingCollection width), plus the projected pretrained per-event embedding when the
group has one, projected to ``d_model``, plus a **time-delta position embedding**: the bucketized
log of (request time - event time), so position means "how long ago", not "how many events ago".

Encoder: the jagged events are padded to the group's max length with ``fbgemm.jagged_to_padded_dense``;
a learned summary token is prepended (so an empty sequence still has one valid token and never
yields NaN); a pre-norm Transformer encoder runs ``scaled_dot_product_attention`` with the padding
masked out of every key. Per-request poolings: the summary token's output and/or the masked mean
of the events. The encoded events and their mask are returned too, for target attention.

In: per attribute [N, D_attr] (N events over U requests), offsets [U + 1], time deltas [N] seconds,
optional pretrained [N, E]. Out: pooled [U, P * d_model], events [U, L, d_model], mask [U, L].
"""

from typing import List, Optional, Tuple

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
import torch
import torch.nn.functional as F
from torch import nn

from pinads_rec.config import SequenceEncoderConfig


def time_delta_bucket(seconds: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """floor(log2(1 + seconds)) clamped to [0, num_buckets - 1]; future events fall in bucket 0."""
    return torch.log2(1.0 + seconds.clamp(min=0.0)).floor().long().clamp(max=num_buckets - 1)


class SelfAttention(nn.Module):
    def __init__(self, d_model: int, num_heads: int, dropout: float):
        super().__init__()
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.num_heads, self.dropout = num_heads, dropout

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        U, L, D = x.shape
        q, k, v = self.qkv(x).view(U, L, 3, self.num_heads, D // self.num_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask[:, None, None, :],
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(U, L, D))


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


class SequenceEncoder(nn.Module):
    def __init__(self, attr_dim: int, max_length: int, cfg: SequenceEncoderConfig, pretrained_dim: int = 0):
        super().__init__()
        d = cfg.d_model
        self.max_length, self.time_buckets, self.d_model = max_length, cfg.time_buckets, d
        self.pretrained = nn.Linear(pretrained_dim, attr_dim) if pretrained_dim else None
        self.project = nn.Linear(attr_dim, d)
        self.time_embedding = nn.Embedding(cfg.time_buckets, d)
        self.summary_token = nn.Parameter(torch.randn(1, 1, d) * 0.02)
        self.layers = nn.ModuleList(
            TransformerLayer(d, cfg.num_heads, cfg.ffn_dim, cfg.dropout) for _ in range(cfg.num_layers))
        self.norm = nn.LayerNorm(d)
        self.summary, self.mean = "summary" in cfg.poolings, "mean" in cfg.poolings

    @property
    def output_dim(self) -> int:
        """Width of the per-request pooled output."""
        return (self.summary + self.mean) * self.d_model

    def forward(self, attributes: List[torch.Tensor], offsets: torch.Tensor, time_deltas: torch.Tensor,
                pretrained: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        event = attributes[0]
        for a in attributes[1:]:
            event = event + a
        if self.pretrained is not None and pretrained is not None:
            event = event + self.pretrained(pretrained)
        event = self.project(event) + self.time_embedding(time_delta_bucket(time_deltas, self.time_buckets))

        L = self.max_length
        padded = torch.ops.fbgemm.jagged_to_padded_dense(event, [offsets], [L], 0.0)  # [U, L, d]
        lengths = offsets[1:] - offsets[:-1]
        event_mask = torch.arange(L, device=offsets.device)[None, :] < lengths[:, None]  # [U, L]
        U = padded.shape[0]
        x = torch.cat([self.summary_token.expand(U, 1, self.d_model).to(padded.dtype), padded], dim=1)
        key_mask = torch.cat([torch.ones_like(event_mask[:, :1]), event_mask], dim=1)
        for layer in self.layers:
            x = layer(x, key_mask)
        x = self.norm(x)
        events = x[:, 1:]
        pooled = []
        if self.summary:
            pooled.append(x[:, 0])
        if self.mean:
            m = event_mask.unsqueeze(-1).to(x.dtype)
            pooled.append((events * m).sum(dim=1) / lengths.clamp(min=1).unsqueeze(-1).to(x.dtype))
        pooled = torch.cat(pooled, dim=1) if pooled else events.new_zeros(U, 0)
        return pooled, events, event_mask
