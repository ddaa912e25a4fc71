"""Sequence arch: every user action sequence group turned into features (sequence-modeling
article; docs/ablations.md compares the variants). Each group has its own ``SequenceEncoderConfig``;
per group:

1. ``EventRepresentation``: attributes combined by sum or concat, padded; time-delta positions;
2. ``EarlyInteraction`` (optional): cosine similarities with the candidate / user as event
   attributes, the candidate / user as extra self-attention tokens;
3. encoders, any subset: ``TransformerEncoder`` (+ "target" attention of each candidate over the
   encoded events, + the ``SequenceProjection`` of its output), ``HSTUEncoder`` (+ target attention
   over its output: the candidate enters there, so the history is encoded once per request),
   ``sum_pooling``, ``PeriodSumPooling``, ``DINAttention``, ``ShortTermInterest`` (the short half of
   long/short interest; the long half is what the other encoders make of the whole sequence), and
   ``TargetRetrieval`` (per candidate, the events sharing its category, searched in the whole
   history while the other encoders read the newest ``window`` events). Each is an entry of the
   registry in modules/encoders.py, which builds it, gives its width and runs it: the group loops
   over the entries its config lists, in registry order.

Long histories: with ``padding: buckets`` the events are padded only to the batch's longest and
the attention encoders run per length bucket (modules/length_buckets.py); the outputs are those
of the padded path.

Request-level broadcasting: a group's candidate-independent work runs once per request and is
indexed out to the request's rows by ``request_index``; the candidate attentions (target, DIN,
short-term) are per row but light. A group with candidate early interaction is encoded per row.

One module for all groups so that TorchRec's pipeline tracer treats it as one leaf (it holds no
sharded module): nothing inside needs to be FX-traceable.

In: the EmbeddingCollection's output (``<group>.<feature>`` -> JaggedTensor over U requests; a
multi-valued attribute's holds every id of every event, pooled here into one row per event by its
``pooling``, with the bag sizes by key), time deltas and pretrained embeddings per group, the bag
sizes (``Batch.sequence_bag_sizes``), request_index [B], the candidate query
[B, query_dim] (None: no candidate-dependent parts, as in the two-tower user tower), the user
representation [U, user_dim] (or None). Out: [B, output_dim].
"""

from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import torch
from torch import nn

from pinads_rec.config import CANDIDATE_PREFIX, FeaturesConfig, SequenceEncoderConfig, SequenceGroupConfig
from pinads_rec.modules import encoders
from pinads_rec.modules.early_interaction import EarlyInteraction
from pinads_rec.modules.encoder_io import EncoderInputs
from pinads_rec.modules.event_representation import EventRepresentation
from pinads_rec.modules.jagged import bag_segments, pad_bags, pool_bags
from pinads_rec.modules.retrieval import Search

if TYPE_CHECKING:  # an annotation only: the arch itself runs with torch alone (benchmarks/arch_precision.py)
    from torchrec.sparse.jagged_tensor import JaggedTensor


