"""Length-bucketed padding: a sequence encoder run without padding every unit to the longest.

Self-attention costs L^2 per unit. Histories are long-tailed (a median of ~200 events with a tail to
4,000), so padding a batch to its longest unit -- or to the group's max_length -- spends most of
the work on padding. ``run_by_length`` sorts the units by length, groups them into buckets whose
lengths grow by ``GROWTH`` (a unit of length l goes to bucket floor(log_GROWTH(l))), cuts each
bucket to its own longest unit and runs the encoder once per bucket: the padded work is at most
GROWTH^2 times the real work for a quadratic encoder, about GROWTH^2 / 2 on average, instead of
(L_max / l)^2. docs/long_sequences.md compares it with padding and with torch's nested tensors.

The encoder must give outputs at a unit's valid positions that do not depend on the padding after
them (masked keys; a normalization by the unit's own length, not the padded one): then bucketed and
padded outputs agree to float rounding (tests/test_length_buckets.py).

In: an encoder ``fn(x [u, l, W], mask [u, l], *per_unit [u, l, ...]) -> [u, l, W']``, x [U, L, W],
mask [U, L] (True = real position; real positions first), per-unit tensors [U, L, ...]. Out:
[U, L, W'], zeros past each unit's bucket length.

The bucket loop is plain Python on the batch's lengths (one host sync per call on a GPU): it lives
inside the sequence arch, which the training pipeline treats as one opaque leaf. ``torch.export``
cannot trace a loop over data-dependent buckets, so while exporting the encoder runs once on the
whole padded block: the same outputs (serve/export.py).
"""

import math
from typing import Callable, List, Tuple

import torch
import torch.nn.functional as F

GROWTH = math.sqrt(2.0)


def length_buckets(lengths: torch.Tensor) -> List[Tuple[torch.Tensor, int]]:
    """(unit indices, padded length) per non-empty bucket, shortest first, for lengths [U]. Units
    sorted by length are sorted by bucket too: a bucket's padded length is its last unit's."""
    ordered, order = torch.sort(lengths, stable=True)
    bucket = torch.log(ordered.clamp(min=1).double()).div(math.log(GROWTH)).floor().long()
    _, counts = torch.unique_consecutive(bucket, return_counts=True)
    counts = counts.tolist()  # one host sync for the sizes, one for the lengths
    longest = ordered.index_select(
        0, torch.tensor(counts, dtype=torch.long, device=lengths.device).cumsum(0) - 1
    ).clamp(min=1)
    return list(zip(torch.split(order, counts), longest.tolist()))


def run_by_length(
    fn: Callable[..., torch.Tensor], x: torch.Tensor, mask: torch.Tensor, *per_unit: torch.Tensor
) -> torch.Tensor:
    if torch.compiler.is_exporting():
        return fn(x, mask, *per_unit)
    U, L = mask.shape
    parts, order = [], []
    for idx, length in length_buckets(mask.sum(dim=1)):
        cut = [t.index_select(0, idx)[:, :length] for t in (x, mask, *per_unit)]
        y = fn(*cut)
        parts.append(F.pad(y, (0, 0, 0, L - length)))
        order.append(idx)
    if not parts:  # no unit at all
        return fn(x, mask, *per_unit)
    # One gather puts the buckets' units back in their places.
    inverse = torch.empty_like(mask[:, 0], dtype=torch.long)
    sorted_units = torch.cat(order)
    inverse[sorted_units] = torch.arange(U, device=mask.device)
    return torch.cat(parts, dim=0).index_select(0, inverse)
