"""Sequence encoders behind one interface: a registry of what ``GroupEncoder`` (modules/sequence.py)
can run over a group's events, by the name a config lists in ``SequenceEncoderConfig.encoders``.

An entry declares everything the group needs to know about its encoder, so adding one touches its
module, its entry here and its test:

- ``build``: its modules from the group config, the encoder config, the event width W, the query
  width (0: no candidate query) and the user width, under the attribute names they are registered
  by on ``GroupEncoder`` (the state_dict names: ``groups.<g>.transformer.*``...); None for a part
  that is off;
- ``widths``: the width of its per-unit output (once per request, or per row when the group is
  encoded per candidate; broadcast to the rows by ``request_index``) and of its per-row output;
- ``needs_query``: left out when there is no candidate query (the two-tower user tower);
- ``reads``: "window" (the newest ``window`` events, after early interaction) or "history" (the
  whole padded history, before the window cut);
- ``id_keys``: the sequence-KJT keys whose ids it reads (the retrieval's search);
- ``check``: its config checks, run by config validation for every entry on every encoder config
  (``listed`` says whether the config lists it: a value that is wrong fails even while it is off).

``run`` maps ``EncoderInputs`` to ``Parts``: in [U, L, W] events (U units), out per-unit tensors
[U, D_u] and per-row tensors [B, D_r]. The group concatenates, each in registry order, the per-unit
parts of the window entries, then of the history entries, then the per-row parts of the window
entries, then of the history entries (the layout the cross network was trained on). Registry order
is also build order: the modules' initial weights come from the RNG in that order.

The registry imports no torch: config validation runs the entries' checks, and the data tools
(build, inspect) load configs without torch. Each builder imports the modules it makes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Dict, List, Literal, Optional, Tuple

from pinads_rec.config import (
    CANDIDATE_PREFIX,
    ConfigError,
    FeaturesConfig,
    SequenceEncoderConfig,
    SequenceGroupConfig,
    positive,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

Modules = Dict[str, Optional["nn.Module"]]


@dataclass(frozen=True)
class BuildContext:
    group: SequenceGroupConfig
    cfg: SequenceEncoderConfig
    width: int  # the event width W (EventRepresentation.width)
    query_dim: int  # 0: no candidate query
    user_dim: int


@dataclass
class EncoderInputs:
    """What an encoder reads. content / x (content + time-delta positions) [U, L, W], mask [U, L],
    deltas [U, L]; tokens: early-interaction tokens [U, X, W] (or None); query [B, Dq] (or None);
    index [B]: the unit of each row; request_index [B]; offsets [U + 1] and search (the
    ``retrieval.Search`` fields): only for the history entries."""

    content: torch.Tensor
    x: torch.Tensor
    mask: torch.Tensor
    deltas: torch.Tensor
    query: Optional[torch.Tensor]
    index: torch.Tensor
    request_index: torch.Tensor
    tokens: Optional[torch.Tensor] = None
    offsets: Optional[torch.Tensor] = None
    search: Optional[Tuple[torch.Tensor, ...]] = None


@dataclass
class Parts:
    unit: List[torch.Tensor] = field(default_factory=list)  # [U, D_u] each
    row: List[torch.Tensor] = field(default_factory=list)  # [B, D_r] each


@dataclass(frozen=True)
class CheckContext:
    path: str  # the encoder config's dotted path (model.sequence, model.sequence_groups.<g>)
    enc: SequenceEncoderConfig
    features: FeaturesConfig
    group: Optional[SequenceGroupConfig]  # None: model.sequence itself, before any group
    width: Optional[int]  # the event width (None: combine concat without a group)
    listed: bool  # the config lists this encoder


@dataclass(frozen=True)
class Encoder:
    name: str
    build: Callable[[BuildContext], Modules]
    widths: Callable[[Modules, BuildContext], Tuple[int, int]]  # (per unit, per row)
    run: Callable[[Modules, EncoderInputs], Parts]
    needs_query: bool = False
    reads: Literal["window", "history"] = "window"
    id_keys: Callable[[SequenceGroupConfig, SequenceEncoderConfig], List[str]] = lambda group, cfg: []
    check: Callable[[CheckContext], None] = lambda c: None


REGISTRY: Dict[str, Encoder] = {}


def register(encoder: Encoder) -> Encoder:
    if encoder.name in REGISTRY:
        raise ValueError(f"sequence encoder {encoder.name!r} is registered already")
    REGISTRY[encoder.name] = encoder
    return encoder


def unregister(name: str) -> None:
    del REGISTRY[name]


def names() -> List[str]:
    return list(REGISTRY)


def event_width(
    features: FeaturesConfig, group: Optional[SequenceGroupConfig], enc: SequenceEncoderConfig
) -> Optional[int]:
    """The group's event width as ``EventRepresentation`` makes it (None: concat without a group)."""
    if enc.combine == "sum":
        return width_of_events([], 0, "sum", enc.d_model)
    if group is None:
        return None
    attr_dims = [features.table(f.table).embedding_dim for f in group.features]
    return width_of_events(attr_dims, group.embedding_dim if group.embedding_column else 0, "concat", enc.d_model)


