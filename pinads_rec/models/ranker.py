"""The unified multi-surface, multi-task ads ranker (unified-surfaces + sequence-modeling articles).

Data path, top to bottom:

1. sparse arch: an ``EmbeddingBagCollection`` pools the categorical features per row [B, ...];
   an ``EmbeddingCollection`` looks up every sequence event, once per *request* [U, ...];
2. sequence arch: one ``SequenceEncoder`` per group, run per request, then broadcast to the
   request's candidate rows by ``request_index``; optionally each candidate then attends over its
   request's encoded events (``TargetAttention``, light and per row);
3. dense arch: normalized dense features ++ pooled embeddings ++ sequence representations ->
   DCNv2 cross network (torchrec ``LowRankCrossNet``) -> MMoE -> per-task towers giving one logit
   per surface -> each row keeps its own surface's logits.

The module is plain: it never mentions DistributedModelParallel. ``pinads_rec.parallel`` shards the
two collections from outside, and the forward is FX-traceable so ``TrainPipelineSparseDist`` can
overlap their input distribution with compute.
"""

from typing import Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.modules.crossnet import CrossNet, LowRankCrossNet
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from pinads_rec.config import CANDIDATE_PREFIX, FeaturesConfig, ModelConfig
from pinads_rec.data.batch import Batch
from pinads_rec.modules.dense_norm import DenseNormalization
from pinads_rec.modules.mmoe import MMoE
from pinads_rec.modules.sequence import SequenceEncoder
from pinads_rec.modules.target_attention import TargetAttention


def embedding_bag_configs(features: FeaturesConfig) -> List[EmbeddingBagConfig]:
    out = []
    for t in features.tables:
        users = [s for s in features.pooled_sparse if s.table == t.name]
        if users:
            pooling = PoolingType.MEAN if users[0].pooling == "mean" else PoolingType.SUM
            out.append(EmbeddingBagConfig(name=t.name, embedding_dim=t.embedding_dim, num_embeddings=t.num_embeddings,
                                          feature_names=[s.name for s in users], pooling=pooling))
    return out


def embedding_configs(features: FeaturesConfig) -> List[EmbeddingConfig]:
    out = []
    for t in features.tables:
        keys = [f"{g.name}.{f.name}" for g in features.sequence_groups for f in g.features if f.table == t.name]
        keys += [CANDIDATE_PREFIX + s.name for s in features.shared_sparse if s.table == t.name]
        if keys:
            out.append(EmbeddingConfig(name=t.name, embedding_dim=t.embedding_dim,
                                       num_embeddings=t.num_embeddings, feature_names=keys))
    return out


class UnifiedRanker(nn.Module):
    def __init__(self, features: FeaturesConfig, model: ModelConfig, device: torch.device = None):
        super().__init__()
        self.features = features
        bag_tables = embedding_bag_configs(features)
        seq_tables = embedding_configs(features)
        self.ebc = EmbeddingBagCollection(tables=bag_tables, device=device)
        self.sparse_keys = [s.name for s in features.sparse]
        seq_dims = {t.embedding_dim for t in seq_tables}
        if len(seq_dims) > 1:
            raise ValueError(f"sequence tables must share one embedding_dim (an EmbeddingCollection "
                             f"requirement); got {sorted(seq_dims)} for {[t.name for t in seq_tables]}")
        self.ec = EmbeddingCollection(tables=seq_tables, device=device) if seq_tables else None
        seq_dim = seq_dims.pop() if seq_dims else 0

        # (group, its KJT keys, whether it carries a pretrained per-event embedding): fixed at build
        # time so the forward has no data-dependent branches (FX tracing for the train pipeline).
        self.groups = [(g.name, [f"{g.name}.{f.name}" for f in g.features], g.embedding_column is not None)
                       for g in features.sequence_groups]
        self.sequence_encoders = nn.ModuleDict({
            g.name: SequenceEncoder(seq_dim, g.max_length, model.sequence, g.embedding_dim if g.embedding_column else 0)
            for g in features.sequence_groups})
        self.dense_norm = DenseNormalization(features.dense)

        # Target attention queries come from the candidate side: pooled features not marked user_side.
        dims = {s.name: features.table(s.table).embedding_dim for s in features.sparse}
        self.shared_keys = [s.name for s in features.shared_sparse]
        self.bag_keys = [s.name for s in features.pooled_sparse]
        self.candidate_keys = [s.name for s in features.sparse if not s.user_side]
        use_target = "target" in model.sequence.poolings and bool(self.candidate_keys)
        self.target_attention = nn.ModuleDict({
            g.name: TargetAttention(sum(dims[k] for k in self.candidate_keys), model.sequence.d_model)
            for g in features.sequence_groups} if use_target else {})

        width = (features.dense_dim + sum(dims.values())
                 + sum(e.output_dim for e in self.sequence_encoders.values())
                 + len(self.target_attention) * model.sequence.d_model)
        self.interaction_width = width
        dcn = model.dcn
        self.cross = (LowRankCrossNet(width, dcn.num_layers, dcn.low_rank) if dcn.low_rank
                      else CrossNet(width, dcn.num_layers))
        self.mmoe = MMoE(width, len(features.tasks), len(features.surfaces), model.mmoe.num_experts,
                         model.mmoe.expert_dims, model.mmoe.tower_dims)
        self.register_buffer("task_weights", torch.tensor([t.weight for t in features.tasks]), persistent=False)

    def forward(self, batch: Batch) -> torch.Tensor:
        """Logits [B, T]: each row's logit per task from its own surface's head."""
        # By name, in config order: a sharded EBC returns its keys grouped by sharding, not as declared.
        bags = self.ebc(batch.sparse).to_dict()
        pooled = {k: bags[k] for k in self.bag_keys}
        if self.ec is not None:
            events = self.ec(batch.sequences)
            for k in self.shared_keys:  # candidate ids looked up in a sequence table: [B, D] in row order
                pooled[k] = events[CANDIDATE_PREFIX + k].values()
        parts = [self.dense_norm(batch.dense)] + [pooled[k] for k in self.sparse_keys]
        if self.ec is not None:
            query = torch.cat([pooled[k] for k in self.candidate_keys], dim=1) if self.target_attention else None
            per_request, per_row = [], []
            for group, keys, pretrained in self.groups:
                summary, encoded, mask = self.sequence_encoders[group](
                    [events[k].values() for k in keys], events[keys[0]].offsets(),
                    batch.sequence_time_deltas[group],
                    batch.sequence_embeddings[group] if pretrained else None)
                per_request.append(summary)
                if self.target_attention:
                    per_row.append(self.target_attention[group](query, encoded, mask, batch.request_index))
            # Request-level broadcasting: user-side work ran once per request; rows index into it.
            parts.append(torch.cat(per_request, dim=1).index_select(0, batch.request_index))
            parts += per_row
        x = self.cross(torch.cat(parts, dim=1))
        logits = self.mmoe(x)  # [B, T, S]
        index = batch.surface.view(-1, 1, 1).expand(-1, logits.shape[1], 1)
        return logits.gather(2, index).squeeze(2)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        per_task = F.binary_cross_entropy_with_logits(logits, labels, reduction="none").mean(dim=0)
        return (per_task * self.task_weights).sum()


class RankerTrainTask(nn.Module):
    """What the train pipeline runs: forward(batch) -> (loss, (loss, logits, labels))."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, batch: Batch) -> Tuple[torch.Tensor, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        logits = self.model(batch)
        loss = self.model.loss(logits, batch.labels)
        return loss, (loss.detach(), logits.detach(), batch.labels)
