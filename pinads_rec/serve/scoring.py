"""Scoring: a loaded model -> probabilities [N, T] (tasks in config order), per request, per batch,
or for a whole Parquet directory written back as Parquet.

``Predictor.score_request`` takes one request's candidate rows (an Arrow table in the data
contract, labels optional) through ``RequestBatcher``: the batch holds one user (U = 1), so the
user-side work -- user features, sequence encoders -- runs once for all N candidates (request-level
broadcasting, unified-surfaces article). ``score_directory`` streams ``ScoringBatches`` through any
``RowScorer`` (the eager ``Predictor`` or the reloaded ``export.ExportedScorer``) into one file,
which appears complete or not at all (a temporary file renamed at the end).
"""

from __future__ import annotations

import os
import re
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import nn

from pinads_rec import config
from pinads_rec.data import page_checksums
from pinads_rec.data.build_output import running
from pinads_rec.data.loader.batch import Batch
from pinads_rec.data.loader.contract import ContractError
from pinads_rec.data.loader.reader import AS_READ_PREFIX
from pinads_rec.serve.batching import RequestBatcher, ScoringBatches
from pinads_rec.serve.loading import load_model


class RowScorer:
    """Shared by the eager ``Predictor`` and the reloaded ``ExportedScorer``: rows -> Batch -> [N, T].
    A subclass sets ``cfg`` and ``_batcher`` (a ``RequestBatcher``) and implements ``score_batch``."""

    cfg: config.ExperimentConfig
    _batcher: RequestBatcher

    @property
    def tasks(self) -> List[str]:
        return [t.name for t in self.cfg.features.tasks]

    def request_batch(self, request: pa.Table, where: str = "request") -> Batch:
        return self._batcher.batch(request, where)

    def requests_batch(self, requests: pa.Table, where: str = "requests") -> Batch:
        """Several requests' batch from their per-request rows (one user slot each)."""
        return self._batcher.batch_requests(requests, where)

    def score_request(self, request: pa.Table) -> torch.Tensor:
        """Probabilities [N, T] (tasks in config order) for one request's N candidate rows, given as an
        Arrow table in the data contract (label columns optional). The user-side work runs once."""
        return self.score_batch(self.request_batch(request))

    def score_batch(self, batch: Batch) -> torch.Tensor:
        raise NotImplementedError


class Predictor(RowScorer):
    """A trained model on CPU, ready to score: ``Predictor.from_run("runs/demo").score_request(rows)``."""

    def __init__(self, model: nn.Module, cfg: config.ExperimentConfig):
        self.model, self.cfg = model, cfg
        self.device = next(model.parameters()).device
        self._batcher = RequestBatcher(cfg)

    @classmethod
    def from_run(
        cls,
        run_dir: Union[str, Path],
        precision: Optional[str] = None,
        step: Optional[int] = None,
        fp16_overflow: Optional[str] = None,
        device: str = "cpu",
        serve: Optional[Dict[str, Any]] = None,
    ) -> "Predictor":
        """``serve``: serve.* settings over the run's (its tables' dtypes, ``loading.load_model``)."""
        model, cfg = load_model(run_dir, precision, step, fp16_overflow, device, serve)
        return cls(model, cfg)

    @torch.inference_mode()
    def score_batch(self, batch: Batch) -> torch.Tensor:
        """Probabilities [B, T] of a loader batch (padding rows included: mask with ``batch.valid``),
        on the CPU whatever device the model runs on."""
        if self.device.type != "cpu":
            batch = batch.to(self.device, non_blocking=True)
        return torch.sigmoid(self.model(batch).float()).cpu()


def score_directory(
    predictor: RowScorer, data_dir: str, out: Union[str, Path], batch_size: Optional[int] = None
) -> Dict[str, float]:
    """Scores every row of a Parquet directory; writes request_id, item_id, surface (name) and one
    ``p_<task>`` column per task to ``out``, streaming batch by batch. Padding rows are not written.

    Atomic: the batches go to a temporary file beside ``out`` (``.<name>.<pid>-*.tmp``), renamed to ``out``
    once the last one is written and synced. A failure removes it (``out``, if there was one, is left
    as it was); a killed process leaves at most that hidden temporary file, never an ``out`` that
    looks whole but holds part of the rows (a Parquet file cut between row groups reads fine). The
    next score to ``out`` removes it (``remove_stale_temporaries``)."""
    cfg = predictor.cfg
    names = cfg.features.columns
    batches = ScoringBatches(cfg, data_dir, batch_size)
    surfaces = np.array(cfg.features.surfaces, dtype=object)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out)
    # Not mkstemp: its file is private (0600); this one gets the permissions out would (umask).
    temporary = out.parent / f".{out.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    writer, rows, started = None, 0, time.perf_counter()
    try:
        with os.fdopen(fd, "wb") as sink:
            try:
                for table, batch in batches:
                    probs = predictor.score_batch(batch)
                    valid = batch.valid.numpy()
                    columns = {
                        names.request_id: table.column(AS_READ_PREFIX + names.request_id),
                        names.item_id: table.column(AS_READ_PREFIX + names.item_id),
                        names.surface: pa.array(surfaces[batch.surface.numpy()[valid]], pa.string()),
                    }
                    for t, task in enumerate(predictor.tasks):
                        columns[f"p_{task}"] = pa.array(probs[:, t].numpy()[valid], pa.float32())
                    chunk = pa.table(columns)
                    if writer is None:
                        writer = pq.ParquetWriter(sink, chunk.schema, **page_checksums.WRITE)
                    writer.write_table(chunk)
                    rows += chunk.num_rows
                if writer is None:
                    raise ContractError(f"{data_dir}: no rows to score")
            finally:
                if writer is not None:
                    writer.close()  # the footer (also on a failure: before its sink closes)
            sink.flush()
            os.fsync(sink.fileno())
        os.replace(temporary, out)
    except BaseException:  # KeyboardInterrupt too: no temporary file left behind
        temporary.unlink(missing_ok=True)
        raise
    seconds = time.perf_counter() - started
    return {"rows": rows, "seconds": seconds, "rows_per_s": rows / seconds if seconds else 0.0}


def remove_stale_temporaries(out: Path) -> List[Path]:
    """Removes the temporary files killed scores to ``out`` left beside it: names of
    ``score_directory``'s pattern for ``out`` only, whose pid runs nothing on this machine (a score
    still writing keeps its own; a pid since reused leaves its file for a later run). The paths removed."""
    pattern = re.compile(rf"\.{re.escape(out.name)}\.(\d+)-[0-9a-f]{{8}}\.tmp")
    removed = []
    for path in sorted(out.parent.iterdir()):
        m = pattern.fullmatch(path.name)
        if m and path.is_file() and not running(int(m.group(1))):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed
