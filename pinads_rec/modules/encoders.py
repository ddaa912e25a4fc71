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
  (``listed`` says whether the config lists it: a value that is wrong fails even while it is off);
- ``settings``: the dataclass of its config keys, ``model.sequence.settings.<name>.*``, read with
  ``cfg.settings_for(name)``. The built-ins' are declared beside their entries and composed into
  ``SequenceEncoderConfig`` (config/schema.py): their keys (``model.sequence.num_layers``,
  ``model.sequence.hstu.*``...) predate the registry.

``run`` maps ``EncoderInputs`` to ``Parts`` (modules/encoder_io.py): in [U, L, W] events (U units),
out per-unit tensors [U, D_u] and per-row tensors [B, D_r]. The group concatenates, each in registry
order, the per-unit parts of the window entries, then of the history entries, then the per-row parts
of the window entries, then of the history entries (the layout the cross network was trained on).
Registry order is also build order: the modules' initial weights come from the RNG in that order.

No torch here (config validation runs the checks, and the data tools load configs without torch:
each builder imports its modules), nor the config, which composes these settings (hence ``Any``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Literal, Optional, Tuple

from pinads_rec.config_base import CANDIDATE_PREFIX, ConfigError, positive
from pinads_rec.modules.encoder_io import EncoderInputs, Parts

if TYPE_CHECKING:
    from torch import nn

Modules = Dict[str, Optional["nn.Module"]]


@dataclass(frozen=True)
class BuildContext:
    group: Any  # config.SequenceGroupConfig
    cfg: Any  # config.SequenceEncoderConfig
    width: int  # the event width W (EventRepresentation.width)
    query_dim: int  # 0: no candidate query
    user_dim: int


@dataclass(frozen=True)
class CheckContext:
    path: str  # the encoder config's dotted path (model.sequence, model.sequence_groups.<g>)
    enc: Any  # config.SequenceEncoderConfig
    features: Any  # config.FeaturesConfig
    group: Any  # config.SequenceGroupConfig; None: model.sequence itself, before any group
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
    id_keys: Callable[[Any, Any], List[str]] = lambda group, cfg: []  # (group config, encoder config)
    check: Callable[[CheckContext], None] = lambda c: None
    settings: Optional[type] = None  # a dataclass: model.sequence.settings.<name>


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


def settings_class(name: str) -> type:
    """The settings dataclass of the encoder ``name``, registered with ``settings``."""
    entry = REGISTRY.get(name)
    if entry is None or entry.settings is None:
        declaring = [n for n, e in REGISTRY.items() if e.settings is not None]
        raise ConfigError(f"no registered encoder {name!r} with settings of its own (those with: {declaring})")
    return entry.settings


def width_of_events(attr_dims: List[int], pretrained_dim: int, combine: str, d_model: int) -> int:
    """W: d_model with combine "sum", the attributes' and pretrained widths together with "concat"
    (``EventRepresentation.width``)."""
    return d_model if combine == "sum" else sum(attr_dims) + pretrained_dim


def _events_read(c: BuildContext) -> int:
    """The most events a window encoder reads: the group's max_length, or the window."""
    return min(c.group.max_length, c.cfg.window) if c.cfg.window else c.group.max_length


# The built-in encoders, in build order: each one's settings, build, run, checks and entry.


@dataclass
class SequenceProjectionConfig:
    """DCNv2 projection of the (wide) Transformer output into a small representation (in the groups
    with a Transformer)."""

    dim: int = 0  # 0: off
    # DCNv2 cross layers before the linear map to dim (0: the linear map alone).
    num_layers: int = 2
    # Rank of the cross layers' weights (0: full rank).
    low_rank: int = 16


@dataclass
class TransformerSettings:
    """The Transformer's keys of ``SequenceEncoderConfig`` (at its top level)."""

    # Transformer.
    # Its encoder layers.
    num_layers: int = 1
    # Attention heads; they divide the event width (d_model, or the concatenated width).
    num_heads: int = 1
    # Hidden width of each layer's feed-forward network.
    ffn_dim: int = 64
    # Dropout rate in the Transformer layers.
    dropout: float = 0.0
    # What the Transformer's encoded events become: "summary" (a prepended summary token's output),
    # "mean" (masked mean) -- once per request -- "transact" (TransAct-style: max-pool plus the latest
    # transact_recent tokens), and "target" (each candidate attends over the encoded events).
    poolings: List[Literal["summary", "mean", "transact", "target"]] = field(
        default_factory=lambda: ["summary", "mean", "target"]
    )
    # Latest encoded events the transact pooling keeps beside its max-pool.
    transact_recent: int = 4
    projection: SequenceProjectionConfig = field(default_factory=SequenceProjectionConfig)


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
        "target": (
            TargetAttention(c.query_dim, c.width, cfg.target_weights, _events_read(c))
            if c.query_dim and "target" in cfg.poolings
            else None
        ),
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


@dataclass
class HSTUConfig:
    """The HSTU encoder (modules/hstu.py): pointwise SiLU attention with relative position and time
    biases, run per request without padding waste."""

    # Stacked HSTU layers.
    num_layers: int = 2
    # Attention heads; they divide the event width.
    num_heads: int = 2
    # Dropout rate in the HSTU layers.
    dropout: float = 0.0
    # Relative attention biases: log2 buckets of |i - j| positions and of |t_i - t_j| seconds.
    position_buckets: int = 32
    # Buckets of the time bias (log2 of |t_i - t_j| seconds).
    time_buckets: int = 24


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
        "hstu_target": TargetAttention(c.query_dim, c.width, c.cfg.target_weights, _events_read(c))
        if c.query_dim
        else None,
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


@dataclass
class RetrievalConfig:
    """Target-aware retrieval from a long history (SIM's hard search; modules/retrieval.py): per
    candidate, the newest ``max_events`` events whose ``attribute`` equals the candidate's
    ``candidate`` feature, encoded with target attention. With bags on either side (a multi-valued
    attribute, a multi-hot candidate feature) an event matches when the two share an id. Groups
    whose attributes differ each set their own under model.sequence_groups.<group>.retrieval."""

    # A feature of the group (model.sequence's must be one of every group that lists retrieval and
    # has no model.sequence_groups entry: a group with other attributes sets its own there).
    attribute: str = "topic"
    candidate: str = "item_topic"  # a candidate-side sparse feature on the attribute's table
    # Events retrieved per candidate: the newest that match.
    max_events: int = 32


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


def _check_candidate_on_table(key: str, candidate: str, features, group, attribute, what: str) -> None:
    """``candidate`` is a candidate-side sparse feature on the table of the group's ``attribute``
    (``what`` compares their ids, so they must mean the same thing)."""
    sparse = {f.name: f for f in features.sparse}
    cand = sparse.get(candidate)
    if cand is None or cand.user_side:
        raise ConfigError(
            f"{key}: {candidate!r} is not a candidate-side sparse feature "
            f"({sorted(n for n, f in sparse.items() if not f.user_side)})"
        )
    if cand.table != attribute.table:
        raise ConfigError(
            f"{key}: {candidate!r} uses table {cand.table!r} but {group.name}.{attribute.name} uses "
            f"{attribute.table!r}: {what} compares ids, so both must use one table"
        )


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
    _check_candidate_on_table(f"{path}.candidate", r.candidate, c.features, group, attrs[r.attribute], "retrieval")


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


@dataclass
class PeriodSumSettings:
    """period_sum's key of ``SequenceEncoderConfig`` (at its top level)."""

    # Period sum pooling: period boundaries in seconds of time delta (request time - event time);
    # [a, b, c] makes the periods [0, a), [a, b), [b, c), [c, inf). Future events are left out.
    period_boundaries_s: List[float] = field(default_factory=lambda: [3600.0, 86400.0, 7 * 86400.0])


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


@dataclass
class DINSettings:
    """DIN's key of ``SequenceEncoderConfig`` (at its top level)."""

    # DIN: hidden widths of the attention MLP over [q, k, q - k, q * k].
    din_hidden: List[int] = field(default_factory=lambda: [32])


def _build_din(c: BuildContext) -> Modules:
    from pinads_rec.modules.din import DINAttention

    return {"din": DINAttention(c.query_dim, c.width, c.cfg.din_hidden, c.cfg.target_weights, _events_read(c))}


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


@dataclass
class LongShortSettings:
    """long_short's keys of ``SequenceEncoderConfig`` (at its top level)."""

    # Long/short interest: the short-term part's window and attention MLP.
    short_length: int = 8
    # Hidden widths of the short-term part's attention MLP.
    short_hidden: List[int] = field(default_factory=lambda: [16])


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


@dataclass
class CountPair:
    """One pair counted: an attribute of the group's events and a candidate-side sparse feature on
    the same table (ids are compared)."""

    # A feature of the group.
    attribute: str = "item"
    # A candidate-side sparse feature on the attribute's table.
    candidate: str = "item_id"


@dataclass
class MatchCountsConfig:
    """Target-aware counting (modules/match_counts.py): per pair, the candidate's matches among the
    newest events, as features the dense arch reads. A group counts the pairs (and splits by the
    ``by`` attribute) whose attributes it has; one may set its own under
    model.sequence_groups.<group>.counts."""

    # The pairs counted (each: attribute, a feature of the groups that count it; candidate, a
    # candidate-side sparse feature on the attribute's table).
    pairs: List[CountPair] = field(default_factory=lambda: [CountPair()])
    # Matches counted among the newest k events, for each k (0: the whole history).
    windows: List[int] = field(default_factory=lambda: [5, 20, 0])
    # Recency-weighted match sums, one per half-life in seconds (an event weighs 2^(-age / half-life)).
    half_lives_s: List[float] = field(default_factory=lambda: [86400.0])
    # An attribute of the groups (the action) whose values split each window's count, in the groups
    # that have it ("": none).
    by: str = ""
    # The ids of ``by`` counted apart (the ids as the batch holds them: the build's vocabulary's).
    by_values: List[int] = field(default_factory=list)
    # Width of the learned encoding of the counts' piecewise-linear bins (0: the log1p counts alone).
    dim: int = 16


def _pair_keys(group, cfg) -> List[Tuple[str, str]]:
    """The sequence-KJT keys of the pairs ``group`` has the attribute of (the others are left out there)."""
    attrs = {f.name for f in group.features}
    return [
        (f"{group.name}.{p.attribute}", CANDIDATE_PREFIX + p.candidate)
        for p in cfg.counts.pairs
        if p.attribute in attrs
    ]


def _by_key(group, cfg) -> Optional[str]:
    by = cfg.counts.by
    return f"{group.name}.{by}" if by and by in {f.name for f in group.features} else None


def _count_keys(group, cfg) -> List[str]:
    keys = [k for pair in _pair_keys(group, cfg) for k in pair]
    by = _by_key(group, cfg)
    return keys + ([by] if by else [])


def _build_counts(c: BuildContext) -> Modules:
    from pinads_rec.modules.match_counts import MatchCounts

    s = c.cfg.counts
    pairs, by = _pair_keys(c.group, c.cfg), _by_key(c.group, c.cfg)
    # A group with none of the pairs' attributes counts nothing.
    return {
        "counts": MatchCounts(pairs, by, s.windows, s.half_lives_s, s.by_values, c.group.max_length, s.dim)
        if pairs
        else None
    }


def _run_counts(m: Modules, i: EncoderInputs) -> Parts:
    if m["counts"] is None:
        return Parts()
    return Parts(row=[m["counts"](i.ids, i.offsets, i.mask, i.deltas, i.request_index)])


def _check_counts(c: CheckContext) -> None:
    s, path = c.enc.counts, f"{c.path}.counts"
    for j, w in enumerate(s.windows):
        positive(f"{path}.windows[{j}]", w, allow_zero=True)
    for j, h in enumerate(s.half_lives_s):
        positive(f"{path}.half_lives_s[{j}]", h)
    positive(f"{path}.dim", s.dim, allow_zero=True)
    if not c.listed or c.group is None:
        return
    if not s.pairs:
        raise ConfigError(f"{path}.pairs: list at least one (attribute, candidate) pair to count")
    attrs = {f.name: f for f in c.group.features}
    anywhere = {f.name for g in c.features.sequence_groups for f in g.features}
    for j, p in enumerate(s.pairs):
        where = f"{path}.pairs[{j}]"
        if p.attribute not in anywhere:
            raise ConfigError(
                f"{where}.attribute: {p.attribute!r} is not a feature of any sequence group ({sorted(anywhere)})"
            )
        if p.attribute not in attrs:  # counted in the groups that have it
            continue
        _check_candidate_on_table(
            f"{where}.candidate", p.candidate, c.features, c.group, attrs[p.attribute], "counting"
        )
    if s.by and s.by not in anywhere:
        raise ConfigError(f"{path}.by: {s.by!r} is not a feature of any sequence group ({sorted(anywhere)})")
    if s.by in attrs and attrs[s.by].multi_valued:
        raise ConfigError(f"{path}.by: {s.by!r} holds several ids per event; counts split by one id per event")
    if bool(s.by) != bool(s.by_values):
        raise ConfigError(f"{path}.by_values: give the ids of {path}.by to count apart, and both or neither")


register(
    Encoder(
        "counts",
        build=_build_counts,
        widths=lambda m, c: (0, m["counts"].output_dim if m["counts"] is not None else 0),
        run=_run_counts,
        needs_query=True,
        reads="history",  # the windows are cut from the whole history
        id_keys=_count_keys,
        check=_check_counts,
    )
)
