"""Surface-specific calibration layers (unified-surfaces article).

One affine map of the logit per (surface, task) -- Platt scaling, ``a[s, t] * logit + b[s, t]`` --
on top of the model's logits; ``global`` shares one map per task across surfaces (the switch-off),
``none`` is the identity.

How it is trained: at the end of the training job, with the backbone frozen, on data it never
trained on -- a calibration split from the end of the training period (``data.calibration_dir``)
or a held-out slice of the latest training data (``data.calibration_holdout``) -- by exact maximum
likelihood (Newton's method per (surface, task)). The fit matches the sum of predictions to the sum
of labels per (surface, task), so its error is label noise: ~1 / sqrt(positives) of each cell.
Not by the training loss, because a backbone that is still moving
leaves a calibration layer trained alongside it behind: measured on the demo data, a layer
trained with the model (detached logits, its own loss term) still left the final model 5-22% off
on some surfaces and tasks, since the dense learning rate decays while the embedding tables keep
moving. A final fit on data the backbone never trained on calibrates the model that is served.

The maps are buffers (in checkpoints, broadcast by DDP, no optimizer state): identity until fit,
one row per surface in every mode (``global`` fits one map and copies it to every surface), so a
trained model can be recalibrated in another mode.

A fit that cannot be trusted is not served as fit. On data where the backbone learned little (real
MovieLens-100K after 3 epochs) the raw logits of a cell were nearly constant and the fit returned a
scale of 65,135: five distinct predictions. Two causes, two remedies:

* **Undamped Newton diverged.** With logits nearly constant and far from the labels' rate (-6 for
  a 30% rate) the Hessian vanishes at the start and the first full step lands on a scale of 10^4,
  every prediction 0 (scale 21,361 in tests/test_calibration.py); it also diverged on 2 of 30 random
  healthy cells (logits -2.6 +- 1.9, a 21% rate: scale 29,437). :func:`fit_platt` now halves a
  group's step until it does not raise that group's objective, so it reaches the true optimum
  (there: scale 0.17, every prediction near the rate; 0.53 on the healthy cell). A fit that
  converged undamped is unchanged (the other 28 cells within 1e-6; tests/test_golden.py's figures).
* **The optimum itself can be unfit to serve**, checked per (surface, task) after the fit
  (:func:`guarded_maps`), each refusal logged as a WARNING naming the cell, the raw-logit spread,
  the refused map and the one used instead:

  1. *The scale stays in* ``SCALE_RANGE`` *= [0.05, 20].* Outside it the fit is stretching a spread
     the backbone did not learn (a large scale: nearly constant logits whose noise happens to
     separate the labels) or discarding one it did (a tiny or negative scale: the prior's pull on
     a nearly constant logit far from the rate can invert the cell's ranking). The scale is
     clamped to the nearer bound -- the objective is convex, so when its optimum lies outside the
     range the best scale within it is that bound -- and the bias refit given it
     (:func:`fit_bias`), which keeps the cell's mean prediction at its label rate. The bounds leave
     a healthy backbone's fits alone: it is miscalibrated by a factor of a few, not of twenty (the
     tiny-data test runs fit scales of 0.6-2.2).
  2. *The map keeps the backbone's resolution.* The cell's calibrated float32 probabilities must
     take at least min(``MIN_DISTINCT``, ``MIN_DISTINCT_SHARE`` x the raw ones') distinct values
     (100, or half): a map that saturates the rows into a handful of 0s and 1s is refused even
     with a scale in range, and falls back to bias only (scale 1, bias refit): the raw logits'
     resolution and the cell's label rate, the least the fit can claim. (An absolute count, not a
     ratio alone: moving predictions from 0.002 to 0.3 loses float32 resolution by itself.)

In: logits [B, T], surface [B] int64. Out: [B, T].
"""

import logging
import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

log = logging.getLogger(__name__)

SCALE_RANGE = (0.05, 20.0)  # the scales a fit may use (rule 1 of the module docstring)
# Rule 2: a map keeps at least min(MIN_DISTINCT, MIN_DISTINCT_SHARE x raw) distinct probabilities.
MIN_DISTINCT = 100
MIN_DISTINCT_SHARE = 0.5


