"""A torch.profiler trace of a range of training steps (``train.profile_steps: [first, last]``),
recorded on every rank by the :class:`StepProfiler` hook and written as Chrome trace JSON to
``<run_dir>/profile/steps-<first>-<last>.rank<r>.json``: open it in https://ui.perfetto.dev or
chrome://tracing. Every rank writes its own, so a wait in a collective shows against the rank it
waited for.

Each step is a span ``step <n>`` from the end of step n-1 to the end of step n: the pipelined step
(this batch's compute, the next one's copy and input all-to-all), the step record and a checkpoint
when one falls there. The profiler records every op (about 1 us each, ~10% of a small CPU step), so
keep the range to a few steps. A run that ends inside the range (its epochs ran out first) stops the
trace at its evaluation, which then includes calibration and the eval pass.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional, Sequence, Tuple, Union

from torch.profiler import ProfilerActivity, profile, record_function

from pinads_rec.training.hooks import Hook
from pinads_rec.training.trainer import Trainer

log = logging.getLogger("pinads_rec.train")

PROFILE_DIR = "profile"


def trace_path(run_dir: Union[str, Path], first: int, last: int, rank: int) -> Path:
    """Where rank ``rank`` writes its trace of steps ``first``..``last``."""
    return Path(run_dir) / PROFILE_DIR / f"steps-{first}-{last}.rank{rank}.json"


class StepProfiler(Hook):
    """Profiles steps ``steps = [first, last]`` (default: the trainer's train.profile_steps; none
    when empty) on every rank; ``run_dir`` defaults to the trainer's train.run_dir. After the trace
    is written, ``path`` names its file."""

    def __init__(self, steps: Optional[Sequence[int]] = None, run_dir: Union[str, Path, None] = None):
        self.steps = steps
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.path: Optional[Path] = None
        self._profile: Optional[profile] = None
        self._span: Optional[record_function] = None

    def _window(self, trainer: Trainer) -> Optional[Tuple[int, int]]:
        steps = self.steps if self.steps is not None else trainer.cfg.train.profile_steps
        return (steps[0], steps[1]) if steps else None

    def on_start(self, trainer: Trainer) -> None:
        window = self._window(trainer)
        if window is None:
            return
        done = trainer.state.step
        if done >= window[1] and trainer.env.is_main:
            log.warning("train.profile_steps %s: the run resumed at step %d, past them; no trace", list(window), done)
        elif done >= window[0] and trainer.env.is_main:
            log.warning(
                "train.profile_steps %s: the run resumed at step %d; the trace starts after it", list(window), done
            )
        self._advance(trainer, window)

    def on_step_end(self, trainer: Trainer) -> None:
        window = self._window(trainer)
        if window is not None:
            self._advance(trainer, window)

    def _advance(self, trainer: Trainer, window: Tuple[int, int]) -> None:
        """Called with ``trainer.state.step`` steps done: ends that step's span, and starts the
        trace or the next step's span while the next step is in the window."""
        first, last = window
        done = trainer.state.step
        if self._span is not None:
            self._span.__exit__(None, None, None)
            self._span = None
            if done >= last:
                self._write(trainer, window)
                return
        elif self._profile is None and self.path is None and first - 1 <= done < last:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if trainer.env.device.type == "cuda" else [])
            self._profile = profile(activities=activities)
            self._profile.start()
        if self._profile is not None:
            # Entered here and left at the next call: the span covers the whole step between hook calls.
            self._span = record_function(f"step {done + 1}")
            self._span.__enter__()

    def on_evaluation(self, trainer: Trainer, summary: dict) -> None:
        window = self._window(trainer)
        if window is None:
            return
        if self._profile is not None:
            if trainer.env.is_main:
                log.warning(
                    "train.profile_steps %s: the run ended at step %d; the trace ends after its evaluation",
                    list(window),
                    summary["step"],
                )
            self._span.__exit__(None, None, None)
            self._span = None
            self._write(trainer, window)
        elif self.path is None and trainer.env.is_main and summary["step"] < window[0]:
            log.warning(
                "train.profile_steps %s: the run ended at step %d, before them; no trace", list(window), summary["step"]
            )

    def _write(self, trainer: Trainer, window: Tuple[int, int]) -> None:
        self._profile.stop()
        path = trace_path(self.run_dir if self.run_dir is not None else trainer.run_dir, *window, trainer.env.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._profile.export_chrome_trace(str(path))
        self._profile, self.path = None, path
        if trainer.env.is_main:
            log.info("profiler trace of steps %d-%d: %s (one per rank; open in ui.perfetto.dev)", *window, path)
