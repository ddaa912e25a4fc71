"""The feature layout: which table each feature uses, which TorchRec collection looks it up, and the
KeyedJaggedTensor keys and widths that follow -- derived once from ``FeaturesConfig``.

Three collections, under the module names every model keeps (plans, sharders, constraints and
checkpoints name them):

- ``ebc``: an EmbeddingBagCollection pooling the features looked up once per row (``row_keys``);
- ``user_ebc``: an EmbeddingBagCollection pooling the user-side features looked up once per request
  (``user_keys``: marked ``user_side`` and in a table no candidate-side feature uses);
- ``ec``: an EmbeddingCollection over every table a sequence feature uses. Its KJT holds, per
  request, the sequence features (``<group>.<feature>``, ``event_keys``) and then ``candidate.<name>``:
  the ids of the request's candidate rows of each single-id feature whose table is a sequence table
  (``shared_keys``), so the candidate and the user's events share one embedding space and the
  lookups come back, pooled per row, as [B, D] in row order.

Bags in the sequence KJT (``bag_keys``): a multi-valued event attribute (``max_values`` > 1) holds
a bag of ids per event, a candidate key a bag per row (one id, or a multi-hot feature's several).
The batch carries each bag's size (``Batch.sequence_bag_sizes``); the models pool each bag into
one embedding by the feature's pooling, so an event (a row) gets one vector per attribute.

Any of the three may have no keys (no per-row pooled features, no user-side ones, no sequence
groups): the models then have no such collection (None) and the batch's KJT for it is empty.

The loader builds the batch's KJTs with these keys, the models read the lookups by them, the planner
constrains these tables, and serving rebuilds the KJTs from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List

from pinads_rec.config import CANDIDATE_PREFIX, FeaturesConfig, SparseFeatureConfig

if TYPE_CHECKING:  # torchrec is imported where its configs are made: data tools never load it
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig


@dataclass(frozen=True)
class FeatureLayout:
    """Built once from FeaturesConfig (``FeatureLayout.of``): which table each feature uses, which
    TorchRec collection it lives in, the KJT keys of each collection in order, and widths."""

    features: FeaturesConfig = field(repr=False)
    row_keys: List[str]  # pooled per row (EBC "ebc"), config order
    user_keys: List[str]  # pooled once per request (EBC "user_ebc"), config order
    event_keys: List[str]  # "<group>.<feature>" sequence features, group by group
    shared_keys: List[str]  # candidate features looked up in a sequence table (EC "ec"), config order
    sequence_keys: List[str]  # the EC's KJT keys: event_keys, then "candidate.<name>" per shared key
    sequence_tables: List[str]  # names of the tables a sequence feature uses, sorted
    # sequence keys holding a bag per event (multi-valued attributes) or per row (candidate keys)
    bag_keys: List[str]
    bag_pooling: Dict[str, str]  # bag key -> "sum" | "mean"
    sparse_keys: List[str]  # every sparse feature, config order
    candidate_keys: List[str]  # sparse features not marked user_side, config order
    user_side_keys: List[str]  # sparse features marked user_side, config order
    feature_dims: Dict[str, int]  # sparse feature -> its table's embedding_dim
    dense_dim: int  # width of the dense input: the dense features' dims summed
    managed_tables: List[str]  # tables with managed_collision (raw ids, remapped by TorchRec), config order

    @classmethod
    def of(cls, features: FeaturesConfig) -> "FeatureLayout":
        sequence_tables = sorted({f.table for g in features.sequence_groups for f in g.features})
        pooled = [s for s in features.sparse if s.table not in sequence_tables]
        shared = [s for s in features.sparse if s.table in sequence_tables]
        # Looked up once per request only when no candidate-side feature reads the same table: a
        # table lives in one collection.
        row_tables = {s.table for s in features.sparse if not s.user_side}
        user = [s.name for s in pooled if s.user_side and s.table not in row_tables]
        event_keys = [f"{g.name}.{f.name}" for g in features.sequence_groups for f in g.features]
        bag_pooling = {
            f"{g.name}.{f.name}": f.pooling for g in features.sequence_groups for f in g.features if f.multi_valued
        }
        bag_pooling.update((CANDIDATE_PREFIX + s.name, s.pooling) for s in shared)
        return cls(
            features=features,
            row_keys=[s.name for s in pooled if s.name not in user],
            user_keys=user,
            event_keys=event_keys,
            shared_keys=[s.name for s in shared],
            sequence_keys=event_keys + [CANDIDATE_PREFIX + s.name for s in shared],
            sequence_tables=sequence_tables,
            bag_keys=list(bag_pooling),
            bag_pooling=bag_pooling,
            sparse_keys=[s.name for s in features.sparse],
            candidate_keys=[s.name for s in features.sparse if not s.user_side],
            user_side_keys=[s.name for s in features.sparse if s.user_side],
            feature_dims={s.name: features.table(s.table).embedding_dim for s in features.sparse},
            dense_dim=sum(d.dim for d in features.dense),
            managed_tables=[t.name for t in features.tables if t.managed_collision is not None],
        )

    def managed_keys(self) -> List[str]:
        """The KJT keys (of every collection) whose ids a managed-collision table maps."""
        managed = set(self.managed_tables)
        keys = [s.name for s in self.features.sparse if s.table in managed]
        keys += [CANDIDATE_PREFIX + k for k in keys if k in self.shared_keys]
        return keys + [
            f"{g.name}.{f.name}" for g in self.features.sequence_groups for f in g.features if f.table in managed
        ]

    def sparse_feature(self, name: str) -> SparseFeatureConfig:
        return next(s for s in self.features.sparse if s.name == name)

    def columns(self, keys: List[str]) -> List[str]:
        """The Parquet column of each sparse feature named in ``keys``."""
        return [self.sparse_feature(k).column for k in keys]

    def width(self, keys: List[str]) -> int:
        """The summed embedding widths of the sparse features named in ``keys``."""
        return sum(self.feature_dims[k] for k in keys)

    def dense_indices(self, user_side: bool) -> List[int]:
        """Positions in the dense input [B, dense_dim] of the user-side (or the other) dense features."""
        out, at = [], 0
        for d in self.features.dense:
            if d.user_side == user_side:
                out.extend(range(at, at + d.dim))
            at += d.dim
        return out

    def embedding_bag_configs(self, user_side: bool = False) -> List[EmbeddingBagConfig]:
        """Tables of the pooled features looked up per row (``ebc``), or once per request (``user_ebc``)."""
        from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

        keys = self.user_keys if user_side else self.row_keys
        out = []
        for t in self.features.tables:
            names = [k for k in keys if self.sparse_feature(k).table == t.name]
            if names:
                pooling = PoolingType.MEAN if self.sparse_feature(names[0]).pooling == "mean" else PoolingType.SUM
                out.append(
                    EmbeddingBagConfig(
                        name=t.name,
                        embedding_dim=t.embedding_dim,
                        num_embeddings=t.num_embeddings,
                        feature_names=names,
                        pooling=pooling,
                    )
                )
        return out

    def embedding_configs(self) -> List[EmbeddingConfig]:
        """Tables of the EmbeddingCollection (``ec``): each with its sequence keys, then its candidate keys."""
        from torchrec.modules.embedding_configs import EmbeddingConfig

        out = []
        for t in self.features.tables:
            keys = [
                f"{g.name}.{f.name}" for g in self.features.sequence_groups for f in g.features if f.table == t.name
            ]
            keys += [CANDIDATE_PREFIX + k for k in self.shared_keys if self.sparse_feature(k).table == t.name]
            if keys:
                out.append(
                    EmbeddingConfig(
                        name=t.name, embedding_dim=t.embedding_dim, num_embeddings=t.num_embeddings, feature_names=keys
                    )
                )
        return out

    def all_table_configs(self) -> list:
        """Every table the three collections hold: ebc's, user_ebc's, then ec's (planner constraints)."""
        return self.embedding_bag_configs() + self.embedding_bag_configs(user_side=True) + self.embedding_configs()

    @property
    def sequence_dim(self) -> int:
        """The embedding_dim every sequence table shares (an EmbeddingCollection requirement); 0 without."""
        tables = self.embedding_configs()
        dims = {t.embedding_dim for t in tables}
        if len(dims) > 1:
            raise ValueError(
                f"sequence tables must share one embedding_dim (an EmbeddingCollection "
                f"requirement); got {sorted(dims)} for {[t.name for t in tables]}"
            )
        return dims.pop() if dims else 0
