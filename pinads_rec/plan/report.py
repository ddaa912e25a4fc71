"""The planner's report (``planner.plan``'s dict, the ``--out`` JSON) as text: the topology and
inputs, each table, each rank, the critical path (``format_report``); two reports side by side
(``format_comparison``)."""

from __future__ import annotations

import math
from typing import Dict, List

from pinads_rec.plan.formats import GB, gb, num, ranks
from pinads_rec.text_table import format_table


def _table(header: List[str], rows: List[List[str]], left: List[int]) -> List[str]:
    """Indented table lines; ``left``: the text columns (a GB cell may read "<0.0001", not a number)."""
    return ["  " + ln for ln in format_table(header, rows, left=left).splitlines()]


def pooling_line(report: dict) -> str:
    """How the lookups per table were counted, and the candidates per request behind them."""
    c = report.get("candidates_per_request") or {}
    if c.get("source") == "constraints":
        return "Pooling factors: the caller's per-table constraints"
    if not report["pooling_factors"]:
        return "Pooling factors: TorchRec default (1 per table and row)"
    return (
        f"Pooling factors: from the config (sequence lengths); candidates per request: {c['value']:.2f} ({c['detail']})"
    )


def _candidates(c: dict) -> str:
    return "-" if c.get("value") is None else f"{c['value']:.2f} ({c['detail']})"


