"""The two-tower ad table: every item's ad-tower vectors precomputed, written to and read from
Parquet, and requests scored from it (models/two_tower.py holds the model itself).

The ad vector of a ``TwoTowerRanker`` depends on the ad's features only, so it can be computed once
per item: ``export_ad_embeddings`` (model + batches) or ``export_ads`` (a trained run + a data
directory, the ``export-ads`` command) write one row per item -- ``item_id`` and one
``fixed_size_list<float32, E>`` column per task -- and ``score_with_ad_table`` scores a request from
``load_ad_table``'s ``AdTable`` [N, T, E] plus one user-tower pass: N dot products instead of N
dense-arch passes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple, Union

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import nn

from pinads_rec.config import CANDIDATE_PREFIX
from pinads_rec.data import page_checksums
from pinads_rec.data.loader.batch import Batch
from pinads_rec.data.loader.reader import open_parquet
from pinads_rec.models.two_tower import TwoTowerRanker
from pinads_rec.serve.batching import file_order_batches
from pinads_rec.serve.loading import ServeError
from pinads_rec.serve.scoring import Predictor


def _unwrap(model: nn.Module) -> TwoTowerRanker:
    """The TwoTowerRanker inside a train task (``.model``) or a DMP wrapper (``.module``)."""
    seen = model
    for _ in range(4):
        if isinstance(seen, TwoTowerRanker):
            return seen
        inner = getattr(seen, "model", None)
        seen = inner if isinstance(inner, nn.Module) else getattr(seen, "module", None)
    raise TypeError(f"expected a TwoTowerRanker (or a wrapper of one), got {type(model).__name__}")


def item_ids(model: TwoTowerRanker, batch: Batch) -> torch.Tensor:
    """[B] int64: each row's candidate id as its embedding table sees it (after ``hash: true``), read
    from the sparse feature whose column is ``features.columns.item_id``."""
    f = model.features
    feature = next((s for s in f.sparse if s.column == f.columns.item_id), None)
    if feature is None:
        raise ValueError(
            f"two_tower export needs a sparse feature reading the item column "
            f"{f.columns.item_id!r} (features.sparse[*].column)"
        )
    if feature.name in model.layout.shared_keys:
        ids = batch.sequences[CANDIDATE_PREFIX + feature.name].values()
    else:
        ids = batch.sparse[feature.name].values()
    if ids.shape[0] != batch.batch_size:
        raise ValueError(
            f"feature {feature.name!r}: expected one item id per row, got {ids.shape[0]} ids "
            f"for {batch.batch_size} rows"
        )
    return ids


def export_ad_embeddings(model: nn.Module, batches: Iterable[Batch], path: Union[str, Path]) -> int:
    """Writes the ad tower's vectors of every distinct item seen in ``batches`` to a Parquet file.

    ``model``: a TwoTowerRanker (or a train task / unsharded wrapper of one) with its trained weights;
    ``batches``: e.g. ``pinads_rec.serve.batching.file_order_batches(cfg, directory)``; ``path``: the file to write.
    Columns: ``item_id`` (int64, sorted, unique) and one ``fixed_size_list<float32, E>`` column per
    task, named after the task; the schema metadata ``pinads_rec`` holds {"tasks", "embedding_dim"}.
    An item seen in several rows keeps its first row's vector (the ad tower reads item features only,
    so every row gives the same one). Runs in eval mode (batch norms use running statistics), then
    restores the model's mode. Returns the number of items written. Meant for an unsharded model in
    one process (e.g. loaded from a checkpoint); on a DMP-sharded one every rank must pass the same
    number of batches and write its own path.
    """
    tt = _unwrap(model)
    was_training = tt.training
    tt.eval()
    ids_seen: Dict[int, int] = {}
    chunks_ids: List[np.ndarray] = []
    chunks_vec: List[np.ndarray] = []
    try:
        with torch.no_grad():
            for batch in batches:
                ids = item_ids(tt, batch).cpu().numpy()
                keep_rows = batch.valid.cpu().numpy().copy()
                # First occurrence per item, within the batch and across batches.
                _, first = np.unique(ids, return_index=True)
                is_first = np.zeros(len(ids), bool)
                is_first[first] = True
                keep_rows &= is_first & np.array([int(i) not in ids_seen for i in ids], bool)
                # Every batch goes through the ad tower, even one without new items: on a sharded
                # model every rank must make the same collective calls.
                vectors = tt.ad_embeddings(batch).float().cpu().numpy()[keep_rows]  # [n, T, E]
                for i in ids[keep_rows]:
                    ids_seen[int(i)] = len(ids_seen)
                chunks_ids.append(ids[keep_rows].astype(np.int64))
                chunks_vec.append(vectors)
    finally:
        tt.train(was_training)
    T, E = len(tt.features.tasks), tt.embedding_dim
    all_ids = np.concatenate(chunks_ids) if chunks_ids else np.zeros(0, np.int64)
    all_vec = np.concatenate(chunks_vec) if chunks_vec else np.zeros((0, T, E), np.float32)
    order = np.argsort(all_ids, kind="stable")
    all_ids, all_vec = all_ids[order], np.ascontiguousarray(all_vec[order], dtype=np.float32)
    columns = {"item_id": pa.array(all_ids, pa.int64())}
    for t, task in enumerate(tt.features.tasks):
        flat = pa.array(np.ascontiguousarray(all_vec[:, t, :]).reshape(-1), pa.float32())
        columns[task.name] = pa.FixedSizeListArray.from_arrays(flat, E)
    meta = {"tasks": [t.name for t in tt.features.tasks], "embedding_dim": E}
    table = pa.table(columns).replace_schema_metadata({"pinads_rec": json.dumps(meta)})
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, str(path), **page_checksums.WRITE)
    return len(all_ids)


@dataclass
class AdTable:
    """Precomputed ad vectors in memory: ``ids`` [N] int64 sorted, ``vectors`` [N, T, E] float32."""

    ids: torch.Tensor
    vectors: torch.Tensor

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """[B] item ids -> [B, T, E]; an id missing from the table is a KeyError naming it."""
        pos = torch.searchsorted(self.ids, ids).clamp(max=max(len(self.ids) - 1, 0))
        found = self.ids.index_select(0, pos) == ids if len(self.ids) else torch.zeros_like(ids, dtype=torch.bool)
        if not bool(found.all()):
            missing = ids[~found].unique()[:5].tolist()
            raise KeyError(
                f"{int((~found).sum())} row(s) have items missing from the ad table, e.g. {missing}: "
                f"export the embeddings of every item you score"
            )
        return self.vectors.index_select(0, pos)


def load_ad_table(source: Union[str, Path, pa.Table], tasks: Optional[List[str]] = None) -> AdTable:
    """Reads a table written by ``export_ad_embeddings`` (path or pyarrow Table); checks the tasks."""
    table = source if isinstance(source, pa.Table) else open_parquet(str(source)).read()
    meta = json.loads((table.schema.metadata or {}).get(b"pinads_rec", b"{}"))
    names = meta.get("tasks") or [n for n in table.column_names if n != "item_id"]
    if tasks is not None and list(tasks) != list(names):
        raise ValueError(f"ad table has tasks {names}, the model {list(tasks)}")
    ids = torch.from_numpy(table.column("item_id").to_numpy().astype(np.int64))
    per_task = []
    for name in names:
        col = table.column(name).combine_chunks()
        E = col.type.list_size
        per_task.append(col.flatten().to_numpy(zero_copy_only=False).reshape(-1, E))
    vectors = torch.from_numpy(np.stack(per_task, axis=1).astype(np.float32))  # [N, T, E]
    if len(ids) > 1 and not bool((ids[1:] > ids[:-1]).all()):
        order = torch.argsort(ids)
        ids, vectors = ids[order], vectors[order]
    return AdTable(ids, vectors)


def score_with_ad_table(
    model: nn.Module, batch: Batch, table: Union[AdTable, str, Path, pa.Table]
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(raw, calibrated) logits [B, T] from precomputed ad vectors: one user-tower pass per request,
    then per row a table lookup and T dot products. Equals ``model.scores(batch)`` in eval mode (up
    to float rounding). Pass an ``AdTable`` (``load_ad_table``) to avoid re-reading the file."""
    tt = _unwrap(model)
    if not isinstance(table, AdTable):
        table = load_ad_table(table, [t.name for t in tt.features.tasks])
    users = tt.user_embeddings(batch)  # [U, T, E]
    ads = table.lookup(item_ids(tt, batch)).to(users.device)  # [B, T, E]
    raw = tt.combine(users, ads, batch.request_index, batch.surface)
    return raw, tt.calibration(raw, batch.surface)


def export_ads(
    run_dir: Union[str, Path],
    data_dir: Optional[str],
    out: Union[str, Path],
    precision: Optional[str] = None,
    batch_size: Optional[int] = None,
) -> int:
    """Writes a two-tower run's ad vectors of every item in ``data_dir`` (default: the run's eval
    data) to ``out``; returns the number of items written."""
    predictor = Predictor.from_run(run_dir, precision)
    cfg = predictor.cfg
    if cfg.model.kind != "two_tower":
        raise ServeError(f"{run_dir}: export-ads needs a two_tower run; this one is model.kind {cfg.model.kind!r}")
    return export_ad_embeddings(
        predictor.model, file_order_batches(cfg, data_dir or cfg.data.eval_dir, batch_size), out
    )
