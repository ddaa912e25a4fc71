"""Jagged rows padded to a dense block: fbgemm's ``jagged_to_padded_dense`` where fbgemm is
installed, an equivalent torch gather where it is not (a GPU machine with torch alone: the dense and
sequence arch still run there, benchmarks/arch_precision.py). Both give the same bits, forward and
backward (tests/test_jagged_fallback.py): padding copies values and zeros, it computes nothing.

In: values [N, W] (the rows of U units, one after another), offsets [U + 1], a length L.
Out: [U, L, W]; a unit's rows past L are cut off, the slots past its length are zeros.

Bags (an event's several genres, a candidate's tags): ``bag_segments`` numbers each id by its bag,
``pool_bags`` sums or averages each bag's embeddings into one row, ``pad_bags`` lays each bag's ids
out in a row of a fixed width. Output sizes come from the inputs' shapes (never from their values),
so these trace and export too.
"""

from importlib.util import find_spec

import torch
import torch.nn.functional as F

# Absent, not broken: an fbgemm that is installed but fails to import (a torch it was not built
# for) raises here, rather than quietly running the fallback.
HAVE_FBGEMM = find_spec("fbgemm_gpu") is not None
if HAVE_FBGEMM:
    import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)


def pad_jagged_torch(values: torch.Tensor, offsets: torch.Tensor, max_length: int) -> torch.Tensor:
    """The torch form: one gather from the values with a zero row appended; each slot [u, l] reads
    row offsets[u] + l, or the zero row past the unit's length. No data-dependent shape, so it
    traces and exports like the fbgemm op."""
    U = offsets.shape[0] - 1
    steps = torch.arange(max_length, device=offsets.device)
    lengths = offsets[1:] - offsets[:-1]
    index = torch.where(steps < lengths[:, None], offsets[:-1, None] + steps, values.shape[0])
    padded = F.pad(values, (0, 0, 0, 1))  # [N + 1, W], the last row zeros
    return padded.index_select(0, index.reshape(-1)).view(U, max_length, values.shape[1])


def pad_jagged(values: torch.Tensor, offsets: torch.Tensor, max_length: int) -> torch.Tensor:
    if HAVE_FBGEMM:
        return torch.ops.fbgemm.jagged_to_padded_dense(values, [offsets], [max_length], 0.0)
    return pad_jagged_torch(values, offsets, max_length)


def bag_segments(sizes: torch.Tensor, num_values: int) -> torch.Tensor:
    """[M] the bag of each of the ``num_values`` ids laid out bag after bag (``sizes`` [N] summing to M)."""
    bags = torch.arange(sizes.shape[0], device=sizes.device)
    return torch.repeat_interleave(bags, sizes, output_size=num_values)


def pool_bags(values: torch.Tensor, sizes: torch.Tensor, mean: bool) -> torch.Tensor:
    """values [M, D] of N bags of ``sizes`` [N] ids -> [N, D]: each bag's sum (or mean); an empty
    bag gives zeros."""
    segment = bag_segments(sizes, values.shape[0])
    out = values.new_zeros(sizes.shape[0], values.shape[1]).index_add(0, segment, values)
    if mean:
        out = out / sizes.clamp(min=1).to(out.dtype).unsqueeze(1)
    return out


def pad_bags(ids: torch.Tensor, sizes: torch.Tensor, width: int, fill: int) -> torch.Tensor:
    """ids [M] of N bags of ``sizes`` [N] (each at most ``width``) -> [N, width], ``fill`` past a bag's end."""
    segment = bag_segments(sizes, ids.shape[0])
    starts = torch.cumsum(sizes, 0) - sizes
    position = torch.arange(ids.shape[0], device=ids.device) - starts.index_select(0, segment)
    out = ids.new_full((sizes.shape[0], width), fill)
    return out.index_put((segment, position), ids)
