"""What the trainer evaluates, on data it does not train on: one no-grad scoring pass that keeps
every rank in every sharded forward (``scoring_pass``), the held-out rows (``heldout_loader``), the
metrics per surface x task (``evaluation_rows``) and, where a vocabulary maps the user or item ids,
the same of the known and the new ones apart (``evaluation_with_slices``, ``format_slices``), and
the calibration fit on the held-out rows with the backbone frozen (``fit_calibration``). Which
evaluation is the best is the validator's (validator.py)."""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from pinads_rec import config, parallel, text_table
from pinads_rec.data.loader.batch import Batch, user_id_column
from pinads_rec.data.loader.contract import ContractError
from pinads_rec.data.loader.dataset import LoaderSettings, ParquetBatches, make_loader
from pinads_rec.features import FeatureLayout
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
    return evaluation_with_slices(model, settings, env, group, split)[0]


# The key naming a slice in its metrics rows (the trainer's summary["slices"]).
SLICE = "slice"


def unknown_id_features(layout: FeatureLayout, vocabulary_tables: Sequence[str]) -> Dict[str, str]:
    """The sparse feature, by "users" and "items", reading features.columns.user_id / item_id (one
    id a row: the contract's id columns) where a vocabulary maps its table (``build.vocabularies``):
    its id 0 is then an id the vocabulary never kept, a user or an item new since its fitting split.
    Without a vocabulary 0 may be a real id, so no slice is made."""
    f = layout.features
    out = {}
    for who, column in (("users", f.columns.user_id), ("items", f.columns.item_id)):
        for s in f.sparse:
            if s.column == column and s.table in vocabulary_tables:
                out[who] = s.name
                break
    return out


def _row_ids(batch: Batch, layout: FeatureLayout, key: str) -> torch.Tensor:
    """[B] the id of single-id feature ``key`` on each row, wherever the batch carries it."""
    if key in layout.user_keys:  # once per request slot
        return batch.user_sparse[key].values()[batch.request_index]
    if key in layout.shared_keys:  # the request's candidates, in row order
        return batch.sequences[config.CANDIDATE_PREFIX + key].values()
    return batch.sparse[key].values()


def evaluation_with_slices(
    model,
    settings: LoaderSettings,
    env: parallel.Distributed,
    group,
    split: str = "eval",
    vocabulary_tables: Sequence[str] = (),
) -> Tuple[List[dict], List[dict]]:
    """:func:`evaluation_rows`' rows, and from the same pass the rows of the known and of the new
    users, then items (``unknown_id_features``: id 0 of a table ``vocabulary_tables`` names), each
    with its ``SLICE`` ("known users", "new users", "known items", "new items"); a pair only where
    the split holds new ids. A new user's rows share one id, so its slice has no GAUC."""
    features = settings.layout.features
    tasks = [t.name for t in features.tasks]
    has_oracle = all(t.true_probability_column for t in features.tasks)
    has_users = user_id_column(features) is not None  # GAUC beside AUC
    acc = MetricAccumulator(tasks, features.surfaces, has_oracle, has_users)
    keys = unknown_id_features(settings.layout, vocabulary_tables)
    sliced = {
        (who, new): MetricAccumulator(tasks, features.surfaces, has_oracle, has_users and not (new and who == "users"))
        for who in keys
        for new in (False, True)
    }
    if split == "holdout":
        loader, where = heldout_loader(settings, env)
        what = f"holdout ({where})"
    else:
        eval_dir = settings.data.eval_dir
        loader = make_loader(eval_dir, settings, env.rank, env.world_size, shuffle=False)
        what = f"eval ({eval_dir})"
    spare = functools.partial(spare_batch, settings, env)  # a rank with no row group of the split replays it masked
    for batch, logits in scoring_pass(model, env, group, loader, what, spare):
        probs, users = torch.sigmoid(logits), batch.user_id
        acc.update(probs, batch.labels, batch.surface, batch.true_probs, valid=batch.valid, users=users)
        for (who, new), a in sliced.items():
            is_new = _row_ids(batch, settings.layout, keys[who]) == 0
            a.update(
                probs,
                batch.labels,
                batch.surface,
                batch.true_probs,
                valid=batch.valid & (is_new if new else ~is_new),
                users=users if a.has_users else None,
            )
    rows = acc.compute()
    slices: List[dict] = []
    for who in keys:  # every rank computes every slice: compute() gathers over the ranks
        known, new = sliced[who, False].compute(), sliced[who, True].compute()
        if any(r["examples"] for r in new):
            slices += [{SLICE: f"known {who}", **r} for r in known] + [{SLICE: f"new {who}", **r} for r in new]
    return rows, slices


def format_slices(slices: Sequence[dict]) -> str:
    """The known / new slices (``evaluation_with_slices``) as a text table: per slice its share of
    the split's rows, label rate, AUC, the oracle's AUC, NE and calibration (predicted / observed
    positives); the surfaces' rows, then "all" where there are several surfaces. "" without slices."""
    if not slices:
        return ""
    surfaces = {r["surface"] for r in slices if r["surface"] != ALL_SURFACES}
    shown = [r for r in slices if len(surfaces) > 1 or r["surface"] != ALL_SURFACES]
    # A pair's two slices split the split's rows: their examples summed are its total.
    totals: Dict[tuple, int] = {}
    for r in slices:
        key = (r[SLICE].split(" ", 1)[1], r["surface"], r["task"])
        totals[key] = totals.get(key, 0) + int(r["examples"])

    def f(x, spec=".4f") -> str:
        return "-" if x is None or x != x else format(x, spec)

    body = []
    for r in shown:
        n = int(r["examples"])
        total = totals[(r[SLICE].split(" ", 1)[1], r["surface"], r["task"])]
        body.append(
            [
                r[SLICE],
                r["surface"],
                r["task"],
                f"{n:,}",
                f(n / total if total else None, ".1%"),
                f(r["positives"] / n if n else None),
                f(r["auc"]),
                f(r.get("oracle_auc")),
                f(r["ne"]),
                f(r["calibration"], ".3f"),
            ]
        )
    header = ["slice", "surface", "task", "n", "share", "pos_rate", "AUC", "oAUC", "NE", "calib"]
    title = "Known and new ids (id 0: not in the build's vocabulary; a new user or item)"
    return title + "\n" + text_table.format_table(header, body, left=[0, 1, 2])


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
