"""The training run: ``Trainer(cfg, env, hooks).run()`` is what ``train.py`` launches on every rank.

Set-up shards the training task (``task.py``: planner + DistributedModelParallel) and starts where
the :class:`Checkpointer` says (resume, warm start or fresh); ``TrainPipelineSparseDist`` overlaps
the next batch's copy and input all-to-all with the current step. :meth:`Trainer.fit` is a loop of
components: each step is metered (``step_meter.py``), evaluated when the :class:`Validator` says
(train.eval_every: the best evaluation, early stopping), checkpointed when the checkpointer says;
the epochs' batches and rows are ``epochs.py``'s; hooks (``hooks.py``) report. At the end
:meth:`Trainer.run` reloads the best weights, fits the calibration layers on rows it did not train
on (backbone frozen), saves the run's last checkpoint (what serving loads) and reports AUC / NE /
log loss / calibration per surface x task (with the oracle when the data has it).
"""

from __future__ import annotations

import datetime
import logging
import time
from pathlib import Path
from typing import Iterator, List, Optional, Sequence

import torch.distributed as dist
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import ShardingPlan

from pinads_rec import config, parallel
from pinads_rec.data.loader.batch import Batch
from pinads_rec.data.loader.dataset import LoaderSettings
from pinads_rec.models.train_task import NonFiniteError, NonFiniteGuard, guard_gradients
from pinads_rec.modules.precision import fallback_count
from pinads_rec.training import epochs
from pinads_rec.training.checkpointer import Checkpointer
from pinads_rec.training.collectives import NamedCollectiveErrors
from pinads_rec.training.evaluation import evaluation_rows, evaluation_with_slices, fit_calibration
from pinads_rec.training.hooks import Hook
from pinads_rec.training.step_meter import StepMeter, StepOutput
from pinads_rec.training.task import pipelined_module_names, shard_train_task
from pinads_rec.training.validator import Validator

log = logging.getLogger("pinads_rec.train")


