"""A training step's output (:class:`StepOutput`) and what the steps measure between two step
records (:meth:`Hook.on_step`): the mean loss over the window, the largest absolute logit in it, and
the examples per second since the first step (all ranks' rows: each step trains a batch of every
rank)."""

from __future__ import annotations

import dataclasses
import time

import torch


@dataclasses.dataclass
class StepOutput:
    """One training step as the pipeline returns it: the loss (scalar), logits and labels ``[B, T]``."""

    loss: torch.Tensor
    logits: torch.Tensor
    labels: torch.Tensor


class StepMeter:
    """Meters the steps of one :meth:`Trainer.fit`. ``update`` after every step; ``record`` at each
    step record (it starts a new window); ``totals`` at the end."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.begun, self.started = time.perf_counter(), None
        self.examples, self.window_loss, self.window_n, self.logit_abs_max = 0, 0.0, 0, 0.0

    def update(self, step: StepOutput) -> None:
        """One step, its labels ``[B, T]`` B rows of this rank."""
        if self.started is None:
            # Rates leave the first step out: it starts the loader's workers and traces the
            # pipeline, seconds that would dominate a short run's examples/s.
            self.started = time.perf_counter()
        else:
            self.examples += step.labels.shape[0] * self.world_size
        self.window_loss += float(step.loss)
        self.window_n += 1
        self.logit_abs_max = max(self.logit_abs_max, float(step.logits.abs().max()))

    def examples_per_s(self) -> float:
        """Examples a second since the first step ended (0 before a second step)."""
        return self.examples / (time.perf_counter() - self.started) if self.examples else 0.0

    def record(self, step: int, epoch: int, nonfinite_skipped: int, fp16_fallbacks: int, lr: float) -> dict:
        """The step record of :meth:`Hook.on_step` for the window ending at ``step``; starts the next."""
        record = {
            "step": step,
            "epoch": epoch,
            "loss": self.window_loss / self.window_n,
            "logit_abs_max": self.logit_abs_max,
            "nonfinite_skipped": nonfinite_skipped,
            "fp16_fallbacks": fp16_fallbacks,
            "lr": lr,
            "examples_per_s": self.examples_per_s(),
        }
        self.window_loss, self.window_n, self.logit_abs_max = 0.0, 0, 0.0
        return record

    def totals(self) -> dict:
        """{"train_examples_per_s", "train_seconds" (since the meter was made)}."""
        return {"train_examples_per_s": self.examples_per_s(), "train_seconds": time.perf_counter() - self.begun}
