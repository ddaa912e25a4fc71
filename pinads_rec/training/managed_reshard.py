"""Managed-collision state moved onto another world size.

Sharded over W ranks, a managed table's rank r maps the raw ids of its block r of the input range
(``managed_collision.INPUT_RANGE`` cut in W) to slots of its own row range, and keeps the map (ids,
slots, the eviction policy's counters) beside those rows, its last slot the unknown row its
block's misses read. On more ranks (TorchEasyRec #360: trained on 2, resumed on 4) an old rank's
ids belong to several new ranks while their rows stay in its range: TorchRec 1.8 asserts ("shard
... cannot be built out of segments"), and the loaded slices would send most ids to a rank without
a slot for them. On fewer, TorchRec reloads the merged ranks as they were, each keeping its
unknown row in a slot the merged rank's pool may hand to a new id.

``relayout`` does what either needs: every rank reads the table's whole map, rows and row-wise
optimizer state from the checkpoint, keeps the ids its block now holds and gives them slots of its
own range (in their old slot order), their rows, optimizer state and counters moved along; its
unknown row starts as the one its block's start missed to; spare slots get fresh rows. A rank
whose block holds more ids than its slots keeps the most recently (LRU, distance-LFU) or most often
(LFU) seen: the others would have been evicted next. Every id it keeps scores as before; an id
without a slot reads the new rank's unknown row (tests/test_managed_collision.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List

import torch
import torch.distributed.checkpoint as dcp

from pinads_rec.managed_collision import INPUT_RANGE, ManagedIds, row_wise_bounds
from pinads_rec.parallel import local_pieces

EMPTY = torch.iinfo(torch.int64).max  # TorchRec's mark of an empty slot


def managed_modules(dmp, state: dict) -> Dict[str, tuple]:
    """table -> (its map's state-dict prefix, its collection's, this rank's ManagedIds module) for
    every managed table of ``dmp`` (``state``: its state dict). A table lives in one collection."""
    out = {}
    for module in dmp.modules():
        if isinstance(module, ManagedIds):
            suffix = f"._managed_collision_modules.{module._name}._mch_sorted_raw_ids"
            mc = next(k for k in state if k.endswith(suffix))[: -len("._mch_sorted_raw_ids")]
            out[module._name] = (mc, mc.split("._managed_collision_collection.")[0], module)
    return out


def relayout(path: Path, dmp, optimizer, saved_world_size: int, world_size: int, rank: int) -> None:
    """Re-places every managed table of checkpoint ``path`` (trained on ``saved_world_size`` ranks)
    onto this rank of ``world_size``, in ``dmp`` and, unless None, ``optimizer`` (both
    already loaded with the rest of the checkpoint)."""
    model_state = dmp.state_dict()
    optim_state = optimizer.state_dict()["state"] if optimizer is not None else {}
    for table, (mc, collection, module) in managed_modules(dmp, model_state).items():
        weight_key = next(
            k
            for k in model_state
            if k.startswith(collection + "._embedding_module.") and k.endswith(f".{table}.weight")
        )
        meta = [m.metadata_name for m in module._eviction_policy.metadata_info if m.is_mch_metadata]
        names = {"ids": "_mch_sorted_raw_ids", "slots": "_mch_remapped_ids_mapping", **{m: f"_mch_{m}" for m in meta}}
        rows = module._table_rows
        weight = model_state[weight_key]
        wanted = {f"{mc}.{buffer}": torch.empty(rows, dtype=torch.int64) for buffer in names.values()}
        wanted[weight_key] = torch.empty(tuple(weight.shape), dtype=weight.dtype)
        request = {"model": wanted}
        optim_key = next((k for k in optim_state if k.endswith(weight_key)), None)
        old_momenta = {}
        if optim_key is not None:
            old_momenta = {n: torch.empty(tuple(t.shape), dtype=t.dtype) for n, t in optim_state[optim_key].items()}
            request["optimizer"] = {"state": {optim_key: old_momenta}}
        dcp.load(request, checkpoint_id=str(path))
        old = {name: wanted[f"{mc}.{buffer}"] for name, buffer in names.items()}
        momenta = optim_state[optim_key] if optim_key is not None else {}
        _place(
            module, old, meta, (wanted[weight_key], weight), (old_momenta, momenta), saved_world_size, world_size, rank
        )


def _keep_order(meta: List[str]) -> str:
    """The counter whose largest values an overfull rank keeps: recency where the policy has it."""
    return "last_access_iter" if "last_access_iter" in meta else meta[0]


@torch.no_grad()
def _place(module, old, meta, weights, momenta, saved_world_size, world_size, rank) -> None:
    """This rank's share of one table's old map, rows and optimizer state, written in place."""
    rows, offset, slots = module._table_rows, module._output_global_offset, module._zch_size
    used = old["ids"] != EMPTY
    block = -(-INPUT_RANGE // world_size)
    mine = used & (torch.div(old["ids"], block, rounding_mode="floor") == rank)
    picked = {name: values[mine] for name, values in old.items()}
    capacity = slots - 1  # the shard's last slot is its unknown row
    if len(picked["ids"]) > capacity:
        keep = torch.argsort(picked[_keep_order(meta)], descending=True, stable=True)[:capacity]
        picked = {name: values[keep] for name, values in picked.items()}
    order = torch.argsort(picked["slots"], stable=True)  # in old slot order: deterministic
    picked = {name: values[order] for name, values in picked.items()}
    k = len(picked["ids"])
    module._mch_sorted_raw_ids.fill_(EMPTY)
    module._mch_sorted_raw_ids[:k] = picked["ids"]
    module._mch_remapped_ids_mapping.copy_(torch.arange(offset, offset + slots))
    for m in meta:
        module._mch_metadata[m].zero_()
        module._mch_metadata[m][:k] = picked[m]
    module._sort_mch_buffers()
    # The unknown row: the one this rank's ids missed to before (the old block holding its start's).
    old_block = rank * block // -(-INPUT_RANGE // saved_world_size)
    old_unknown = row_wise_bounds(rows, saved_world_size)[old_block + 1] - 1
    sources = torch.cat([picked["slots"], torch.tensor([old_unknown])])
    targets = torch.cat([torch.arange(k), torch.tensor([slots - 1])])
    spare = torch.arange(k, slots - 1)  # no id: a fresh row, as an evicted slot gets
    old_weight, weight = weights
    for _, (h, _), local in local_pieces(weight):
        if h:
            local[targets] = old_weight[sources].to(local.dtype)
            fresh = torch.empty(len(spare), local.shape[1]).uniform_(-(rows**-0.5), rows**-0.5)
            local[spare] = fresh.to(local.dtype)
    old_momenta, momenta = momenta
    for name, tensor in momenta.items():
        for _, (h, *_), local in local_pieces(tensor):
            if h:
                local[targets] = old_momenta[name][sources].to(local.dtype)
                local[spare] = 0
