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
   DCNv2 cross network (modules/cross_network.py) -> MMoE -> per-task towers giving one logit
   per surface -> each row keeps its own surface's logits -> surface-specific calibration.

User-side results are broadcast to the rows by ``request_index`` (request-level broadcasting); the
large layers are ``LargeLayer``s (BF16 when configured, modules/precision.py).

The module is plain: it never mentions DistributedModelParallel. ``pinads_rec.parallel`` shards the
collections from outside (any of the three may be absent: None when the feature layout gives it no
table), and the forward is FX-traceable so ``TrainPipelineSparseDist`` can overlap their input
distribution with compute.
"""

from typing import Tuple

import torch
from torch import nn

from pinads_rec.config import FeaturesConfig, ModelConfig
from pinads_rec.data.loader.batch import Batch
from pinads_rec.features import FeatureLayout
from pinads_rec.managed_collision import lookup
from pinads_rec.models.objective import engagement_loss
from pinads_rec.models.sparse_arch import candidate_lookups, row_ids, sparse_collections
from pinads_rec.modules.calibration import Calibration
from pinads_rec.modules.cross_network import cross_network
from pinads_rec.modules.dense_norm import DenseNormalization
from pinads_rec.modules.id_match import IdMatches
from pinads_rec.modules.mmoe import MMoE
from pinads_rec.modules.sequence import SequenceArch


class UnifiedRanker(nn.Module):
    def __init__(self, features: FeaturesConfig, model: ModelConfig, device: torch.device = None):
        super().__init__()
        self.features = features
        self.layout = layout = FeatureLayout.of(features)
        self.ebc, self.user_ebc, self.ec, seq_dim = sparse_collections(layout, device)

        self.dense_norm = DenseNormalization(features.dense, model.resilient_bn)

        # Target attention queries come from the candidate side: sparse features not marked user_side.
        self.sequence_arch = (
            SequenceArch(
                features,
                {g.name: model.sequence_for(g.name) for g in features.sequence_groups},
                seq_dim,
                layout.width(layout.candidate_keys),
                layout.width(layout.user_keys),
            )
            if features.sequence_groups
            else None
        )
        missing = [
            k for k in (self.sequence_arch.id_keys if self.sequence_arch else []) if k not in layout.sequence_keys
        ]
        if missing:
            raise ValueError(
                f"retrieval reads the ids of {missing}, which the sequence EmbeddingCollection does not look up "
                f"(a retrieval candidate feature must be candidate-side, on the attribute's table)"
            )

        self.id_matches = IdMatches([(p.candidate, p.other) for p in model.id_matches]) if model.id_matches else None
        width = (
            layout.dense_dim
            + layout.width(layout.sparse_keys)
            + (self.sequence_arch.output_dim if self.sequence_arch is not None else 0)
            + (self.id_matches.output_dim if self.id_matches is not None else 0)
        )
        self.interaction_width = width
        self.cross = cross_network(width, model.dcn.num_layers, model.dcn.low_rank)
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
        layout = self.layout
        pooled = {}
        if self.ebc is not None:  # None without per-row pooled features (fixed at build: still traceable)
            bags = lookup(self.ebc, batch.sparse).to_dict()
            pooled = {k: bags[k] for k in layout.row_keys}
        user = None
        if self.user_ebc is not None:
            # Request-level broadcasting: looked up once per request, indexed out to its rows.
            users = lookup(self.user_ebc, batch.user_sparse).to_dict()
            for k in layout.user_keys:
                pooled[k] = users[k].index_select(0, batch.request_index)
            if self.sequence_arch is not None and self.sequence_arch.uses_user:
                user = torch.cat([users[k] for k in layout.user_keys], dim=1)  # [S, D] per request slot
        if self.ec is not None:
            events = lookup(self.ec, batch.sequences)
            # Candidate ids looked up in a sequence table: [B, D] in row order.
            pooled.update(candidate_lookups(layout, events, batch.sequence_bag_sizes, layout.shared_keys))
        parts = [self.dense_norm(batch.dense)] + [pooled[k] for k in layout.sparse_keys]
        if self.sequence_arch is not None:
            query = (
                torch.cat([pooled[k] for k in layout.candidate_keys], dim=1) if self.sequence_arch.uses_query else None
            )
            # The retrieval compares ids: the events' and the candidates' (row order), as the loader gave them.
            ids = {k: batch.sequences[k].values() for k in self.sequence_arch.id_keys}
            parts.append(
                self.sequence_arch(
                    events,
                    batch.sequence_time_deltas,
                    batch.sequence_embeddings,
                    batch.request_index,
                    query,
                    user,
                    ids,
                    bag_sizes=batch.sequence_bag_sizes,
                )
            )
        if self.id_matches is not None:
            sides = [
                (row_ids(layout, batch, a), row_ids(layout, batch, b), b in layout.user_keys)
                for a, b in self.id_matches.pairs
            ]
            parts.append(self.id_matches(sides, batch.request_index))
        x = self.cross(torch.cat(parts, dim=1))
        logits = self.mmoe(x)  # [B, T, S]
        index = batch.surface.view(-1, 1, 1).expand(-1, logits.shape[1], 1)
        raw = logits.gather(2, index).squeeze(2)
        return raw, self.calibration(raw, batch.surface)

    def loss(self, raw: torch.Tensor, calibrated: torch.Tensor, batch: Batch) -> torch.Tensor:
        return engagement_loss(raw, batch.labels, batch.valid, self.task_weights)
