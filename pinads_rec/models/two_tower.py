"""The lightweight two-tower engagement ranker (two-tower GPU-serving article), for early-stage ranking.

Data path, top to bottom:

1. sparse arch: the same TorchRec collections as the unified ranker (``ebc`` per row, ``user_ebc``
   once per request, ``ec`` for the sequence events once per request and the candidates' ids in
   row order; any of them None when the feature layout gives it no table), so
   ``pinads_rec.parallel`` plans and shards it unchanged;
2. **user tower**, once per request [U, ...]: user-side pooled features (``user_side: true``; those
   looked up per row are read at the request's first row), user-side dense features
   (``DenseFeatureConfig.user_side``, read at the first row), a surface embedding (the surface is a
   property of the request), and every sequence group pooled per request by the ranker's
   ``SequenceArch`` (a ``SequenceEncoder`` per group) without its candidate-dependent pooling
   ("target" would let the candidate into the user vector). With
   ``model.sequence.num_layers: 0`` and ``poolings: [mean]`` (configs/two_tower.yaml) that is the
   light pooling: the masked mean of (event attributes + time-delta embedding), layer-normed;
   ``num_layers > 0`` puts a Transformer in the user tower, still once per request;
3. **ad tower**, per row [B, ...]: the candidate-side pooled features (incl. the candidate ids
   looked up in the sequence tables, ``candidate.<name>`` keys) and candidate-side dense features;
4. each tower: normalized inputs -> DCNv2 (modules/cross_network.py) -> MMoE giving one
   ``model.two_tower.embedding_dim`` vector per task: user [U, T, E], ad [B, T, E];
5. score: per task, the dot product of the row's request's user vector (request-level
   broadcasting by ``request_index``) and the row's ad vector, plus a per-(surface, task) bias ->
   raw [B, T]; surface-specific calibration -> calibrated [B, T].

Because the ad vector depends on the ad's features only, it can be precomputed per item
(``user_embeddings`` / ``ad_embeddings`` / ``combine`` are the towers and the score on their own;
pinads_rec/serve/ad_table.py writes, reads and scores from that table). The ad tower must see item
features only: mark request/user features (user activity, the query, the related pin's topic...)
``user_side: true`` or the exported vector of an item depends on the request it happened to be
seen in.

Like ranker.py the module is plain (no DistributedModelParallel) and its ``scores`` is FX-traceable
at the top level: every data-dependent step lives in a direct child without sharded tables, which
``TrainPipelineSparseDist``'s tracer treats as a leaf (a ModuleDict's children would be traced
into, hence one ``SequenceArch`` for all groups).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Tuple

import torch
from torch import nn

from pinads_rec.config import DCNConfig, FeaturesConfig, MMoEConfig, ModelConfig
from pinads_rec.data.loader.batch import Batch
from pinads_rec.features import FeatureLayout
from pinads_rec.managed_collision import lookup
from pinads_rec.models.objective import engagement_loss
from pinads_rec.models.sparse_arch import candidate_lookups, sparse_collections
from pinads_rec.modules.calibration import Calibration
from pinads_rec.modules.cross_network import cross_network
from pinads_rec.modules.dense_norm import DenseNormalization
from pinads_rec.modules.mmoe import MMoE
from pinads_rec.modules.sequence import SequenceArch

SURFACE_EMBEDDING_DIM = 8


class FirstRowOfRequest(nn.Module):
    """request_index [B] -> [U] the first row of each request slot (user-side values carried per row
    are read there). A submodule because it needs U as a Python int: a leaf for FX tracing."""

    def forward(self, request_index: torch.Tensor) -> torch.Tensor:
        B = request_index.shape[0]
        U = int(request_index.max()) + 1 if B else 0
        rows = torch.arange(B, device=request_index.device)
        return torch.full((U,), B, dtype=torch.int64, device=request_index.device).scatter_reduce(
            0, request_index, rows, reduce="amin"
        )


class Tower(nn.Module):
    """One tower: DCNv2 cross network then MMoE with one E-wide output per task.
    In: [N, D]. Out: [N, T, E]."""

    def __init__(self, width: int, num_tasks: int, embedding_dim: int, dcn: DCNConfig, mmoe: MMoEConfig):
        super().__init__()
        self.cross = cross_network(width, dcn.num_layers, dcn.low_rank)
        # The MMoE's per-task tower outputs ("one logit per surface" in the ranker) are here the
        # task's embedding_dim-wide vector.
        self.mmoe = MMoE(width, num_tasks, embedding_dim, mmoe.num_experts, mmoe.expert_dims, mmoe.tower_dims)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mmoe(self.cross(x))


class TwoTowerRanker(nn.Module):
    def __init__(self, features: FeaturesConfig, model: ModelConfig, device: torch.device = None):
        super().__init__()
        self.features = features
        tt = model.two_tower
        num_tasks, num_surfaces = len(features.tasks), len(features.surfaces)
        self.embedding_dim = tt.embedding_dim

        # Sparse arch: the ranker's tables, module names and keys (same plans, same sharders).
        self.layout = layout = FeatureLayout.of(features)
        self.ebc, self.user_ebc, self.ec, seq_dim = sparse_collections(layout, device)

        # Which tower each feature feeds, fixed at build time (no data-dependent branches). The user
        # tower also reads the user-side features looked up per row or in a sequence table (at the
        # request's first row); layout.user_keys come from user_ebc, once per request.
        user_side = set(layout.user_side_keys)
        self.user_row_keys = [k for k in layout.row_keys if k in user_side]  # [B] from ebc: first row
        self.user_shared_keys = [k for k in layout.shared_keys if k in user_side]  # [B] from ec: first row
        self.ad_bag_keys = [k for k in layout.row_keys if k not in user_side]
        self.ad_shared_keys = [k for k in layout.shared_keys if k not in user_side]
        user_cols, ad_cols = layout.dense_indices(user_side=True), layout.dense_indices(user_side=False)
        self.register_buffer("user_dense_cols", torch.tensor(user_cols, dtype=torch.int64), persistent=False)
        self.register_buffer("ad_dense_cols", torch.tensor(ad_cols, dtype=torch.int64), persistent=False)
        self.user_dense_norm = DenseNormalization([d for d in features.dense if d.user_side], model.resilient_bn)
        self.ad_dense_norm = DenseNormalization([d for d in features.dense if not d.user_side], model.resilient_bn)

        # Sequence pooling for the user tower: the candidate must not enter the user vector, so the
        # candidate-dependent parts are left out (query_dim 0; mean pooling if nothing else is left).
        # One module for all groups: a direct child without sharded tables is one leaf for the
        # pipeline's tracer (the children of a ModuleDict would be traced into).
        user_seq = {}
        for g in features.sequence_groups:
            enc = model.sequence_for(g.name)
            user_seq[g.name] = dataclasses.replace(enc, poolings=[p for p in enc.poolings if p != "target"] or ["mean"])
        self.sequence_arch = (
            SequenceArch(features, user_seq, seq_dim, query_dim=0)
            if self.ec is not None and features.sequence_groups
            else None
        )
        self.surface_embedding = nn.Embedding(num_surfaces, SURFACE_EMBEDDING_DIM)
        self.first_row = FirstRowOfRequest()

        user_width = (
            len(user_cols)
            + SURFACE_EMBEDDING_DIM
            + layout.width(layout.user_keys + self.user_row_keys + self.user_shared_keys)
            + (self.sequence_arch.output_dim if self.sequence_arch is not None else 0)
        )
        ad_width = len(ad_cols) + layout.width(self.ad_bag_keys + self.ad_shared_keys)
        if ad_width == 0:
            raise ValueError(
                "two_tower: the ad tower has no input; declare candidate-side features "
                "(sparse or dense features without user_side: true)"
            )
        self.user_width, self.ad_width = user_width, ad_width
        self.user_tower = Tower(user_width, num_tasks, tt.embedding_dim, tt.dcn, tt.mmoe)
        self.ad_tower = Tower(ad_width, num_tasks, tt.embedding_dim, tt.dcn, tt.mmoe)
        self.bias = nn.Parameter(torch.zeros(num_surfaces, num_tasks))  # per (surface, task)
        self.calibration = Calibration(num_surfaces, num_tasks, model.calibration)
        self.register_buffer("task_weights", torch.tensor([t.weight for t in features.tasks]), persistent=False)

    # --- the training / evaluation interface (same as UnifiedRanker) ---------------------------

    def forward(self, batch: Batch) -> torch.Tensor:
        """Calibrated logits [B, T]."""
        return self.scores(batch)[1]

    def scores(self, batch: Batch) -> Tuple[torch.Tensor, torch.Tensor]:
        """(raw, calibrated) logits [B, T]. Each sharded collection is called once (pipelining)."""
        looked_up = self._lookup(batch, user=True, ad=True)
        users = self._user_tower(batch, looked_up)
        ads = self._ad_tower(batch, looked_up)
        raw = self.combine(users, ads, batch.request_index, batch.surface)
        return raw, self.calibration(raw, batch.surface)

    def loss(self, raw: torch.Tensor, calibrated: torch.Tensor, batch: Batch) -> torch.Tensor:
        return engagement_loss(raw, batch.labels, batch.valid, self.task_weights)

    # --- the towers on their own (serving: pinads_rec/serve/ad_table.py) -----------------------

    def user_embeddings(self, batch: Batch) -> torch.Tensor:
        """[U, T, E]: one vector per task for each request of the batch."""
        return self._user_tower(batch, self._lookup(batch, user=True, ad=False))

    def ad_embeddings(self, batch: Batch) -> torch.Tensor:
        """[B, T, E]: one vector per task for each row's candidate (surface-independent)."""
        return self._ad_tower(batch, self._lookup(batch, user=False, ad=True))

    def combine(
        self, users: torch.Tensor, ads: torch.Tensor, request_index: torch.Tensor, surface: torch.Tensor
    ) -> torch.Tensor:
        """users [U, T, E], ads [B, T, E] -> raw logits [B, T]: per task, the row's request's user
        vector . the row's ad vector + bias[surface, task]."""
        return (users.index_select(0, request_index) * ads).sum(dim=-1) + self.bias.index_select(0, surface)

    # --- internals -----------------------------------------------------------------------------

    def _lookup(self, batch: Batch, user: bool, ad: bool) -> Dict[str, object]:
        out: Dict[str, object] = {}
        # ebc is None exactly when the layout has no row_keys (then both key lists are empty).
        if (ad and self.ad_bag_keys) or (user and self.user_row_keys):
            out["bags"] = lookup(self.ebc, batch.sparse).to_dict()
        if user and self.user_ebc is not None:
            out["users"] = lookup(self.user_ebc, batch.user_sparse).to_dict()
        if self.ec is not None and (user or (ad and self.ad_shared_keys)):
            out["events"] = lookup(self.ec, batch.sequences)
        return out

    def _user_tower(self, batch: Batch, looked_up: Dict[str, object]) -> torch.Tensor:
        first = self.first_row(batch.request_index)  # [U]
        # = arange(U): the user_sparse KJT may carry more (empty, padding) slots than requests.
        slots = batch.request_index.index_select(0, first)
        parts = [
            self.user_dense_norm(batch.dense.index_select(0, first).index_select(1, self.user_dense_cols)),
            self.surface_embedding(batch.surface.index_select(0, first)),
        ]
        # By name, in config order: a sharded collection returns its keys grouped by sharding.
        parts += [looked_up["users"][k].index_select(0, slots) for k in self.layout.user_keys]
        parts += [looked_up["bags"][k].index_select(0, first) for k in self.user_row_keys]
        if self.ec is not None:
            shared = candidate_lookups(
                self.layout, looked_up["events"], batch.sequence_bag_sizes, self.user_shared_keys
            )
            parts += [shared[k].index_select(0, first) for k in self.user_shared_keys]
        if self.sequence_arch is not None:  # per request: "broadcast" to the slots themselves
            parts.append(
                self.sequence_arch(
                    looked_up["events"],
                    batch.sequence_time_deltas,
                    batch.sequence_embeddings,
                    slots,
                    None,
                    bag_sizes=batch.sequence_bag_sizes,
                )
            )
        return self.user_tower(torch.cat(parts, dim=1))

    def _ad_tower(self, batch: Batch, looked_up: Dict[str, object]) -> torch.Tensor:
        parts = [self.ad_dense_norm(batch.dense.index_select(1, self.ad_dense_cols))]
        parts += [looked_up["bags"][k] for k in self.ad_bag_keys]
        if self.ad_shared_keys:  # candidate ids looked up in a sequence table: [B, D] in row order
            shared = candidate_lookups(self.layout, looked_up["events"], batch.sequence_bag_sizes, self.ad_shared_keys)
            parts += [shared[k] for k in self.ad_shared_keys]
        return self.ad_tower(torch.cat(parts, dim=1))
