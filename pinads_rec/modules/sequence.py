"""Sequence arch: every user action sequence group turned into features (sequence-modeling
article; docs/ablations.md compares the variants). Each group has its own ``SequenceEncoderConfig``;
per group:

1. ``EventRepresentation``: attributes combined by sum or concat, padded; time-delta positions;
2. ``EarlyInteraction`` (optional): cosine similarities with the candidate / user as event
   attributes, the candidate / user as extra self-attention tokens;
3. encoders, any subset: ``TransformerEncoder`` (+ "target" attention of each candidate over the
   encoded events, + the ``SequenceProjection`` of its output), ``sum_pooling``,
   ``PeriodSumPooling``, ``DINAttention``, and ``ShortTermInterest`` (the short half of long/short
   interest; the long half is what the other encoders make of the whole sequence).

Request-level broadcasting: a group's candidate-independent work runs once per request and is
indexed out to the request's rows by ``request_index``; the candidate attentions (target, DIN,
short-term) are per row but light. A group with candidate early interaction is encoded per row.

One module for all groups so that TorchRec's pipeline tracer treats it as one leaf (it holds no
sharded module): nothing inside needs to be FX-traceable.

In: the EmbeddingCollection's output (``<group>.<feature>`` -> JaggedTensor over U requests),
time deltas and pretrained embeddings per group, request_index [B], the candidate query
[B, query_dim] (None: no candidate-dependent parts, as in the two-tower user tower), the user
representation [U, user_dim] (or None). Out: [B, output_dim].
"""

from typing import TYPE_CHECKING, Dict, List, Optional

import torch
from torch import nn

from pinads_rec.config import FeaturesConfig, SequenceEncoderConfig, SequenceGroupConfig
from pinads_rec.modules.din import DINAttention
from pinads_rec.modules.early_interaction import EarlyInteraction
from pinads_rec.modules.event_representation import EventRepresentation
from pinads_rec.modules.long_short import ShortTermInterest
from pinads_rec.modules.pooling import PeriodSumPooling, sum_pooling
from pinads_rec.modules.sequence_projection import SequenceProjection
from pinads_rec.modules.target_attention import TargetAttention
from pinads_rec.modules.transformer import TransformerEncoder

if TYPE_CHECKING:  # an annotation only: the arch itself runs with torch alone (benchmarks/arch_precision.py)
    from torchrec.sparse.jagged_tensor import JaggedTensor


