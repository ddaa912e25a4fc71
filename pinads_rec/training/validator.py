"""Evaluations during training (train.eval_every) and the choice of the best: when to evaluate, the
value that picks the best (train.early_stop: ``selection_name``, ``selection_value``, ``improves``),
patience (early stopping), the best so far and reading its weights back at the end of the run.

The :class:`Validator`'s state (:class:`Selection`: what picks the best, its value and step, the
evaluations since, the last evaluation's step) is saved in every checkpoint's train_state.json
beside the trainer's position, so a resumed run keeps its best and its patience count; a resume
that picks the best another way starts both over. The best step's checkpoint holds its weights:
the trainer saves one at every improvement, and pruning spares it (training/checkpoint.py).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import torch

from pinads_rec import config, parallel
from pinads_rec.metrics import ALL_SURFACES
from pinads_rec.training import checkpoint
from pinads_rec.training.collectives import NamedCollectiveErrors

log = logging.getLogger("pinads_rec.train")


def selection_name(train: config.TrainConfig) -> str:
    """What picks the best evaluation, in words: ``auc (mean over surfaces, mean over tasks; max) on
    holdout``. A checkpoint stores it; a resume under another forgets the best so far."""
    stop = train.selection
    surface = {"mean": "mean over surfaces", "all": "all surfaces pooled"}.get(stop.surface, f"surface {stop.surface}")
    task = "mean over tasks" if stop.task is None else f"task {stop.task}"
    return f"{stop.metric} ({surface}, {task}; {stop.better}) on {train.eval_on}"


def selection_value(rows: Sequence[dict], stop: config.EarlyStopConfig) -> float:
    """train.early_stop.metric of evaluation ``rows`` averaged over the cells chosen by its task and
    surface; a NaN cell (the AUC of a surface without positives) is left out, and the value is NaN
    when every cell is."""
    values = [
        float(r[stop.metric])
        for r in rows
        if (stop.task is None or r["task"] == stop.task)
        and (r["surface"] != ALL_SURFACES if stop.surface == "mean" else r["surface"] == stop.surface)
        and r[stop.metric] is not None
        and r[stop.metric] == r[stop.metric]
    ]
    return sum(values) / len(values) if values else float("nan")


def improves(value: float, best: Optional[float], stop: config.EarlyStopConfig) -> bool:
    """``value`` beats ``best`` by more than train.early_stop.min_delta in its direction (any finite
    value beats no best; NaN beats nothing)."""
    if value != value:
        return False
    if best is None:
        return True
    return value > best + stop.min_delta if stop.better == "max" else value < best - stop.min_delta


@dataclasses.dataclass
class Selection:
    """The validator's state, as train_state.json holds it (a checkpoint older than it holds none)."""

    selection: Optional[str] = None  # what picks the best (selection_name); a resume under another resets it
    best_value: Optional[float] = None  # the best evaluation's value (None before a finite one)
    best_step: Optional[int] = None  # its step: checkpoints/step-<best_step> holds its weights
    evals_since_best: int = 0  # evaluations since then without improvement (early stopping's count)
    last_eval_step: Optional[int] = None


