"""Resilient Batch Norm (sequence-modeling article, "Model Stability: Resilient Batch Norm").

A drop-in for ``nn.BatchNorm1d`` on [B, C] inputs that cannot blow up on a zero-variance or
suddenly shifted column (a stale or absent feature filled with a default, a low-coverage shift).

In training, per column c:

1. batch mean ``m_c`` and unbiased batch variance ``v_c`` (what ``nn.BatchNorm1d`` feeds its
   running variance);
2. the column is *left out* of the running-statistics update (mean and variance both) when

   - ``v_c <= minimal_variance`` (strictly above is required, so ``minimal_variance = 0`` still
     rejects an exactly constant column), or
   - its change ratio ``max(v_c / rv_c, rv_c / v_c)`` -- symmetric: a variance 10x larger and one
     10x smaller count alike -- exceeds ``variance_shift_threshold`` (``rv_c``: running variance);

3. every other column takes BatchNorm's momentum update:
   ``rm_c <- (1 - momentum) rm_c + momentum m_c``, ``rv_c <- (1 - momentum) rv_c + momentum v_c``;
4. the input is normalized with the **running** statistics (in training: as updated by this batch,
   the article's order of steps), in training as in eval: ``y = (x - rm) / sqrt(rv + eps)``, then
   scaled and shifted (``weight``, ``bias``).

First batches: a column's running statistics are uninitialized (``initialized[c]`` False) until
the first batch whose variance passes the minimal-variance check; that batch's mean and variance
are adopted as they are (no shift check, nothing to compare with; no EMA from the 0 / 1 defaults,
which would normalize a feature of mean 5 to ~5 for dozens of steps). Until then the column passes
through as identity (then ``weight``/``bias``), so a column that starts out constant never divides
by a zero variance. ``num_masked[c]`` counts the training batches column c was left out of.

Limitation (as in the article): a genuine, lasting variance change larger than the threshold keeps
that column's statistics frozen at their pre-shift values; the threshold is the knob.

In: x [B, C] float. Out: [B, C]. All state is in buffers (state_dict round-trips). No Python
branch on tensor values (masks are ``torch.where``s), and the statistics step is one
``torch.fx.wrap``-ed call, so the module FX-traces (``TrainPipelineSparseDist`` traces the model).
Under DistributedModelParallel it is a plain dense module: like ``nn.BatchNorm1d`` under DDP (which
DMP wraps with ``broadcast_buffers=False``), each rank updates its own buffers from its own batches.
"""

from typing import Tuple

import torch
from torch import nn


@torch.fx.wrap
def _running_stats(
    x: torch.Tensor,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    initialized: torch.Tensor,
    num_masked: torch.Tensor,
    num_batches_tracked: torch.Tensor,
    training: bool,
    minimal_variance: float,
    variance_shift_threshold: float,
    momentum: float,
    eps: float,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """In training, updates the running statistics in place (the masked momentum update); returns
    the mean and 1/std to normalize with. One traced call (``torch.fx.wrap``): an FX trace proxies
    parameters, not buffers, so the buffer arithmetic would otherwise be frozen into constants."""
    if training:
        x = x.detach()
        batch_mean = x.mean(dim=0)
        batch_var = x.var(dim=0)  # unbiased; NaN for a one-row batch, which then fails the checks
        ratio = torch.maximum(batch_var / running_var, running_var / batch_var)
        usable = batch_var > minimal_variance
        steady = ~initialized | (ratio <= variance_shift_threshold)
        update = usable & steady
        m = momentum
        new_mean = torch.where(initialized, (1 - m) * running_mean + m * batch_mean, batch_mean)
        new_var = torch.where(initialized, (1 - m) * running_var + m * batch_var, batch_var)
        running_mean.copy_(torch.where(update, new_mean, running_mean))
        running_var.copy_(torch.where(update, new_var, running_var))
        initialized.copy_(initialized | update)
        num_masked.add_((~update).long())
        num_batches_tracked.add_(1)
    # Normalize with running statistics: a zero-variance batch would otherwise divide by sqrt(eps).
    # A column never initialized passes through (0 mean, unit scale).
    mean = torch.where(initialized, running_mean, torch.zeros_like(running_mean))
    inv_std = torch.where(initialized, torch.rsqrt(running_var + eps), torch.ones_like(running_var))
    return mean, inv_std


class ResilientBatchNorm1d(nn.Module):
    def __init__(
        self,
        num_features: int,
        minimal_variance: float = 1e-4,
        variance_shift_threshold: float = 10.0,
        momentum: float = 0.1,
        eps: float = 1e-5,
        affine: bool = True,
    ):
        super().__init__()
        if variance_shift_threshold <= 1.0:
            raise ValueError(f"variance_shift_threshold is a ratio and must be > 1, got {variance_shift_threshold}")
        self.num_features = num_features
        self.minimal_variance = minimal_variance
        self.variance_shift_threshold = variance_shift_threshold
        self.momentum = momentum
        self.eps = eps
        self.affine = affine
        self.weight = nn.Parameter(torch.ones(num_features)) if affine else None
        self.bias = nn.Parameter(torch.zeros(num_features)) if affine else None
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))
        self.register_buffer("initialized", torch.zeros(num_features, dtype=torch.bool))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))
        self.register_buffer("num_masked", torch.zeros(num_features, dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean, inv_std = _running_stats(
            x,
            self.running_mean,
            self.running_var,
            self.initialized,
            self.num_masked,
            self.num_batches_tracked,
            self.training,
            self.minimal_variance,
            self.variance_shift_threshold,
            self.momentum,
            self.eps,
        )
        y = (x - mean) * inv_std
        if self.affine:
            y = y * self.weight + self.bias
        return y

    def extra_repr(self) -> str:
        return (
            f"{self.num_features}, minimal_variance={self.minimal_variance}, "
            f"variance_shift_threshold={self.variance_shift_threshold}, momentum={self.momentum}, "
            f"eps={self.eps}, affine={self.affine}"
        )
