"""What the trainer evaluates, on data it does not train on: one no-grad scoring pass that keeps
every rank in every sharded forward (``scoring_pass``), the held-out rows (``heldout_loader``), the
metrics per surface x task (``evaluation_rows``), the choice of the best evaluation
(``selection_*``, ``improves``: train.early_stop), and the calibration fit on the held-out rows
with the backbone frozen (``fit_calibration``)."""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from pinads_rec import config, parallel
from pinads_rec.data.batch import Batch, user_id_column
from pinads_rec.data.contract import ContractError
from pinads_rec.data.dataset import LoaderSettings, ParquetBatches, make_loader
from pinads_rec.metrics import ALL_SURFACES, MetricAccumulator, gather_rows
from pinads_rec.modules.calibration import Calibration

log = logging.getLogger("pinads_rec.train")


def spare_batch(settings: LoaderSettings, env: parallel.Distributed) -> Optional[Batch]:
    """This rank's first batch of training rows (in file order), for a scoring pass on a split with
    fewer row groups than ranks: the ranks without any replay it masked; None if it has none."""
    train_part = ParquetBatches(
        settings.data.train_dir, settings, env.rank, env.world_size, shuffle=False, drop_last=False, part="train"
    )
    return next(iter(train_part), None)


def scoring_pass(
    model, env: parallel.Distributed, group, loader, what: str, spare: Optional[Callable[[], Optional[Batch]]] = None
) -> Iterator[Tuple[Batch, torch.Tensor]]:
    """Yields (batch, logits [B, T] on CPU) over one no-grad pass of ``loader``. Ranks that run out
    early replay their last batch (or ``spare()``'s, when they had none) with every row marked
    invalid, so every rank takes part in every sharded forward; use ``batch.valid``."""
    batches, last = iter(loader), None
    model.eval()
    try:
        with torch.no_grad():
            while True:
                batch = next(batches, None)
                flag = torch.tensor([0 if batch is None else 1])
                if group is not None:
                    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
                if not flag.item():
                    break
                if batch is None:
                    if last is None and spare is not None:
                        last = spare()
                    if last is None:
                        raise ContractError(
                            f"rank {env.rank} got no {what} rows: fewer row groups than the {env.world_size} ranks"
                        )
                    batch = dataclasses.replace(last, valid=torch.zeros_like(last.valid))
                last = batch
                _, (_, logits, _) = model(batch.to(env.device))
                yield batch, logits.float().cpu()
    finally:
        model.train()


def heldout_loader(settings: LoaderSettings, env: parallel.Distributed) -> Tuple[DataLoader, str]:
    """This rank's loader over the rows held out of training -- data.calibration_dir, or the
    training files' last row groups (data.calibration_holdout) -- and where they are, for messages.
    The calibration is fit on them, and train.eval_on: holdout evaluates on them."""
    data = settings.data
    if data.calibration_dir:
        loader = make_loader(data.calibration_dir, settings, env.rank, env.world_size, shuffle=False)
        return loader, data.calibration_dir
    loader = make_loader(data.train_dir, settings, env.rank, env.world_size, shuffle=False, part="holdout")
    return loader, f"{data.train_dir} (data.calibration_holdout)"


def evaluation_rows(
    model, settings: LoaderSettings, env: parallel.Distributed, group, split: str = "eval"
) -> List[dict]:
    """AUC / NE / calibration per surface x task of ``model`` (a TrainTask, sharded or not) over the
    eval files (``split`` "eval") or the held-out rows (``split`` "holdout": :func:`heldout_loader`),
    gathered over the ranks."""
    features = settings.layout.features
    tasks = [t.name for t in features.tasks]
    has_oracle = all(t.true_probability_column for t in features.tasks)
    has_users = user_id_column(features) is not None  # GAUC beside AUC
    acc = MetricAccumulator(tasks, features.surfaces, has_oracle, has_users)
    if split == "holdout":
        loader, where = heldout_loader(settings, env)
        what = f"holdout ({where})"
    else:
        eval_dir = settings.data.eval_dir
        loader = make_loader(eval_dir, settings, env.rank, env.world_size, shuffle=False)
        what = f"eval ({eval_dir})"
    spare = functools.partial(spare_batch, settings, env)  # a rank with no row group of the split replays it masked
    for batch, logits in scoring_pass(model, env, group, loader, what, spare):
        acc.update(
            torch.sigmoid(logits), batch.labels, batch.surface, batch.true_probs, valid=batch.valid, users=batch.user_id
        )
    return acc.compute()


