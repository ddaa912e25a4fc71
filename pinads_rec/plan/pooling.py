"""How many lookups a batch makes, for the planner's pooling factors: the candidates per request
(the sequence collection's input has one row per request) and, for the scaling projection, the ids
per key measured on the first batches.

The candidates per request come from, in order (``candidates_per_request``):

1. the caller (``--candidates-per-request N``);
2. the training data, when ``data.train_dir`` holds Parquet files: candidate rows / requests over
   all its row groups (``count_candidates``: the footers alone for the per-request layout, the
   request id column for per-row files);
3. ``synth.candidates_per_request`` when nothing is in ``data.train_dir`` and the config's data is
   the synthetic generator's (``generator_mismatch``: the generator's files hold every column the
   config reads, with the contract's types -- what ``make data`` / ``python -m pinads_rec.data.synth``
   write for the demo and the configs extending it; a ``build:`` section alone does not decide,
   the demo's describes the generator's own raw logs);
4. else ``NoCandidates``: the data is a real dataset's (configs/datasets/) not built yet.
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple

from pinads_rec.config import CANDIDATE_PREFIX, ExperimentConfig, FeaturesConfig, SynthConfig


class NoCandidates(ValueError):
    """Nothing to take the candidates per request from; the message names both ways out."""


@dataclass(frozen=True)
class CandidateCount:
    """Requests and candidate rows of a training directory, counted from its files."""

    directory: str
    files: int
    requests: int
    rows: int

    @property
    def per_request(self) -> float:
        return self.rows / self.requests


@dataclass(frozen=True)
class Candidates:
    """Mean candidates per request the plan is sized with, and where the number came from."""

    value: Optional[float]  # None: not used (no pooling factors, or the caller's constraints)
    source: str  # "flag" | "measured" | "synth" | "unused" | "constraints"
    detail: str  # for the report: "measured from data/x/train, 3 files: ..."
    note: Optional[str] = None  # said before the report (the generator's setting stands in for data)

    def as_dict(self) -> dict:
        out = {"value": self.value, "source": self.source, "detail": self.detail}
        return {**out, "note": self.note} if self.note else out


def _parquet_files(directory: str) -> list:
    if os.path.isfile(directory):
        return [directory]
    return sorted(glob.glob(os.path.join(directory, "**", "*.parquet"), recursive=True))


def count_candidates(features: FeaturesConfig, train_dir: Optional[str]) -> Optional[CandidateCount]:
    """Requests and rows of ``train_dir``'s Parquet files (None when unset, holding none, or no
    rows), reading only what is needed: a per-request row group's footer counts both (its first
    label list's values are its candidates); a per-row one's request id column is read and its runs
    counted (a request's rows are contiguous, also across row groups). Files whose schema breaks
    the contract, or an incomplete build, are a ContractError, as for the loader."""
    from pinads_rec.data.loader.reader import list_files, list_row_groups, open_parquet
    from pinads_rec.data.loader.storage_layout import request_starts

    if not train_dir or not _parquet_files(train_dir):
        return None
    files = list_files(train_dir)
    groups = list_row_groups(files, features)
    if not groups:
        return None
    column = features.columns.request_id
    requests, last = 0, None  # last: (file, the request id its previous row group ended with)
    for g in groups:
        if g.num_requests is not None:
            requests += g.num_requests
            continue
        ids = open_parquet(g.path).read_row_group(g.index, columns=[column]).column(column).to_numpy()
        # A request cut by a row-group boundary continues in the next row group: counted once.
        requests += len(request_starts(ids)) - int(last == (g.path, ids[0]))
        last = (g.path, ids[-1])
    return CandidateCount(train_dir, len(files), requests, sum(g.num_rows for g in groups))


def generator_mismatch(features: FeaturesConfig, synth: SynthConfig) -> Optional[str]:
    """None when the synthetic generator's files hold every column ``features`` reads (with the
    contract's types): the config's data is the generator's. Else why not (the first column the
    contract check finds missing or of another type)."""
    from pinads_rec.data import synth as generator
    from pinads_rec.data.loader.contract import ContractError, check_schema, contract_columns
    from pinads_rec.data.loader.storage_layout import stored_request_level

    schema = generator.contract_schema(synth)
    try:
        check_schema(
            "the generator's files", schema, contract_columns(features), True, stored_request_level(schema, features)
        )
    except ContractError as e:
        return str(e)
    return None


def candidates_per_request(cfg: ExperimentConfig, given: Optional[float] = None, config_path: str = "") -> Candidates:
    """The candidates per request to plan ``cfg`` with (the module docstring says from where).
    Raises NoCandidates when there are no training files and the data is not the generator's."""
    if given is not None:
        return Candidates(float(given), "flag", "--candidates-per-request")
    train_dir = cfg.data.train_dir
    count = count_candidates(cfg.features, train_dir)
    if count is not None:
        detail = (
            f"measured from {train_dir}, {count.files} file{'s' if count.files != 1 else ''}: "
            f"{count.rows:,} rows in {count.requests:,} requests"
        )
        return Candidates(count.per_request, "measured", detail)
    name = config_path or "the config"
    if not train_dir:
        where, out = "is not set", "DIR (and --set data.train_dir=DIR/train)"
    else:
        where = f"{train_dir} holds no Parquet files" if os.path.exists(train_dir) else f"{train_dir} does not exist"
        out = Path(train_dir).parent
    mismatch = generator_mismatch(cfg.features, cfg.synth)
    if mismatch is None:
        value = float(cfg.synth.candidates_per_request)
        note = (
            f"note: {name}: data.train_dir {where}; the config reads the synthetic generator's columns, so "
            f"its data is generated (python -m pinads_rec.data.synth --config {name} --out {out}): planning "
            f"with synth.candidates_per_request = {value:g} (--candidates-per-request N plans for other data)"
        )
        return Candidates(value, "synth", "synth.candidates_per_request: synthetic data", note)
    make = (
        f"build the data (python -m pinads_rec.data.build --config {name} --raw RAW_DIR --out {out})"
        if cfg.build.impressions.path
        else f"write the data into {train_dir or 'data.train_dir'}"
    )
    raise NoCandidates(
        f"{name}: the planner sizes the sequence tables' lookups by the candidates per request, and "
        f"data.train_dir {where} to measure them from; nor is the data the synthetic generator's "
        f"({mismatch}). Either {make}, or pass --candidates-per-request N."
    )