def width_of_events(attr_dims: List[int], pretrained_dim: int, combine: str, d_model: int) -> int:
    """W: d_model with combine "sum", the attributes' and pretrained widths together with "concat"
    (``EventRepresentation.width``)."""
    return d_model if combine == "sum" else sum(attr_dims) + pretrained_dim


# --------------------------------------------------------------------------------------------
# The built-in encoders, in build order.
# --------------------------------------------------------------------------------------------


def _build_transformer(c: BuildContext) -> Modules:
    from pinads_rec.modules.sequence_projection import SequenceProjection
    from pinads_rec.modules.target_attention import TargetAttention
    from pinads_rec.modules.transformer import TransformerEncoder

    cfg = c.cfg
    transformer = TransformerEncoder(
        c.width,
        cfg.num_layers,
        cfg.num_heads,
        cfg.ffn_dim,
        cfg.dropout,
        [p for p in cfg.poolings if p != "target"],
        cfg.transact_recent,
        bucketed=cfg.padding == "buckets",
    )
    return {
        "transformer": transformer,
        "projection": SequenceProjection(transformer.output_dim, cfg.projection) if cfg.projection.dim else None,
        "target": TargetAttention(c.query_dim, c.width) if c.query_dim and "target" in cfg.poolings else None,
    }


def _run_transformer(m: Modules, i: EncoderInputs) -> Parts:
    pooled, encoded = m["transformer"](i.x, i.mask, i.tokens)
    unit = [m["projection"](pooled) if m["projection"] is not None else pooled]
    row = [m["target"](i.query, encoded, i.mask, i.index)] if m["target"] is not None else []
    return Parts(unit, row)


def _check_transformer(c: CheckContext) -> None:
    enc, path = c.enc, c.path
    positive(f"{path}.num_layers", enc.num_layers, allow_zero=True)
    positive(f"{path}.num_heads", enc.num_heads)
    positive(f"{path}.transact_recent", enc.transact_recent)
    if len(set(enc.poolings)) != len(enc.poolings):
        raise ConfigError(f"{path}.poolings: listed twice in {enc.poolings}")
    if c.listed and not enc.poolings:
        raise ConfigError(f"{path}.poolings: the Transformer needs at least one pooling")
    if enc.combine == "sum" and enc.d_model % enc.num_heads:
        raise ConfigError(f"{path}.num_heads: {enc.num_heads} does not divide d_model {enc.d_model}")
    p = enc.projection
    positive(f"{path}.projection.dim", p.dim, allow_zero=True)
    positive(f"{path}.projection.num_layers", p.num_layers, allow_zero=True)
    positive(f"{path}.projection.low_rank", p.low_rank, allow_zero=True)
    if c.listed and c.group is not None and enc.combine == "concat" and c.width % enc.num_heads:
        raise ConfigError(
            f"{path}.num_heads: {enc.num_heads} does not divide the concatenated event width "
            f"{c.width} of sequence group {c.group.name!r}"
        )


