"""Train the unified ranker: the script torchrun / TorchX launch on every rank.

    torchx run dist.ddp -j 1x2 --script pinads_rec/train.py -- --config configs/demo.yaml --set a.b=1,c.d=2
    python -m pinads_rec.train --config configs/demo.yaml --set train.max_steps=100   # one process

Parses the command line, sets up logging, and runs ``pinads_rec.training.Trainer`` with the run log
(metrics.jsonl, config.json, run_metadata.json), the console report, the TensorBoard event files
(train.tensorboard) and the profiler trace (train.profile_steps) as hooks; a data, checkpoint or
numerics error ends the rank with a one-line message, and so does a collective that another rank
left waiting for train.collective_timeout_s (naming the rank and the step), and so does a
train.run_dir holding a run of another config. A config that cannot run -- a wrong key, an input
directory or plan file that is not there, a plan this device cannot run -- is refused before the
process group starts (``check_before_start``): one line, exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import List, Optional

import torch
import torch.distributed as dist

from pinads_rec import arguments, config, parallel
from pinads_rec.data.loader.contract import ContractError
from pinads_rec.models.train_task import NonFiniteError
from pinads_rec.modules.precision import PrecisionOverflow
from pinads_rec.reference.hook import ReferenceBaseline
from pinads_rec.training import checkpoint
from pinads_rec.training.checkpoint import IncompatibleCheckpoint, NoCheckpoint, RunDirConflict
from pinads_rec.training.collectives import CollectiveError
from pinads_rec.training.console import ConsoleReport
from pinads_rec.training.hooks import Hook
from pinads_rec.training.profiler import StepProfiler
from pinads_rec.training.run_log import RunLog
from pinads_rec.training.tensorboard_writer import TensorBoardWriter
from pinads_rec.training.trainer import Trainer

DEFAULT_CONFIG = "configs/demo.yaml"


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config_path", nargs="?", help=argparse.SUPPRESS)
    p.add_argument("--config", default=None, help=f"experiment YAML (default {DEFAULT_CONFIG})")
    config.add_overrides_flag(
        p, "override config fields: --set train.max_steps=100 (repeatable), or several in one: --set a.b=1,c.d=2"
    )
    args = p.parse_args(argv)
    # TorchX refuses a repeated --set on its command line, so under TorchX several come in one flag.
    args.overrides = [part for text in args.overrides for part in config.split_overrides(text)]
    args.config = (
        args.config
        or (args.config_path if args.config_path and args.config_path.endswith((".yaml", ".yml")) else None)
        or DEFAULT_CONFIG
    )
    return args


def default_hooks(train: config.TrainConfig) -> List[Hook]:
    """What a run reports: the reference beside it (unless reference.enabled is off), metrics.jsonl and
    its metadata, the console, TensorBoard (unless train.tensorboard is off) and a profiler trace
    (when train.profile_steps names steps)."""
    # The reference first: it adds to the summary the others print and write.
    hooks: List[Hook] = [ReferenceBaseline(), RunLog(), ConsoleReport()]
    if train.tensorboard:
        hooks.append(TensorBoardWriter())
    if train.profile_steps:
        hooks.append(StepProfiler())
    return hooks


def check_before_start(cfg: config.ExperimentConfig) -> None:
    """What a run reads and where it writes, before the process group, the data and the model: a
    missing directory, a warm start from no checkpoint, a plan file that is not a plan or that this
    device or world size cannot run, is an error naming the key (ConfigError; the plan's ValueError;
    NoCheckpoint), on every rank alike."""
    for key in Trainer.REQUIRED_KEYS:
        config.require(cfg, key)
    inputs = ("data.train_dir", "data.eval_dir", "data.calibration_dir", "train.plan_file")
    arguments.config_paths(cfg, inputs=inputs, outputs=("train.run_dir",))
    if cfg.train.init_from and checkpoint.latest(cfg.train.run_dir) is None:  # else the run resumes: not read
        checkpoint.resolve(cfg.train.init_from)
    parallel.check_managed_world_size(cfg.features, int(os.environ.get("WORLD_SIZE", 1)))
    parallel.constraints(cfg.features, cfg.train, "cuda" if torch.cuda.is_available() else "cpu")


def worker_message(error: Exception) -> str:
    """The error's message, whole. One a DataLoader worker raised arrives re-raised by torch with
    the worker's traceback in front ("Caught X in DataLoader worker process N. Original Traceback
    ... module.X: <message>"): the message is what follows its last "module.X: "."""
    text = str(error).strip()
    head = f"\n{type(error).__module__}.{type(error).__qualname__}: "
    at = text.rfind(head)
    return text[at + len(head) :].strip() if text.startswith("Caught ") and at >= 0 else text


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    # force: importing torchrec already configured the root logger. Libraries stay at WARNING (fbgemm
    # logs every table's arguments at INFO); the project's own messages at INFO.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s", force=True)
    logging.getLogger("pinads_rec").setLevel(logging.INFO)
    try:
        cfg = config.load(args.config, args.overrides)
        check_before_start(cfg)
    except (config.ConfigError, ValueError, NoCheckpoint) as e:  # ValueError: a plan the device cannot run
        print(f"config error: {e}", file=sys.stderr)
        return 2
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    env = parallel.init_distributed(cfg.train.collective_timeout_s)
    try:
        Trainer(cfg, env, hooks=default_hooks(cfg.train)).run()
    except CollectiveError as e:
        # It names the rank and the step; exit at once: torchrun then stops the ranks still waiting.
        print(str(e), file=sys.stderr, flush=True)
        os._exit(2)
    except (
        ContractError,
        IncompatibleCheckpoint,
        NoCheckpoint,
        NonFiniteError,
        PrecisionOverflow,
        RunDirConflict,
    ) as e:
        message = worker_message(e)
        kinds = {
            ContractError: "data error",
            IncompatibleCheckpoint: "checkpoint error",
            NoCheckpoint: "checkpoint error",
            RunDirConflict: "checkpoint error",
        }
        kind = next((k for cls, k in kinds.items() if isinstance(e, cls)), "numerics error")  # subclasses too
        print(f"[rank {env.rank}] {kind}: {message}", file=sys.stderr, flush=True)
        # Exit at once: the launcher then stops the other ranks instead of leaving them in a collective.
        os._exit(2)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
