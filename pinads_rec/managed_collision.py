"""Managed-collision tables: raw ids mapped to slots by TorchRec's managed collision.

A table with ``managed_collision`` in its config (``config.ManagedCollisionConfig``) takes raw ids,
any int64 >= 0, and TorchRec's ``MCHManagedCollisionModule`` maps each to a slot of the table's
``num_embeddings``: an id keeps its own row until the eviction policy (LRU, LFU, distance-LFU) gives
its slot to a newer id, whose row then starts fresh; ids not (yet) admitted share the shard's last
slot, the unknown row. Admission and eviction happen every ``eviction_interval`` training steps,
over the ids counted since the last round; eval and serving only look ids up.

TorchRec manages a whole collection: every table of a ``ManagedCollisionCollection`` has a module.
A collection (``ebc``, ``user_ebc``, ``ec``) with one managed table therefore becomes a
``ManagedCollisionEmbeddingBagCollection`` / ``ManagedCollisionEmbeddingCollection``, and its other
tables get ``PassThroughIds``: their ids are rows, as before, but they are sharded row-wise with the
managed ones (TorchRec shards managed collections row-wise only). Collections without a managed table
stay plain TorchRec collections: a config that asks for none builds exactly the model it built before.

Row-wise sharding sends an id to the rank whose block of the input range [0, 2^63 - 1) holds it.
Raw ids are small and grow with time (new ads get the next ids), so the batch spreads a managed
table's ids over that range with ``spread_ids``, a bijection: no two ids meet, and every rank gets
its share of ids old and new. The remapping is TorchRec's.
"""

from __future__ import annotations

from functools import partial
from typing import Dict, List, Optional, Tuple, Union

import numpy as np
import torch
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.modules.mc_embedding_modules import (
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
)
from torchrec.modules.mc_modules import (
    DistanceLFU_EvictionPolicy,
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    ManagedCollisionCollection,
    ManagedCollisionModule,
    MCHEvictionPolicy,
    MCHManagedCollisionModule,
    average_threshold_filter,
    dynamic_threshold_filter,
    probabilistic_threshold_filter,
)
from torchrec.sparse.jagged_tensor import JaggedTensor

from pinads_rec.config import AdmissionConfig, ManagedCollisionConfig, TableConfig

# The managed modules' input range: [0, INPUT_RANGE). TorchRec marks an empty slot with int64's
# maximum, which is INPUT_RANGE itself, so no id may take that value.
INPUT_RANGE = 2**63 - 1
# TorchRec's planner requires a managed table's bucket count to divide evenly over the ranks; any
# count it divides gives the plain row-wise shards. This one divides over 1-10, 12, 14-16, 18, 20,
# 21, 24, 28, 30, 32 ... 1024 ranks (a world size it does not divide is refused by parallel.py).
PLANNING_BUCKETS = 2**10 * 3**2 * 5 * 7

_MASK = np.uint64(2**63 - 1)
_MIX = (np.uint64(0x3C79AC492BA7B653), np.uint64(0x1C69B3F74AC4AE35))  # odd: invertible mod 2^63


def spread_ids(ids: np.ndarray) -> np.ndarray:
    """Raw ids (int64 >= 0) -> the same number of ids spread over [0, INPUT_RANGE): a bijection of
    [0, 2^63) (xor-shifts and odd multipliers modulo 2^63), so distinct ids stay distinct and
    consecutive ids land in every rank's block. The one id it would send to INPUT_RANGE (TorchRec's
    empty-slot mark) goes to INPUT_RANGE - 1 instead."""
    x = ids.astype(np.uint64)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(31)
        x = (x * _MIX[0]) & _MASK
        x ^= x >> np.uint64(29)
        x = (x * _MIX[1]) & _MASK
        x ^= x >> np.uint64(32)
    out = x.astype(np.int64)
    out[out == INPUT_RANGE] = INPUT_RANGE - 1
    return out


def _at_least(min_count: int, counts: torch.Tensor) -> Tuple[torch.Tensor, float]:
    """Admission by a fixed count: the ids seen at least ``min_count`` times in the round."""
    return counts >= min_count, float(min_count - 1)


