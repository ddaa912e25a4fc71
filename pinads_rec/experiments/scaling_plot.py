"""The scaling sweep's PNGs under ``--out``: per swept dimension ``scaling_<dim>.png`` (examples/s,
the stacked step-time breakdown and peak memory), in a grid ``scaling_ranks_vs_<dim>.png`` (the
rank ratio along another dimension), and ``projection.png`` (the planner's GPU projection)."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional

from pinads_rec.experiments.scaling_report import rank_ratios
from pinads_rec.experiments.scaling_sweep import DIMENSIONS, Point

# The stacked step time: (label, column, column whose time is shown apart and taken out of it).
STEP_PARTS = [
    ("data loading", "data_ms", "comms_data_ms"),
    ("wait for other ranks", "comms_data_ms", None),
    ("fwd compute", "forward_ms", "comms_fwd_ms"),
    ("fwd comms", "comms_fwd_ms", None),
    ("bwd compute + emb. update", "backward_ms", "comms_bwd_ms"),
    ("bwd comms", "comms_bwd_ms", None),
    ("dense optimizer", "optimizer_ms", None),
]
STEP_COLORS = ["#9e9e9e", "#d9d9d9", "#1f77b4", "#aec7e8", "#d62728", "#ff9896", "#2ca02c"]


def _base_value(base: Point, dim: str) -> str:
    """A dimension's base value as the CSV holds it ("" for the config's own table sizes)."""
    v = getattr(base, dim)
    return str(v if v is not None else "")


def _along(rows: List[dict], dim: str, base: Point) -> List[dict]:
    """The runs that differ from the base point in ``dim`` only, ordered by it."""
    others = [d for d in DIMENSIONS if d != dim]
    sel = [r for r in rows if all(str(r[d]) == _base_value(base, d) for d in others)]
    return sorted(sel, key=lambda r: r[dim])


def _two_lines(ax, xs, rows: List[dict], solid: tuple, dashed: tuple, title: str, ylabel: str, top: float) -> None:
    """Two columns of ``rows`` against ``xs`` (``solid``/``dashed``: (column, label))."""
    for (key, label), style in ((solid, "o-"), (dashed, "s--")):
        ax.plot(xs, [r[key] for r in rows], style, label=label)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, top * max(r[solid[0]] for r in rows))
    ax.legend(loc="upper left", fontsize=8)


def _step_breakdown(ax, xs, rows: List[dict]) -> None:
    bottom = [0.0] * len(rows)
    for (label, key, minus), color in zip(STEP_PARTS, STEP_COLORS):
        h = [max(r[key] - (r[minus] if minus else 0.0), 0.0) for r in rows]
        ax.bar(xs, h, bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, h)]
    ax.set_title("step time per rank (mean of measured steps)")
    ax.set_ylabel("ms / step")
    ax.set_ylim(0, 1.6 * max(bottom))
    ax.legend(loc="upper left", fontsize=7, ncol=2)


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _sweep_figure(plt, rows: List[dict], dim: str, base: Point, out: Path) -> Path:
    """Throughput, step breakdown and memory along one swept dimension."""
    xs = [str(r[dim]) for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    throughput = ("examples_per_s", "global"), ("examples_per_s_per_rank", "per rank")
    _two_lines(axes[0], xs, rows, *throughput, "throughput", "examples / s", 1.25)
    _step_breakdown(axes[1], xs, rows)
    memory = ("peak_rss_mib", "peak RSS, largest rank"), ("base_rss_mib", "RSS after imports")
    _two_lines(axes[2], xs, rows, *memory, "memory per rank", "MiB", 1.3)
    for ax in axes:
        ax.set_xlabel(dim)
    fixed = ", ".join(
        f"{d}={getattr(base, d) if getattr(base, d) is not None else 'cfg'}" for d in DIMENSIONS if d != dim
    )
    fig.suptitle(f"{dim} sweep ({fixed})")
    return _save(plt, fig, out / f"scaling_{dim}.png")


def _ranks_vs_figure(plt, rows: List[dict], ratios: List[dict], dim: str, base: Point, out: Path) -> Path:
    """A grid's throughput per rank count and rank ratio along ``dim`` (the others at the base)."""
    others = [d for d in DIMENSIONS[1:] if d != dim]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for n in sorted({r["ranks"] for r in rows}):
        rs = sorted(
            [r for r in rows if r["ranks"] == n and all(str(r[d]) == _base_value(base, d) for d in others)],
            key=lambda r: r[dim],
        )
        axes[0].plot([str(r[dim]) for r in rs], [r["examples_per_s"] for r in rs], "o-", label=f"{n} rank(s)")
    ratios = sorted(ratios, key=lambda q: int(q["at"][dim]))
    for n in sorted({q["ranks"] for q in ratios}):
        qs = [q for q in ratios if q["ranks"] == n]
        axes[1].plot(
            [q["at"][dim] for q in qs], [q["ratio"] for q in qs], "o-", label=f"{n} vs {qs[0]['base_ranks']} ranks"
        )
        axes[1].axhline(qs[0]["ideal"], color="gray", ls=":", lw=1)
    axes[0].set_title("throughput (global)")
    axes[0].set_ylabel("examples / s")
    axes[0].set_ylim(bottom=0)
    axes[1].set_title("weak-scaling speed-up (same batch per rank)")
    axes[1].set_ylabel("examples/s ratio")
    axes[1].set_ylim(0, max(q["ideal"] for q in ratios) * 1.1)
    for ax in axes:
        ax.set_xlabel(dim)
        ax.legend(fontsize=8)
    return _save(plt, fig, out / f"scaling_ranks_vs_{dim}.png")


