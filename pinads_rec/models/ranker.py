"""The unified multi-surface, multi-task ads ranker (unified-surfaces + sequence-modeling articles).

Data path, top to bottom:

1. sparse arch: an ``EmbeddingBagCollection`` pools the candidate-side categorical features per
   row [B, ...], a second one the user-side features once per *request* [U, ...]; an
   ``EmbeddingCollection`` looks up every sequence event, once per request [U, ...];
2. sequence arch (``SequenceArch``, modules/sequence.py): per group its configured encoders
   (Transformer, sum / period sum pooling, DIN, long/short interest, early interaction), run per
   request and broadcast to the request's candidate rows by ``request_index``, plus the light
   per-candidate attentions;
3. dense arch: normalized dense features ++ pooled embeddings ++ sequence representations ->
   DCNv2 cross network (torchrec ``LowRankCrossNet``) -> MMoE -> per-task towers giving one logit
   per surface -> each row keeps its own surface's logits -> surface-specific calibration.

User-side results are broadcast to the rows by ``request_index`` (request-level broadcasting); the
large layers are ``LargeLayer``s (BF16 when configured, modules/precision.py).

The module is plain: it never mentions DistributedModelParallel. ``pinads_rec.parallel`` shards the
two collections from outside, and the forward is FX-traceable so ``TrainPipelineSparseDist`` can
overlap their input distribution with compute.
"""

from typing import List, Tuple

import torch
from torch import nn
from torchrec.modules.crossnet import CrossNet, LowRankCrossNet
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from pinads_rec.config import CANDIDATE_PREFIX, FeaturesConfig, ModelConfig
from pinads_rec.data.batch import Batch
from pinads_rec.models.objective import engagement_loss
from pinads_rec.modules.calibration import Calibration
from pinads_rec.modules.dense_norm import DenseNormalization
from pinads_rec.modules.mmoe import MMoE
from pinads_rec.modules.precision import LargeLayer
from pinads_rec.modules.sequence import SequenceArch


def embedding_bag_configs(features: FeaturesConfig, user_side: bool = False) -> List[EmbeddingBagConfig]:
    """Tables of the pooled features looked up per row, or (user_side) once per request."""
    out = []
    for t in features.tables:
        users = [s for s in (features.user_sparse if user_side else features.row_sparse) if s.table == t.name]
        if users:
            pooling = PoolingType.MEAN if users[0].pooling == "mean" else PoolingType.SUM
            out.append(
                EmbeddingBagConfig(
                    name=t.name,
                    embedding_dim=t.embedding_dim,
                    num_embeddings=t.num_embeddings,
                    feature_names=[s.name for s in users],
                    pooling=pooling,
                )
            )
    return out


def embedding_configs(features: FeaturesConfig) -> List[EmbeddingConfig]:
    out = []
    for t in features.tables:
        keys = [f"{g.name}.{f.name}" for g in features.sequence_groups for f in g.features if f.table == t.name]
        keys += [CANDIDATE_PREFIX + s.name for s in features.shared_sparse if s.table == t.name]
        if keys:
            out.append(
                EmbeddingConfig(
                    name=t.name, embedding_dim=t.embedding_dim, num_embeddings=t.num_embeddings, feature_names=keys
                )
            )
    return out


def sparse_collections(features: FeaturesConfig, device: torch.device = None):
    """The sparse arch every model shares, (ebc, user_ebc, ec, sequence width): the pooled row
    features, the pooled user features (None without any), and the sequence + shared-candidate
    lookups (None without sequence groups). Models keep them under these names, so plans, sharders
    and constraints apply to all models alike."""
    ebc = EmbeddingBagCollection(tables=embedding_bag_configs(features), device=device)
    user_tables = embedding_bag_configs(features, user_side=True)
    user_ebc = EmbeddingBagCollection(tables=user_tables, device=device) if user_tables else None
    seq_tables = embedding_configs(features)
    seq_dims = {t.embedding_dim for t in seq_tables}
    if len(seq_dims) > 1:
        raise ValueError(
            f"sequence tables must share one embedding_dim (an EmbeddingCollection "
            f"requirement); got {sorted(seq_dims)} for {[t.name for t in seq_tables]}"
        )
    ec = EmbeddingCollection(tables=seq_tables, device=device) if seq_tables else None
    return ebc, user_ebc, ec, (seq_dims.pop() if seq_dims else 0)