register(
    Encoder(
        "transformer",
        build=_build_transformer,
        widths=lambda m, c: (
            (m["projection"] or m["transformer"]).output_dim,
            c.width if m["target"] is not None else 0,
        ),
        run=_run_transformer,
        check=_check_transformer,
    )
)


def _build_hstu(c: BuildContext) -> Modules:
    from pinads_rec.modules.hstu import HSTUEncoder
    from pinads_rec.modules.target_attention import TargetAttention

    h = c.cfg.hstu
    return {
        "hstu": HSTUEncoder(
            c.width,
            h.num_layers,
            h.num_heads,
            h.dropout,
            h.position_buckets,
            h.time_buckets,
            c.cfg.padding == "buckets",
        ),
        # The candidate enters here, after the history is encoded once per request.
        "hstu_target": TargetAttention(c.query_dim, c.width) if c.query_dim else None,
    }


def _run_hstu(m: Modules, i: EncoderInputs) -> Parts:
    pooled, encoded = m["hstu"](i.x, i.mask, i.deltas)
    row = [m["hstu_target"](i.query, encoded, i.mask, i.index)] if m["hstu_target"] is not None else []
    return Parts([pooled], row)


def _check_hstu(c: CheckContext) -> None:
    h, path = c.enc.hstu, c.path
    positive(f"{path}.hstu.num_layers", h.num_layers)
    positive(f"{path}.hstu.num_heads", h.num_heads)
    positive(f"{path}.hstu.position_buckets", h.position_buckets)
    positive(f"{path}.hstu.time_buckets", h.time_buckets)
    width = c.width if c.width is not None else c.enc.d_model
    if c.listed and width % h.num_heads:
        raise ConfigError(f"{path}.hstu.num_heads: {h.num_heads} does not divide the event width {width}")


register(
    Encoder(
        "hstu",
        build=_build_hstu,
        widths=lambda m, c: (m["hstu"].output_dim, c.width if m["hstu_target"] is not None else 0),
        run=_run_hstu,
        check=_check_hstu,
    )
)


def _build_retrieval(c: BuildContext) -> Modules:
    from pinads_rec.modules.retrieval import TargetRetrieval

    return {"retrieval": TargetRetrieval(c.query_dim, c.width, c.cfg.retrieval.max_events)}


def _run_retrieval(m: Modules, i: EncoderInputs) -> Parts:
    from pinads_rec.modules.jagged import pad_jagged_torch
    from pinads_rec.modules.retrieval import Search

    search = Search(*i.search)
    per_event = search.event_ids if search.event_ids.dim() == 2 else search.event_ids.unsqueeze(1)
    event_ids = pad_jagged_torch(per_event, i.offsets, i.content.shape[1])  # [U, L, K]
    retrieved = m["retrieval"](
        i.x, event_ids, i.mask, search.candidate_ids, i.query, i.request_index, search.candidate_rows
    )
    return Parts(row=[retrieved])


def _check_retrieval(c: CheckContext) -> None:
    """The attribute is one of the group's features; the candidate feature is candidate-side and
    uses the same table (ids are compared, so they must mean the same thing)."""
    r, path = c.enc.retrieval, f"{c.path}.retrieval"
    positive(f"{path}.max_events", r.max_events)
    if not c.listed or c.group is None:
        return
    group = c.group
    attrs = {f.name: f for f in group.features}
    if r.attribute not in attrs:
        raise ConfigError(
            f"{path}.attribute: {r.attribute!r} is not a feature of sequence group {group.name!r} ({sorted(attrs)})"
        )
    sparse = {f.name: f for f in c.features.sparse}
    cand = sparse.get(r.candidate)
    if cand is None or cand.user_side:
        raise ConfigError(
            f"{path}.candidate: {r.candidate!r} is not a candidate-side sparse feature "
            f"({sorted(n for n, f in sparse.items() if not f.user_side)})"
        )
    if cand.table != attrs[r.attribute].table:
        raise ConfigError(
            f"{path}.candidate: {r.candidate!r} uses table {cand.table!r} but {group.name}.{r.attribute} uses "
            f"{attrs[r.attribute].table!r}: retrieval compares ids, so both must use one table"
        )


