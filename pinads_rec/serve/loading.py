"""Loading a trained run for inference: checkpoint -> unsharded CPU model, ready to score.

The trainer's DCP checkpoint (``<run>/checkpoints/step-N/``) holds the state dict of
``DistributedModelParallel(TrainTask(model))``: keys ``model.<param>`` with the embedding tables as
sharded tensors. DCP reshards on load, so reading those keys into a *plain* state dict of the
unsharded model (``model.`` + its own keys) gives full-shape tensors on one process, whatever plan
or world size wrote them. The model is built from the checkpoint's own config, put in eval mode,
and its large layers (Transformer, DCNv2, MMoE experts) are cast to the inference precision
(``model.precision.inference``; sequence-modeling article, "Serving Efficiency"): by default
``auto``, BF16 on a CPU with AMX or avx512_bf16 and FP32 on one without (modules/precision.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

import torch
from torch import nn

from pinads_rec import config
from pinads_rec.library_notices import without_warning
from pinads_rec.managed_collision import route_misses
from pinads_rec.models import build_model
from pinads_rec.modules.precision import PRECISIONS, resolve, set_precision
from pinads_rec.serve.quantize import quantize_tables, table_dtypes
from pinads_rec.training import checkpoint as ckpt_lib
from pinads_rec.training.run_log import CONFIG_FILE

log = logging.getLogger("pinads_rec.serve")

# The trainer checkpoints DMP(TrainTask(model)): the model's keys sit under "model." in the state
# dict saved as the DCP entry "model".
CHECKPOINT_PREFIX = "model."


class ServeError(ValueError):
    """A run, checkpoint or export that cannot be served; the message says what and where."""


def find_checkpoint(run_dir: Union[str, Path], step: Optional[int] = None) -> Path:
    """``<run_dir>/checkpoints/step-<step>`` (the latest complete one when step is None)."""
    run_dir = Path(run_dir)
    if step is not None:
        path = run_dir / "checkpoints" / f"step-{step}"
        if not (path / ckpt_lib.STATE_FILE).exists():
            raise ServeError(f"{path}: no complete checkpoint there")
        return path
    path = ckpt_lib.latest(run_dir)
    if path is None:
        raise ServeError(
            f"{run_dir}: no checkpoint under {run_dir / 'checkpoints'} (train first, or point --run at a train.run_dir)"
        )
    return path


def run_config(run_dir: Union[str, Path], checkpoint: Optional[Path] = None) -> config.ExperimentConfig:
    """The config the weights were trained with: the checkpoint's own copy, else ``<run>/config.json``."""
    raw = None
    if checkpoint is not None and (checkpoint / ckpt_lib.STATE_FILE).exists():
        raw = json.loads((checkpoint / ckpt_lib.STATE_FILE).read_text()).get("config")
    if raw is None:
        path = Path(run_dir) / CONFIG_FILE
        if not path.exists():
            raise ServeError(f"{run_dir}: no {CONFIG_FILE} and no config in the checkpoint")
        raw = json.loads(path.read_text())
    try:
        return config.from_dict(raw)
    except config.ConfigError as e:
        raise ServeError(f"{run_dir}: the run's config no longer loads ({e})") from None


def load_weights(model: nn.Module, path: Path) -> None:
    """Reads a trainer checkpoint's model weights into the unsharded ``model`` (in place)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    reader = FileSystemReader(str(path))
    # DCP's metadata names a tensor by its path: the entry ("model.") then its key in that entry.
    saved = {k[len("model.") :] for k in reader.read_metadata().state_dict_metadata if k.startswith("model.")}
    own = model.state_dict()
    missing = sorted(k for k in own if CHECKPOINT_PREFIX + k not in saved)
    if missing:
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise ServeError(
            f"checkpoint {path} lacks weights of this model ({shown}); was it written by another model or code version?"
        )
    state = {CHECKPOINT_PREFIX + k: v for k, v in own.items()}
    # no_dist: read every shard in this one process, even inside an initialized process group.
    with without_warning(
        "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to load", UserWarning
    ):
        dcp.load({"model": state}, storage_reader=reader, no_dist=True)
    model.load_state_dict({k: state[CHECKPOINT_PREFIX + k] for k in own})


def prepare(model: nn.Module, precision: str, fp16_overflow: str = "error") -> nn.Module:
    """Eval mode, large layers cast to ``precision`` (fp32 | bf16 | fp16, or auto: the one that fits
    the model's device), no gradients."""
    if precision not in PRECISIONS:
        raise ServeError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    precision = resolve(precision, next(model.parameters()).device, "inference precision")
    set_precision(model, precision, cast_weights=True, fp16_overflow=fp16_overflow)
    return model


def with_serve_settings(cfg: config.ExperimentConfig, settings: Optional[Dict[str, Any]]) -> config.ExperimentConfig:
    """``cfg`` with a launch's ``serve.*`` settings (``serve_settings``) over the run's;
    ``table_dtypes`` adds to the run's exceptions. Checked as a loaded config is."""
    if not settings:
        return cfg
    raw = config.to_dict(cfg)
    table_dtypes = {**raw["serve"]["table_dtypes"], **settings.get("table_dtypes", {})}
    raw["serve"].update(settings, table_dtypes=table_dtypes)
    return config.from_dict(raw)


def load_model(
    run_dir: Union[str, Path],
    precision: Optional[str] = None,
    step: Optional[int] = None,
    fp16_overflow: Optional[str] = None,
    device: str = "cpu",
    serve: Optional[Dict[str, Any]] = None,
) -> Tuple[nn.Module, config.ExperimentConfig]:
    """(unsharded model with the trained weights on ``device``, ready to score; the run's config as
    served: its ``model.precision.inference`` is the precision the model runs in, ``auto`` resolved
    for that device). ``serve``: serve.* settings over the run's (``with_serve_settings``); the
    tables are served at their ``table_dtypes`` (serve/quantize.py)."""
    path = find_checkpoint(run_dir, step)
    cfg = with_serve_settings(run_config(run_dir, path), serve)
    model = build_model(cfg.features, cfg.model)
    load_weights(model, path)
    route_misses(model, ckpt_lib.saved_world_size(path))  # managed tables' unknown rows, as trained
    if device != "cpu":
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ServeError(f"device {device!r}: torch sees no CUDA device here")
        model.to(device)  # before the precision is resolved: auto asks the device that runs it
    prec = cfg.model.precision
    chosen = resolve(precision or prec.inference, next(model.parameters()).device, "inference precision")
    prepare(model, chosen, fp16_overflow or prec.fp16_overflow)
    dtypes = table_dtypes(cfg)
    quantize_tables(model, dtypes)
    shown = ", ".join(f"{d} {t}" for t, d in dtypes.items() if d != "fp32") or "fp32"
    log.info("loaded %s (%s, %s; tables %s)", path, cfg.model.kind, chosen, shown)
    served = dataclasses.replace(prec, inference=chosen)
    return model, dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, precision=served))