def with_pooling_factors(
    constraints: Dict[str, object], features: FeaturesConfig, batch_size: int, candidates: float
) -> Dict[str, object]:
    """``constraints`` (per table) with per-feature pooling factors and batch sizes: a pooled
    feature once per row; a user-side one once per request; a sequence feature ``max_length``
    times per request and a candidate key (the request's candidates, in row order) ``candidates``
    times, both in the sequence collection whose input has one row per request."""
    from pinads_rec.features import FeatureLayout

    out = dict(constraints)
    per_request = max(1, math.ceil(batch_size / max(candidates, 1.0)))
    max_len = {g.name: g.max_length for g in features.sequence_groups}
    layout = FeatureLayout.of(features)
    for t in layout.embedding_bag_configs():
        n = len(t.feature_names)
        out[t.name] = dataclasses.replace(out[t.name], pooling_factors=[1.0] * n, batch_sizes=[batch_size] * n)
    for t in layout.embedding_bag_configs(user_side=True):
        n = len(t.feature_names)
        out[t.name] = dataclasses.replace(out[t.name], pooling_factors=[1.0] * n, batch_sizes=[per_request] * n)
    for t in layout.embedding_configs():
        factors = [
            float(candidates) if key.startswith(CANDIDATE_PREFIX) else float(max_len[key.split(".", 1)[0]])
            for key in t.feature_names
        ]
        out[t.name] = dataclasses.replace(
            out[t.name], pooling_factors=factors, batch_sizes=[per_request] * len(factors)
        )
    return out


def measured_pooling(cfg: ExperimentConfig, batches: int = 2) -> Dict[str, Tuple[float, float]]:
    """Per KJT key: (ids per input row, input rows per batch row), measured on the first batches of
    the training data. Pooled features have one input row per batch row; the EmbeddingCollection's
    input has one row per request (a sequence feature is looked up once per request)."""
    from pinads_rec.data.loader.dataset import LoaderSettings, ParquetBatches

    ids: Dict[str, float] = {}
    strides: Dict[str, float] = {}
    rows = 0
    for i, batch in enumerate(ParquetBatches(cfg.data.train_dir, LoaderSettings.of(cfg), shuffle=False)):
        for kjt in (batch.sparse, batch.sequences):
            for key, n in zip(kjt.keys(), kjt.length_per_key()):
                ids[key] = ids.get(key, 0.0) + n
                strides[key] = strides.get(key, 0.0) + kjt.stride()
        rows += batch.batch_size
        if i + 1 >= batches:
            break
    return {k: (ids[k] / max(strides[k], 1.0), strides[k] / max(rows, 1)) for k in ids}
