"""Streaming Parquet loader: row groups -> shuffled whole requests -> ``Batch``, for one rank.

``ParquetBatches`` composes the three steps: ``RowGroupReader`` (reader.py: files, checks, row
filter), ``ShufflePool`` (shuffle.py: whole requests, bounded shuffle buffer) and
``BatchBuilder`` (batch.py: Arrow -> tensors). ``make_loader`` wraps it in a DataLoader. What
they read of the experiment is ``LoaderSettings`` (``LoaderSettings.of(cfg)``): the feature layout,
the data section, the seed, ``model.broadcast`` and the vocabularies' id dropout -- never the
whole config.

- Both storage layouts are read (storage_layout.py: one row per candidate, or one per request); in
  memory a request's sequences are held once, from the file to the batch.
- Row groups are dealt to (rank, worker) slots round-robin after a per-epoch shuffle, so every row
  is read exactly once per epoch by exactly one slot.
- The shuffle pool holds whole requests (all candidates of a request stay together, which
  request-level broadcasting relies on): at most ``shuffle_buffer_rows`` rows plus one row group.
- Batches have exactly ``batch_size`` rows: sharded embeddings exchange equal-sized blocks between
  ranks. A slot's last, partial batch is dropped in training (``drop_last``: fewer than batch_size
  rows per worker and epoch) or, in evaluation, padded by repeating a row marked ``valid = False``.
  (Padding it in training too would keep those rows, but a batch of one request's copies takes the
  candidate attentions' block path through backward, and the golden run would change: not done.)
- What an epoch trains: every rank must take the same number of steps (the trainer's
  ``EndTogether``), so a training epoch ends when the rank with the fewest batches runs out, and
  the other ranks' later batches are not trained. Ranks are dealt whole row groups, so their shares
  differ: without ``data.max_unique_users_per_batch`` closing batches early, the rows left out of an
  epoch are at most sum over ranks of (the rank's rows - the smallest share) + world size x
  max(data.num_workers, 1) x (batch_size - 1) (each worker's dropped partial batch, and a rank's
  batches number at least its rows / batch_size less one per worker). ``rows_dealt`` gives the
  shares from the files' footers; the trainer counts the rows each epoch trained (metrics.jsonl's
  epoch record).
- ``data.max_unique_users_per_batch`` bounds the requests (unique users) in a batch: a batch that
  reaches it closes early and is padded to ``batch_size`` the same way, so user-side shapes stay
  bounded.
- ``data.row_filter`` keeps only the rows whose column holds one of the listed values (ad-type
  segmentation), before shuffling; requests left without rows disappear.

Random numbers: the row-group deal draws from (seed, epoch), the request shuffle from (seed, epoch,
rank, worker), the id dropout (``build.vocabularies[].dropout``: training batches only) from a
generator of its own of the same, so a run is reproducible whatever the workers' timing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple

import numpy as np
import torch

from pinads_rec.config import ConfigError, DataConfig, ExperimentConfig
from pinads_rec.data.loader.batch import Batch, BatchBuilder
from pinads_rec.data.loader.contract import ContractError
from pinads_rec.data.loader.reader import (
    RowGroup,
    RowGroupReader,
    assign_row_groups,
    list_files,
    list_row_groups,
    select_part,
)
from pinads_rec.data.loader.shuffle import ShufflePool, read_requests
from pinads_rec.features import FeatureLayout
from pinads_rec.library_notices import drop_log_message

# torch 2.13's own KeyedJaggedTensor metaclass (torch.fx ProxyableClassMeta.__call__) calls the
# is_fx_tracing() that torch now deprecates, and logs so on the first KJT a process builds: here,
# BatchBuilder's, in the trainer or a loader worker. No call of ours asks for it and there is nothing
# to migrate; drop that one message of that one logger, for the process (it is logged once).
drop_log_message("torch.fx._symbolic_trace", "is_fx_tracing will return true")


@dataclass(frozen=True)
class LoaderSettings:
    """What the loader reads from an experiment, and nothing else."""

    layout: FeatureLayout  # the features' columns, KJT keys and widths
    data: DataConfig  # batch size, shuffle buffer, workers, repairs, row filter, user bound, holdout
    seed: int  # draws the row-group deal and the request shuffle (train.seed)
    broadcast: bool  # model.broadcast: one user slot per request, or per row
    # (table, rate) of build.vocabularies[].dropout: training batches' ids of the table set to 0 at that rate
    id_dropout: Tuple[Tuple[str, float], ...] = ()

    @classmethod
    def of(cls, cfg: ExperimentConfig) -> "LoaderSettings":
        for i, v in enumerate(cfg.build.vocabularies):
            if not 0.0 <= v.dropout < 1.0:
                raise ConfigError(f"build.vocabularies[{i}].dropout: must be in [0, 1), got {v.dropout}")
        dropout = tuple((v.table, v.dropout) for v in cfg.build.vocabularies if v.dropout > 0.0)
        return cls(FeatureLayout.of(cfg.features), cfg.data, cfg.train.seed, cfg.model.broadcast, dropout)


class ParquetBatches(torch.utils.data.IterableDataset):
    """The batches of one rank over ``directory``; inside a DataLoader each worker takes its share.
    ``part`` is ``all``, ``train`` or ``holdout`` (``data.calibration_holdout``'s last row groups)."""

    def __init__(
        self,
        directory: str,
        settings: LoaderSettings,
        rank: int = 0,
        world_size: int = 1,
        *,
        shuffle: bool = True,
        batch_size: Optional[int] = None,
        drop_last: Optional[bool] = None,
        part: str = "all",
    ):
        super().__init__()
        self.settings, self.layout = settings, settings.layout
        layout, data = settings.layout, settings.data
        self.rank, self.world_size, self.shuffle = rank, world_size, shuffle
        self.batch_size = batch_size or data.batch_size
        self.drop_last = shuffle if drop_last is None else drop_last
        self.directory, self.part = directory, part
        self.files = list_files(directory, share=(rank, world_size))  # the ranks split the hashing
        groups = list_row_groups(self.files, layout.features)
        with_rows = {g.path for g in groups}
        self.files_without_rows = [f for f in self.files if f not in with_rows]
        self.row_groups = select_part(groups, part, data.calibration_holdout, directory)
        self.epoch = 0
        self.reader = RowGroupReader(layout.features, data)
        # Requests (unique users) a batch may hold: the user-side lookups' fixed batch size.
        self.user_slots = min(data.max_unique_users_per_batch or self.batch_size, self.batch_size)
        self.max_requests = self.user_slots if settings.broadcast else self.batch_size
        self.builder = BatchBuilder(layout, self.user_slots, settings.broadcast, id_dropout=dict(settings.id_dropout))

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def num_rows(self) -> int:
        """Candidate rows (a per-request file's are counted from its footer)."""
        return sum(g.num_rows for g in self.row_groups)

    def require_rows(self, what: str) -> None:
        """ContractError unless the split has a row: ``what`` names it (``data.eval_dir``)."""
        if not self.row_groups:
            raise ContractError(
                f"{what} {self.directory}: 0 rows ({len(self.files)} .parquet file(s), none with a row)"
            )

    def slots_of(self, rank: int, num_workers: int) -> List[List[RowGroup]]:
        """The row groups dealt to each of ``rank``'s loader workers in this epoch (``num_workers``
        0: the rank reads them itself, one slot)."""
        workers = max(num_workers, 1)
        return [
            assign_row_groups(
                self.row_groups,
                rank * workers + w,
                self.world_size * workers,
                self.settings.seed,
                self.epoch,
                self.shuffle,
            )
            for w in range(workers)
        ]

    def rows_dealt(self, rank: int, num_workers: int) -> int:
        """The rows dealt to ``rank`` in this epoch (the footers' counts, before data.row_filter)."""
        return sum(g.num_rows for slot in self.slots_of(rank, num_workers) for g in slot)

    def require_a_batch_per_rank(self, what: str, num_workers: int) -> None:
        """ContractError when, from the row counts in the files' footers, some rank cannot make one
        training batch in this epoch: no rows; fewer than batch_size x world size; or a rank dealt
        row groups whose rows, split over its loader workers, leave no worker a batch (each worker
        drops its last partial batch). A batch closed early by data.max_unique_users_per_batch holds
        fewer rows (at least one per request), so the bound used is min(batch_size, that cap).
        Necessary, not sufficient: data.row_filter and the request bound act when rows are read
        (Trainer.fit stops an epoch that gives no step)."""
        self.require_rows(what)
        fewest = min(self.batch_size, self.max_requests)  # rows of the smallest batch a worker keeps
        bound = f"data.batch_size {self.batch_size}"
        if fewest < self.batch_size:
            bound = f"min(data.batch_size {self.batch_size}, data.max_unique_users_per_batch {self.max_requests})"
        need = fewest * self.world_size
        if self.num_rows < need:
            raise ContractError(
                f"{what} {self.directory}: {self.num_rows} rows < {bound} x {self.world_size} rank(s) = {need}: "
                f"no full batch per rank"
            )
        workers = max(num_workers, 1)
        for rank in range(self.world_size):
            slots = self.slots_of(rank, num_workers)
            per_worker = [sum(g.num_rows for g in slot) for slot in slots]
            if max(per_worker) < fewest:
                raise ContractError(
                    f"{what} {self.directory}: rank {rank} is dealt {sum(per_worker)} rows in "
                    f"{sum(map(len, slots))} row group(s) in epoch {self.epoch} (at most {max(per_worker)} per "
                    f"loader worker, of {workers}) < {bound}: no full batch on that rank; write smaller row "
                    f"groups or more data, or use fewer ranks or data.num_workers"
                )

    def my_row_groups(self) -> List[RowGroup]:
        info = torch.utils.data.get_worker_info()
        workers, worker = (info.num_workers, info.id) if info else (1, 0)
        return self.slots_of(self.rank, workers)[worker]

    def __iter__(self) -> Iterator[Batch]:
        info = torch.utils.data.get_worker_info()
        rng = np.random.default_rng([self.settings.seed, self.epoch, self.rank, info.id if info else 0])
        pool = ShufflePool(
            self.batch_size,
            self.max_requests,
            max(self.settings.data.shuffle_buffer_rows, self.batch_size) if self.shuffle else 0,
            rng if self.shuffle else None,
        )
        # Training batches (shuffled; a scoring pass never is) drop ids; a generator of their own
        # leaves the shuffle's draws as they are.
        drop_rng = np.random.default_rng([self.settings.seed, self.epoch, self.rank, info.id if info else 0, 1])
        for rows in pool.batches(read_requests(self.reader, self.my_row_groups())):
            if rows.last and self.drop_last and rows.num_rows < self.batch_size:
                return
            yield self.builder.build_requests(
                rows.requests, rows.source, pad_to=self.batch_size, rng=drop_rng if self.shuffle else None
            )


def make_loader(
    directory: str,
    settings: LoaderSettings,
    rank: int = 0,
    world_size: int = 1,
    *,
    part: str = "all",
    shuffle: bool = True,
    num_workers: Optional[int] = None,
    epoch: int = 0,
    pin_memory: bool = False,
    prefetch_factor: Optional[int] = None,
) -> torch.utils.data.DataLoader:
    """A DataLoader over this rank's ``ParquetBatches``; workers (``data.num_workers`` unless given)
    read disjoint row groups in parallel, each keeping ``prefetch_factor`` batches ready
    (``data.prefetch_factor`` unless given)."""
    dataset = ParquetBatches(directory, settings, rank, world_size, shuffle=shuffle, part=part)
    dataset.set_epoch(epoch)
    workers = settings.data.num_workers if num_workers is None else num_workers
    prefetch_factor = settings.data.prefetch_factor if prefetch_factor is None else prefetch_factor
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=None,
        num_workers=workers,
        pin_memory=pin_memory,
        persistent_workers=False,
        prefetch_factor=prefetch_factor if workers else None,
        worker_init_fn=_one_thread if workers else None,
    )


def _one_thread(worker_id: int) -> None:
    """Loader workers share the host's cores with the trainer: one torch thread each. (A module-level
    function, so workers also start under spawn/forkserver.)"""
    torch.set_num_threads(1)