register(
    Encoder(
        "retrieval",
        build=_build_retrieval,
        widths=lambda m, c: (0, m["retrieval"].output_dim),
        run=_run_retrieval,
        needs_query=True,
        reads="history",  # searches the whole history, before the window
        # The ids it compares: the events' attribute and the candidate's feature (keys of the
        # sequence KJT, which carries the candidate ids of shared tables).
        id_keys=lambda group, cfg: [
            f"{group.name}.{cfg.retrieval.attribute}",
            CANDIDATE_PREFIX + cfg.retrieval.candidate,
        ],
        check=_check_retrieval,
    )
)


# Sums of up to max_length events are layer-normed before they meet the cross network (which
# multiplies its inputs: unnormed 100-event sums drove the logits to 1e4 and training to a
# constant model). No bias: an empty period stays zeros.
def _build_sum(c: BuildContext) -> Modules:
    from torch import nn

    return {"sum": nn.LayerNorm(c.width, bias=False)}


def _run_sum(m: Modules, i: EncoderInputs) -> Parts:
    from pinads_rec.modules.pooling import sum_pooling

    return Parts([m["sum"](sum_pooling(i.content, i.mask))])


register(Encoder("sum", build=_build_sum, widths=lambda m, c: (c.width, 0), run=_run_sum))


def _build_period_sum(c: BuildContext) -> Modules:
    from torch import nn

    from pinads_rec.modules.pooling import PeriodSumPooling

    return {"period_sum": PeriodSumPooling(c.cfg.period_boundaries_s), "period_norm": nn.LayerNorm(c.width, bias=False)}


def _run_period_sum(m: Modules, i: EncoderInputs) -> Parts:
    periods = m["period_sum"](i.content, i.mask, i.deltas)
    return Parts([m["period_norm"](periods.view(periods.shape[0], -1, i.content.shape[-1])).flatten(1)])


def _check_period_sum(c: CheckContext) -> None:
    b = c.enc.period_boundaries_s
    if not b or any(not x > 0 for x in b) or any(x >= y for x, y in zip(b, b[1:])):
        raise ConfigError(f"{c.path}.period_boundaries_s: need increasing positive seconds, got {b}")


register(
    Encoder(
        "period_sum",
        build=_build_period_sum,
        widths=lambda m, c: (m["period_sum"].num_periods * c.width, 0),
        run=_run_period_sum,
        check=_check_period_sum,
    )
)


def _check_hidden(key: str) -> Callable[[CheckContext], None]:
    def check(c: CheckContext) -> None:
        widths = getattr(c.enc, key)
        if not widths:
            raise ConfigError(f"{c.path}.{key}: list at least one hidden width of the attention MLP")
        for i, w in enumerate(widths):
            positive(f"{c.path}.{key}[{i}]", w)

    return check


def _build_din(c: BuildContext) -> Modules:
    from pinads_rec.modules.din import DINAttention

    return {"din": DINAttention(c.query_dim, c.width, c.cfg.din_hidden)}


register(
    Encoder(
        "din",
        build=_build_din,
        widths=lambda m, c: (0, c.width),
        run=lambda m, i: Parts(row=[m["din"](i.query, i.x, i.mask, i.index)]),
        needs_query=True,
        check=_check_hidden("din_hidden"),
    )
)


def _check_long_short(c: CheckContext) -> None:
    positive(f"{c.path}.short_length", c.enc.short_length)
    _check_hidden("short_hidden")(c)


def _build_long_short(c: BuildContext) -> Modules:
    from pinads_rec.modules.long_short import ShortTermInterest

    return {"short": ShortTermInterest(c.query_dim, c.width, c.cfg.short_length, c.cfg.short_hidden)}


register(
    Encoder(
        "long_short",
        build=_build_long_short,
        widths=lambda m, c: (0, c.width),
        run=lambda m, i: Parts(row=[m["short"](i.query, i.x, i.mask, i.index)]),
        needs_query=True,
        check=_check_long_short,
    )
)
