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

import hashlib
from contextlib import contextmanager
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
# 21, 24, 28, 30, 32 ... 1024 ranks (a world size it does not divide is refused by parallel.check_managed_world_size).
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

    # --- the round in progress: what TorchRec keeps outside the state dict ---------------------------

    def round_state(self) -> dict:
        """What the next eviction round needs that the state dict lacks: the ids counted since the
        last round with the policy's history of them (when each was seen), the step of that round
        and the history buffer's size (TorchRec sizes it from the first batch it profiles). Without
        them a resumed module would start the schedule at its resume step with nothing counted."""
        counted = self._current_history_buffer_offset
        ids = self._history_accumulator[:counted] if counted else torch.empty(0, dtype=torch.int64)
        return {
            "last_round": self._last_eviction_iter,
            "buffer_size": self._input_history_buffer_size,
            "ids": ids.cpu().clone(),
            "history": {name: h[:counted].cpu().clone() for name, h in self._history_metadata.items()},
        }

    @torch.no_grad()
    def restore_round(self, last_round: int, buffer_size: int, ids: torch.Tensor, history: Dict[str, torch.Tensor]):
        """Puts a ``round_state`` back (after the state dict, whose step counter it goes on from)."""
        if last_round < 0:  # saved before the module's first training step: TorchRec starts it itself
            return
        self._current_iter = int(self._current_iter_tensor.item())
        self._last_eviction_iter = last_round
        size = max(buffer_size, len(ids))
        self._input_history_buffer_size = size
        self._history_accumulator = torch.zeros(size, dtype=torch.int64, device=self.device)
        self._history_accumulator[: len(ids)] = ids.to(self.device)
        for name, _, is_history in self._eviction_policy.metadata_info:
            if is_history:
                buffer = torch.zeros(size, dtype=torch.int64, device=self.device)
                buffer[: len(ids)] = history[name].to(self.device)
                self.register_buffer(f"_history_{name}", buffer, persistent=False)
                self._history_metadata[name] = buffer
        self._current_history_buffer_offset = len(ids)

    def round_seed(self, run_seed: int) -> int:
        """The seed of the rows this module's current round re-initializes: a function of the run's
        seed, the table, the shard (its first row) and the round's step, so that a resumed run
        draws the rows the uninterrupted one drew, with no generator state to carry."""
        key = f"{run_seed}/{self._name}/{self._output_global_offset}/{self._current_iter}".encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def managed_ids(model: torch.nn.Module) -> Dict[str, ManagedIds]:
    """Table -> this process's ManagedIds module of it (one per table on a rank: row-wise shards)."""
    return {m._name: m for m in model.modules() if isinstance(m, ManagedIds)}


def round_states(model: torch.nn.Module) -> Dict[str, dict]:
    """Every managed table's ``ManagedIds.round_state`` on this rank."""
    return {table: module.round_state() for table, module in managed_ids(model).items()}


def restore_rounds(
    model: torch.nn.Module, saved: List[Dict[str, dict]], saved_world_size: int, world_size: int, rank: int
) -> None:
    """Puts the rounds in progress of a checkpoint back: ``saved`` holds this rank's ``round_states``
    on the checkpoint's world size, or every saved rank's on another one. There each rank takes
    the counted ids of its own block of the input range (where row-wise sharding now sends them),
    in saved rank order, into a buffer as large as the largest saved one's share."""
    for table, module in managed_ids(model).items():
        parts = [s[table] for s in saved if table in s]
        if not parts:
            continue
        if saved_world_size == world_size:
            module.restore_round(**parts[0])
            continue
        ids = torch.cat([p["ids"] for p in parts])
        mine = torch.div(ids, -(-INPUT_RANGE // world_size), rounding_mode="floor") == rank
        history = {name: torch.cat([p["history"][name] for p in parts])[mine] for name in parts[0]["history"]}
        size = max(p["buffer_size"] for p in parts) * saved_world_size // world_size
        module.restore_round(max(p["last_round"] for p in parts), size, ids[mine], history)


@contextmanager
def seeded_rng(seed: int, device: torch.device):
    """torch's RNG (CPU, and ``device``'s on CUDA) seeded by ``seed`` inside, restored after."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


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