class UnifiedRanker(nn.Module):
    def __init__(self, features: FeaturesConfig, model: ModelConfig, device: torch.device = None):
        super().__init__()
        self.features = features
        self.ebc, self.user_ebc, self.ec, seq_dim = sparse_collections(features, device)
        self.sparse_keys = [s.name for s in features.sparse]

        self.dense_norm = DenseNormalization(features.dense, model.resilient_bn)

        # Target attention queries come from the candidate side: pooled features not marked user_side.
        dims = {s.name: features.table(s.table).embedding_dim for s in features.sparse}
        self.shared_keys = [s.name for s in features.shared_sparse]
        self.bag_keys = [s.name for s in features.row_sparse]
        self.user_keys = [s.name for s in features.user_sparse]
        self.candidate_keys = [s.name for s in features.sparse if not s.user_side]
        self.sequence_arch = (
            SequenceArch(
                features,
                {g.name: model.sequence_for(g.name) for g in features.sequence_groups},
                seq_dim,
                sum(dims[k] for k in self.candidate_keys),
                sum(dims[k] for k in self.user_keys),
            )
            if features.sequence_groups
            else None
        )

        width = (
            features.dense_dim
            + sum(dims.values())
            + (self.sequence_arch.output_dim if self.sequence_arch is not None else 0)
        )
        self.interaction_width = width
        dcn = model.dcn
        self.cross = LargeLayer(
            LowRankCrossNet(width, dcn.num_layers, dcn.low_rank) if dcn.low_rank else CrossNet(width, dcn.num_layers)
        )
        self.mmoe = MMoE(
            width,
            len(features.tasks),
            len(features.surfaces),
            model.mmoe.num_experts,
            model.mmoe.expert_dims,
            model.mmoe.tower_dims,
        )
        self.calibration = Calibration(len(features.surfaces), len(features.tasks), model.calibration)
        self.register_buffer("task_weights", torch.tensor([t.weight for t in features.tasks]), persistent=False)

    def forward(self, batch: Batch) -> torch.Tensor:
        """Calibrated logits [B, T]: each row's logit per task from its own surface's head."""
        return self.scores(batch)[1]

    def scores(self, batch: Batch) -> Tuple[torch.Tensor, torch.Tensor]:
        """(raw, calibrated) logits [B, T]."""
        # By name, in config order: a sharded EBC returns its keys grouped by sharding, not as declared.
        bags = self.ebc(batch.sparse).to_dict()
        pooled = {k: bags[k] for k in self.bag_keys}
        user = None
        if self.user_ebc is not None:
            # Request-level broadcasting: looked up once per request, indexed out to its rows.
            users = self.user_ebc(batch.user_sparse).to_dict()
            for k in self.user_keys:
                pooled[k] = users[k].index_select(0, batch.request_index)
            if self.sequence_arch is not None and self.sequence_arch.uses_user:
                user = torch.cat([users[k] for k in self.user_keys], dim=1)  # [S, D] per request slot
        if self.ec is not None:
            events = self.ec(batch.sequences)
            for k in self.shared_keys:  # candidate ids looked up in a sequence table: [B, D] in row order
                pooled[k] = events[CANDIDATE_PREFIX + k].values()
        parts = [self.dense_norm(batch.dense)] + [pooled[k] for k in self.sparse_keys]
        if self.sequence_arch is not None:
            query = (
                torch.cat([pooled[k] for k in self.candidate_keys], dim=1) if self.sequence_arch.uses_query else None
            )
            parts.append(
                self.sequence_arch(
                    events, batch.sequence_time_deltas, batch.sequence_embeddings, batch.request_index, query, user
                )
            )
        x = self.cross(torch.cat(parts, dim=1))
        logits = self.mmoe(x)  # [B, T, S]
        index = batch.surface.view(-1, 1, 1).expand(-1, logits.shape[1], 1)
        raw = logits.gather(2, index).squeeze(2)
        return raw, self.calibration(raw, batch.surface)

    def loss(self, raw: torch.Tensor, calibrated: torch.Tensor, batch: Batch) -> torch.Tensor:
        return engagement_loss(raw, batch.labels, batch.valid, self.task_weights)