class Trainer:
    """One training run of ``cfg`` on this rank. :meth:`run` does it all; the pieces (:meth:`setup`,
    :meth:`epoch_batches`, :meth:`train_step`, :meth:`fit`, :meth:`validate`, :meth:`save`,
    :meth:`evaluate`) serve callers that time or vary one of them.

    Attributes after :meth:`setup`: ``cfg`` (with the checkpoint's plan when resuming), ``env``,
    ``data_group`` (gloo; None on one rank), ``dmp`` (the sharded TrainTask), ``guard``,
    ``optimizer``, ``schedule`` (the dense LR schedule), ``loader`` (this rank's training batches),
    ``state`` (the position: checkpoint.TrainState), ``validator``, ``checkpointer``, ``pipeline``,
    ``total_steps``, ``run_dir``, ``resumed_from`` (the checkpoint resumed, or None), ``warm_from``
    (the checkpoint a warm start read: train.init_from) and ``pipelined_modules`` (known after the
    first step); ``started_at`` (wall clock, seconds) from construction on."""

    # The config's keys without a default that training reads (config.require: a config that forgot
    # one fails naming it rather than reading or writing another run's files).
    REQUIRED_KEYS = ("data.train_dir", "data.eval_dir", "train.run_dir")

    def __init__(
        self,
        cfg: config.ExperimentConfig,
        env: Optional[parallel.Distributed] = None,
        hooks: Sequence[Hook] = (),
        plan: Optional[ShardingPlan] = None,
    ):
        for key in self.REQUIRED_KEYS:
            config.require(cfg, key)
        self.cfg = cfg
        self.env = env if env is not None else parallel.init_distributed(cfg.train.collective_timeout_s)
        self.hooks = list(hooks)
        self.plan = plan
        self.pipelined_modules: Optional[List[str]] = None
        self._ready = False
        self.started_at = time.time()  # wall clock, for the run's metadata

    def setup(self) -> Trainer:
        """Data group, where the run starts (:class:`Checkpointer`: resume, warm start or fresh, and the
        plan), the training epochs (their loader, the data checked), the sharded TrainTask, optimizers
        and LR schedule, the guard, the validator, the state restored, the pipeline. Idempotent."""
        if self._ready:
            return self
        # With the run's collective timeout (a new group's default is the backend's 30 minutes).
        timeout = datetime.timedelta(seconds=self.cfg.train.collective_timeout_s)
        self.data_group = dist.new_group(backend="gloo", timeout=timeout) if self.env.world_size > 1 else None
        start = self.checkpointer = Checkpointer(self.cfg, self.env)
        self.cfg, self.run_dir = start.cfg, start.run_dir
        self.resumed_from, self.warm_from = start.resumed_from, start.warm_from
        cfg, env = self.cfg, self.env
        self.settings = settings = LoaderSettings.of(cfg)
        self.epochs = epochs.TrainingEpochs(cfg, settings, env, self.data_group, self.collectives)
        self.loader = self.epochs.loader
        self.dmp = shard_train_task(cfg, env, self.plan, group=self.data_group)
        self.guard = next(m for m in self.dmp.modules() if isinstance(m, NonFiniteGuard))
        self.total_steps = self.epochs.total_steps()
        self.optimizer, self.schedule = parallel.make_optimizer(self.dmp, cfg.train, self.total_steps)
        guard_gradients(self.schedule.optimizer._optimizer, cfg.train.nonfinite, self.guard)  # the dense AdamW
        self.validator = Validator(cfg.train, env, self.collectives)
        self.state = self.checkpointer.restore(self.dmp, self.optimizer, self.schedule, self.validator)
        self.pipeline = TrainPipelineSparseDist(self.dmp, self.optimizer, env.device, execute_all_batches=True)
        self._ready = True
        return self

    def epoch_batches(self, epoch: int) -> epochs.EndTogether:
        """This rank's batches of ``epoch`` from ``state.batches_in_epoch`` on (the resume point),
        ending on every rank at the same step (:meth:`TrainingEpochs.batches`)."""
        self.setup()
        return self.epochs.batches(epoch, self.state.batches_in_epoch)

    def collectives(self, where: str) -> NamedCollectiveErrors:
        """A context re-raising a collective's timeout or failure as a CollectiveError naming this
        rank and ``where`` (e.g. "step 12"): see NamedCollectiveErrors."""
        return NamedCollectiveErrors(self.env.rank, where, self.cfg.train.collective_timeout_s)

    def train_step(self, batches: Iterator[Batch]) -> StepOutput:
        """One pipelined step (forward, backward, optimizers), then the LR schedule and the position
        in ``state``. Raises StopIteration when ``batches`` is done, CollectiveError when a
        collective times out or fails."""
        self.setup()
        try:
            with self.collectives(f"step {self.state.step + 1}"):
                loss, logits, labels = self.pipeline.progress(batches)
        except NonFiniteError as e:
            raise NonFiniteError(f"step {self.state.step + 1}, epoch {self.state.epoch}: {e}") from None
        if self.pipelined_modules is None:
            names = self.pipelined_modules = pipelined_module_names(self.dmp, self.pipeline)
            if self.env.is_main:
                log.info("TrainPipelineSparseDist pipelines %s", names or "NOTHING (model not traceable)")
        self.schedule.step()
        self.state.step += 1
        self.state.batches_in_epoch += 1
        return StepOutput(loss, logits, labels)

    @property
    def finished(self) -> bool:
        """train.max_steps reached, or early stopping."""
        max_steps = self.cfg.train.max_steps
        return (bool(max_steps) and self.state.step >= max_steps) or self.validator.stopped_early

    def fit(self) -> dict:
        """The epoch loop from ``state`` to ``train.epochs`` or ``train.max_steps``: each step metered
        (on_step every ``train.log_every`` steps), evaluated when the validator says (a checkpoint at each
        improvement; early stopping), checkpointed when the checkpointer says; on_epoch_end after every
        epoch. Returns {"step", "train_examples_per_s", "train_seconds", "pipelined_modules"}."""
        self.setup()
        state, validator = self.state, self.validator
        self._tell("on_start")
        meter = StepMeter(self.env.world_size)
        for epoch in range(state.epoch, self.cfg.train.epochs):
            if self.finished:
                break
            batches = self.epoch_batches(epoch)
            for step in epochs.epoch_steps(self.train_step, batches, validator.steps_between, lambda: state.step):
                meter.update(step)
                if state.step % self.cfg.train.log_every == 0:
                    self._tell("on_step", self._step_record(meter, epoch))
                # Evaluated before the checkpoint: it then holds this evaluation's outcome.
                improved = validator.due_after_step(state.step) and self.validate()
                self._save_if(self.checkpointer.due(state.step) or improved)
                self._tell("on_step_end")
                if self.finished:
                    break
            self._end_epoch(epoch, batches)
        if validator.due_at_end(state.step):
            self._save_if(self.validate())
        return {"step": state.step, **meter.totals(), "pipelined_modules": self.pipelined_modules or []}

    def _step_record(self, meter: StepMeter, epoch: int) -> dict:
        lr = self.schedule.get_last_lr()[0]
        return meter.record(self.state.step, epoch, self.guard.skipped, fallback_count(self.dmp), lr)

    def _end_epoch(self, epoch: int, batches: epochs.EndTogether) -> None:
        """The epoch's record to the hooks (an epoch that trained nothing refused first); unless
        training is over, the next epoch's position and its evaluation (train.eval_every.epochs)."""
        state, complete = self.state, not self.finished
        record = self.epochs.end(epoch, state.step, batches, state.batches_in_epoch, complete)
        self._tell("on_epoch_end", record)
        if complete:
            state.epoch, state.batches_in_epoch = epoch + 1, 0
            if self.validator.due_after_epoch(state.epoch, state.step):
                self._save_if(self.validate())

    def _save_if(self, due: bool) -> None:
        if due:
            with self.collectives(f"step {self.state.step}, saving the checkpoint"):
                self.save()

    def _tell(self, event: str, *args) -> None:
        """Calls ``event`` (a :class:`Hook` method) on every hook, in order."""
        for hook in self.hooks:
            getattr(hook, event)(self, *args)

    def validate(self) -> bool:
        """One evaluation during training of the current weights (:meth:`Validator.validate`), the
        pipeline detached (an evaluation point leaves nothing in flight; the next step attaches it
        again); the hooks see its record (on_validation). True when it improved on the best: then
        the caller saves a checkpoint of this step, which the best step names."""
        self.setup()
        state = self.state
        epoch = state.epoch - 1 if state.batches_in_epoch == 0 else state.epoch  # the last step's
        self.pipeline.detach()
        record = self.validator.validate(state.step, epoch, self.evaluate)
        self._tell("on_validation", record)
        return record["improved"]

    def evaluate(self, split: str = "eval") -> List[dict]:
        """Metrics rows per surface x task over the eval split, or the held-out rows (``split``
        "holdout"; see :func:`evaluation_rows`)."""
        self.setup()
        return evaluation_rows(self.dmp, self.settings, self.env, self.data_group, split)

    def save(self) -> Path:
        """A checkpoint of the current step under ``run_dir`` (:meth:`Checkpointer.save`); returns its directory."""
        self.setup()
        return self.checkpointer.save(self.state)

    def run(self) -> dict:
        """fit, then (pipeline detached) the best evaluation's weights back (train.eval_every), calibrate,
        save, evaluate. Returns the summary, which hooks see: fit's figures, the guard's and FP16 fallback
        counts, world size, global batch, the ``eval`` rows, ``slices`` (known / new users' and items' rows,
        where a vocabulary maps them) and ``selection`` (train.eval_every: :meth:`Validator.summary`)."""
        self.setup()
        fitted = self.fit()
        self.pipeline.detach()
        after = f"after step {self.state.step}"
        with self.collectives(f"{after}, loading the best weights"):
            self.validator.restore_best(self.dmp, self.run_dir, self.state.step)
        with self.collectives(f"{after}, calibration"):
            fit_calibration(self.dmp, self.settings, self.env, self.data_group)
        with self.collectives(f"{after}, saving the checkpoint"):
            self.save()
        with self.collectives(f"{after}, evaluation"):
            # One pass: the rows, and those of the known / new users and items (vocabulary id 0).
            tables = [v.table for v in self.cfg.build.vocabularies]
            rows, slices = evaluation_with_slices(self.dmp, self.settings, self.env, self.data_group, "eval", tables)
        summary = {
            **fitted,
            "nonfinite_skipped": self.guard.skipped,
            "fp16_fallbacks": fallback_count(self.dmp),
            "world_size": self.env.world_size,
            "global_batch": self.cfg.data.batch_size * self.env.world_size,
            "eval": rows,
        }
        if slices:
            summary["slices"] = slices
        if self.cfg.train.eval_every is not None:
            summary["selection"] = self.validator.summary(self.state.step)
        self._tell("on_evaluation", summary)
        self._tell("on_end")
        return summary
