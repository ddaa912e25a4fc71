"""Evaluation metrics for ads engagement prediction, per surface x per task, exact over all examples.

What it computes, for every (surface, task) pair plus an ``"all"`` surface row per task:

* ``auc``          exact ROC AUC over all examples (rank-based Mann-Whitney statistic, tied scores
                   get the average rank, i.e. a tied positive/negative pair counts 1/2); nan when
                   only one class is present.
* ``log_loss``     mean binary cross-entropy of the predicted probabilities (clamped to
                   [1e-7, 1 - 1e-7]).
* ``ne``           normalized entropy = log_loss / H(p_bar), where p_bar is the empirical base rate
                   and H(p) = -(p log p + (1 - p) log(1 - p)); nan when p_bar is 0 or 1.
* ``calibration``  sum(predicted) / sum(labels); nan when there are no positives.
* ``ece``          expected calibration error over ``ECE_BINS`` equal-count bins of the predicted
                   probability: sum_b (n_b / N) |mean predicted_b - mean label_b|. Equal-count
                   bins because engagement rates are small: equal-width bins would put nearly every
                   example in the first one.
* ``gauc``         impression-weighted per-user AUC, as the DIN/DSIN papers report on Taobao:
                   sum_u n_u AUC_u / sum_u n_u over the users with both classes in the cell (n_u
                   their examples), ties averaged as in ``auc``; ``gauc_coverage`` the share of the
                   cell's examples those users hold. ``None`` when the accumulator has no user ids.
* ``oracle_auc`` / ``oracle_ne``  the same AUC / NE computed from the generator's true
                   probabilities (synthetic data only), ``None`` when the accumulator has no oracle.
* ``calibration_vs_truth``  sum(predicted) / sum(true probabilities) (synthetic data only): the
                   calibration ratio without the labels' Bernoulli noise (a cell with 200 positives
                   has a label-based ratio that is +-7% noise alone).

Why AUC is computed here and not by ``torchmetrics.functional.binary_auroc``: torchmetrics (1.0.3)
builds its ROC curve in float32 whatever the input dtype (its counts are ``long * 1.0``), so it is
off by up to ~1e-7 and its counts stop being exact past 2**24 examples. The rank statistic below is
exact in float64 (one rounding); tests/test_metrics.py checks that the two agree to float32
precision, and to one ulp when torchmetrics runs in float64. NE, ECE on equal-count bins, the
oracle columns and calibration vs truth exist in no library.

Metrics are exact, not bucketed/approximated: :class:`MetricAccumulator` keeps every evaluated
example (detached CPU copies) and, when ``torch.distributed`` is initialized with more than one
rank, gathers all examples from all ranks to every rank (:func:`gather_rows`, also used to fit the
calibration maps) before computing, so every rank returns the same rows, equal to a single-process
computation on the concatenation of the ranks' data (in rank order). Everything is computed in
float64 with torch only.

How it scales: every rank holds every example, (1 + 3 x tasks) float64 columns, 80 bytes a row
for 3 tasks: fine for millions of rows (10M rows: 0.8 GB per rank). Beyond that, keep the metrics
mergeable instead of exact: per (surface, task, label) histograms of the predicted probability on
fixed bins (10^4-10^5), summed with one ``all_reduce`` whatever the row count, give AUC (pairs in
one bin count 1/2: the error is bounded by the share of pairs sharing a bin) and the equal-count
ECE bins; log loss, NE and calibration are sums and reduce exactly. For monitoring during training,
TorchRec's windowed AUC (``torchrec.metrics``) over the latest predictions does the same job.

Labels are binary engagement labels; for AUC and the ``positives`` count a label is positive when
it is > 0.5. Log loss / NE / calibration use the label values as given.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from pinads_rec import text_table

__all__ = [
    "EPS",
    "auc",
    "gauc",
    "log_loss",
    "normalized_entropy",
    "calibration",
    "expected_calibration_error",
    "MetricAccumulator",
    "auc_standard_error",
    "format_table",
    "gather_rows",
]

EPS = 1e-7
ECE_BINS = 20
ALL_SURFACES = "all"


# --------------------------------------------------------------------------------------------
# Metric functions on 1-D tensors.
# --------------------------------------------------------------------------------------------


def _as_1d_f64(x: torch.Tensor) -> torch.Tensor:
    x = torch.as_tensor(x)
    if x.dim() != 1:
        x = x.reshape(-1)
    return x.detach().to(device="cpu", dtype=torch.float64)


def _paired(predictions: torch.Tensor, labels: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Both as 1-D float64 CPU tensors of the same length."""
    p, y = _as_1d_f64(predictions), _as_1d_f64(labels)
    if p.numel() != y.numel():
        raise ValueError(f"length mismatch: {p.numel()} predictions vs {y.numel()} labels")
    return p, y


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Exact ROC AUC, ties averaged. nan when only one class is present (or on nan scores).

    Sorts once (``torch.unique``), groups equal scores, and for each group of tied scores counts
    ``positives_in_group * (negatives_strictly_below + negatives_in_group / 2)``.
    """
    s, y = _paired(scores, labels)
    pos = y > 0.5
    n_pos = int(pos.sum())
    n_neg = s.numel() - n_pos
    if n_pos == 0 or n_neg == 0 or bool(torch.isnan(s).any()):
        return float("nan")
    # uniq is sorted ascending; inverse maps every example to its tie group.
    _, inverse = torch.unique(s, sorted=True, return_inverse=True)
    n_groups = int(inverse.max()) + 1
    pos_g = torch.zeros(n_groups, dtype=torch.int64).index_add_(0, inverse, pos.to(torch.int64))
    tot_g = torch.bincount(inverse, minlength=n_groups)
    neg_g = tot_g - pos_g
    neg_below = torch.cumsum(neg_g, 0) - neg_g  # negatives with strictly lower score
    num = (pos_g.to(torch.float64) * (neg_below.to(torch.float64) + 0.5 * neg_g.to(torch.float64))).sum()
    return float(num / (float(n_pos) * float(n_neg)))


def gauc(scores: torch.Tensor, labels: torch.Tensor, users: torch.Tensor) -> Tuple[float, float]:
    """(GAUC, coverage): each user's exact AUC (ties averaged) weighted by the user's examples, over
    the users with both a positive and a negative, and the share of the examples they hold. (nan,
    0.0) when no user has both classes (or on nan scores).

    One pass for all users: the examples sorted by (user, score), a tie group per (user, score), and
    each group's ``positives * (the user's negatives strictly below + its own negatives / 2)``.
    """
    s, y = _paired(scores, labels)
    u = torch.as_tensor(users).reshape(-1).to(device="cpu", dtype=torch.int64)
    if u.numel() != s.numel():
        raise ValueError(f"length mismatch: {u.numel()} users vs {s.numel()} scores")
    if s.numel() == 0 or bool(torch.isnan(s).any()):
        return float("nan"), 0.0
    by_score = torch.sort(s, stable=True).indices
    order = by_score[torch.sort(u[by_score], stable=True).indices]  # by user, then by score
    us, ss, pos = u[order], s[order], (y[order] > 0.5).to(torch.int64)
    starts = torch.ones(s.numel(), dtype=torch.bool)
    starts[1:] = (us[1:] != us[:-1]) | (ss[1:] != ss[:-1])
    group = torch.cumsum(starts.to(torch.int64), 0) - 1
    n_groups = int(group[-1]) + 1
    pos_g = torch.zeros(n_groups, dtype=torch.int64).index_add_(0, group, pos)
    neg_g = torch.bincount(group, minlength=n_groups) - pos_g
    user_g = us[starts]
    first = torch.ones(n_groups, dtype=torch.bool)
    first[1:] = user_g[1:] != user_g[:-1]
    user = torch.cumsum(first.to(torch.int64), 0) - 1
    neg_before = torch.cumsum(neg_g, 0) - neg_g  # over all users before, then reset per user
    neg_below = neg_before - neg_before[first][user]
    n_users = int(user[-1]) + 1
    num = torch.zeros(n_users, dtype=torch.float64).index_add_(
        0, user, pos_g.to(torch.float64) * (neg_below.to(torch.float64) + 0.5 * neg_g.to(torch.float64))
    )
    p_u = torch.zeros(n_users, dtype=torch.int64).index_add_(0, user, pos_g)
    n_u = torch.zeros(n_users, dtype=torch.int64).index_add_(0, user, neg_g)
    both = (p_u > 0) & (n_u > 0)
    if not bool(both.any()):
        return float("nan"), 0.0
    weight = (p_u + n_u)[both].to(torch.float64)
    per_user = num[both] / (p_u[both].to(torch.float64) * n_u[both].to(torch.float64))
    return float((weight * per_user).sum() / weight.sum()), float(weight.sum()) / s.numel()


def log_loss(probs: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean binary cross-entropy (natural log), probs clamped to [1e-7, 1-1e-7]. nan when empty."""
    p, y = _paired(probs, labels)
    if p.numel() == 0:
        return float("nan")
    p = p.clamp(EPS, 1.0 - EPS)
    ll = -(y * torch.log(p) + (1.0 - y) * torch.log1p(-p))
    return float(ll.mean())


