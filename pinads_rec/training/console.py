"""The console report of a run, rank 0 only: a progress bar over the steps (advanced at each step
record, with the window's loss and examples/s) and, at the end, the throughput and the evaluation
table (:func:`pinads_rec.metrics.format_table`); with evaluations during training (train.eval_every)
the latest one's value beside the bar, and at the end which evaluation's weights the model has."""

from __future__ import annotations

import sys

from tqdm import tqdm

from pinads_rec.metrics import format_table
from pinads_rec.training.trainer import Hook, Trainer


class ConsoleReport(Hook):
    def on_start(self, trainer: Trainer) -> None:
        self.bar = tqdm(
            total=trainer.total_steps,
            initial=trainer.state.step,
            disable=not trainer.env.is_main,
            unit="step",
            mininterval=1.0 if sys.stderr.isatty() else 15.0,
            dynamic_ncols=True,
        )

    def on_step(self, trainer: Trainer, record: dict) -> None:
        self.bar.update(record["step"] - self.bar.n)
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", ex_s=f"{record['examples_per_s']:,.0f}")

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
            print(format_table(summary["eval"]))
