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

from typing import Dict, List, Optional, Tuple

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from torchrec.sparse.jagged_tensor import JaggedTensor

from pinads_rec.config import FeaturesConfig, SequenceEncoderConfig
from pinads_rec.modules.precision import LargeLayer
from pinads_rec.modules.target_attention import TargetAttention


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
        # CPU BF16 training: the flash-attention backward is slower than the math kernel in BF16
        # (benchmarks/inference_precision.py measures both); elsewhere SDPA picks its fastest.
        backends = ([SDPBackend.MATH] if q.dtype == torch.bfloat16 and self.training and q.device.type == "cpu"
                    else [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                          SDPBackend.MATH])
        with sdpa_kernel(backends):
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


class TransformerStack(nn.Module):
    """The encoder's layers: the large part of the sequence arch (run in BF16 when configured)."""

    def __init__(self, d_model: int, cfg: SequenceEncoderConfig):
        super().__init__()
        self.layers = nn.ModuleList(
            TransformerLayer(d_model, cfg.num_heads, cfg.ffn_dim, cfg.dropout) for _ in range(cfg.num_layers))
        self.norm = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, key_mask)
        return self.norm(x)


class SequenceEncoder(nn.Module):
    def __init__(self, attr_dim: int, max_length: int, cfg: SequenceEncoderConfig, pretrained_dim: int = 0):
        super().__init__()
        d = cfg.d_model
        self.max_length, self.time_buckets, self.d_model = max_length, cfg.time_buckets, d
        self.pretrained = nn.Linear(pretrained_dim, attr_dim) if pretrained_dim else None
        self.project = nn.Linear(attr_dim, d)
        self.time_embedding = nn.Embedding(cfg.time_buckets, d)
        self.summary_token = nn.Parameter(torch.randn(1, 1, d) * 0.02)
        self.transformer = LargeLayer(TransformerStack(d, cfg))
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
        x = self.transformer(x, key_mask)
        events = x[:, 1:]
        pooled = []
        if self.summary:
            pooled.append(x[:, 0])
        if self.mean:
            m = event_mask.unsqueeze(-1).to(x.dtype)
            pooled.append((events * m).sum(dim=1) / lengths.clamp(min=1).unsqueeze(-1).to(x.dtype))
        pooled = torch.cat(pooled, dim=1) if pooled else events.new_zeros(U, 0)
        return pooled, events, event_mask


class SequenceArch(nn.Module):
    """Every sequence group of the model: per group a ``SequenceEncoder`` run once per request and
    broadcast to the request's rows by ``request_index`` (request-level broadcasting), plus, with the
    "target" pooling, a per-row ``TargetAttention`` of the candidate over the request's events.

    One module for all groups so that TorchRec's pipeline tracer treats it as one leaf (it holds no
    sharded module): nothing inside needs to be FX-traceable.

    In: the EmbeddingCollection's output (``<group>.<feature>`` -> JaggedTensor over U requests),
    time deltas and pretrained embeddings per group, request_index [B], the candidate query
    [B, query_dim] (or None). Out: [B, output_dim].
    """

    def __init__(self, features: FeaturesConfig, cfg: SequenceEncoderConfig, attr_dim: int, query_dim: int):
        super().__init__()
        self.groups = [(g.name, [f"{g.name}.{f.name}" for f in g.features], g.embedding_column is not None)
                       for g in features.sequence_groups]
        self.encoders = nn.ModuleDict({
            g.name: SequenceEncoder(attr_dim, g.max_length, cfg, g.embedding_dim if g.embedding_column else 0)
            for g in features.sequence_groups})
        self.uses_query = "target" in cfg.poolings and query_dim > 0
        self.target_attention = nn.ModuleDict({
            g.name: TargetAttention(query_dim, cfg.d_model) for g in features.sequence_groups} if self.uses_query else {})
        self.output_dim = (sum(e.output_dim for e in self.encoders.values())
                           + len(self.target_attention) * cfg.d_model)

    def forward(self, events: Dict[str, JaggedTensor], time_deltas: Dict[str, torch.Tensor],
                pretrained: Dict[str, torch.Tensor], request_index: torch.Tensor,
                query: Optional[torch.Tensor]) -> torch.Tensor:
        per_request, per_row = [], []
        for group, keys, has_pretrained in self.groups:
            summary, encoded, mask = self.encoders[group](
                [events[k].values() for k in keys], events[keys[0]].offsets(), time_deltas[group],
                pretrained[group] if has_pretrained else None)
            per_request.append(summary)
            if self.uses_query:
                per_row.append(self.target_attention[group](query, encoded, mask, request_index))
        # Request-level broadcasting: the user-side work ran once per request; rows index into it.
        return torch.cat([torch.cat(per_request, dim=1).index_select(0, request_index)] + per_row, dim=1)