def _entropy(p: float) -> float:
    return -(p * math.log(p) + (1.0 - p) * math.log(1.0 - p))


def normalized_entropy(probs: torch.Tensor, labels: torch.Tensor) -> float:
    """Log loss divided by the entropy of the empirical base rate. nan if base rate is 0 or 1."""
    p, y = _paired(probs, labels)
    if y.numel() == 0:
        return float("nan")
    base = float(y.mean())
    if not (0.0 < base < 1.0):
        return float("nan")
    return log_loss(p, y) / _entropy(base)


def calibration(probs: torch.Tensor, labels: torch.Tensor) -> float:
    """Sum of predicted probabilities / sum of labels. nan if there are no positives."""
    p, y = _paired(probs, labels)
    sy = float(y.sum())
    if sy == 0.0:
        return float("nan")
    return float(p.sum()) / sy


def expected_calibration_error(probs: torch.Tensor, labels: torch.Tensor, bins: int = ECE_BINS) -> float:
    """sum over equal-count bins of the sorted predictions of (n_b / N) |mean p_b - mean y_b|."""
    p, y = _paired(probs, labels)
    if p.numel() == 0:
        return float("nan")
    order = torch.argsort(p)
    gaps = [(pb.sum() - yb.sum()).abs() for pb, yb in zip(p[order].tensor_split(bins), y[order].tensor_split(bins))]
    return float(sum(gaps)) / p.numel()


