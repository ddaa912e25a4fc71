"""The training run, in pieces a caller can reuse: set-up, one step, the epoch loop, calibration,
evaluation and the checkpoint.

``Trainer(cfg, env, hooks).run()`` is what ``train.py`` launches on every rank: planner +
DistributedModelParallel shard the embedding collections, ``TrainPipelineSparseDist`` overlaps the
next batch's copy and input all-to-all with the current step, ``torch.distributed.checkpoint``
saves and resumes the run; at the end the calibration layers are fit on a calibration split
(data.calibration_dir) or held-out training rows (data.calibration_holdout) with the backbone
frozen, and an eval pass reports AUC / NE / log loss / calibration per surface x task (with the
oracle when the data has it). What a run reports (metrics.jsonl, the console) are :class:`Hook` s;
the loop only calls them.

Evaluations during training (train.eval_every, off by default): every N epochs or steps the model
is evaluated on train.eval_on (the held-out calibration rows, or the eval split) with the pipeline
drained and detached; the evaluation that is best by train.early_stop.metric is checkpointed (its
step's checkpoint, spared by pruning), training stops after train.early_stop.patience evaluations
without improvement, and :meth:`Trainer.run` reloads the best weights before calibrating, saving
(the run's last checkpoint, which serving loads, then holds them) and the final evaluation. The
best value, its step and the count since are in the checkpoint's state: a resumed run keeps them.

Shapes: a step's logits and labels are ``[B, T]`` (B rows of this rank, T tasks); evaluation rows
are dicts per surface x task (:class:`pinads_rec.metrics.MetricAccumulator`).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import time
from pathlib import Path
from typing import Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import ShardingPlan

from pinads_rec import config, parallel
from pinads_rec.data.batch import Batch
from pinads_rec.data.contract import ContractError
from pinads_rec.data.dataset import LoaderSettings, ParquetBatches, make_loader
from pinads_rec.models import build_model
from pinads_rec.models.train_task import NonFiniteError, NonFiniteGuard, TrainTask, guard_gradients
from pinads_rec.modules.precision import fallback_count, set_precision
from pinads_rec.training import checkpoint
from pinads_rec.training.evaluation import (
    evaluation_rows,
    evaluation_with_slices,
    fit_calibration,
    improves,
    selection_name,
    selection_value,
)

log = logging.getLogger("pinads_rec.train")


class Hook:
    """What a run reports, plugged into :class:`Trainer` without touching its loop. Subclass and
    override what you need; every method is a no-op. Hooks run on every rank (``trainer.env``
    says which one) in the order given."""

    def on_start(self, trainer: Trainer) -> None:
        """After set-up, before the first step."""

    def on_step(self, trainer: Trainer, record: dict) -> None:
        """Every ``train.log_every`` steps. ``record``: {"step", "epoch", "loss" (mean over the
        window), "logit_abs_max", "nonfinite_skipped", "fp16_fallbacks", "lr", "examples_per_s"}."""

    def on_step_end(self, trainer: Trainer) -> None:
        """After every training step (``trainer.state.step`` is the step just done), for per-step
        work such as a profiler's window; keep it cheap."""

    def on_epoch_end(self, trainer: Trainer, record: dict) -> None:
        """At the end of each epoch of training (also one that train.max_steps or early stopping
        ends). ``record``: {"epoch", "step" (its last), "rows_trained" (the valid rows its steps
        trained, summed over the ranks), "rows_trained_per_rank", "train_split_rows" (the rows of
        the training split, from the files' footers, before data.row_filter), "rows_dealt_per_rank"
        (those dealt to each rank this epoch, from the footers too), "complete" (the epoch ran until
        a rank ran out of batches; False when train.max_steps or early stopping ended it)}. Rows are
        left out of a complete epoch where ranks hold more batches than the one with the fewest
        (data/dataset.py says by how much at most)."""

    def on_validation(self, trainer: Trainer, record: dict) -> None:
        """After each evaluation during training (train.eval_every). ``record``: {"step", "epoch",
        "validation_on" (train.eval_on), "selection" (what picks the best: :func:`selection_name`),
        "value" (its value here), "improved", "best_value", "best_step", "evals_since_best",
        "patience", "stopping" (early stopping ends training here), "rows" (the evaluation rows)}."""

    def on_evaluation(self, trainer: Trainer, summary: dict) -> None:
        """The final summary (what :meth:`Trainer.run` returns): fit's figures and the ``eval`` rows."""

    def on_end(self, trainer: Trainer) -> None:
        """After a completed run."""


