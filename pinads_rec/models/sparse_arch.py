"""The sparse arch every model shares: the three TorchRec collections of the feature layout
(pinads_rec/features.py), built on the given device (``meta`` before sharding).

Models keep them under the names ``ebc``, ``user_ebc`` and ``ec``, so sharding plans, sharders,
planner constraints and checkpoints apply to every model alike. A collection the layout gives no
table is None (TorchRec fails on an empty collection) and every model skips it; the batch's KJT
for it is then empty.
"""

from typing import TYPE_CHECKING, Dict, List, NamedTuple, Optional, Tuple

import torch
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from pinads_rec.config import CANDIDATE_PREFIX
from pinads_rec.features import FeatureLayout
from pinads_rec.managed_collision import with_managed_collision
from pinads_rec.modules.jagged import bag_segments, pool_bags

if TYPE_CHECKING:
    from torchrec.sparse.jagged_tensor import JaggedTensor


class SparseCollections(NamedTuple):
    ebc: Optional[EmbeddingBagCollection]  # pooled per row: stride-B KJT -> [B, D] per row_keys feature; None without
    user_ebc: Optional[EmbeddingBagCollection]  # pooled per request slot: [S, D] per user_keys feature; None without
    ec: Optional[EmbeddingCollection]  # per request: sequence_keys -> JaggedTensor; None without sequence groups
    sequence_dim: int  # the width every ec table shares (0 without)


def sparse_collections(layout: FeatureLayout, device: Optional[torch.device] = None) -> SparseCollections:
    """The three collections; one holding a managed-collision table is TorchRec's managed-collision
    collection around it (pinads_rec/managed_collision.py)."""
    tables = {t.name: t for t in layout.features.tables}

    def collision_managed(collection):  # wrapped only where a table has managed_collision
        return with_managed_collision(collection, tables, device)

    row_tables = layout.embedding_bag_configs()
    ebc = collision_managed(EmbeddingBagCollection(tables=row_tables, device=device)) if row_tables else None
    user_tables = layout.embedding_bag_configs(user_side=True)
    user_ebc = collision_managed(EmbeddingBagCollection(tables=user_tables, device=device)) if user_tables else None
    sequence_dim = layout.sequence_dim
    seq_tables = layout.embedding_configs()
    ec = collision_managed(EmbeddingCollection(tables=seq_tables, device=device)) if seq_tables else None
    return SparseCollections(ebc, user_ebc, ec, sequence_dim)


def candidate_lookups(
    layout: FeatureLayout, looked_up: Dict[str, "JaggedTensor"], bag_sizes: Dict[str, torch.Tensor], keys: List[str]
) -> Dict[str, torch.Tensor]:
    """The candidate features ``keys`` (of ``layout.shared_keys``) that ``ec`` looked up: [B, D]
    each, in row order, every row's ids pooled by the feature's pooling (a row of one id: its
    embedding)."""
    out = {}
    for k in keys:
        key = CANDIDATE_PREFIX + k
        out[k] = pool_bags(looked_up[key].values(), bag_sizes[key], mean=layout.bag_pooling[key] == "mean")
    return out


def row_ids(layout: FeatureLayout, batch, key: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """The ids of the sparse feature ``key`` as the batch holds them [M], with the unit of each [M]:
    its row, or for a feature looked up once per request (``layout.user_keys``) its request slot."""
    if key in layout.shared_keys:  # in the sequence KJT, the rows' ids after the events
        ids = batch.sequences[CANDIDATE_PREFIX + key].values()
        return ids, bag_segments(batch.sequence_bag_sizes[CANDIDATE_PREFIX + key], ids.shape[0])
    jagged = (batch.user_sparse if key in layout.user_keys else batch.sparse)[key]
    ids = jagged.values()
    return ids, bag_segments(jagged.lengths(), ids.shape[0])
