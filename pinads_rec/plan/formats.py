"""The formats the planner's printouts share: bytes as GB (2^30, as TorchRec counts), numbers
without trailing zeros, and lists of ranks as ranges."""

from __future__ import annotations

from typing import Sequence

GB = 1024**3  # TorchRec's planner counts GB as GiB (its HBM_CAP is 32 * 1024**3 "32 GB")


def num(x: float) -> str:
    return f"{x:g}"


def gb(b: float) -> str:
    """Bytes as GB: two decimals, more significant digits below 0.1 GB, plain 0 for nothing."""
    v = b / GB
    if v == 0:
        return "0"
    if abs(v) >= 0.1:
        return f"{v:.2f}"
    return f"{v:.4f}" if abs(v) >= 0.0001 else "<0.0001"


def ranks(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 3, 8] -> '0-3,8'."""
    uniq = sorted(set(ranks))
    parts, i = [], 0
    while i < len(uniq):
        j = i
        while j + 1 < len(uniq) and uniq[j + 1] == uniq[j] + 1:
            j += 1
        parts.append(str(uniq[i]) if i == j else f"{uniq[i]}-{uniq[j]}")
        i = j + 1
    out = ",".join(parts)
    return out if len(ranks) == len(uniq) else f"{out} ({len(ranks)} shards)"
