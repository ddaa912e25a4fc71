"""The :class:`Hook` protocol: what a run reports (metrics.jsonl, the console, TensorBoard, a
profiler's trace) is a hook that :class:`~pinads_rec.training.trainer.Trainer` calls at fixed points
of its loop, with the records documented here; the loop does not change for a new report."""

from __future__ import annotations


class Hook:
    """What a run reports, plugged into the Trainer without touching its loop. Subclass and
    override what you need; every method is a no-op. Hooks run on every rank (``trainer.env``
    says which one) in the order given. ``trainer``: the Trainer calling (not annotated: this
    module is the trainer's, an import back would close a circle)."""

    def on_start(self, trainer) -> None:
        """After set-up, before the first step."""

    def on_step(self, trainer, record: dict) -> None:
        """Every ``train.log_every`` steps. ``record``: {"step", "epoch", "loss" (mean over the
        window), "logit_abs_max", "nonfinite_skipped", "fp16_fallbacks", "lr", "examples_per_s"}."""

    def on_step_end(self, trainer) -> None:
        """After every training step (``trainer.state.step`` is the step just done), for per-step
        work such as a profiler's window; keep it cheap."""

    def on_epoch_end(self, trainer, record: dict) -> None:
        """At the end of each epoch of training (also one that train.max_steps or early stopping
        ends). ``record``: {"epoch", "step" (its last), "rows_trained" (the valid rows its steps
        trained, summed over the ranks), "rows_trained_per_rank", "train_split_rows" (the rows of
        the training split, from the files' footers, before data.row_filter), "rows_dealt_per_rank"
        (those dealt to each rank this epoch, from the footers too), "complete" (the epoch ran until
        a rank ran out of batches; False when train.max_steps or early stopping ended it)}. Rows are
        left out of a complete epoch where ranks hold more batches than the one with the fewest
        (data/loader/dataset.py says by how much at most)."""

    def on_validation(self, trainer, record: dict) -> None:
        """After each evaluation during training (train.eval_every). ``record``: {"step", "epoch",
        "validation_on" (train.eval_on), "selection" (what picks the best:
        :func:`pinads_rec.training.validator.selection_name`), "value" (its value here), "improved",
        "best_value", "best_step", "evals_since_best", "patience", "stopping" (early stopping ends
        training here), "rows" (the evaluation rows)}."""

    def on_evaluation(self, trainer, summary: dict) -> None:
        """The final summary (what :meth:`Trainer.run` returns): fit's figures and the ``eval`` rows."""

    def on_end(self, trainer) -> None:
        """After a completed run."""
