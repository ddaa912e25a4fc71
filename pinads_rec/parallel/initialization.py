"""The embedding tables in a sharded model's state dict: which parameters are tables
(``EMBEDDING_PARAM``), a rank's pieces of one (``local_pieces``), and their initialization, the
same under every sharding plan and world size (``init_embeddings``)."""

from __future__ import annotations

import zlib

import torch
from torch import nn

EMBEDDING_PARAM = (".embedding_bags.", ".embeddings.")  # parameter names of EBC / EC tables
_INIT_BLOCK_ROWS = 4096


def local_pieces(weight: torch.Tensor) -> list:
    """This rank's pieces of a table in a DMP state dict, as (global (row, col) offset, (rows, cols),
    the tensor holding them): a DTensor's local shards (TorchRec keeps a rank's shards of a table in
    a LocalShardsWrapper, with global offsets; none on a rank that holds no shard), a ShardedTensor's
    (checkpoints and modules made before DTensor output), or the whole of a replicated table."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(weight, DTensor):
        local = weight.to_local()
        return [
            (tuple(o), tuple(z), t) for o, z, t in zip(local.local_offsets(), local.local_sizes(), local.local_shards())
        ]
    if isinstance(weight, ShardedTensor):
        return [(s.metadata.shard_offsets, s.metadata.shard_sizes, s.tensor) for s in weight.local_shards()]
    return [((0, 0), tuple(weight.shape), weight)]  # replicated (data_parallel)


@torch.no_grad()
def init_embeddings(dmp: nn.Module, seed: int) -> None:
    """Uniform(+-1/sqrt(rows)) like TorchRec's default, but drawn per block of rows from
    (seed, table, block): a row's initial value is the same under every sharding plan and world size
    (table-, row-, column-wise or replicated), which makes plans comparable step for step."""
    for name, weight in dmp.state_dict().items():
        if not any(p in name for p in EMBEDDING_PARAM):
            continue
        rows, cols = weight.shape
        bound = rows**-0.5
        for (r0, c0), (h, w), out in local_pieces(weight):
            if h == 0:
                continue
            for block in range(r0 // _INIT_BLOCK_ROWS, (r0 + h - 1) // _INIT_BLOCK_ROWS + 1):
                g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{name}/{block}".encode()))
                start = block * _INIT_BLOCK_ROWS
                values = torch.empty(min(_INIT_BLOCK_ROWS, rows - start), cols).uniform_(-bound, bound, generator=g)
                lo, hi = max(r0, start), min(r0 + h, start + values.shape[0])
                out[lo - r0 : hi - r0].copy_(values[lo - start : hi - start, c0 : c0 + w])