class GroupEncoder(nn.Module):
    def __init__(
        self, group: SequenceGroupConfig, cfg: SequenceEncoderConfig, attr_dim: int, query_dim: int, user_dim: int
    ):
        super().__init__()
        self.keys = [f"{group.name}.{f.name}" for f in group.features]
        self.has_pretrained = group.embedding_column is not None
        self.events = EventRepresentation(
            [attr_dim] * len(group.features),
            group.embedding_dim if self.has_pretrained else 0,
            group.max_length,
            cfg.combine,
            cfg.d_model,
            cfg.time_buckets,
        )
        W = self.events.width
        enc = set(cfg.encoders)
        candidate = query_dim > 0  # without a query, the candidate-dependent parts are left out
        # Early interaction with what the model has: no candidate query (two-tower user tower) or no
        # user-side features means no such representation to interact with.
        available = {"candidate": candidate, "user": user_dim > 0}
        early = cfg.early_interaction
        cosine = [n for n in early.cosine if available[n]]
        tokens = [n for n in early.tokens if available[n] and "transformer" in enc]
        self.per_candidate = "candidate" in cosine or "candidate" in tokens
        self.uses_user = "user" in cosine or "user" in tokens
        self.early = (
            EarlyInteraction(W, {"candidate": query_dim, "user": user_dim}, cosine, tokens)
            if cosine or tokens
            else None
        )
        self.transformer = (
            TransformerEncoder(
                W,
                cfg.num_layers,
                cfg.num_heads,
                cfg.ffn_dim,
                cfg.dropout,
                [p for p in cfg.poolings if p != "target"],
                cfg.transact_recent,
            )
            if "transformer" in enc
            else None
        )
        self.projection = (
            SequenceProjection(self.transformer.output_dim, cfg.projection)
            if self.transformer is not None and cfg.projection.dim
            else None
        )
        self.target = (
            TargetAttention(query_dim, W)
            if candidate and self.transformer is not None and "target" in cfg.poolings
            else None
        )
        # Sums of up to max_length events are layer-normed before they meet the cross network (which
        # multiplies its inputs: unnormed 100-event sums drove the logits to 1e4 and training to a
        # constant model). No bias: an empty period stays zeros.
        self.sum = nn.LayerNorm(W, bias=False) if "sum" in enc else None
        self.period_sum = PeriodSumPooling(cfg.period_boundaries_s) if "period_sum" in enc else None
        self.period_norm = nn.LayerNorm(W, bias=False) if "period_sum" in enc else None
        self.din = DINAttention(query_dim, W, cfg.din_hidden) if candidate and "din" in enc else None
        self.short = (
            ShortTermInterest(query_dim, W, cfg.short_length, cfg.short_hidden)
            if candidate and "long_short" in enc
            else None
        )
        transformer_dim = (
            self.projection.output_dim
            if self.projection is not None
            else self.transformer.output_dim
            if self.transformer is not None
            else 0
        )
        self.output_dim = (
            transformer_dim
            + W
            * ((self.sum is not None) + (self.target is not None) + (self.din is not None) + (self.short is not None))
            + (self.period_sum.num_periods * W if self.period_sum is not None else 0)
        )
        if self.output_dim == 0:
            raise ValueError(
                f"sequence group {group.name!r}: encoders {cfg.encoders} give no feature without a "
                f"candidate query (two-tower user tower); add transformer, sum or period_sum"
            )

    def forward(self, events: Dict[str, "JaggedTensor"], *rest: Optional[torch.Tensor]) -> torch.Tensor:
        """``encode`` of the group's events as the EmbeddingCollection returns them (``<group>.<feature>``
        -> JaggedTensor over U requests); ``rest``: time_deltas, pretrained, request_index, query,
        user, as ``encode`` takes them."""
        attributes = [events[k].values() for k in self.keys]
        return self.encode(attributes, events[self.keys[0]].offsets(), *rest)

    def encode(
        self,
        attributes: List[torch.Tensor],
        offsets: torch.Tensor,
        time_deltas: torch.Tensor,
        pretrained: Optional[torch.Tensor],
        request_index: torch.Tensor,
        query: Optional[torch.Tensor],
        user: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """The group's features [B, output_dim] from plain tensors: each attribute's event embeddings
        [N, D] (in ``self.keys`` order), the events' offsets [U + 1] per request, time deltas [N],
        pretrained event embeddings [N, E] (or None), request_index [B], the candidate query [B, Dq]
        and the user representation [U, Du] (each None when absent)."""
        content, mask, deltas = self.events(
            attributes, offsets, time_deltas, pretrained if self.has_pretrained else None
        )
        index = request_index
        if user is not None:
            user = user[: content.shape[0]]  # the user slots past the batch's requests are padding
        if self.per_candidate:  # the candidate changes the sequence itself: one unit per row
            content, mask, deltas = (t.index_select(0, request_index) for t in (content, mask, deltas))
            user = user.index_select(0, request_index) if user is not None else None
            index = torch.arange(request_index.shape[0], device=request_index.device)
        tokens = None
        if self.early is not None:
            content, tokens = self.early(content, mask, {"candidate": query, "user": user})
        x = content + self.events.positions(deltas)

        per_unit: List[torch.Tensor] = []
        per_row: List[torch.Tensor] = []
        if self.transformer is not None:
            pooled, encoded = self.transformer(x, mask, tokens)
            per_unit.append(self.projection(pooled) if self.projection is not None else pooled)
            if self.target is not None:
                per_row.append(self.target(query, encoded, mask, index))
        if self.sum is not None:
            per_unit.append(self.sum(sum_pooling(content, mask)))
        if self.period_sum is not None:
            periods = self.period_sum(content, mask, deltas)
            per_unit.append(self.period_norm(periods.view(periods.shape[0], -1, content.shape[-1])).flatten(1))
        if self.din is not None:
            per_row.append(self.din(query, x, mask, index))
        if self.short is not None:
            per_row.append(self.short(query, x, mask, index))
        if per_unit:
            # Request-level broadcasting: once per unit, indexed out to the rows.
            unit = torch.cat(per_unit, dim=1) if len(per_unit) > 1 else per_unit[0]
            per_row.insert(0, unit if self.per_candidate else unit.index_select(0, request_index))
        return torch.cat(per_row, dim=1) if len(per_row) > 1 else per_row[0]


class SequenceArch(nn.Module):
    def __init__(
        self,
        features: FeaturesConfig,
        encoders: Dict[str, SequenceEncoderConfig],
        attr_dim: int,
        query_dim: int,
        user_dim: int = 0,
    ):
        super().__init__()
        self.groups = nn.ModuleDict(
            {g.name: GroupEncoder(g, encoders[g.name], attr_dim, query_dim, user_dim) for g in features.sequence_groups}
        )
        self.uses_query = query_dim > 0
        self.uses_user = any(g.uses_user for g in self.groups.values())
        self.output_dim = sum(g.output_dim for g in self.groups.values())

    def forward(
        self,
        events: Dict[str, "JaggedTensor"],
        time_deltas: Dict[str, torch.Tensor],
        pretrained: Dict[str, torch.Tensor],
        request_index: torch.Tensor,
        query: Optional[torch.Tensor],
        user: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        return torch.cat(
            [
                encoder(events, time_deltas[name], pretrained.get(name), request_index, query, user)
                for name, encoder in self.groups.items()
            ],
            dim=1,
        )