def admission_filter(admission: AdmissionConfig):
    """The threshold filter TorchRec's eviction policy applies to a round's id counts (None: all)."""
    return {
        "all": None,
        "min_count": partial(_at_least, admission.min_count),
        "average": average_threshold_filter,
        "dynamic": partial(dynamic_threshold_filter, threshold_skew_multiplier=admission.skew),
        "probabilistic": partial(probabilistic_threshold_filter, per_id_probability=admission.probability),
    }[admission.kind]


def eviction_policy(mc: ManagedCollisionConfig) -> MCHEvictionPolicy:
    admit = admission_filter(mc.admission)
    if mc.eviction == "lru":
        return LRU_EvictionPolicy(threshold_filtering_func=admit)
    if mc.eviction == "lfu":
        return LFU_EvictionPolicy(threshold_filtering_func=admit)
    return DistanceLFU_EvictionPolicy(decay_exponent=mc.decay_exponent, threshold_filtering_func=admit)


class PassThroughIds(ManagedCollisionModule):
    """The module of a table in a managed collection that asked for no management: its ids are its
    rows, unchanged (ids within the table, checked by the loader as for any table), routed to ranks
    by row blocks as row-wise sharding routes them. It keeps no state to save or reshard."""

    def __init__(
        self,
        num_embeddings: int,
        device: torch.device,
        output_segments: Optional[List[int]] = None,
        buckets: int = PLANNING_BUCKETS,
    ) -> None:
        super().__init__(device=device, output_segments=output_segments or [0, num_embeddings])
        self._num_embeddings = num_embeddings
        self._buckets = buckets

    def preprocess(self, features: Dict[str, JaggedTensor]) -> Dict[str, JaggedTensor]:
        return features

    def profile(self, features: Dict[str, JaggedTensor]) -> Dict[str, JaggedTensor]:
        return features

    def remap(
        self,
        features: Dict[str, JaggedTensor],
        mutate_miss_lengths: bool = True,
        write_weights: Optional[torch.Tensor] = None,
    ) -> Dict[str, JaggedTensor]:
        return features

    def forward(self, features: Dict[str, JaggedTensor], mutate_miss_lengths: bool = True) -> Dict[str, JaggedTensor]:
        return features

    def evict(self) -> Optional[torch.Tensor]:
        return None

    def output_size(self) -> int:
        return self._num_embeddings

    def input_size(self) -> int:
        return self._num_embeddings

    def buckets(self) -> int:
        return self._buckets

    def validate_state(self) -> None:
        pass  # nothing kept: any layout of the rows loads

    def open_slots(self) -> torch.Tensor:
        return torch.zeros(1, dtype=torch.int64, device=self.device)

    def rebuild_with_output_id_range(
        self, output_id_range: Tuple[int, int], output_segments: List[int], device: Optional[torch.device] = None
    ) -> "PassThroughIds":
        # The routing block of a shard is the table's rows over the ranks, as row-wise sharding cuts them.
        return type(self)(self._num_embeddings, device or self.device, output_segments, len(output_segments) - 1)