class Validator:
    """When a run evaluates (every train.eval_every epochs or steps, and after its last step), what
    each evaluation tells (improved, the best so far, early stopping) and the best weights at the
    end. Inactive without train.eval_every, but for carrying a resumed checkpoint's selection on.
    ``collectives(where)``: the trainer's naming of a collective's errors."""

    def __init__(
        self, train: config.TrainConfig, env: parallel.Distributed, collectives: Callable[[str], NamedCollectiveErrors]
    ):
        self.train, self.env, self.collectives = train, env, collectives
        self.every, self.stop = train.eval_every, train.selection
        self.chooser = selection_name(train) if self.every is not None else None
        self.state = Selection()

    @property
    def steps_between(self) -> Optional[int]:
        """train.eval_every.steps (the pipeline is fed up to each such step), or None."""
        return self.every.steps if self.every is not None and self.every.steps else None

    def due_after_step(self, step: int) -> bool:
        return self.steps_between is not None and step % self.steps_between == 0

    def due_after_epoch(self, epochs_done: int, step: int) -> bool:
        epochs = self.every.epochs if self.every is not None else None
        return bool(epochs) and epochs_done % epochs == 0 and self.state.last_eval_step != step

    def due_at_end(self, step: int) -> bool:
        """The last weights are candidates too: a run may end between two evaluation points."""
        return self.every is not None and self.state.last_eval_step != step

    @property
    def stopped_early(self) -> bool:
        """train.early_stop.patience evaluations in a row did not improve on the best (derived from
        the count, so a resume with a larger patience trains on)."""
        patience = self.stop.patience
        return self.every is not None and bool(patience) and self.state.evals_since_best >= patience

    def validate(self, step: int, epoch: int, evaluate: Callable[[str], List[dict]]) -> dict:
        """One evaluation (``evaluate(train.eval_on)``: its rows) of the weights after ``step``, the
        RNG states put back after it so training goes on as it would have without it. Updates the
        selection, logs it and returns the record of :meth:`Hook.on_validation`."""
        state, stop, env = self.state, self.stop, self.env
        devices = [env.device.index or 0] if env.device.type == "cuda" else []
        with self.collectives(f"step {step}, evaluation on {self.train.eval_on}"):
            with torch.random.fork_rng(devices=devices):  # the loader's iterator draws a seed
                rows = evaluate(self.train.eval_on)
        value = selection_value(rows, stop)
        improved = improves(value, state.best_value, stop)
        if improved:
            state.best_value, state.best_step, state.evals_since_best = value, step, 0
        else:
            state.evals_since_best += 1
        state.selection, state.last_eval_step = self.chooser, step
        if env.is_main:
            self._log(step, epoch, value, improved)
        return {
            "step": step,
            "epoch": epoch,
            "validation_on": self.train.eval_on,
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

    def _log(self, step: int, epoch: int, value: float, improved: bool) -> None:
        state, stop = self.state, self.stop
        best = (
            "no finite value yet"
            if state.best_step is None
            else f"best {state.best_value:.6f} at step {state.best_step}"
        )
        since = "" if improved else f"; {state.evals_since_best} evaluation(s) without improvement"
        log.info(
            "evaluation at step %d (epoch %d): %s = %.6f; %s%s%s",
            step,
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
                step,
                epoch,
                state.evals_since_best,
                state.selection,
                state.best_value if state.best_value is not None else float("nan"),
                state.best_step if state.best_step is not None else -1,
                stop.patience,
            )

    def restore_best(self, dmp, run_dir: Path, step: int) -> None:
        """With train.eval_every: the best evaluation's weights back into ``dmp``, read from its
        step's checkpoint (unless they are those of ``step``, the last), and say which; the pipeline
        must be detached. Without a finite evaluation the last weights stay, with a warning."""
        state = self.state
        if self.every is None:
            return
        if state.best_step is None:
            if self.env.is_main:
                log.warning("no evaluation gave a finite %s: the model is the last step's weights", state.selection)
            return
        if state.best_step != step:
            checkpoint.load_model(Path(run_dir) / "checkpoints" / f"step-{state.best_step}", dmp)
        if self.env.is_main:
            log.info(
                "the run's model: the weights of step %d (of %d), its best evaluation: %s = %.6f%s",
                state.best_step,
                step,
                state.selection,
                state.best_value,
                f"; training stopped early at step {step}" if self.stopped_early else "",
            )

    def summary(self, step: int) -> dict:
        """The run summary's ``selection`` (after the last ``step``)."""
        state = self.state
        return {
            "by": state.selection,
            "best_step": state.best_step,
            "best_value": state.best_value,
            "evals_since_best": state.evals_since_best,
            "stopped_early_at": step if self.stopped_early else None,
        }

    def state_dict(self) -> dict:
        return dataclasses.asdict(self.state)

    def load_state_dict(self, saved: dict, source: Path) -> None:
        """The selection of checkpoint ``source`` (``saved``: its train_state.json's "train", whose
        other keys are the trainer's): kept, unless this run picks the best another way."""
        fields = {f.name for f in dataclasses.fields(Selection)}
        state = self.state = Selection(**{k: v for k, v in saved.items() if k in fields})
        if self.chooser is not None and state.selection not in (None, self.chooser):
            # Values of another metric or split do not compare with this run's.
            if self.env.is_main:
                log.warning(
                    "resumed from %s, whose best evaluation was picked by %s; this run picks by %s: its best "
                    "so far (step %s) and patience count start over",
                    source,
                    state.selection,
                    self.chooser,
                    state.best_step,
                )
            state = self.state = Selection()
        state.selection = self.chooser or state.selection
        if self.env.is_main and self.chooser is not None and state.best_step is not None:
            log.info(
                "best evaluation so far: step %d, %s = %.6f; %d evaluation(s) since without improvement",
                state.best_step,
                self.chooser,
                state.best_value,
                state.evals_since_best,
            )
