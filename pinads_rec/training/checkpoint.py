"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP).

Layout: ``<run_dir>/checkpoints/step-<N>/`` holds the DCP shards of the model and optimizers, a
``train_state.json`` (step, epoch, position in the epoch, world size, LR schedule, config), the
sharding plan (``plan.json``, reused on resume so optimizer state keeps its layout even when the
world size changes), each rank's RNG state (``rng-<rank>.pt``) and, with managed-collision
tables, each rank's eviction rounds in progress (``managed-rounds-<rank>.pt``: the ids counted
since the last round, which TorchRec keeps outside the state dict). A checkpoint
is written to ``step-<N>.tmp`` and renamed once every rank has finished, so a crash while saving
leaves the previous checkpoint as the latest loadable one. Loading checks first that the
checkpoint's ``features`` and ``model`` config match the run's, and refuses with the differing keys
(weights of another model would load partly or fail deep inside DCP). A resume (the run's own
train.run_dir holds a checkpoint) also checks that the data and training config is the
checkpoint's but for what a resume may change (:data:`RESUMABLE_CHANGES`), and refuses a run
directory holding a run of another config (:func:`check_same_run`).

With evaluations during training (train.eval_every) every improvement on the best evaluation is
saved as a checkpoint of its step, and ``train_state.json`` carries the selection beside the
position (the validator's state, training/validator.py: the best value, its step, the evaluations
since, early stopping's count). Pruning to ``train.keep_checkpoints`` spares the best step's
checkpoint, so a resumed run keeps both its best weights and its patience counter;
:func:`load_model` reads the best weights back.

A warm start (train.init_from, :func:`warm_start`) reads another run's checkpoint into a new run:
its weights and, as train.init_optimizer says, its optimizer state -- never its step, LR schedule,
RNG or best evaluation, which start fresh. DCP re-places the shards for this world size, as for a
resume on another world size.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from pinads_rec import config, parallel
from pinads_rec.managed_collision import restore_rounds, round_states

STATE_FILE = "train_state.json"
PLAN_FILE = "plan.json"
ROUNDS_FILE = "managed-rounds"  # per rank: the managed tables' eviction rounds in progress


@dataclass
class TrainState:
    """The run's position, the first keys of train_state.json's "train" (the validator's state
    follows them: ``save``'s ``selection``)."""

    step: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0  # per-rank batches of `epoch` already trained: resume skips these
    world_size: int = 1  # of the run that wrote the checkpoint


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def latest(run_dir: Path) -> Optional[Path]:
    ckpts = [
        p
        for p in (Path(run_dir) / "checkpoints").glob("step-*")
        if not p.name.endswith(".tmp") and (p / STATE_FILE).exists()
    ]
    return max(ckpts, key=lambda p: int(p.name.split("-")[1]), default=None)


def save(
    run_dir: Path,
    state: TrainState,
    dmp,
    optimizer,
    schedule,
    cfg: config.ExperimentConfig,
    selection: Optional[dict] = None,
) -> Path:
    """A checkpoint of step ``state.step`` in ``run_dir``; ``selection``: the validator's state,
    saved after the position (its best step's checkpoint is spared by pruning). Returns its directory."""
    selection = selection or {}
    root = Path(run_dir) / "checkpoints"
    final, tmp = root / f"step-{state.step}", root / f"step-{state.step}.tmp"
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    dcp.save({"model": dmp.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=str(tmp))
    torch.save(
        {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
        tmp / f"rng-{_rank()}.pt",
    )
    rounds = round_states(dmp)
    if rounds:
        torch.save(rounds, tmp / f"{ROUNDS_FILE}-{_rank()}.pt")
    _barrier()
    if rank0:
        meta = {
            "train": {**asdict(state), **selection},
            "schedule": schedule.state_dict(),
            "config": config.to_dict(cfg),
        }
        (tmp / PLAN_FILE).write_text(json.dumps(parallel.plan_tables(dmp.plan), indent=1))
        (tmp / STATE_FILE).write_text(json.dumps(meta, indent=1, default=str))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        old = sorted(
            (p for p in root.glob("step-*") if not p.name.endswith(".tmp")), key=lambda p: int(p.name.split("-")[1])
        )
        for p in old[: -cfg.train.keep_checkpoints]:
            if p.name != f"step-{selection.get('best_step')}":  # the best weights stay, however old
                shutil.rmtree(p, ignore_errors=True)
    _barrier()
    return final


class IncompatibleCheckpoint(ValueError):
    """The checkpoint was written by a model with another architecture or feature set."""


def config_differences(saved: dict, current: dict, prefix: str = "") -> list:
    """Dotted keys whose values differ between two config dicts (recursing into dicts and lists)."""
    if isinstance(saved, dict) and isinstance(current, dict):
        out = []
        for key in sorted(set(saved) | set(current)):
            out += config_differences(saved.get(key), current.get(key), f"{prefix}.{key}" if prefix else key)
        return out
    if isinstance(saved, list) and isinstance(current, list) and len(saved) == len(current):
        return [d for i, (a, b) in enumerate(zip(saved, current)) for d in config_differences(a, b, f"{prefix}[{i}]")]
    return [] if saved == current else [prefix]


def _saved_config(path: Path) -> dict:
    """Checkpoint ``path``'s config as a dict."""
    return config.saved_as_today(json.loads((Path(path) / STATE_FILE).read_text())["config"])


def check_compatible(path: Path, cfg: config.ExperimentConfig) -> None:
    """The parts of the config that shape the weights must match: features and model (except
    model.calibration: the calibration maps are refit at the end of every run, so a trained model
    may be recalibrated another way; and model.precision.inference: it only says how the trained
    weights are served -- checkpoints of the days its default was bf16 resume under auto)."""
    saved = _saved_config(path)
    current = config.to_dict(cfg)
    diffs = [
        d
        for section in ("features", "model")
        for d in config_differences(saved.get(section), current[section], section)
        if d not in ("model.calibration", "model.precision.inference")
    ]
    if diffs:
        shown = ", ".join(diffs[:8]) + (f" and {len(diffs) - 8} more" if len(diffs) > 8 else "")
        raise IncompatibleCheckpoint(
            f"checkpoint {path} was written by a different model ({shown} differ); use another "
            f"train.run_dir or restore the config it was trained with"
        )


class RunDirConflict(ValueError):
    """train.run_dir holds a checkpoint of a run of another config: resuming would go on with that run."""


# The data and train keys a resume may change (and their sub-keys); check_compatible covers
# features and model, the other sections are not training's.
RESUMABLE_CHANGES = (
    # how far the run goes: a relaunch may train on
    "train.max_steps",
    "train.epochs",
    # what it goes on with and is evaluated on: continued training on a newer day's data
    # (experiments/stability.py resumes on the newest day)
    "data.train_dir",
    "data.eval_dir",
    "data.calibration_dir",
    # which of their rows are read (experiments/ablate.py evaluates a finished run on a slice)
    "data.row_filter",
    # evaluation during training: the trainer resets a best value picked another way
    "train.eval_every",
    "train.eval_on",
    "train.early_stop",
    # the fault policies: the fix a data or numerics error names is a relaunch with another one
    "train.nonfinite",
    "data.nonfinite_dense",
    "data.overlong_sequence",
    # how it runs and reports, not what it computes
    "data.num_workers",
    "data.prefetch_factor",
    "train.dense_optimizer_kernel",
    "train.collective_timeout_s",
    "train.log_every",
    "train.tensorboard",
    "train.profile_steps",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    # where: a checkpoint copied into another directory; and the plan, which a resume takes from
    # the checkpoint unless train.plan_file names one
    "train.run_dir",
    "train.plan_file",
)


def check_same_run(path: Path, cfg: config.ExperimentConfig) -> None:
    """A resume from checkpoint ``path`` (the latest in cfg.train.run_dir) goes on with the same
    run: its data and train config must be the checkpoint's, but for RESUMABLE_CHANGES. Otherwise
    RunDirConflict, naming the differing keys and the fix (another train.run_dir, or delete this one)."""
    saved, current = _saved_config(path), config.to_dict(cfg)
    diffs = [
        d
        for section in ("data", "train")
        for d in config_differences(saved.get(section), current[section], section)
        if not any(d == key or d.startswith((key + ".", key + "[")) for key in RESUMABLE_CHANGES)
    ]
    if diffs:
        run_dir = cfg.train.run_dir
        shown = ", ".join(diffs[:8]) + (f" and {len(diffs) - 8} more" if len(diffs) > 8 else "")
        raise RunDirConflict(
            f"train.run_dir {run_dir} holds a run of another config (its checkpoint {Path(path).name} differs "
            f"in {shown}): give this run a new train.run_dir, or delete {run_dir} to start over "
            f"(a resume may change only how far it trains, the data directories, evaluation, fault "
            f"policies and reporting)"
        )


def saved_world_size(path: Path) -> int:
    """The world size of the run that wrote checkpoint ``path``."""
    return json.loads((Path(path) / STATE_FILE).read_text())["train"].get("world_size", 1)


def needs_relayout(path: Path, features: config.FeaturesConfig, world_size: int) -> bool:
    """Whether checkpoint ``path``'s managed-collision tables must be re-laid out for this world
    size (``managed_reshard``): on any other world size than the checkpoint's. (TorchRec reloads
    them itself only on a world size dividing the checkpoint's, and the merged ranks would then
    keep an unknown row each, one of which a new id could take.)"""
    managed = any(t.managed_collision is not None for t in features.tables)
    return managed and saved_world_size(path) != world_size


def _managed_segments(model_state: dict) -> dict:
    """The managed modules' shard boundaries of this run, which a re-layout keeps (TorchRec checks
    a loaded module's shard against them)."""
    return {k: v.clone() for k, v in model_state.items() if k.endswith("._output_segments_tensor")}


def _relayout(path: Path, dmp, optimizer) -> None:
    from pinads_rec.training.managed_reshard import relayout

    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    relayout(path, dmp, optimizer, saved_world_size(path), world, rank)


def load(path: Path, dmp, optimizer, schedule, relayout: bool = False) -> TrainState:
    # Optimizer state is created lazily at the first step; DCP loads in place, so materialize it
    # first (a zero-gradient step) or the moments would silently stay empty. Runs before the model
    # weights are loaded, so whatever that step touches is overwritten.
    optimizer.init_state()
    optimizer.zero_grad(set_to_none=True)
    state = {"model": dmp.state_dict(), "optimizer": optimizer.state_dict()}
    _load_into(path, dmp, optimizer, state, relayout)
    _restore_rounds(path, dmp)
    meta = json.loads((Path(path) / STATE_FILE).read_text())
    rng = Path(path) / f"rng-{_rank()}.pt"
    if rng.exists():  # a rank that did not exist in the saved run keeps its fresh seed
        saved = torch.load(rng, weights_only=False)
        torch.set_rng_state(saved["torch"])
        np.random.set_state(saved["numpy"])
        random.setstate(saved["python"])
    schedule.load_state_dict(meta["schedule"])
    # The scheduler restores its counter, not the optimizer's current LR: put that back too.
    for group, lr in zip(schedule.optimizer.param_groups, schedule.get_last_lr()):
        group["lr"] = lr
    position = {f.name for f in fields(TrainState)}
    return TrainState(**{k: v for k, v in meta["train"].items() if k in position})


def saved_train_state(path: Path) -> dict:
    """Checkpoint ``path``'s train_state.json "train": the position and the validator's state."""
    return json.loads((Path(path) / STATE_FILE).read_text())["train"]


def _restore_rounds(path: Path, dmp) -> None:
    """The managed tables' eviction rounds in progress (``managed_collision.restore_rounds``): this
    rank's on the checkpoint's world size, every saved rank's on another. A checkpoint without
    them (written before they were saved) starts each table's next round at the resume step."""
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    saved = saved_world_size(path)
    ranks = [rank] if saved == world else range(saved)
    files = [Path(path) / f"{ROUNDS_FILE}-{r}.pt" for r in ranks]
    if all(f.exists() for f in files):
        restore_rounds(dmp, [torch.load(f, weights_only=True) for f in files], saved, world, rank)


def _load_into(path: Path, dmp, optimizer, state: dict, relayout: bool) -> None:
    """DCP-loads ``state`` (the model's and, unless None, the optimizer's state dicts) from ``path``
    into ``dmp`` and ``optimizer``; ``relayout``: the managed tables re-laid out for this world size
    (``needs_relayout``), their shard boundaries kept."""
    segments = _managed_segments(state["model"]) if relayout else {}
    dcp.load(state, checkpoint_id=str(path))
    state["model"].update(segments)
    dmp.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    if relayout:
        _relayout(path, dmp, optimizer)


def load_model(path: Path, dmp, relayout: bool = False) -> None:
    """Reads only the model weights (and buffers) of checkpoint ``path`` into ``dmp``, in place: the
    optimizers, LR schedule, RNG and position stay the run's (the best evaluation's weights
    reloaded at the end of a run)."""
    if not (Path(path) / STATE_FILE).exists():
        raise FileNotFoundError(f"{path}: no complete checkpoint there (the best evaluation's weights)")
    _load_into(path, dmp, None, {"model": dmp.state_dict()}, relayout)


class NoCheckpoint(FileNotFoundError):
    """train.init_from names no complete checkpoint."""


def resolve(path: str | Path) -> Path:
    """train.init_from -> the checkpoint directory: a checkpoint itself, or a run directory's newest
    (its final model). NoCheckpoint, naming the path, when there is neither."""
    p = Path(path)
    if (p / STATE_FILE).exists():
        return p
    found = latest(p)
    if found is None:
        raise NoCheckpoint(
            f"train.init_from {path}: no complete checkpoint there (a run directory with checkpoints/step-N, "
            f"or one step-N directory holding {STATE_FILE})"
        )
    return found


def warm_start(path: Path, dmp, optimizer, carry: str, relayout: bool = False) -> None:
    """Reads checkpoint ``path``'s weights into ``dmp`` and, as ``carry`` (train.init_optimizer)
    says, its optimizer state: "all", "embedding" (the dense AdamW's moments and step count back to
    zero, as a new optimizer's) or "none". The optimizers keep this run's hyperparameters
    (learning rates, weight decay): the checkpoint's are its old schedule's."""
    if carry == "none":
        load_model(path, dmp, relayout)
        return
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    optimizer.init_state()  # DCP loads in place: the state must exist (see load)
    optimizer.zero_grad(set_to_none=True)
    state = {"model": dmp.state_dict(), "optimizer": optimizer.state_dict()}
    _load_into(path, dmp, optimizer, state, relayout)
    for group, fresh in zip(optimizer.param_groups, hyper):
        group.update(fresh)
    if carry == "embedding":  # the dense AdamW as freshly made: zero moments, step 0
        for name, part in optimizer.optimizers:
            if name == "dense":
                for param_state in part.state.values():
                    for value in param_state.values():
                        if isinstance(value, torch.Tensor):
                            value.zero_()