def fit_platt(
    logits: torch.Tensor,
    labels: torch.Tensor,
    groups: torch.Tensor,
    num_groups: int,
    prior: float = 1.0,
    iterations: int = 50,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per group g, the (a_g, b_g) minimizing sum_i BCE(a_g z_i + b_g, y_i) + prior/2 ((a_g - 1)^2 + b_g^2).

    logits, labels [N] (float64 used inside); groups [N] in [0, num_groups). The small prior keeps a
    group with few or no positives at (or near) the identity. Newton's method on the 2x2 system of
    every group at once (a convex problem), each group's step halved until it does not raise that
    group's objective: the full step is taken whenever it does (so a fit that converged undamped
    is unchanged), while logits far from the labels' rate -- nearly constant at -6 for a 30% rate,
    where the Hessian vanishes -- no longer send undamped Newton to scales of 10^4 and every
    prediction to 0."""
    z, y = logits.double(), labels.double()
    a = torch.ones(num_groups, dtype=torch.float64)
    b = torch.zeros(num_groups, dtype=torch.float64)

    def per_group(v: torch.Tensor) -> torch.Tensor:
        return torch.zeros(num_groups, dtype=torch.float64).index_add_(0, groups, v)

    def objective(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        x = a[groups] * z + b[groups]
        bce = torch.nn.functional.binary_cross_entropy_with_logits(x, y, reduction="none")
        return per_group(bce) + prior / 2 * ((a - 1) ** 2 + b**2)

    current = objective(a, b)
    for _ in range(iterations):
        p = torch.sigmoid(a[groups] * z + b[groups])
        r, w = p - y, p * (1 - p)
        ga, gb = per_group(r * z) + prior * (a - 1), per_group(r) + prior * b
        haa, hab, hbb = per_group(w * z * z) + prior, per_group(w * z), per_group(w) + prior
        det = haa * hbb - hab * hab
        da, db = (hbb * ga - hab * gb) / det, (haa * gb - hab * ga) / det
        t = torch.ones(num_groups, dtype=torch.float64)
        for _ in range(60):  # backtracking: halve the step of the groups it made worse
            trial = objective(a - t * da, b - t * db)
            worse = trial > current
            if not bool(worse.any()):
                break
            t = torch.where(worse, t / 2, t)
        a, b, current = a - t * da, b - t * db, torch.minimum(trial, current)
        if float(torch.maximum((t * da).abs(), (t * db).abs()).max()) < 1e-10:
            break
    return a.float(), b.float()


def fit_bias(
    logits: torch.Tensor, labels: torch.Tensor, scale: float, prior: float = 1.0, iterations: int = 50
) -> float:
    """The b minimizing sum_i BCE(scale z_i + b, y_i) + prior/2 (b - c)^2 for a fixed ``scale`` (one
    group), c = (1 - scale) mean(z) the bias that leaves the mean logit where it was: at scale 1 the
    prior of :func:`fit_platt` (c = 0), and at a clamped scale one that pulls a cell with few labels
    towards the raw model's mean prediction instead of towards a bias of 0, which at scale 20 would
    be a prediction nowhere near it. Newton's method in one dimension from the bias that puts the
    mean logit at the label rate, its step halved while it raises the objective."""
    x, y = logits.double() * scale, labels.double()
    centre = (1.0 - scale) * float(logits.double().mean())
    rate = float(y.mean().clamp(1e-6, 1 - 1e-6))
    b = math.log(rate / (1 - rate)) - float(x.mean())

    def objective(b: float) -> float:
        bce = torch.nn.functional.binary_cross_entropy_with_logits(x + b, y, reduction="sum")
        return float(bce) + prior / 2 * (b - centre) ** 2

    current = objective(b)
    for _ in range(iterations):
        p = torch.sigmoid(x + b)
        step = float(((p - y).sum() + prior * (b - centre)) / ((p * (1 - p)).sum() + prior))
        for _ in range(60):
            trial = objective(b - step)
            if trial <= current:
                break
            step /= 2
        b, current = b - step, min(trial, current)
        if abs(step) < 1e-10:
            break
    return b


def probabilities(logits: torch.Tensor, scale: float, bias: float) -> torch.Tensor:
    """What the served model predicts through the map: float32, as :class:`Calibration` and
    ``sigmoid`` compute it."""
    return torch.sigmoid(logits.float() * torch.tensor(scale, dtype=torch.float32) + torch.tensor(bias))


def distinct(values: torch.Tensor) -> int:
    return int(torch.unique(values).numel())


@dataclass
class Refusal:
    """A cell whose fitted map was not used: ``group`` (the surface index; 0 for all surfaces in
    ``global`` mode), ``task`` (its index), the ``rules`` it broke ("scale", "resolution": the
    module docstring's 1 and 2), the refused map and the one used (scale, bias), the raw logits'
    spread (std, min, max), and the distinct probabilities of the raw logits, of the last map
    refused and of the map used (on the rows fit)."""

    group: int
    task: int
    rules: Tuple[str, ...]
    fitted: Tuple[float, float]
    used: Tuple[float, float]
    logit_std: float
    logit_min: float
    logit_max: float
    distinct_raw: int
    distinct_refused: int
    distinct_used: int

    def describe(self, surface: str, task: str) -> str:
        why = []
        if "scale" in self.rules:
            why.append(f"scale outside [{SCALE_RANGE[0]:g}, {SCALE_RANGE[1]:g}]")
        if "resolution" in self.rules:
            why.append(
                f"{'clamped, it' if 'scale' in self.rules else 'it'} keeps {self.distinct_refused} distinct "
                f"predictions of the raw logits' {self.distinct_raw}"
            )
        instead = "bias only (scale 1), bias refit" if "resolution" in self.rules else "scale clamped, bias refit"
        return (
            f"calibration {surface} x {task}: refused scale {self.fitted[0]:.6g}, bias {self.fitted[1]:.6g} "
            f"({'; '.join(why)}; raw logits std {self.logit_std:.3g}, range [{self.logit_min:.4g}, "
            f"{self.logit_max:.4g}]); used scale {self.used[0]:.6g}, bias {self.used[1]:.6g} instead ({instead}; "
            f"{self.distinct_used} distinct predictions)"
        )


def guarded_maps(
    logits: torch.Tensor,
    labels: torch.Tensor,
    groups: torch.Tensor,
    num_groups: int,
    task: int = 0,
    maps: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> Tuple[torch.Tensor, torch.Tensor, List[Refusal]]:
    """The module docstring's two rules applied to ``maps`` ((scale [G], bias [G]); by default
    :func:`fit_platt`'s) on every group with rows: (scale [G], bias [G] as used, the refusals)."""
    a, b = (m.clone() for m in maps) if maps is not None else fit_platt(logits, labels, groups, num_groups)
    refusals = []
    for g in range(num_groups):
        rows = groups == g
        if not bool(rows.any()):
            continue
        z, y = logits[rows], labels[rows]
        fitted = (float(a[g]), float(b[g]))
        scale, bias, rules = fitted[0], fitted[1], ()
        if not SCALE_RANGE[0] <= scale <= SCALE_RANGE[1]:  # also a NaN scale
            scale = min(max(scale, SCALE_RANGE[0]), SCALE_RANGE[1]) if scale == scale else 1.0
            bias, rules = fit_bias(z, y, scale), ("scale",)
        raw, kept = distinct(torch.sigmoid(z.float())), distinct(probabilities(z, scale, bias))
        refused_kept = distinct(probabilities(z, *fitted)) if rules else kept  # of the map refused first
        if kept < min(MIN_DISTINCT, MIN_DISTINCT_SHARE * raw):
            refused_kept = kept
            scale, bias, rules = 1.0, fit_bias(z, y, 1.0), rules + ("resolution",)
            kept = distinct(probabilities(z, scale, bias))
        if rules:
            zd = z.double()
            spread = (float(zd.std()) if z.numel() > 1 else 0.0, float(zd.min()), float(zd.max()))
            refusals.append(Refusal(g, task, rules, fitted, (scale, bias), *spread, raw, refused_kept, kept))
            a[g], b[g] = scale, bias
    return a, b, refusals


class Calibration(nn.Module):
    def __init__(self, num_surfaces: int, num_tasks: int, mode: str = "surface"):
        super().__init__()
        self.mode = mode
        self.register_buffer("scale", torch.ones(num_surfaces, num_tasks))
        self.register_buffer("bias", torch.zeros(num_surfaces, num_tasks))

    def forward(self, logits: torch.Tensor, surface: torch.Tensor) -> torch.Tensor:
        if self.mode == "none":
            return logits
        return logits * self.scale.index_select(0, surface) + self.bias.index_select(0, surface)

    def reset(self) -> None:
        self.scale.fill_(1.0)
        self.bias.fill_(0.0)

    def fit(
        self,
        raw: torch.Tensor,
        labels: torch.Tensor,
        surface: torch.Tensor,
        surfaces: Optional[Sequence[str]] = None,
        tasks: Optional[Sequence[str]] = None,
        warn: bool = True,
    ) -> List[Refusal]:
        """Fit every map on the backbone's raw logits [N, T] of held-out rows (labels [N, T], surface
        [N]) under the module docstring's rules; returns the refused fits, each also logged as a
        WARNING (when ``warn``) naming its cell by ``surfaces`` / ``tasks`` (indices without them)."""
        self.reset()
        if self.mode == "none":
            return []
        groups = surface if self.mode == "surface" else torch.zeros_like(surface)
        refusals = []
        for t in range(raw.shape[1]):
            a, b, refused = guarded_maps(raw[:, t], labels[:, t], groups, self.scale.shape[0], task=t)
            if self.mode == "global":
                a, b = a[0].expand_as(a), b[0].expand_as(b)
            self.scale[:, t], self.bias[:, t] = a, b
            refusals += refused
        for r in refusals if warn else ():
            where = "all surfaces" if self.mode == "global" else (surfaces[r.group] if surfaces else str(r.group))
            log.warning(r.describe(where, tasks[r.task] if tasks else str(r.task)))
        return refusals