def _projection_figure(plt, projection: List[dict], out: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    series: Dict[str, List[dict]] = {}
    for r in projection:
        series.setdefault(str(r["table_rows"]) or "cfg", []).append(r)
    for label, rs in series.items():
        rs = sorted(rs, key=lambda r: r["gpus"])
        g = [r["gpus"] for r in rs]
        axes[0].plot(g, [r["critical_path_ms"] for r in rs], "o-", label=f"table_rows={label}")
        axes[1].plot(g, [r["embedding_examples_per_s"] for r in rs], "o-", label=f"table_rows={label}")
    axes[0].set_title("planner critical path per step")
    axes[0].set_ylabel("ms / step (embedding fwd+bwd incl. comms)")
    axes[1].set_title("implied embedding-only throughput")
    axes[1].set_ylabel("examples / s")
    gpus = sorted({r["gpus"] for r in projection})
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(gpus, [str(g) for g in gpus])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set_xlabel("GPUs (80 GiB HBM, 8 per host)")
        ax.legend(fontsize=8)
    fig.suptitle(f"TorchRec planner projection at batch {projection[0]['batch_size_per_rank']} per GPU")
    return _save(plt, fig, out / "projection.png")


def plot(
    rows: List[dict], sweeps: Dict[str, List[int]], base: Point, out: Path, projection: Optional[List[dict]] = None
) -> List[Path]:
    """Every PNG the rows (the best repeat of each point) and the projection allow; their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for dim in DIMENSIONS:
        sel = _along(rows, dim, base)
        if dim in sweeps and len(sel) >= 2:
            written.append(_sweep_figure(plt, sel, dim, base, out))
    ratios = rank_ratios(rows)
    for dim in DIMENSIONS[1:]:
        # Grid sweeps: the rank ratio along another dimension (others at the base point).
        others = [d for d in DIMENSIONS[1:] if d != dim]
        sel = [q for q in ratios if all(q["at"][d] == _base_value(base, d) for d in others)]
        if len({q["at"][dim] for q in sel}) >= 2:
            written.append(_ranks_vs_figure(plt, rows, sel, dim, base, out))
    if projection:
        written.append(_projection_figure(plt, projection, out))
    return written