class GroupEncoder(nn.Module):
    def __init__(
        self, group: SequenceGroupConfig, cfg: SequenceEncoderConfig, attr_dim: int, query_dim: int, user_dim: int
    ):
        super().__init__()
        self.keys = [f"{group.name}.{f.name}" for f in group.features]
        # Multi-valued attributes: key -> (mean pooling?, max ids per event).
        self.bags = {
            f"{group.name}.{f.name}": (f.pooling == "mean", f.max_values) for f in group.features if f.multi_valued
        }
        # A single-id attribute: its lengths are the events per request (config validation ensures one).
        self.offsets_key = next(k for k, f in zip(self.keys, group.features) if not f.multi_valued)
        self.has_pretrained = group.embedding_column is not None
        self.events = EventRepresentation(
            [attr_dim] * len(group.features),
            group.embedding_dim if self.has_pretrained else 0,
            group.max_length,
            cfg.combine,
            cfg.d_model,
            cfg.time_buckets,
            pad_to_longest=cfg.padding == "buckets",
        )
        W = self.events.width
        self.window = cfg.window
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
        # The listed encoders in registry order (build order, and the order of their outputs), each
        # module registered under its own name (the state_dict's).
        context = encoders.BuildContext(group, cfg, W, query_dim, user_dim)
        self.encoders: List[Tuple[str, List[str]]] = []  # names, not entries: the module stays picklable
        self.id_keys: List[str] = []
        self.output_dim = 0
        for entry in encoders.REGISTRY.values():
            if entry.name not in enc or (entry.needs_query and not candidate):
                continue
            modules = entry.build(context)
            for name, module in modules.items():
                setattr(self, name, module)
            self.encoders.append((entry.name, list(modules)))
            self.id_keys += [k for k in entry.id_keys(group, cfg) if k not in self.id_keys]
            self.output_dim += sum(entry.widths(modules, context))
        # The retrieval's search: its event attribute and candidate feature.
        self.search_keys = (
            encoders.REGISTRY["retrieval"].id_keys(group, cfg) if "retrieval" in dict(self.encoders) else []
        )
        if self.output_dim == 0:
            raise ValueError(
                f"sequence group {group.name!r}: encoders {cfg.encoders} give no feature without a "
                f"candidate query (two-tower user tower); add transformer, hstu, sum or period_sum"
            )

    def forward(
        self,
        events: Dict[str, "JaggedTensor"],
        time_deltas: torch.Tensor,
        pretrained: Optional[torch.Tensor],
        request_index: torch.Tensor,
        query: Optional[torch.Tensor],
        user: Optional[torch.Tensor],
        ids: Optional[Dict[str, torch.Tensor]] = None,
        bag_sizes: Optional[Dict[str, torch.Tensor]] = None,
    ) -> torch.Tensor:
        """``encode`` of the group's events as the EmbeddingCollection returns them (``<group>.<feature>``
        -> JaggedTensor over U requests), each bag of a multi-valued attribute pooled into its event's
        row; ``ids``: the sequence KJT's ids by key (those in ``id_keys``); ``bag_sizes``: ids per
        bag by key (``Batch.sequence_bag_sizes``: needed with bags or a retrieval); the rest as
        ``encode`` takes them."""
        attributes = []
        for k in self.keys:
            values = events[k].values()
            if k in self.bags:
                values = pool_bags(values, bag_sizes[k], mean=self.bags[k][0])
            attributes.append(values)
        by_key = {}  # key -> (ids, the row of each): an event's ids [N] or bags [N, K]; a candidate's [Mc]
        for key in self.id_keys:
            if key.startswith(CANDIDATE_PREFIX):
                by_key[key] = (ids[key], bag_segments(bag_sizes[key], ids[key].shape[0]))
            elif key in self.bags:
                by_key[key] = (pad_bags(ids[key], bag_sizes[key], self.bags[key][1], fill=-1), None)
            else:
                by_key[key] = (ids[key], None)
        search = None
        if self.search_keys:
            event_key, candidate_key = self.search_keys
            search = Search(by_key[event_key][0], *by_key[candidate_key])
        offsets = events[self.offsets_key].offsets()
        return self.encode(attributes, offsets, time_deltas, pretrained, request_index, query, user, search, by_key)

    def encode(
        self,
        attributes: List[torch.Tensor],
        offsets: torch.Tensor,
        time_deltas: torch.Tensor,
        pretrained: Optional[torch.Tensor],
        request_index: torch.Tensor,
        query: Optional[torch.Tensor],
        user: Optional[torch.Tensor],
        search: Optional[Tuple[torch.Tensor, ...]] = None,
        ids: Optional[Dict[str, Tuple[torch.Tensor, Optional[torch.Tensor]]]] = None,
    ) -> torch.Tensor:
        """The group's features [B, output_dim] from plain tensors: each attribute's event embeddings
        [N, D] (in ``self.keys`` order), the events' offsets [U + 1] per request, time deltas [N],
        pretrained event embeddings [N, E] (or None), request_index [B], the candidate query [B, Dq],
        the user representation [U, Du] (each None when absent) and, for the retrieval, the ids it
        compares (``retrieval.Search``: the events' attribute ids [N] or bags [N, K], the candidates'
        ids [B], or [Mc] with the row of each) and ``ids``, every key of ``id_keys`` so (an event key's
        ids with None, a candidate key's with its rows)."""
        content, mask, deltas = self.events(
            attributes, offsets, time_deltas, pretrained if self.has_pretrained else None
        )
        per_unit: List[torch.Tensor] = []
        per_row: List[torch.Tensor] = []
        history_rows: List[torch.Tensor] = []  # after the window encoders' per-row parts
        listed = [(encoders.REGISTRY[e], n) for e, n in self.encoders]
        history = [(e, n) for e, n in listed if e.reads == "history"]
        if history:  # the whole history, before the window
            inputs = EncoderInputs(
                content,
                content + self.events.positions(deltas),
                mask,
                deltas,
                query,
                request_index,
                request_index,
                offsets=offsets,
                search=search,
                ids=ids,
            )
            for entry, names in history:
                parts = entry.run({n: getattr(self, n) for n in names}, inputs)
                per_unit += [t.index_select(0, request_index) for t in parts.unit]
                history_rows += parts.row
        if self.window:  # newest first: the window is the first positions
            content, mask, deltas = (t[:, : self.window].contiguous() for t in (content, mask, deltas))
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
        inputs = EncoderInputs(content, x, mask, deltas, query, index, request_index, tokens)
        units: List[torch.Tensor] = []
        for entry, names in listed:
            if entry.reads == "window":
                parts = entry.run({n: getattr(self, n) for n in names}, inputs)
                units += parts.unit
                per_row += parts.row
        per_row += history_rows
        if units:
            # Request-level broadcasting: once per unit, indexed out to the rows.
            unit = torch.cat(units, dim=1) if len(units) > 1 else units[0]
            per_unit.insert(0, unit if self.per_candidate else unit.index_select(0, request_index))
        out = per_unit + per_row
        return torch.cat(out, dim=1) if len(out) > 1 else out[0]


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
        # Keys of the sequence KJT whose ids the arch reads (target-aware retrieval).
        self.id_keys = [k for g in self.groups.values() for k in g.id_keys]
        self.output_dim = sum(g.output_dim for g in self.groups.values())

    def forward(
        self,
        events: Dict[str, "JaggedTensor"],
        time_deltas: Dict[str, torch.Tensor],
        pretrained: Dict[str, torch.Tensor],
        request_index: torch.Tensor,
        query: Optional[torch.Tensor],
        user: Optional[torch.Tensor] = None,
        ids: Optional[Dict[str, torch.Tensor]] = None,
        bag_sizes: Optional[Dict[str, torch.Tensor]] = None,
    ) -> torch.Tensor:
        ids = ids if ids is not None else {}
        return torch.cat(
            [
                encoder(events, time_deltas[name], pretrained.get(name), request_index, query, user, ids, bag_sizes)
                for name, encoder in self.groups.items()
            ],
            dim=1,
        )