def format_report(report: dict, title: str = "") -> str:
    t, res, cp = report["topology"], report["storage_reservation"], report["critical_path"]
    cuda = t["compute_device"] == "cuda"
    hosts = math.ceil(t["world_size"] / t["local_world_size"])
    out = []
    head = f"Plan for {report['config'] or 'config'}" + (f" ({title})" if title else "")
    out.append(head)
    out.append("=" * len(head))
    mem = f"{num(t['hbm_gb'])} GB HBM + {num(t['ddr_gb'])} GB DDR" if cuda else f"{num(t['ddr_gb'])} GB DDR"
    out.append(
        f"Topology: {hosts} host(s) x {t['local_world_size']} {t['compute_device']} = {t['world_size']} ranks, "
        f"{mem} per rank; batch {report['batch_size']} per rank"
    )
    out.append(
        f"Bandwidths (GB/s): HBM {num(t['hbm_bw_gbps'])}, DDR {num(t['ddr_bw_gbps'])}, "
        f"intra-host {num(t['intra_host_bw_gbps'])}, inter-host {num(t['inter_host_bw_gbps'])}"
    )
    out.append(f"Sharding types allowed: {','.join(report['sharding_types']) or 'all the device supports'}")
    out.append(pooling_line(report))
    where = "HBM" if cuda else "DDR"
    out.append(
        f"Storage reserved per rank ({res['policy']}, {num(res['percentage'])}%): "
        f"{gb(res['margin_hbm_bytes'])} GB margin + {gb(res['dense_bytes'])} GB dense (6 x params) + "
        f"{gb(res['kjt_bytes'])} GB input batches = "
        f"{gb(res['margin_hbm_bytes'] + res['dense_bytes'] + res['kjt_bytes'])} GB; "
        f"{gb(res['available_hbm_bytes'] if cuda else res['available_ddr_bytes'])} GB {where} left for embeddings"
    )
    out.append("")
    out.append(
        "Tables (GB over all shards: weights + optimizer state + the kernels' I/O buffers; "
        "cost: the shards' per-step ms, summed)"
    )
    rows = []
    for name, tb in report["tables"].items():
        mem_cols = [gb(tb["hbm_bytes"]), gb(tb["ddr_bytes"])] if cuda else [gb(tb["hbm_bytes"] + tb["ddr_bytes"])]
        rows.append(
            [
                name,
                tb["module"].rsplit(".", 1)[-1],
                f"{tb['num_embeddings']:,} x {tb['embedding_dim']}",
                gb(tb["weight_bytes"]),
                *mem_cols,
                tb["sharding_type"],
                tb["compute_kernel"],
                ranks(tb["ranks"]),
                f"{tb['cost_ms']:.3f}",
            ]
        )
    mem_head = ["HBM GB", "DDR GB"] if cuda else ["DDR GB"]
    header = ["table", "module", "rows x dim", "weights GB", *mem_head, "sharding", "kernel", "ranks", "cost ms"]
    n = len(mem_head)
    out += _table(header, rows, left=[0, 1, 2, 4 + n, 5 + n, 6 + n])
    out.append("")
    out.append("Per rank (GB: embedding shards + dense/input reservation; ms per step, planner estimates)")
    rows = []
    for r in report["per_rank"]:
        mem_cols = (
            [gb(r["hbm_bytes"]), gb(r["hbm_total_bytes"]), f"{100 * r['hbm_total_bytes'] / t['hbm_cap_bytes']:.0f}%"]
            if cuda
            else []
        )
        rows.append(
            [
                str(r["rank"]),
                str(r["host"]),
                *mem_cols,
                gb(r["ddr_total_bytes"]),
                str(r["shards"]),
                f"{r['fwd_compute']:.3f}",
                f"{r['fwd_comms']:.3f}",
                f"{r['bwd_compute']:.3f}",
                f"{r['bwd_comms']:.3f}",
                f"{r['prefetch_compute']:.3f}",
                f"{r['total']:.3f}",
                "*" if r["rank"] == cp["rank"] else "",
            ]
        )
    mem_head = ["emb HBM", "HBM used", "of cap"] if cuda else []
    header = ["rank", "host", *mem_head, "DDR used", "shards"]
    header += ["fwd comp", "fwd comms", "bwd comp", "bwd comms", "prefetch", "total ms", ""]
    out += _table(header, rows, left=[len(header) - 1])
    out.append("")
    hbm_max = max(report["per_rank"], key=lambda r: r["hbm_total_bytes"] if cuda else r["ddr_total_bytes"])
    used = hbm_max["hbm_total_bytes"] if cuda else hbm_max["ddr_total_bytes"]
    cap = t["hbm_cap_bytes"] if cuda else t["ddr_cap_bytes"]
    out.append(
        f"Critical path: rank {cp['rank']} (*), {cp['total_ms']:.3f} ms per step "
        f"(fwd {cp['fwd_compute_ms']:.3f} compute + {cp['fwd_comms_ms']:.3f} comms, "
        f"bwd {cp['bwd_compute_ms']:.3f} compute + {cp['bwd_comms_ms']:.3f} comms, "
        f"prefetch {cp['prefetch_compute_ms']:.3f})"
    )
    if "torchrec_sync_estimate_ms" in cp:
        s = cp["torchrec_sync_estimate_ms"]
        out.append(
            f"TorchRec's synchronized critical path: {s['total']:.3f} ms "
            f"({s['comms']:.3f} comms + {s['compute']:.3f} compute)"
        )
    global_batch = report["batch_size"] * t["world_size"]
    if cp["total_ms"] > 0:
        out.append(
            f"Embedding-bound rate: global batch {global_batch:,} / {cp['total_ms']:.3f} ms = "
            f"{global_batch / cp['total_ms'] / 1000:.2f} M examples/s (sparse part only: no dense compute)"
        )
    out.append(f"Most memory: rank {hbm_max['rank']}, {gb(used)} of {gb(cap)} GB {where} ({100 * used / cap:.0f}%)")
    kinds: Dict[str, List[str]] = {}
    for name, tb in report["tables"].items():
        kinds.setdefault(f"{tb['sharding_type']}/{tb['compute_kernel']}", []).append(name)
    out.append("Layouts: " + "; ".join(f"{k}: {', '.join(v)}" for k, v in kinds.items()))
    for name, tb in report["tables"].items():
        mc = tb.get("managed_collision")
        if mc:
            out.append(
                f"Managed collision: {name} ({mc['eviction']}, a round every {mc['eviction_interval']} steps, "
                f"admission {mc['admission']}): {tb['num_embeddings']:,} slots, one unknown row per rank; id map "
                f"{gb(mc['id_map_bytes'])} GB over all shards beside the rows (not in the planner's storage); raw ids "
                f"routed to the rank of their block, as its {tb['sharding_type']} shards"
            )
    planner = report["planner"]
    if planner.get("proposals") is not None:
        out.append(
            f"(planner: {planner['proposals']} proposals, {planner['plans']} plans that fit, "
            f"{planner['seconds']:.1f} s)"
        )
    return "\n".join(out)