class CollectiveError(RuntimeError):
    """A collective of this rank timed out or lost its peers: another rank stopped or hangs. The
    message names this rank and the step (or phase) it was in."""


def collective_failure(e: BaseException) -> Optional[str]:
    """ "timeout" or "failed" when ``e`` is a collective's error (gloo raises RuntimeErrors from its
    transport, NCCL DistErrors), None for anything else."""
    text = str(e)
    if not (isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and "gloo/" in text)):
        return None
    return "timeout" if "timed out" in text.lower() or "timeout" in text.lower() else "failed"


class NamedCollectiveErrors:
    """Re-raises a collective's timeout or failure inside as a CollectiveError naming the rank and
    ``where``: on gloo the waiting rank's collective raises after train.collective_timeout_s with
    nothing in it about the run. (On NCCL the watchdog ends the process itself, naming the rank and
    the collective: parallel.init_distributed.) Anything else passes through untouched."""

    def __init__(self, rank: int, where: str, timeout_s: float):
        self.rank, self.where, self.timeout_s = rank, where, timeout_s

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        kind = collective_failure(exc) if exc is not None else None
        if kind is None:
            return False
        if kind == "timeout":
            what = f"a collective did not complete within {self.timeout_s:g} s (another rank stopped or hung?)"
        else:
            what = f"a collective failed, another rank stopped? ({str(exc).strip().splitlines()[0][:300]})"
        raise CollectiveError(f"rank {self.rank}, {self.where}: {what}") from exc


@dataclasses.dataclass
class StepOutput:
    """One training step as the pipeline returns it: the loss (scalar), logits and labels ``[B, T]``."""

    loss: torch.Tensor
    logits: torch.Tensor
    labels: torch.Tensor


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


class Upto:
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


def meta_train_task(
    features: config.FeaturesConfig,
    model: config.ModelConfig,
    train: config.TrainConfig,
    group: Optional[dist.ProcessGroup] = None,
) -> TrainTask:
    """The training task before sharding -- the model (embedding tables on the meta device), its
    training precision and the non-finite guard (``group``, gloo, lets its ranks agree) -- what
    ``shard_train_task`` shards and the offline planner (``pinads_rec.plan``) plans."""
    torch.manual_seed(train.seed)
    # Embedding tables are created on the meta device: DMP allocates each rank's shards only.
    net = build_model(features, model, device=torch.device("meta"))
    set_precision(net, model.precision.train, fp16_overflow=model.precision.fp16_overflow)
    return TrainTask(net, NonFiniteGuard([t.name for t in features.tasks], train.nonfinite, group))


def shard_train_task(
    cfg: config.ExperimentConfig,
    env: parallel.Distributed,
    plan: Optional[ShardingPlan] = None,
    group: Optional[dist.ProcessGroup] = None,
):
    """The model of ``cfg`` in a TrainTask (``meta_train_task``), sharded (DistributedModelParallel);
    ``group`` (gloo) lets the non-finite guard's ranks agree."""
    return parallel.shard(meta_train_task(cfg.features, cfg.model, cfg.train, group), cfg, env, plan)


def resume_config(cfg: config.ExperimentConfig, ckpt: Path) -> config.ExperimentConfig:
    """``cfg`` for resuming from checkpoint ``ckpt``: refused (IncompatibleCheckpoint) when its model
    differs; with the checkpoint's plan unless train.plan_file names one."""
    checkpoint.check_compatible(ckpt, cfg)
    if cfg.train.plan_file is not None:
        return cfg
    # Same sharding types and kernels as the checkpoint: its optimizer state then loads even on
    # another world size (TorchRec cannot reshard optimizer state across sharding types).
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, plan_file=str(ckpt / checkpoint.PLAN_FILE)))