# --------------------------------------------------------------------------------------------
# The cross-rank gather.
# --------------------------------------------------------------------------------------------


def gather_rows(rows: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Every rank's ``rows`` ``[n_rank, C]`` (n_rank may differ, even be 0) concatenated in rank
    order, ``[sum n_rank, C]`` on CPU with the input's dtype, on every rank of ``group`` (None: the
    default group). Collective: every rank of the group calls it. Without torch.distributed, or on a
    world of one, returns ``rows`` itself."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group=group) == 1:
        return rows
    world = dist.get_world_size(group=group)
    device = torch.device("cpu")
    if "nccl" in str(dist.get_backend(group)).lower():
        device = torch.device("cuda", torch.cuda.current_device())
    size = torch.tensor([rows.shape[0]], dtype=torch.int64, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    sizes_l = [int(s.item()) for s in sizes]
    max_n = max(max(sizes_l), 1)  # never exchange zero-size tensors
    padded = torch.zeros(max_n, *rows.shape[1:], dtype=rows.dtype, device=device)
    padded[: rows.shape[0]] = rows.to(device)
    outs = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(outs, padded, group=group)
    return torch.cat([o[:n].cpu() for o, n in zip(outs, sizes_l)], dim=0)


# --------------------------------------------------------------------------------------------
# Accumulator (exact, all examples, optionally gathered across ranks).
# --------------------------------------------------------------------------------------------


class MetricAccumulator:
    """Collects predictions over an evaluation pass and computes per-surface x per-task metrics.

    ``update`` keeps detached CPU copies of the valid rows; ``compute`` returns a list of dict rows
    (surfaces in the given order, then ``"all"``; tasks in the given order within each surface).
    """

    def __init__(
        self, tasks: Sequence[str], surfaces: Sequence[str], has_oracle: bool = False, has_users: bool = False
    ) -> None:
        self.tasks: List[str] = list(tasks)
        self.surfaces: List[str] = list(surfaces)
        self.has_oracle = bool(has_oracle)
        self.has_users = bool(has_users)  # user ids given to update(): GAUC
        if not self.tasks:
            raise ValueError("MetricAccumulator needs at least one task")
        if not self.surfaces:
            raise ValueError("MetricAccumulator needs at least one surface")
        if ALL_SURFACES in self.surfaces:
            raise ValueError(f"surface name {ALL_SURFACES!r} is reserved for the aggregate row")
        self.reset()

    def reset(self) -> None:
        self._probs: List[torch.Tensor] = []
        self._labels: List[torch.Tensor] = []
        self._surface: List[torch.Tensor] = []
        self._true: List[torch.Tensor] = []
        self._users: List[torch.Tensor] = []

    @property
    def num_examples(self) -> int:
        """Examples held locally (before any cross-rank gather)."""
        return sum(int(t.shape[0]) for t in self._surface)

    def update(
        self,
        probs: torch.Tensor,
        labels: torch.Tensor,
        surface: torch.Tensor,
        true_probs: Optional[torch.Tensor] = None,
        valid: Optional[torch.Tensor] = None,
        users: Optional[torch.Tensor] = None,
    ) -> None:
        """Add a batch: probs/labels/true_probs ``[B, T]``, surface ``[B]`` int64 index, valid ``[B]``
        bool, users ``[B]`` int64 user ids (with ``has_users``)."""
        T = len(self.tasks)
        probs = probs.detach()
        labels = labels.detach()
        surface = surface.detach()
        if probs.dim() == 1 and T == 1:
            probs = probs.unsqueeze(1)
        if labels.dim() == 1 and T == 1:
            labels = labels.unsqueeze(1)
        if probs.dim() != 2 or probs.shape[1] != T:
            raise ValueError(f"probs must be [B, {T}], got {tuple(probs.shape)}")
        B = probs.shape[0]
        if tuple(labels.shape) != (B, T):
            raise ValueError(f"labels must be [{B}, {T}], got {tuple(labels.shape)}")
        if tuple(surface.shape) != (B,):
            raise ValueError(f"surface must be [{B}], got {tuple(surface.shape)}")
        if self.has_oracle:
            if true_probs is None:
                raise ValueError("has_oracle=True but update() got no true_probs")
            true_probs = true_probs.detach()
            if true_probs.dim() == 1 and T == 1:
                true_probs = true_probs.unsqueeze(1)
            if tuple(true_probs.shape) != (B, T):
                raise ValueError(f"true_probs must be [{B}, {T}], got {tuple(true_probs.shape)}")
        if self.has_users:
            if users is None:
                raise ValueError("has_users=True but update() got no users")
            users = users.detach().reshape(-1)
            if users.numel() != B:
                raise ValueError(f"users must be [{B}], got {tuple(users.shape)}")
        if valid is not None:
            valid = valid.detach().to(device=probs.device, dtype=torch.bool).reshape(-1)
            if valid.numel() != B:
                raise ValueError(f"valid must be [{B}], got {tuple(valid.shape)}")
            probs = probs[valid]
            labels = labels.to(probs.device)[valid]
            surface = surface.to(probs.device)[valid]
            if self.has_oracle:
                true_probs = true_probs.to(probs.device)[valid]
            if self.has_users:
                users = users.to(probs.device)[valid]
        surface = surface.to(device="cpu", dtype=torch.int64)
        if surface.numel() and (int(surface.min()) < 0 or int(surface.max()) >= len(self.surfaces)):
            raise ValueError(
                f"surface index out of range [0, {len(self.surfaces)}): "
                f"min {int(surface.min())}, max {int(surface.max())}"
            )
        # .to("cpu") is a no-op on CPU tensors, so clone to never alias the caller's buffers.
        self._probs.append(probs.to("cpu", copy=True))
        self._labels.append(labels.to("cpu", copy=True))
        self._surface.append(surface.clone())
        if self.has_oracle:
            self._true.append(true_probs.to("cpu", copy=True))
        if self.has_users:
            self._users.append(users.to(device="cpu", dtype=torch.int64, copy=True))

    # ---- gathering --------------------------------------------------------------------------

    def _local_packed(self) -> torch.Tensor:
        """All local examples as one float64 ``[n, 1 + T (+T) + T]`` tensor: surface | probs | labels | true."""
        T = len(self.tasks)
        n_cols = 1 + 2 * T + (T if self.has_oracle else 0)
        if not self._surface:
            return torch.zeros(0, n_cols, dtype=torch.float64)
        cols = [
            torch.cat(self._surface).to(torch.float64).unsqueeze(1),  # exact for indices < 2**53
            torch.cat(self._probs).to(torch.float64),
            torch.cat(self._labels).to(torch.float64),
        ]
        if self.has_oracle:
            cols.append(torch.cat(self._true).to(torch.float64))
        return torch.cat(cols, dim=1)

    # ---- compute ----------------------------------------------------------------------------

    def compute(self, process_group: Any = None, gather: bool = True) -> List[Dict[str, Any]]:
        """Metrics rows for every surface (then ``"all"``) x task, over all examples of all ranks.

        Collective when torch.distributed is initialized with world size > 1: every rank of
        ``process_group`` must call it. ``gather=False``: this process's examples only, no collective
        (rank 0's reference, fitted when the other ranks are done).
        """
        T = len(self.tasks)

        def gathered(rows: torch.Tensor) -> torch.Tensor:
            return gather_rows(rows, process_group) if gather else rows

        data = gathered(self._local_packed())
        surface = data[:, 0].to(torch.int64)
        probs = data[:, 1 : 1 + T]
        labels = data[:, 1 + T : 1 + 2 * T]
        true = data[:, 1 + 2 * T : 1 + 3 * T] if self.has_oracle else None
        users = None
        if self.has_users:  # int64 apart: ids past 2**53 are not exact in the float64 columns
            local = torch.cat(self._users) if self._users else torch.zeros(0, dtype=torch.int64)
            users = gathered(local.unsqueeze(1))[:, 0]

        rows: List[Dict[str, Any]] = []
        selections = [(name, surface == i) for i, name in enumerate(self.surfaces)]
        selections.append((ALL_SURFACES, None))
        for name, mask in selections:
            for t, task in enumerate(self.tasks):
                p = probs[:, t] if mask is None else probs[mask, t]
                y = labels[:, t] if mask is None else labels[mask, t]
                row: Dict[str, Any] = {
                    "surface": name,
                    "task": task,
                    "examples": int(y.numel()),
                    "positives": int((y > 0.5).sum()),
                    "auc": auc(p, y),
                    "ne": normalized_entropy(p, y),
                    "log_loss": log_loss(p, y),
                    "calibration": calibration(p, y),
                    "ece": expected_calibration_error(p, y),
                    "gauc": None,
                    "gauc_coverage": None,
                    "oracle_auc": None,
                    "oracle_ne": None,
                    "calibration_vs_truth": None,
                }
                if users is not None:
                    row["gauc"], row["gauc_coverage"] = gauc(p, y, users if mask is None else users[mask])
                if true is not None:
                    q = true[:, t] if mask is None else true[mask, t]
                    row["oracle_auc"] = auc(q, y)
                    row["oracle_ne"] = normalized_entropy(q, y)
                    row["calibration_vs_truth"] = float(p.sum() / q.sum()) if float(q.sum()) > 0 else float("nan")
                rows.append(row)
        return rows


# --------------------------------------------------------------------------------------------
# Text table.
# --------------------------------------------------------------------------------------------


def _fmt(x: Optional[float], spec: str = ".4f") -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isnan(x):
        return "nan"
    return format(x, spec)


def oracle_lift(row: Dict[str, Any]) -> Optional[float]:
    """(auc - 0.5) / (oracle_auc - 0.5) of a metrics row: the fraction of the oracle's attainable
    AUC gain over random that the model achieves; None without an oracle, nan when undefined."""
    a, o = row.get("auc"), row.get("oracle_auc")
    if a is None or o is None:
        return None
    if math.isnan(a) or math.isnan(o) or o == 0.5:
        return float("nan")
    return (a - 0.5) / (o - 0.5)


def auc_standard_error(value: Optional[float], positives: int, negatives: int) -> Optional[float]:
    """The AUC's standard error by Hanley & McNeil (1982): how far a second sample of the same size
    would move it. None when undefined (one class, or no AUC)."""
    if value is None or math.isnan(value) or positives < 1 or negatives < 1:
        return None
    q1, q2 = value / (2 - value), 2 * value * value / (1 + value)
    var = value * (1 - value) + (positives - 1) * (q1 - value**2) + (negatives - 1) * (q2 - value**2)
    return math.sqrt(max(var, 0.0) / (positives * negatives))


def format_table(rows: Sequence[Dict[str, Any]], reference: Optional[Sequence[Dict[str, Any]]] = None) -> str:
    """Fixed-width text table of :meth:`MetricAccumulator.compute` rows.

    Lift = (auc - 0.5) / (oracle_auc - 0.5): the fraction of the oracle's attainable AUC gain over
    random that the model achieves; the oracle's columns (oAUC, lift, oNE, cal/true) are shown only
    where the rows have an oracle. GAUC is shown when the rows have it. ``reference``: the reference
    model's rows (pinads_rec.reference), shown beside the model's per surface x task: its AUC, NE
    (and GAUC), ``vs ref`` the model's AUC minus the reference's, and ``AUC se`` the model's AUC's
    standard error (:func:`auc_standard_error`): a margin within it is not a win.
    """
    with_oracle = any(r.get("oracle_auc") is not None for r in rows)
    with_gauc = any(r.get("gauc") is not None for r in rows)
    by_cell = {(r["surface"], r["task"]): r for r in reference or []}
    with_ref_gauc = with_gauc and any(r.get("gauc") is not None for r in by_cell.values())
    headers = ["surface", "task", "n", "pos_rate", "AUC"]
    headers += ["oAUC", "lift"] if with_oracle else []
    headers += ["NE"] + (["oNE"] if with_oracle else []) + ["logloss", "calib"]
    headers += (["cal/true"] if with_oracle else []) + ["ECE"] + (["GAUC"] if with_gauc else [])
    if reference is not None:
        headers += ["ref AUC", "ref NE"] + (["ref GAUC"] if with_ref_gauc else []) + ["vs ref", "AUC se"]
    body: List[List[str]] = []
    for r in rows:
        n = int(r["examples"])
        pos_rate = r["positives"] / n if n else float("nan")
        cells = [str(r["surface"]), str(r["task"]), str(n), _fmt(pos_rate), _fmt(r["auc"])]
        cells += [_fmt(r.get("oracle_auc")), _fmt(oracle_lift(r), ".3f")] if with_oracle else []
        cells += [_fmt(r["ne"])] + ([_fmt(r.get("oracle_ne"))] if with_oracle else [])
        cells += [_fmt(r["log_loss"]), _fmt(r["calibration"], ".3f")]
        cells += [_fmt(r.get("calibration_vs_truth"), ".3f")] if with_oracle else []
        cells += [_fmt(r.get("ece"), ".5f")] + ([_fmt(r.get("gauc"))] if with_gauc else [])
        if reference is not None:
            ref = by_cell.get((r["surface"], r["task"]), {})
            margin = None if ref.get("auc") is None or r["auc"] is None else r["auc"] - ref["auc"]
            cells += [_fmt(ref.get("auc")), _fmt(ref.get("ne"))] + ([_fmt(ref.get("gauc"))] if with_ref_gauc else [])
            se = auc_standard_error(r["auc"], int(r["positives"]), n - int(r["positives"]))
            cells += [_fmt(margin, "+.4f"), _fmt(se)]
        body.append(cells)
    return text_table.format_table(headers, body, left=[0, 1])  # surface and task names at the left