def format_comparison(a: dict, b: dict, label_a: str, label_b: str) -> str:
    out = ["Side by side", "============", f"A = {label_a}", f"B = {label_b}", ""]
    ta, tb = a["topology"], b["topology"]
    cuda = ta["compute_device"] == "cuda" and tb["compute_device"] == "cuda"
    ra, rb = a["critical_path"], b["critical_path"]
    ga, gb_ = a["batch_size"] * ta["world_size"], b["batch_size"] * tb["world_size"]
    out.append(
        f"Critical path: A rank {ra['rank']} {ra['total_ms']:.3f} ms, B rank {rb['rank']} {rb['total_ms']:.3f} ms"
    )
    if ra["total_ms"] > 0 and rb["total_ms"] > 0:
        out.append(
            f"Embedding-bound rate: A {ga / ra['total_ms'] / 1000:.2f} M examples/s (global batch {ga:,}), "
            f"B {gb_ / rb['total_ms'] / 1000:.2f} M examples/s (global batch {gb_:,})"
        )
    key = "hbm_total_bytes" if cuda else "ddr_total_bytes"
    ma, mb = max(r[key] for r in a["per_rank"]), max(r[key] for r in b["per_rank"])
    out.append(f"Most {'HBM' if cuda else 'DDR'} on a rank: A {gb(ma)} GB   B {gb(mb)} GB")
    ca, cb = a.get("candidates_per_request") or {}, b.get("candidates_per_request") or {}
    if ca.get("value") != cb.get("value"):  # the sequence tables' lookups per row differ
        out.append(f"Candidates per request: A {_candidates(ca)}   B {_candidates(cb)}")
    out.append("")
    out.append("Tables (* = layout or ranks differ; GB: HBM + DDR over all shards)")
    rows = []
    for name in list(a["tables"]) + [n for n in b["tables"] if n not in a["tables"]]:
        x, y = a["tables"].get(name), b["tables"].get(name)

        def cell(t):
            if t is None:
                return ("-", "-", "-")
            return (
                f"{t['sharding_type']}/{t['compute_kernel']}",
                ranks(t["ranks"]),
                gb(t["hbm_bytes"] + t["ddr_bytes"]),
            )

        cx, cy = cell(x), cell(y)
        changed = x is None or y is None or cx[:2] != cy[:2]
        rows.append([("* " if changed else "  ") + name, *cx, *cy])
    header = ["table", "A layout", "A ranks", "A GB", "B layout", "B ranks", "B GB"]
    out += _table(header, rows, left=[0, 1, 2, 4, 5])
    out.append("")
    out.append("Per rank (GB used, ms per step)")
    mem = "HBM" if cuda else "DDR"
    rows = []
    for r in range(max(ta["world_size"], tb["world_size"])):
        x = a["per_rank"][r] if r < ta["world_size"] else None
        y = b["per_rank"][r] if r < tb["world_size"] else None
        gx, gy = (gb(x[key]) if x else "-"), (gb(y[key]) if y else "-")
        mx, my = (f"{x['total']:.3f}" if x else "-"), (f"{y['total']:.3f}" if y else "-")
        dm = f"{(y[key] - x[key]) / GB:+.2f}" if x and y else "-"
        dt = f"{y['total'] - x['total']:+.3f}" if x and y else "-"
        rows.append([str(r), gx, gy, dm, mx, my, dt])
    out += _table(["rank", f"A {mem}", f"B {mem}", "B-A GB", "A ms", "B ms", "B-A ms"], rows, left=[])
    return "\n".join(out)
