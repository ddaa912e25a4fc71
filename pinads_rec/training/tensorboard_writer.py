"""A run's TensorBoard event files, written by the :class:`TensorBoardWriter` hook on rank 0 into
the run directory beside metrics.jsonl: ``tensorboard --logdir runs/demo``.

The scalars are metrics.jsonl's values, taken from the same dicts the hooks receive (TensorBoard
stores them as float32):

* ``train/<key>`` at each step record's step: every number of :meth:`Hook.on_step`'s record but the
  step itself: ``loss``, ``lr``, ``examples_per_s``, ``logit_abs_max``, ``nonfinite_skipped``,
  ``fp16_fallbacks``, ``epoch``.
* ``eval/<metric>/<surface>/<task>`` at the run's last step: every float of the evaluation rows
  (``auc``, ``ne``, ``log_loss``, ``calibration``, ``ece``; with user ids ``gauc``,
  ``gauc_coverage``; with an oracle ``oracle_auc``,
  ``oracle_ne``, ``calibration_vs_truth``) and ``lift``, the oracle lift of the console table
  (:func:`pinads_rec.metrics.oracle_lift`). Surfaces include ``all``.
* ``summary/<key>`` at the run's last step: the summary's numbers (``train_examples_per_s``,
  ``train_seconds``, ``nonfinite_skipped``, ``fp16_fallbacks``, ``world_size``, ``global_batch``);
  with train.eval_every also ``summary/best_step`` and ``summary/best_value`` (the evaluation whose
  weights the run's model has).
* ``validation/<metric>/<surface>/<task>`` at each evaluation during training (train.eval_every):
  every float of its rows, as ``eval/`` has them; ``validation/selected`` the value that picks the
  best (train.early_stop.metric over its cells), ``validation/best`` the best so far,
  ``validation/evals_since_best`` early stopping's count.

Text ``run_metadata``: :func:`pinads_rec.training.run_log.run_metadata` as JSON, the content of
run_metadata.json. A resumed run adds an event file to the same directory and hides what an earlier
run wrote after the checkpoint it resumed from (``purge_step``), so the curves show one history;
metrics.jsonl keeps every line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Union

from torch.utils.tensorboard import SummaryWriter

from pinads_rec.metrics import oracle_lift
from pinads_rec.training.hooks import Hook
from pinads_rec.training.run_log import run_metadata
from pinads_rec.training.trainer import Trainer

METADATA_TAG = "run_metadata"


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class TensorBoardWriter(Hook):
    """Writes the run's scalars and metadata as TensorBoard events into ``run_dir`` (default: the
    trainer's train.run_dir), on rank 0 only."""

    def __init__(self, run_dir: Union[str, Path, None] = None):
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.writer: Optional[SummaryWriter] = None

    def on_start(self, trainer: Trainer) -> None:
        if not trainer.env.is_main:
            return
        step = trainer.state.step
        self.writer = SummaryWriter(
            log_dir=str(self.run_dir if self.run_dir is not None else trainer.run_dir),
            purge_step=step + 1 if trainer.resumed_from is not None else None,
        )
        # A fenced block: TensorBoard renders text as Markdown.
        self.writer.add_text(METADATA_TAG, f"```json\n{json.dumps(run_metadata(trainer), indent=1)}\n```", step)

    def on_step(self, trainer: Trainer, record: dict) -> None:
        if self.writer is None:
            return
        for key, value in record.items():
            if key != "step" and is_number(value):
                self.writer.add_scalar(f"train/{key}", value, record["step"])
        # Each record reaches the file at once: a live TensorBoard, and a crashed run, see every step.
        self.writer.flush()

    def rows(self, prefix: str, rows, step: int) -> None:
        for row in rows:
            cell = f"{row['surface']}/{row['task']}"
            for key, value in row.items():
                if isinstance(value, float):
                    self.writer.add_scalar(f"{prefix}/{key}/{cell}", value, step)
            lift = oracle_lift(row)
            if lift is not None:
                self.writer.add_scalar(f"{prefix}/lift/{cell}", lift, step)

    def on_validation(self, trainer: Trainer, record: dict) -> None:
        if self.writer is None:
            return
        step = record["step"]
        self.rows("validation", record["rows"], step)
        self.writer.add_scalar("validation/selected", record["value"], step)
        if record["best_value"] is not None:
            self.writer.add_scalar("validation/best", record["best_value"], step)
        self.writer.add_scalar("validation/evals_since_best", record["evals_since_best"], step)
        self.writer.flush()

    def on_evaluation(self, trainer: Trainer, summary: dict) -> None:
        if self.writer is None:
            return
        step = summary["step"]
        for key, value in summary.items():
            if key != "step" and is_number(value):
                self.writer.add_scalar(f"summary/{key}", value, step)
        for key in ("best_step", "best_value"):
            value = summary.get("selection", {}).get(key)
            if is_number(value):
                self.writer.add_scalar(f"summary/{key}", value, step)
        self.rows("eval", summary["eval"], step)
        self.writer.flush()

    def on_end(self, trainer: Trainer) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