def selection_name(train: config.TrainConfig) -> str:
    """What picks the best evaluation, in words: ``auc (mean over surfaces, mean over tasks; max) on
    holdout``. A checkpoint stores it; a resume under another forgets the best so far."""
    stop = train.selection
    surface = {"mean": "mean over surfaces", "all": "all surfaces pooled"}.get(stop.surface, f"surface {stop.surface}")
    task = "mean over tasks" if stop.task is None else f"task {stop.task}"
    return f"{stop.metric} ({surface}, {task}; {stop.better}) on {train.eval_on}"


def selection_value(rows: Sequence[dict], stop: config.EarlyStopConfig) -> float:
    """train.early_stop.metric of evaluation ``rows`` averaged over the cells chosen by its task and
    surface; a NaN cell (the AUC of a surface without positives) is left out, and the value is NaN
    when every cell is."""
    values = [
        float(r[stop.metric])
        for r in rows
        if (stop.task is None or r["task"] == stop.task)
        and (r["surface"] != ALL_SURFACES if stop.surface == "mean" else r["surface"] == stop.surface)
        and r[stop.metric] is not None
        and r[stop.metric] == r[stop.metric]
    ]
    return sum(values) / len(values) if values else float("nan")


def improves(value: float, best: Optional[float], stop: config.EarlyStopConfig) -> bool:
    """``value`` beats ``best`` by more than train.early_stop.min_delta in its direction (any finite
    value beats no best; NaN beats nothing)."""
    if value != value:
        return False
    if best is None:
        return True
    return value > best + stop.min_delta if stop.better == "max" else value < best - stop.min_delta


def fit_calibration(model, settings: LoaderSettings, env: parallel.Distributed, group) -> None:
    """Fits the calibration layers of ``model`` on the backbone's logits over the calibration split
    (data.calibration_dir) or the held-out training rows (data.calibration_holdout), gathered from
    every rank so all ranks fit the same maps."""
    layer = next(m for m in model.modules() if isinstance(m, Calibration))
    if layer.mode == "none":
        return
    layer.reset()  # identity: the pass below sees the raw logits
    loader, where = heldout_loader(settings, env)
    # The split may have fewer row groups than there are ranks: those without one replay a
    # (masked) training batch in the collective forwards.
    T = len(settings.layout.features.tasks)
    parts = [torch.zeros(0, 2 * T + 1)]  # a rank may see no valid row
    parts += [
        torch.cat([logits, batch.labels, batch.surface.unsqueeze(1).float()], dim=1)[batch.valid]
        for batch, logits in scoring_pass(
            model, env, group, loader, "calibration", functools.partial(spare_batch, settings, env)
        )
    ]
    rows = torch.cat(parts)
    if group is not None:
        rows = gather_rows(rows, group)
    if rows.shape[0] == 0:
        raise ContractError(f"calibration: 0 rows to fit on in {where} (after data.row_filter)")
    # A refused fit (modules/calibration.py's rules) is logged there, once: by rank 0.
    features = settings.layout.features
    tasks = [t.name for t in features.tasks]
    layer.fit(rows[:, :T], rows[:, T : 2 * T], rows[:, 2 * T].long(), features.surfaces, tasks, env.is_main)
    if env.is_main:
        log.info(
            "calibration (%s) fit on %d unseen rows: scale %s, bias %s",
            layer.mode,
            rows.shape[0],
            [[round(v, 3) for v in r] for r in layer.scale.tolist()],
            [[round(v, 3) for v in r] for r in layer.bias.tolist()],
        )
