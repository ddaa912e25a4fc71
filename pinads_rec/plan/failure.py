"""A plan that does not fit, explained: TorchRec's ``PlannerError`` text made readable (byte counts
in GB, no per-shard Perf dumps), then which tables cannot be placed and the tables' smallest
footprints against what the ranks have left after the storage reservation."""

from __future__ import annotations

import re
import textwrap
from typing import Dict, List, Tuple

from pinads_rec.plan.formats import GB, gb
from pinads_rec.text_table import format_table


def readable(message: str) -> List[str]:
    """TorchRec's error text with byte counts in GB, without per-shard Perf dumps, wrapped."""

    def storage(m):
        hbm, ddr = int(m.group(1)), int(m.group(2))
        return f"Storage(hbm={hbm / GB:.2f} GB, ddr={ddr / GB:.2f} GB)"

    text = re.sub(r"Storage\(hbm=(\d+), ddr=(\d+)(?:, ssd=\d+)?\)", storage, message.expandtabs(2))
    text = re.sub(r",? ?perf: Perf\([^)]*\)", "", text)
    out = []
    for line in text.strip().splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        out += textwrap.wrap(
            line.strip(), width=110, initial_indent=" " * (indent + 2), subsequent_indent=" " * (indent + 6)
        ) or [""]
    return out


def explain_failure(error, spec, model, sharders, reservation, capture, batch: int) -> str:
    """TorchRec's message, tidied, then which tables cannot be placed and the totals against what
    the ranks have left after the storage reservation. ``spec``: the PlanSpec planned for;
    ``capture``: the planner's stats capture (its enumerator lists the search space)."""
    lines = [f"no sharding plan fits {spec.describe()}, batch {batch} per rank.", "TorchRec's planner says:"]
    lines += readable(str(error))
    left = reservation.last_reserved_topology
    if left is None:  # the reservation itself failed: nothing is left for the embeddings
        return "\n".join(lines)
    try:
        options = capture.enumerator.enumerate(model, sharders) if capture.enumerator is not None else []
    except Exception:
        options = []
    if not options:
        return "\n".join(lines)
    rank_hbm, rank_ddr = left.devices[0].storage.hbm, left.devices[0].storage.ddr
    all_hbm, all_ddr = sum(d.storage.hbm for d in left.devices), sum(d.storage.ddr for d in left.devices)
    by_table: Dict[str, list] = {}
    for so in options:
        by_table.setdefault(so.name, []).append(so)
    rows, misfits, need_hbm, min_hbm, min_hbm_ddr = [], [], 0, 0, 0
    for name, opts in sorted(by_table.items(), key=lambda kv: -kv[1][0].tensor.numel()):

        def largest(so):
            return max(so.shards, key=lambda shard: shard.storage.hbm + shard.storage.ddr)

        in_hbm = [so for so in opts if so.total_storage.ddr == 0]
        best_hbm = min(in_hbm, key=lambda so: _prefer(so, so.total_storage.hbm)) if in_hbm else None
        offload = [so for so in opts if so.total_storage.ddr > 0]
        best_off = min(offload, key=lambda so: _prefer(so, so.total_storage.hbm)) if offload else None
        least = min(opts, key=lambda so: _prefer(so, so.total_storage.hbm))
        need_hbm += best_hbm.total_storage.hbm if best_hbm else least.total_storage.hbm
        min_hbm += least.total_storage.hbm
        min_hbm_ddr += least.total_storage.ddr
        fits = any(all(s.storage.hbm <= rank_hbm and s.storage.ddr <= rank_ddr for s in so.shards) for so in opts)
        smallest = min(opts, key=lambda so: _prefer(so, largest(so).storage.hbm + largest(so).storage.ddr))
        big = largest(smallest)
        if not fits:
            misfits.append(
                f"{name} (its smallest shard, {smallest.sharding_type}/{smallest.compute_kernel}, needs "
                f"{gb(big.storage.hbm)} GB HBM + {gb(big.storage.ddr)} GB DDR)"
            )
        rows.append(
            [
                name,
                _shape(opts[0]),
                gb(opts[0].tensor.numel() * opts[0].tensor.element_size()),
                f"{gb(best_hbm.total_storage.hbm)} ({best_hbm.sharding_type}/{best_hbm.compute_kernel})"
                if best_hbm
                else "-",
                f"{gb(best_off.total_storage.hbm)} + {gb(best_off.total_storage.ddr)} "
                f"({best_off.sharding_type}/{best_off.compute_kernel})"
                if best_off
                else "-",
                gb(big.storage.hbm + big.storage.ddr),
                "yes" if fits else "NO",
            ]
        )
    lines.append("")
    lines.append(
        f"Per rank after the reservation: {gb(rank_hbm)} GB HBM + {gb(rank_ddr)} GB DDR "
        f"({spec.world_size} rank(s): {gb(all_hbm)} GB HBM + {gb(all_ddr)} GB DDR in all)."
    )
    lines.append(
        "Tables (GB over all shards, weights + optimizer state + I/O buffers, in the layout that needs "
        "the least HBM; 'fits a rank': some layout has every shard within a rank's memory):"
    )
    header = [
        "table",
        "rows x dim",
        "weights GB",
        "all in HBM, GB",
        "with UVM offload, HBM + DDR GB",
        "smallest shard GB",
        "fits a rank?",
    ]
    # Text columns by name: a GB column may hold "<0.0001", which is not a number to format_table.
    lines += ["  " + ln for ln in format_table(header, rows, left=[0, 1, 3, 4, 6]).splitlines()]
    lines.append(
        f"All tables in HBM need at least {gb(need_hbm)} GB (HBM left: {gb(all_hbm)} GB); with UVM "
        f"offload at least {gb(min_hbm)} GB HBM + {gb(min_hbm_ddr)} GB DDR (DDR left: {gb(all_ddr)} GB)."
    )
    if misfits:
        lines.append("Does not fit on any rank in any layout: " + "; ".join(misfits) + ".")
        lines.append("Add ranks (row-wise shards get smaller), more memory per rank, or shrink these tables.")
    elif min_hbm > all_hbm or min_hbm_ddr > all_ddr:
        lines.append(
            "Every table fits a rank on its own, but not all of them together: add ranks or memory, "
            "shrink tables, or lower --reserve-pct."
        )
    else:
        lines.append(
            "The totals would fit: the allowed layouts (sharding types, kernels) cannot be packed onto "
            "the ranks; allow more sharding types (--sharding-types) or add ranks."
        )
    return "\n".join(lines)


def _prefer(so, size: float) -> Tuple[int, bool]:
    """Sort key: size to the MB, and of equal sizes a sharded layout before a replicated one."""
    return round(size / 2**20), so.sharding_type == "data_parallel"


def _shape(so) -> str:
    return f"{int(so.tensor.shape[0]):,} x {int(so.tensor.shape[1])}"