def row_wise_bounds(rows: int, world_size: int) -> List[int]:
    """Where TorchRec's row-wise shards of ``rows`` start, and the end: ceil(rows / ranks) each."""
    block = -(-rows // world_size)
    return [min(r * block, rows) for r in range(world_size + 1)]


class ManagedIds(MCHManagedCollisionModule):
    """TorchRec's MCH module, with the row an id without a slot takes made the same unsharded as on
    the ranks it was trained on.

    Sharded over W ranks, each rank maps the ids of its block of the input range, and an id it has
    no slot for takes that rank's last slot: W unknown rows, one per block. Unsharded (serving, the
    exported program) TorchRec would send every such id to the table's last slot, the last rank's
    row -- a different row for most of them. ``unknown_rows`` (set by ``route_misses`` to the world
    size of the checkpoint's training) gives each miss its block's row instead, so serving scores
    every id as training did. Sharded, each rank's module sees its own block only: the default 1
    is TorchRec's own behaviour."""

    unknown_rows: int = 1

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # The whole table's rows (a shard's module holds its own slots only): TorchRec passes the
        # shards' boundaries, the table's end last, when it rebuilds the module for a shard.
        segments = kwargs.get("output_segments")
        self._table_rows = segments[-1] if segments else self._output_global_offset + self._zch_size

    def remap(
        self,
        features: Dict[str, JaggedTensor],
        mutate_miss_lengths: bool = True,
        write_weights: Optional[torch.Tensor] = None,
    ) -> Dict[str, JaggedTensor]:
        out = super().remap(features, mutate_miss_lengths, write_weights)
        if self.unknown_rows == 1:
            return out
        miss_slot = self._output_global_offset + self._zch_size - 1
        unknown = torch.tensor(row_wise_bounds(self._table_rows, self.unknown_rows)[1:], device=self.device) - 1
        block = -(-INPUT_RANGE // self.unknown_rows)
        routed = {}
        for name, jt in out.items():
            values = jt.values()
            by_block = unknown[torch.div(features[name].values(), block, rounding_mode="floor")]
            routed[name] = JaggedTensor(
                values=torch.where(values == miss_slot, by_block, values),
                lengths=jt.lengths(),
                offsets=jt.offsets(),
                weights=jt.weights_or_none(),
            )
        return routed


def route_misses(model: torch.nn.Module, unknown_rows: int) -> None:
    """An unsharded model's managed tables give an id without a slot the unknown row of its block
    of ids, of ``unknown_rows`` blocks (``ManagedIds``): the world size its checkpoint was trained on."""
    for module in model.modules():
        if isinstance(module, ManagedIds):
            module.unknown_rows = unknown_rows


def managed_module(table: TableConfig, device: Optional[torch.device]) -> ManagedCollisionModule:
    """The module mapping ``table``'s ids: TorchRec's MCH (``ManagedIds``) for a managed table, else
    PassThroughIds."""
    device = device or torch.device("cpu")
    mc = table.managed_collision
    if mc is None:
        return PassThroughIds(table.num_embeddings, device)
    return ManagedIds(
        zch_size=table.num_embeddings,
        device=device,
        eviction_policy=eviction_policy(mc),
        eviction_interval=mc.eviction_interval,
        input_hash_size=INPUT_RANGE,
        name=table.name,
        buckets=PLANNING_BUCKETS,
    )


def id_map_bytes(table: TableConfig) -> int:
    """What a managed table keeps beside its rows, over all shards: per slot its raw id, its slot
    and the eviction policy's counters, 8 bytes each (the policy's history of the ids counted since
    the last round comes on top, per rank: ids per batch x eviction_interval x 1.25 x 8 bytes)."""
    counters = [m for m in eviction_policy(table.managed_collision).metadata_info if m.is_mch_metadata]
    return table.num_embeddings * 8 * (2 + len(counters))


Collection = Union[EmbeddingBagCollection, EmbeddingCollection]


def with_managed_collision(collection: Collection, tables: Dict[str, TableConfig], device: Optional[torch.device]):
    """``collection`` wrapped in TorchRec's managed-collision collection when one of its tables asks
    for managed collision; unchanged otherwise."""
    bags = isinstance(collection, EmbeddingBagCollection)
    configs = collection.embedding_bag_configs() if bags else collection.embedding_configs()
    if not any(tables[c.name].managed_collision for c in configs):
        return collection
    modules = {c.name: managed_module(tables[c.name], device) for c in configs}
    mcc = ManagedCollisionCollection(modules, configs)
    if bags:
        return ManagedCollisionEmbeddingBagCollection(collection, mcc)
    return ManagedCollisionEmbeddingCollection(collection, mcc)


def is_managed(collection) -> bool:
    """A managed-collision collection, before sharding or after (both hold the collection of modules)."""
    return hasattr(collection, "_managed_collision_collection")


def lookup(collection, features):
    """A collection's lookups (KeyedTensor for bags, dict of JaggedTensor for sequences), managed or
    not: a managed collection returns (lookups, remapped ids or None). Decided by the module, not
    its output, so the pipeline's tracer sees the same call."""
    return collection(features)[0] if is_managed(collection) else collection(features)
