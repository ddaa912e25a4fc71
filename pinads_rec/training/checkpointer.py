"""The run's checkpoints, as the trainer uses them (the format: training/checkpoint.py).

Where a run starts: a resume when train.run_dir holds a checkpoint (the same run relaunched: its
config checked, ``checkpoint.check_same_run``), else a warm start from train.init_from (another
run's weights and, as train.init_optimizer says, optimizer state; everything else fresh), else
fresh. Either way the run takes the checkpoint's sharding plan (``resume_config``), and its
managed-collision tables are re-laid out on another world size (``checkpoint.needs_relayout``).
When it saves: every train.checkpoint_every steps (the trainer also saves at each improvement on
the best evaluation and at the end); what: the model, optimizers, LR schedule, RNG, the position
(``checkpoint.TrainState``) and the validator's state.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Optional

from pinads_rec import config, parallel
from pinads_rec.training import checkpoint
from pinads_rec.training.validator import Validator

log = logging.getLogger("pinads_rec.train")


def resume_config(cfg: config.ExperimentConfig, ckpt: Path) -> config.ExperimentConfig:
    """``cfg`` for resuming from checkpoint ``ckpt``: refused (IncompatibleCheckpoint) when its model
    differs; with the checkpoint's plan unless train.plan_file names one."""
    checkpoint.check_compatible(ckpt, cfg)
    if cfg.train.plan_file is not None:
        return cfg
    # Same sharding types and kernels as the checkpoint: its optimizer state then loads even on
    # another world size (TorchRec cannot reshard optimizer state across sharding types).
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, plan_file=str(ckpt / checkpoint.PLAN_FILE)))


class Checkpointer:
    """Decides at construction where the run starts (``resumed_from``, ``warm_from``: a checkpoint
    or None) and the run's config (``cfg``: with that checkpoint's plan); :meth:`restore` loads the
    run's parts from it, :meth:`save` saves them."""

    def __init__(self, cfg: config.ExperimentConfig, env: parallel.Distributed):
        self.env, self.run_dir = env, Path(cfg.train.run_dir)
        self.resumed_from: Optional[Path] = checkpoint.latest(self.run_dir)
        # A warm start only starts a run: once it has checkpoints of its own, a relaunch resumes.
        self.warm_from: Optional[Path] = None
        if self.resumed_from is None and cfg.train.init_from:
            self.warm_from = checkpoint.resolve(cfg.train.init_from)
        if self.resumed_from is not None or self.warm_from is not None:
            cfg = resume_config(cfg, self.resumed_from or self.warm_from)
        if self.resumed_from is not None:
            # A relaunch of the same config resumes by itself; another config must not go on with this run.
            checkpoint.check_same_run(self.resumed_from, cfg)
        self.cfg = cfg

    def due(self, step: int) -> bool:
        """A checkpoint every train.checkpoint_every steps."""
        every = self.cfg.train.checkpoint_every
        return bool(every) and step % every == 0

    def restore(self, dmp, optimizer, schedule, validator: Validator) -> checkpoint.TrainState:
        """Keeps the run's parts, which :meth:`save` saves, and loads them from the checkpoint resumed
        (every part, the position rescaled to this world size) or warm-started from (weights and
        optimizer state); returns the position (fresh but for a resume)."""
        self.dmp, self.optimizer, self.schedule, self.validator = dmp, optimizer, schedule, validator
        cfg, world, source = self.cfg, self.env.world_size, self.warm_from or self.resumed_from
        relayout = source is not None and checkpoint.needs_relayout(source, cfg.features, world)
        if self.warm_from is not None:
            checkpoint.warm_start(self.warm_from, dmp, optimizer, cfg.train.init_optimizer, relayout)
            if self.env.is_main:
                log.info(
                    "warm start from %s (optimizer state: %s); step, LR schedule and metrics start fresh",
                    self.warm_from,
                    cfg.train.init_optimizer,
                )
        if self.resumed_from is None:
            return checkpoint.TrainState(world_size=world)
        state = checkpoint.load(self.resumed_from, dmp, optimizer, schedule, relayout)
        if state.world_size != world:
            # Row groups are dealt to ranks by world size: the same global position is the best
            # resume point there is (exact only when the world size is unchanged).
            state.batches_in_epoch = state.batches_in_epoch * state.world_size // world
            state.world_size = world
        if self.env.is_main:
            log.info("resumed from %s (step %d, epoch %d)", self.resumed_from, state.step, state.epoch)
        validator.load_state_dict(checkpoint.saved_train_state(self.resumed_from), self.resumed_from)
        return state

    def save(self, state: checkpoint.TrainState) -> Path:
        """A checkpoint of step ``state.step`` under ``run_dir`` of every part :meth:`restore` kept;
        returns its directory."""
        selection = self.validator.state_dict()
        return checkpoint.save(self.run_dir, state, self.dmp, self.optimizer, self.schedule, self.cfg, selection)
