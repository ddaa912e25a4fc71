"""The console report of a run, rank 0 only: a progress bar over the steps (advanced at each step
record, with the window's loss and examples/s), a line at each epoch's end with the rows it trained
(:func:`epoch_line`) and, at the end, the throughput and the evaluation table
(:func:`pinads_rec.metrics.format_table`); with evaluations during training (train.eval_every) the
latest one's value beside the bar, and at the end which evaluation's weights the model has."""

from __future__ import annotations

import sys
from typing import Optional

from tqdm import tqdm

from pinads_rec.metrics import format_table
from pinads_rec.reference.fit import describe
from pinads_rec.training.evaluation import format_slices
from pinads_rec.training.hooks import Hook
from pinads_rec.training.trainer import Trainer

# Ranks beyond this many: the epoch line leaves the per-rank counts to metrics.jsonl.
PER_RANK_SHOWN = 8


def epoch_line(record: dict, row_filter: Optional[str] = None) -> str:
    """``epoch 0: trained 3,805 of 4,791 rows (79.4%; rows left: ...)`` of an epoch record
    (:meth:`Hook.on_epoch_end`). ``row_filter``: the data.row_filter column, if any (the footers'
    count of the split includes the rows it drops, so the line does not explain the difference)."""
    trained, total = record["rows_trained"], record["train_split_rows"]
    of = f"{total:,} rows" + (f" (before data.row_filter on {row_filter})" if row_filter else "")
    head = f"epoch {record['epoch']}"
    if not record["complete"]:
        head += f" (cut short at step {record['step']})"
    share = f"{100.0 * trained / total:.1f}%" if total else "-"
    if record["complete"] and trained < total and not row_filter:
        per_rank = zip(record["rows_trained_per_rank"], record["rows_dealt_per_rank"])
        detail = (
            "; trained / dealt per rank: " + ", ".join(f"{t:,} / {d:,}" for t, d in per_rank)
            if len(record["rows_trained_per_rank"]) <= PER_RANK_SHOWN
            else "; per rank in metrics.jsonl"
        )
        share += (
            "; rows left: each loader worker's last partial batch, and those past the step where the rank "
            f"with the fewest batches ran out{detail}"
        )
    return f"{head}: trained {trained:,} of {of} ({share})"


class ConsoleReport(Hook):
    def on_start(self, trainer: Trainer) -> None:
        self.bar = tqdm(
            total=trainer.total_steps,
            initial=trainer.state.step,
            disable=not trainer.env.is_main,
            unit="step",
            mininterval=1.0 if sys.stdout.isatty() else 15.0,
            dynamic_ncols=True,
            # stdout, as the tables: under a launcher (torchx) stdout and stderr are separate pipes,
            # merged in whatever order they arrive, so a bar on stderr could land inside the table.
            file=sys.stdout,
        )

    def on_step(self, trainer: Trainer, record: dict) -> None:
        self.bar.update(record["step"] - self.bar.n)
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", ex_s=f"{record['examples_per_s']:,.0f}")

    def on_epoch_end(self, trainer: Trainer, record: dict) -> None:
        if trainer.env.is_main:
            row_filter = trainer.cfg.data.row_filter
            self.bar.write(epoch_line(record, row_filter.column if row_filter is not None else None))

    def on_validation(self, trainer: Trainer, record: dict) -> None:
        self.bar.update(record["step"] - self.bar.n)
        best = record["best_value"]
        self.bar.set_postfix(val=f"{record['value']:.4f}", best=f"{best:.4f}" if best is not None else "-")

    def on_evaluation(self, trainer: Trainer, summary: dict) -> None:
        self.bar.update(summary["step"] - self.bar.n)
        self.bar.close()
        if trainer.env.is_main:
            print(
                f"\ntrained {summary['step']} steps on {summary['world_size']} rank(s): "
                f"{summary['train_examples_per_s']:,.0f} examples/s"
            )
            chosen = summary.get("selection")
            if chosen and chosen["best_step"] is not None:
                stopped = chosen["stopped_early_at"]
                print(
                    f"model: the weights of step {chosen['best_step']}, the best evaluation by {chosen['by']}: "
                    f"{chosen['best_value']:.4f}" + (f"; early stopping at step {stopped}" if stopped else "")
                )
            reference = summary.get("reference")
            print(format_table(summary["eval"], reference.get("eval") if reference else None))
            if reference:
                print(describe(reference, summary["eval"]))
            slices = format_slices(summary.get("slices", []))
            if slices:
                print("\nknown and new ids (id 0: not in the build's vocabulary):\n" + slices)
            sys.stdout.flush()