def pipelined_module_names(dmp, pipeline) -> List[str]:
    """Sharded modules whose input distribution the pipeline really overlaps (it silently skips
    modules whose inputs it cannot trace back to the batch)."""
    chosen = {id(m) for m in pipeline._pipelined_modules}
    return [name for name, m in dmp.named_modules() if id(m) in chosen]


class Trainer:
    """One training run of ``cfg`` on this rank. :meth:`run` does it all; the pieces
    (:meth:`setup`, :meth:`epoch_batches`, :meth:`train_step`, :meth:`fit`, :meth:`calibrate`,
    :meth:`save`, :meth:`evaluate`, :meth:`validate`, :meth:`restore_best`) serve callers that time
    or vary one of them.

    Attributes after :meth:`setup`: ``cfg`` (with the checkpoint's plan when resuming), ``env``,
    ``data_group`` (gloo; None on one rank), ``dmp`` (the sharded TrainTask), ``guard``,
    ``optimizer``, ``schedule`` (the dense LR schedule), ``loader`` (this rank's training batches),
    ``state`` (checkpoint.TrainState), ``pipeline``, ``total_steps``, ``run_dir``, ``resumed_from``
    (the checkpoint resumed, or None), ``warm_from`` (the checkpoint a warm start read: train.init_from)
    and ``pipelined_modules`` (known after the first step);
    ``started_at`` (wall clock, seconds) from construction on."""

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
        """Data group, resume (checkpoint compatibility and its plan), the training loader and the
        checks that the data can train and evaluate, the sharded TrainTask, optimizers and LR
        schedule, the guard, the pipeline. Idempotent."""
        if self._ready:
            return self
        self.run_dir = Path(self.cfg.train.run_dir)
        # With the run's collective timeout (a new group's default is the backend's 30 minutes).
        timeout = datetime.timedelta(seconds=self.cfg.train.collective_timeout_s)
        self.data_group = dist.new_group(backend="gloo", timeout=timeout) if self.env.world_size > 1 else None
        self.resumed_from = checkpoint.latest(self.run_dir)
        # A warm start only starts a run: once it has checkpoints of its own, a relaunch resumes.
        self.warm_from = None
        if self.resumed_from is None and self.cfg.train.init_from:
            self.warm_from = checkpoint.resolve(self.cfg.train.init_from)
        if self.resumed_from is not None or self.warm_from is not None:
            self.cfg = resume_config(self.cfg, self.resumed_from or self.warm_from)
        if self.resumed_from is not None:
            # A relaunch of the same config resumes by itself; another config must not go on with this run.
            checkpoint.check_same_run(self.resumed_from, self.cfg)
        cfg, env = self.cfg, self.env
        self.settings = settings = LoaderSettings.of(cfg)
        pin_memory = env.device.type == "cuda"
        self.loader = make_loader(
            cfg.data.train_dir, settings, env.rank, env.world_size, shuffle=True, pin_memory=pin_memory, part="train"
        )
        # Before training, not after it: a split too small to train on, an empty eval or calibration
        # split (docs/reliability.md, "Empty or tiny data").
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
        self.dmp = shard_train_task(cfg, env, self.plan, group=self.data_group)
        self.guard = next(m for m in self.dmp.modules() if isinstance(m, NonFiniteGuard))
        steps_per_epoch = max(self.loader.dataset.num_rows // (cfg.data.batch_size * env.world_size), 1)
        self.total_steps = cfg.train.max_steps or cfg.train.epochs * steps_per_epoch
        if cfg.train.warmup_steps > self.total_steps // 2 and env.is_main:
            # The warm-up is in steps, the data in rows: a config sized for one dataset can leave
            # the dense layers at a fraction of train.lr for a whole run on a smaller one.
            log.warning(
                "train.warmup_steps %d is more than half of this run's %d steps (%d a rank per epoch): the dense "
                "layers train below train.lr for most of the run; lower train.warmup_steps",
                cfg.train.warmup_steps,
                self.total_steps,
                steps_per_epoch,
            )
        self.optimizer, self.schedule = parallel.make_optimizer(self.dmp, cfg.train, self.total_steps)
        guard_gradients(self.schedule.optimizer._optimizer, cfg.train.nonfinite, self.guard)  # the dense AdamW

        self.state = self._restored_state()
        self.pipeline = TrainPipelineSparseDist(self.dmp, self.optimizer, env.device, execute_all_batches=True)
        self._ready = True
        return self

    def _restored_state(self) -> checkpoint.TrainState:
        """The resumed checkpoint's state, model and optimizers loaded; a fresh state without one."""
        world = self.env.world_size
        source = self.warm_from or self.resumed_from
        return self._loaded_state(source is not None and checkpoint.needs_relayout(source, self.cfg.features, world))

    def _loaded_state(self, relayout: bool) -> checkpoint.TrainState:
        world = self.env.world_size
        if self.warm_from is not None:
            carry = self.cfg.train.init_optimizer
            checkpoint.warm_start(self.warm_from, self.dmp, self.optimizer, carry, relayout)
            if self.env.is_main:
                log.info(
                    "warm start from %s (optimizer state: %s); step, LR schedule and metrics start fresh",
                    self.warm_from,
                    self.cfg.train.init_optimizer,
                )
            return checkpoint.TrainState(world_size=world)
        if self.resumed_from is None:
            return checkpoint.TrainState(world_size=world)
        state = checkpoint.load(self.resumed_from, self.dmp, self.optimizer, self.schedule, relayout)
        chooser = selection_name(self.cfg.train) if self.cfg.train.eval_every is not None else None
        if chooser is not None and state.selection not in (None, chooser):
            # Values of another metric or split do not compare with this run's.
            if self.env.is_main:
                log.warning(
                    "resumed from %s, whose best evaluation was picked by %s; this run picks by %s: its best "
                    "so far (step %s) and patience count start over",
                    self.resumed_from,
                    state.selection,
                    chooser,
                    state.best_step,
                )
            state.best_value, state.best_step, state.evals_since_best, state.last_eval_step = None, None, 0, None
        state.selection = chooser or state.selection
        if state.world_size != world:
            # Row groups are dealt to ranks by world size: the same global position is the best
            # resume point there is (exact only when the world size is unchanged).
            state.batches_in_epoch = state.batches_in_epoch * state.world_size // world
            state.world_size = world
        if self.env.is_main:
            log.info("resumed from %s (step %d, epoch %d)", self.resumed_from, state.step, state.epoch)
            if chooser is not None and state.best_step is not None:
                log.info(
                    "best evaluation so far: step %d, %s = %.6f; %d evaluation(s) since without improvement",
                    state.best_step,
                    chooser,
                    state.best_value,
                    state.evals_since_best,
                )
        return state

    @property
    def stopped_early(self) -> bool:
        """train.early_stop.patience evaluations in a row did not improve on the best (derived from
        ``state``, so a resume with a larger patience trains on)."""
        patience = self.cfg.train.selection.patience
        return self.cfg.train.eval_every is not None and bool(patience) and self.state.evals_since_best >= patience

    def epoch_batches(self, epoch: int) -> EndTogether:
        """This rank's batches of ``epoch``, from ``state.batches_in_epoch`` on (the resume point),
        ending on every rank at the same step. The batches skipped were trained before the resume
        (the same ones when the world size is unchanged): their valid rows count in the epoch's."""
        self.setup()
        self.loader.dataset.set_epoch(epoch)
        batches = iter(self.loader)
        before = [int(next(batches).valid.sum()) for _ in range(self.state.batches_in_epoch)]
        return EndTogether(batches, self.data_group, before)

    def epoch_rows(self, epoch: int, batches: EndTogether, complete: bool) -> dict:
        """The rows ``epoch`` trained (its steps so far), summed over the ranks with one all_reduce,
        beside the rows of the training split and each rank's share (the files' footers): the
        record of :meth:`Hook.on_epoch_end`."""
        env, dataset = self.env, self.loader.dataset
        trained = torch.zeros(env.world_size, dtype=torch.int64)
        trained[env.rank] = batches.trained_rows(self.state.batches_in_epoch)
        if self.data_group is not None:
            with self.collectives(f"step {self.state.step}, counting the rows of epoch {epoch}"):
                dist.all_reduce(trained, op=dist.ReduceOp.SUM, group=self.data_group)
        workers = self.loader.num_workers
        return {
            "epoch": epoch,
            "step": self.state.step,
            "rows_trained": int(trained.sum()),
            "rows_trained_per_rank": trained.tolist(),
            "train_split_rows": dataset.num_rows,
            "rows_dealt_per_rank": [dataset.rows_dealt(rank, workers) for rank in range(env.world_size)],
            "complete": complete,
        }

    def collectives(self, where: str) -> "NamedCollectiveErrors":
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
            self.pipelined_modules = pipelined_module_names(self.dmp, self.pipeline)
            if self.env.is_main:
                log.info(
                    "TrainPipelineSparseDist pipelines %s", self.pipelined_modules or "NOTHING (model not traceable)"
                )
        self.schedule.step()
        self.state.step += 1
        self.state.batches_in_epoch += 1
        return StepOutput(loss, logits, labels)

    def _steps(self, batches: EndTogether) -> Iterator[StepOutput]:
        """The epoch's steps. With train.eval_every.steps the pipeline is fed up to each evaluation
        point (:class:`Upto`), so at that step it has trained every batch it took and the model can
        be evaluated with nothing in flight; then on from there."""
        every = self.cfg.train.eval_every
        while True:
            part = (
                batches
                if every is None or not every.steps
                else Upto(batches, every.steps - self.state.step % every.steps)
            )
            while True:
                try:
                    step = self.train_step(part)
                except StopIteration:
                    break
                yield step
            if part is batches or part.ended:
                return

    def fit(self) -> dict:
        """The epoch loop from ``state`` to ``train.epochs`` or ``train.max_steps``, checkpointing
        every ``train.checkpoint_every`` steps; hooks see on_start, then on_step every
        ``train.log_every`` steps, on_step_end after every step and on_epoch_end after every epoch
        (the rows it trained: :meth:`epoch_rows`). With train.eval_every it
        evaluates (:meth:`validate`) at every N epochs' end or N steps and after the last step,
        saves a checkpoint at each improvement and stops early on train.early_stop.patience.
        Returns {"step", "train_examples_per_s", "train_seconds", "pipelined_modules"}."""
        self.setup()
        cfg, env, state = self.cfg, self.env, self.state
        every = cfg.train.eval_every
        for hook in self.hooks:
            hook.on_start(self)
        begun, started = time.perf_counter(), None
        examples, window_loss, window_n, logit_abs_max = 0, 0.0, 0, 0.0

        done = (bool(cfg.train.max_steps) and state.step >= cfg.train.max_steps) or self.stopped_early
        for epoch in range(state.epoch, cfg.train.epochs):
            if done:
                break
            batches = self.epoch_batches(epoch)
            from_start, steps_before = state.batches_in_epoch == 0, state.step
            for step in self._steps(batches):
                if started is None:
                    # Rates leave the first step out: it starts the loader's workers and traces the
                    # pipeline, seconds that would dominate a short run's examples/s.
                    started = time.perf_counter()
                else:
                    examples += step.labels.shape[0] * env.world_size
                window_loss += float(step.loss)
                window_n += 1
                logit_abs_max = max(logit_abs_max, float(step.logits.abs().max()))
                if state.step % cfg.train.log_every == 0:
                    rate = examples / (time.perf_counter() - started) if examples else 0.0
                    record = {
                        "step": state.step,
                        "epoch": epoch,
                        "loss": window_loss / window_n,
                        "logit_abs_max": logit_abs_max,
                        "nonfinite_skipped": self.guard.skipped,
                        "fp16_fallbacks": fallback_count(self.dmp),
                        "lr": self.schedule.get_last_lr()[0],
                        "examples_per_s": rate,
                    }
                    for hook in self.hooks:
                        hook.on_step(self, record)
                    window_loss, window_n, logit_abs_max = 0.0, 0, 0.0
                # Evaluated before the checkpoint: it then holds this evaluation's outcome.
                improved = bool(every and every.steps) and state.step % every.steps == 0 and self.validate()
                if (cfg.train.checkpoint_every and state.step % cfg.train.checkpoint_every == 0) or improved:
                    with self.collectives(f"step {state.step}, saving the checkpoint"):
                        self.save()
                for hook in self.hooks:
                    hook.on_step_end(self)
                if (cfg.train.max_steps and state.step >= cfg.train.max_steps) or self.stopped_early:
                    done = True
                    break
            rows = self.epoch_rows(epoch, batches, complete=not done)
            if from_start and state.step == steps_before:
                # The footers promised a batch per rank (setup); the rows read did not make one.
                who = f"rank {env.rank} had" if batches.ran_out_here else "another rank had"
                message = (
                    f"data.train_dir {cfg.data.train_dir}: epoch {epoch} ended before its first step: {who} "
                    f"no batch of data.batch_size {cfg.data.batch_size} rows (data.row_filter, "
                    f"data.max_unique_users_per_batch or this epoch's deal of row groups left too few)"
                )
                if state.step == 0:  # nothing trained at all: stop rather than 'finish' an empty run
                    raise ContractError(message)
                if env.is_main:
                    log.warning("%s; training goes on with the next epoch", message)
            for hook in self.hooks:
                hook.on_epoch_end(self, rows)
            if not done:
                state.epoch, state.batches_in_epoch = epoch + 1, 0
                if every and every.epochs and state.epoch % every.epochs == 0 and state.last_eval_step != state.step:
                    if self.validate():
                        with self.collectives(f"step {state.step}, saving the checkpoint"):
                            self.save()
                    done = self.stopped_early
        if every is not None and state.last_eval_step != state.step:
            # The last weights are candidates too: a run may end between two evaluation points.
            if self.validate():
                with self.collectives(f"step {state.step}, saving the checkpoint"):
                    self.save()
        now = time.perf_counter()
        return {
            "step": state.step,
            "train_examples_per_s": examples / (now - started) if examples else 0.0,
            "train_seconds": now - begun,
            "pipelined_modules": self.pipelined_modules or [],
        }

    def validate(self) -> bool:
        """One evaluation during training (train.eval_every) of the current weights on train.eval_on:
        the pipeline detached (an evaluation point leaves nothing in flight; the next step attaches
        it again) and the RNG states put back after it, so training goes on as it would have without
        it. Updates the selection in ``state`` (best value and step, evaluations since), logs it and
        tells the hooks (on_validation). True when it improved on the best: then the caller saves a
        checkpoint of this step, which the best step names."""
        self.setup()
        cfg, env, state = self.cfg, self.env, self.state
        stop = cfg.train.selection
        epoch = state.epoch - 1 if state.batches_in_epoch == 0 else state.epoch  # the last step's
        self.pipeline.detach()
        devices = [env.device.index or 0] if env.device.type == "cuda" else []
        with self.collectives(f"step {state.step}, evaluation on {cfg.train.eval_on}"):
            with torch.random.fork_rng(devices=devices):  # the loader's iterator draws a seed
                rows = self.evaluate(cfg.train.eval_on)
        value = selection_value(rows, stop)
        improved = improves(value, state.best_value, stop)
        if improved:
            state.best_value, state.best_step, state.evals_since_best = value, state.step, 0
        else:
            state.evals_since_best += 1
        state.selection, state.last_eval_step = selection_name(cfg.train), state.step
        record = {
            "step": state.step,
            "epoch": epoch,
            "validation_on": cfg.train.eval_on,
            "selection": state.selection,
            "value": value,
            "improved": improved,
            "best_value": state.best_value,
            "best_step": state.best_step,
            "evals_since_best": state.evals_since_best,
            "patience": stop.patience,
            "stopping": self.stopped_early,
            "rows": rows,
        }
        if env.is_main:
            best = (
                "no finite value yet"
                if state.best_step is None
                else f"best {state.best_value:.6f} at step {state.best_step}"
            )
            since = "" if improved else f"; {state.evals_since_best} evaluation(s) without improvement"
            log.info(
                "evaluation at step %d (epoch %d): %s = %.6f; %s%s%s",
                state.step,
                epoch,
                state.selection,
                value,
                best,
                since,
                f" of patience {stop.patience}" if stop.patience and not improved else "",
            )
            if self.stopped_early:
                log.info(
                    "early stopping at step %d (epoch %d): %d evaluations without improving on %s = %.6f "
                    "(step %d), train.early_stop.patience %d",
                    state.step,
                    epoch,
                    state.evals_since_best,
                    state.selection,
                    state.best_value if state.best_value is not None else float("nan"),
                    state.best_step if state.best_step is not None else -1,
                    stop.patience,
                )
        for hook in self.hooks:
            hook.on_validation(self, record)
        return improved

    def restore_best(self) -> None:
        """With train.eval_every: the best evaluation's weights back into the model, read from its
        step's checkpoint (unless they are the last step's), and say which; the pipeline must be
        detached. Without a finite evaluation the last weights stay, with a warning."""
        self.setup()
        state = self.state
        if self.cfg.train.eval_every is None:
            return
        if state.best_step is None:
            if self.env.is_main:
                log.warning("no evaluation gave a finite %s: the model is the last step's weights", state.selection)
            return
        if state.best_step != state.step:
            checkpoint.load_model(self.run_dir / "checkpoints" / f"step-{state.best_step}", self.dmp)
        if self.env.is_main:
            log.info(
                "the run's model: the weights of step %d (of %d), its best evaluation: %s = %.6f%s",
                state.best_step,
                state.step,
                state.selection,
                state.best_value,
                f"; training stopped early at step {state.step}" if self.stopped_early else "",
            )

    def calibrate(self) -> None:
        """Fits the calibration maps (see :func:`fit_calibration`); the pipeline must be detached."""
        self.setup()
        fit_calibration(self.dmp, self.settings, self.env, self.data_group)

    def evaluate(self, split: str = "eval") -> List[dict]:
        """Metrics rows per surface x task over the eval split, or the held-out rows (``split``
        "holdout"; see :func:`evaluation_rows`)."""
        self.setup()
        return evaluation_rows(self.dmp, self.settings, self.env, self.data_group, split)

    def save(self) -> Path:
        """A checkpoint of the current step under ``run_dir``; returns its directory."""
        self.setup()
        return checkpoint.save(self.run_dir, self.state, self.dmp, self.optimizer, self.schedule, self.cfg)

    def run(self) -> dict:
        """fit, then (pipeline detached) restore the best evaluation's weights (train.eval_every),
        calibrate, save, evaluate; hooks see the summary. Returns the summary: fit's figures, the
        guard's and FP16 fallback counts, world size, global batch, the ``eval`` rows, ``slices`` (the
        known / new users' and items' rows, where a vocabulary maps them and eval holds new ones) and, with
        train.eval_every, ``selection``: {"by", "best_step", "best_value", "evals_since_best",
        "stopped_early_at" (the step, or None)}."""
        self.setup()
        fitted = self.fit()
        self.pipeline.detach()
        after = f"after step {self.state.step}"
        with self.collectives(f"{after}, loading the best weights"):
            self.restore_best()
        with self.collectives(f"{after}, calibration"):
            self.calibrate()
        with self.collectives(f"{after}, saving the checkpoint"):
            self.save()
        with self.collectives(f"{after}, evaluation"):
            # One pass: the rows, and those of the known / new users and items (vocabulary id 0).
            vocabularies = [v.table for v in self.cfg.build.vocabularies]
            rows, slices = evaluation_with_slices(
                self.dmp, self.settings, self.env, self.data_group, "eval", vocabularies
            )
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
            summary["selection"] = {
                "by": self.state.selection,
                "best_step": self.state.best_step,
                "best_value": self.state.best_value,
                "evals_since_best": self.state.evals_since_best,
                "stopped_early_at": self.state.step if self.stopped_early else None,
            }
        for hook in self.hooks:
            hook.on_evaluation(self, summary)
        for hook in self.hooks:
            hook.on_end(self)
        return summary
