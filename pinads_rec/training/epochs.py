"""The training split in epochs: :class:`TrainingEpochs` holds this rank's loader (made after the
checks that the data can train and evaluate), the run's length in steps, each epoch's batches and,
at an epoch's end, the rows it trained (summed over the ranks, beside the split's) -- refusing an
epoch that trained nothing.

Every rank's iteration ends at the same step (:class:`EndTogether`: one rank out of batches ends the
epoch for all); with evaluations every N steps the pipeline is fed up to each evaluation point
(:class:`FirstBatches`, :func:`epoch_steps`) so nothing is in flight when the model is evaluated.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist

from pinads_rec import config, parallel
from pinads_rec.data.loader.batch import Batch
from pinads_rec.data.loader.contract import ContractError
from pinads_rec.data.loader.dataset import LoaderSettings, ParquetBatches, make_loader
from pinads_rec.training.collectives import NamedCollectiveErrors

log = logging.getLogger("pinads_rec.train")


class TrainingEpochs:
    """This rank's training split, epoch by epoch. ``loader``: its shuffled batches, made after the
    checks -- before training, not after it -- that the split can train (a batch per rank) and that
    the eval and calibration splits hold rows (docs/reliability.md, "Empty or tiny data").
    ``collectives(where)``: the trainer's naming of a collective's errors."""

    def __init__(
        self,
        cfg: config.ExperimentConfig,
        settings: LoaderSettings,
        env: parallel.Distributed,
        group: Optional[dist.ProcessGroup],
        collectives: Callable[[str], NamedCollectiveErrors],
    ):
        self.cfg, self.env, self.group, self.collectives = cfg, env, group, collectives
        pin_memory = env.device.type == "cuda"
        self.loader = make_loader(
            cfg.data.train_dir, settings, env.rank, env.world_size, shuffle=True, pin_memory=pin_memory, part="train"
        )
        train = self.loader.dataset
        train.require_a_batch_per_rank("data.train_dir", settings.data.num_workers)
        if train.files_without_rows and env.is_main:
            log.warning(
                "data.train_dir %s: %d of %d file(s) hold no rows: %s",
                cfg.data.train_dir,
                len(train.files_without_rows),
                len(train.files),
                ", ".join(train.files_without_rows[:5]) + (" ..." if len(train.files_without_rows) > 5 else ""),
            )
        for what, later in (("data.eval_dir", cfg.data.eval_dir), ("data.calibration_dir", cfg.data.calibration_dir)):
            if later:
                ParquetBatches(later, settings, env.rank, env.world_size, shuffle=False).require_rows(what)

    def total_steps(self) -> int:
        """The run's steps: train.max_steps, else train.epochs of the split's full global batches (the
        LR schedule's length); a warning when train.warmup_steps would take most of them."""
        cfg, env = self.cfg, self.env
        steps_per_epoch = max(self.loader.dataset.num_rows // (cfg.data.batch_size * env.world_size), 1)
        total = cfg.train.max_steps or cfg.train.epochs * steps_per_epoch
        if cfg.train.warmup_steps > total // 2 and env.is_main:
            # The warm-up is in steps, the data in rows: a config sized for one dataset can leave
            # the dense layers at a fraction of train.lr for a whole run on a smaller one.
            log.warning(
                "train.warmup_steps %d is more than half of this run's %d steps (%d a rank per epoch): the dense "
                "layers train below train.lr for most of the run; lower train.warmup_steps",
                cfg.train.warmup_steps,
                total,
                steps_per_epoch,
            )
        return total

    def batches(self, epoch: int, skip: int) -> EndTogether:
        """This rank's batches of ``epoch``, after the first ``skip`` (a resume point), ending on every
        rank at the same step. The batches skipped were trained before the resume (the same ones when
        the world size is unchanged): their valid rows count in the epoch's."""
        self.loader.dataset.set_epoch(epoch)
        batches = iter(self.loader)
        before = [int(next(batches).valid.sum()) for _ in range(skip)]
        return EndTogether(batches, self.group, before)

    def end(self, epoch: int, step: int, batches: EndTogether, trained_batches: int, complete: bool) -> dict:
        """The record of :meth:`Hook.on_epoch_end` for ``epoch`` (``step`` its last): the rows its first
        ``trained_batches`` batches held, summed over the ranks with one all_reduce, beside the rows of
        the training split and each rank's share (the files' footers). An epoch that trained no batch
        (none before a resume point either) though the footers promised one per rank: a ContractError
        when the run has trained nothing at all (``step`` 0: it would 'finish' empty), else a warning."""
        env, dataset = self.env, self.loader.dataset
        trained = torch.zeros(env.world_size, dtype=torch.int64)
        trained[env.rank] = batches.trained_rows(trained_batches)
        if self.group is not None:
            with self.collectives(f"step {step}, counting the rows of epoch {epoch}"):
                dist.all_reduce(trained, op=dist.ReduceOp.SUM, group=self.group)
        if not trained_batches:
            self._nothing_trained(epoch, batches, step)
        workers = self.loader.num_workers
        return {
            "epoch": epoch,
            "step": step,
            "rows_trained": int(trained.sum()),
            "rows_trained_per_rank": trained.tolist(),
            "train_split_rows": dataset.num_rows,
            "rows_dealt_per_rank": [dataset.rows_dealt(rank, workers) for rank in range(env.world_size)],
            "complete": complete,
        }

    def _nothing_trained(self, epoch: int, batches: EndTogether, step: int) -> None:
        cfg, env = self.cfg, self.env
        who = f"rank {env.rank} had" if batches.ran_out_here else "another rank had"
        message = (
            f"data.train_dir {cfg.data.train_dir}: epoch {epoch} ended before its first step: {who} "
            f"no batch of data.batch_size {cfg.data.batch_size} rows (data.row_filter, "
            f"data.max_unique_users_per_batch or this epoch's deal of row groups left too few)"
        )
        if step == 0:  # nothing trained at all: stop rather than 'finish' an empty run
            raise ContractError(message)
        if env.is_main:
            log.warning("%s; training goes on with the next epoch", message)


class EndTogether:
    """Stops every rank's iteration at the same step: one rank running out of batches ends the
    epoch for all, instead of leaving the others blocked in a collective (the other ranks' batches
    after that step are not trained). ``valid_rows``: the valid rows of each batch of the epoch in
    order, first ``before`` (the batches a resume skipped, trained before it), then each one handed
    out; the pipeline trains batches in the order it takes them, so after n steps of the epoch it
    has trained the first n."""

    def __init__(self, batches: Iterator[Batch], group: Optional[dist.ProcessGroup], before: Sequence[int] = ()):
        self.batches, self.group = batches, group
        self.ran_out_here = False  # this rank's own batches ended (not another rank's)
        self.valid_rows: List[int] = list(before)

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        batch = next(self.batches, None)
        self.ran_out_here = self.ran_out_here or batch is None
        flag = torch.tensor([0 if batch is None else 1])
        if self.group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        if not flag.item():
            raise StopIteration
        self.valid_rows.append(int(batch.valid.sum()))
        return batch

    def trained_rows(self, steps: int) -> int:
        """The valid rows of the epoch's first ``steps`` batches: what that many steps trained (not
        the batches still in the pipeline's flight)."""
        return sum(self.valid_rows[:steps])


class FirstBatches:
    """The first ``n`` batches of ``batches``, then StopIteration: the pipeline, fed this, trains every
    batch it took before it stops (nothing left in flight). ``ended``: ``batches`` itself ended."""

    def __init__(self, batches: Iterator[Batch], n: int):
        self.batches, self.left, self.ended = batches, n, False

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        if self.left <= 0:
            raise StopIteration
        try:
            batch = next(self.batches)
        except StopIteration:
            self.ended = True
            raise
        self.left -= 1
        return batch


def epoch_steps(
    train_step: Callable[[Iterator[Batch]], object], batches: EndTogether, every: Optional[int], done: Callable[[], int]
):
    """The epoch's steps (``train_step(batches)`` until StopIteration). With ``every`` (evaluations
    every N steps) the pipeline is fed up to each evaluation point (:class:`FirstBatches`; ``done()``:
    the steps done so far), so at that step it has trained every batch it took and the model can be
    evaluated with nothing in flight; then on from there."""
    while True:
        part = batches if every is None else FirstBatches(batches, every - done() % every)
        while True:
            try:
                step = train_step(part)
            except StopIteration:
                break
            yield step
        if part is batches or part.ended:
            return
