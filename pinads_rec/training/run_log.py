"""A run's record on disk, written by the :class:`RunLog` hook on rank 0 and read by
:func:`read_run_log`.

``<run_dir>/config.json``: the config as trained (``config.to_dict``, indented JSON), written when
training starts. ``<run_dir>/metrics.jsonl``: one JSON object a line, a step record every
``train.log_every`` steps (the keys of :meth:`Hook.on_step`'s record), then the run's summary (with
its ``eval`` rows) at the end; a resumed run appends to the same file, so a file may hold several
summaries.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Union

from pinads_rec import config
from pinads_rec.training.trainer import Hook, Trainer

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"


class RunLog(Hook):
    """Writes config.json and metrics.jsonl into ``run_dir`` (default: the trainer's train.run_dir),
    on rank 0 only."""

    def __init__(self, run_dir: Union[str, Path, None] = None):
        self.run_dir = Path(run_dir) if run_dir is not None else None

    def _dir(self, trainer: Trainer) -> Path:
        return self.run_dir if self.run_dir is not None else trainer.run_dir

    def _append(self, trainer: Trainer, line: str) -> None:
        with (self._dir(trainer) / METRICS_FILE).open("a") as f:
            f.write(line + "\n")

    def on_start(self, trainer: Trainer) -> None:
        if trainer.env.is_main:
            run_dir = self._dir(trainer)
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / CONFIG_FILE).write_text(json.dumps(config.to_dict(trainer.cfg), indent=1))

    def on_step(self, trainer: Trainer, record: dict) -> None:
        if trainer.env.is_main:
            self._append(trainer, json.dumps(record))

    def on_evaluation(self, trainer: Trainer, summary: dict) -> None:
        if trainer.env.is_main:
            self._append(trainer, json.dumps(summary, default=float))


@dataclass
class RunRecords:
    """metrics.jsonl parsed: ``steps`` the step records in file order, ``summary`` the last summary
    (None before a run has finished), ``summaries`` every summary in file order (one per finished
    run that wrote into the directory)."""

    steps: List[dict]
    summary: Optional[dict]
    summaries: List[dict] = field(default_factory=list)


def read_run_log(run_dir: Union[str, Path]) -> RunRecords:
    """The records of ``<run_dir>/metrics.jsonl`` (FileNotFoundError when the run wrote none)."""
    records = [json.loads(line) for line in (Path(run_dir) / METRICS_FILE).read_text().splitlines() if line.strip()]
    summaries = [r for r in records if "eval" in r]
    steps = [r for r in records if "eval" not in r]
    return RunRecords(steps=steps, summary=summaries[-1] if summaries else None, summaries=summaries)
