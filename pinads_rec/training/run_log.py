"""A run's record on disk, written by the :class:`RunLog` hook on rank 0 and read by
:func:`read_run_log`.

``<run_dir>/config.json``: the config as trained (``config.to_dict``, indented JSON), written when
training starts. ``<run_dir>/run_metadata.json``: what ran where (:func:`run_metadata`: git commit,
package versions, config, world size, device, host, command line, start time), written when
training starts (a resumed run rewrites both with its own). ``<run_dir>/metrics.jsonl``: one JSON
object a line, a step record every ``train.log_every`` steps (the keys of :meth:`Hook.on_step`'s
record), an epoch record at the end of each epoch (the keys of :meth:`Hook.on_epoch_end`'s record:
``rows_trained`` of the split's ``train_split_rows``, per rank too), a validation record at each
evaluation during training (train.eval_every: the keys of :meth:`Hook.on_validation`'s record, its
``rows`` the evaluation rows), then the run's summary (with its ``eval`` rows, and ``selection``
with train.eval_every) at the end; a resumed run appends to the same file, so a file may hold
several summaries (and an epoch that train.max_steps cut short, then resumed, two epoch records).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import platform
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

import torch

from pinads_rec import config
from pinads_rec.training.hooks import Hook
from pinads_rec.training.trainer import Trainer

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
METADATA_FILE = "run_metadata.json"

# The packages whose versions decide a run's numbers and plans, by import name.
RECORDED_PACKAGES = ("torch", "torchrec", "fbgemm_gpu", "torchx", "pyarrow")
SOURCE_DIR = Path(__file__).resolve().parents[1]  # the pinads_rec package that is running


def git_state(where: Path = SOURCE_DIR) -> Tuple[str, Optional[bool]]:
    """(commit, dirty) of the git checkout holding ``where``: the full HEAD hash and whether tracked
    files differ from it; ("unknown", None) outside a checkout or without git (an installed wheel,
    a container image)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, check=True)
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=where,
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown", None
    return head.stdout.strip(), bool(status.stdout.strip())


def package_versions(names=RECORDED_PACKAGES) -> Dict[str, str]:
    """Installed version of each import name ("not installed" when absent), looked up through the
    distribution that provides it (fbgemm_gpu comes as fbgemm-gpu or fbgemm-gpu-cpu)."""
    providers = importlib.metadata.packages_distributions()
    return {
        name: importlib.metadata.version(providers[name][0]) if name in providers else "not installed" for name in names
    }


def device_name(device: torch.device) -> str:
    """The GPU's name; on CPU the processor's model (from /proc/cpuinfo, Linux), else the machine type."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def run_metadata(trainer: Trainer) -> dict:
    """What ran where, for reproducing and comparing runs: git commit (and uncommitted changes),
    package versions, Python, the config as trained, world size, device, host, command line and
    start time."""
    commit, dirty = git_state()
    device = trainer.env.device
    return {
        "git_commit": commit,
        "git_dirty": dirty,
        "packages": package_versions(),
        "python": platform.python_version(),
        "world_size": trainer.env.world_size,
        "device": str(device),
        "device_name": device_name(device),
        "hostname": socket.gethostname(),
        "command": sys.argv,
        "start_time": datetime.datetime.fromtimestamp(trainer.started_at, datetime.timezone.utc).isoformat(),
        "resumed_from": str(trainer.resumed_from) if trainer.resumed_from is not None else None,
        "config": config.to_dict(trainer.cfg),
    }


class RunLog(Hook):
    """Writes config.json, run_metadata.json and metrics.jsonl into ``run_dir`` (default: the trainer's train.run_dir),
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
            (run_dir / METADATA_FILE).write_text(json.dumps(run_metadata(trainer), indent=1))

    def on_step(self, trainer: Trainer, record: dict) -> None:
        if trainer.env.is_main:
            self._append(trainer, json.dumps(record))

    def on_epoch_end(self, trainer: Trainer, record: dict) -> None:
        if trainer.env.is_main:
            self._append(trainer, json.dumps(record))

    def on_validation(self, trainer: Trainer, record: dict) -> None:
        if trainer.env.is_main:
            self._append(trainer, json.dumps(record, default=float))

    def on_evaluation(self, trainer: Trainer, summary: dict) -> None:
        if trainer.env.is_main:
            self._append(trainer, json.dumps(summary, default=float))


@dataclass
class RunRecords:
    """metrics.jsonl parsed: ``steps`` the step records in file order, ``summary`` the last summary
    (None before a run has finished), ``summaries`` every summary in file order (one per finished
    run that wrote into the directory), ``validations`` the evaluations during training in file
    order (train.eval_every), ``epochs`` the epoch records in file order (the rows each trained)."""

    steps: List[dict]
    summary: Optional[dict]
    summaries: List[dict] = field(default_factory=list)
    validations: List[dict] = field(default_factory=list)
    epochs: List[dict] = field(default_factory=list)


def read_run_log(run_dir: Union[str, Path]) -> RunRecords:
    """The records of ``<run_dir>/metrics.jsonl`` (FileNotFoundError when the run wrote none)."""
    records = [json.loads(line) for line in (Path(run_dir) / METRICS_FILE).read_text().splitlines() if line.strip()]
    summaries = [r for r in records if "eval" in r]
    validations = [r for r in records if "validation_on" in r]
    epochs = [r for r in records if "rows_trained" in r]
    steps = [r for r in records if not ({"eval", "validation_on", "rows_trained"} & r.keys())]
    return RunRecords(
        steps=steps,
        summary=summaries[-1] if summaries else None,
        summaries=summaries,
        validations=validations,
        epochs=epochs,
    )
