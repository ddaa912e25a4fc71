"""The AUC guard of the embedding tables' dtypes: what serving each table smaller costs, measured on
the eval split, and the smallest dtype per table within a tolerance.

    python -m pinads_rec.serve guard --run runs/demo [--data EVAL] [--dtypes fp16 int8 int4]
        [--tolerance 0.001] [--calibration-tolerance 0.005] [--write serve_tables.yaml]

The run's model is loaded once with every table in FP32 (the reference), then copied and quantized
(serve/quantize.py) once per (table, dtype) -- that table alone at that dtype -- and once per dtype
with every table at it. Each variant scores the same eval batches; per surface x task it gives the
AUC and the calibration (mean prediction / mean label) against the reference's.

A table's choice is the smallest dtype whose worst |AUC delta| over every surface x task is within
``tolerance`` and whose worst calibration change within ``calibration_tolerance`` (a relative
change: the bid a calibrated probability prices moves with it). Errors of several tables add up,
so the choice is then scored whole; while it breaks a tolerance, the table costing the most goes
back one dtype (toward FP32). ``--write`` saves it
as the config's ``serve:`` section (``serve.table_dtypes``), which ``serve score / export / online
--set`` and a run's config take.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import yaml
from torch import nn

from pinads_rec.data.loader.batch import Batch
from pinads_rec.metrics import MetricAccumulator
from pinads_rec.serve.batching import ScoringBatches
from pinads_rec.serve.quantize import DTYPES, embedding_bytes, quantize_tables, table_bytes
from pinads_rec.serve.scoring import Predictor

ORDER = list(DTYPES)  # fp32, fp16, int8, int4: largest to smallest
Cell = Tuple[str, str]  # (surface, task)


def scored(model: nn.Module, batches: Sequence[Batch], tasks: List[str], surfaces: List[str]) -> Dict[Cell, dict]:
    """Per surface x task, the metrics row of ``model``'s scores of ``batches``."""
    acc = MetricAccumulator(tasks, surfaces)
    with torch.inference_mode():
        for b in batches:
            acc.update(torch.sigmoid(model(b).float()), b.labels, b.surface, valid=b.valid)
    return {(r["surface"], r["task"]): r for r in acc.compute(gather=False)}


def deltas(variant: Dict[Cell, dict], reference: Dict[Cell, dict]) -> Dict[Cell, dict]:
    """Per cell: the AUC delta and the calibration's relative change against the reference."""
    out = {}
    for cell, r in reference.items():
        v = variant[cell]
        out[cell] = {"auc": v["auc"] - r["auc"], "calibration": v["calibration"] / r["calibration"] - 1.0}
    return out


def worst_auc(d: Dict[Cell, dict]) -> float:
    return max(abs(x["auc"]) for x in d.values())


def worst_calibration(d: Dict[Cell, dict]) -> float:
    return max(abs(x["calibration"]) for x in d.values())


def guard(
    run_dir: Union[str, Path],
    data_dir: Optional[str] = None,
    dtypes: Sequence[str] = ("fp16", "int8", "int4"),
    tolerance: float = 0.001,
    calibration_tolerance: float = 0.005,
    batch_size: int = 4096,
    precision: Optional[str] = None,
    step: Optional[int] = None,
    echo=print,
) -> dict:
    """The measurements and the choice: {"tables": {table: {"rows", "dim", "bytes": {dtype: n},
    "deltas": {dtype: {cell: ...}}}}, "all": {dtype: {"deltas", "bytes"}}, "choice": {table: dtype},
    "choice_deltas", "choice_bytes", "fp32_bytes"}."""
    fp32 = {"embedding_dtype": "fp32", "table_dtypes": {}}
    predictor = Predictor.from_run(run_dir, precision, step, serve=fp32)
    cfg = predictor.cfg
    f = cfg.features
    tasks = [t.name for t in f.tasks]
    batches = [b for _, b in ScoringBatches(cfg, data_dir or cfg.data.eval_dir, batch_size)]
    echo(f"{sum(int(b.valid.sum()) for b in batches):,} eval rows in {len(batches)} batches")
    reference = scored(predictor.model, batches, tasks, f.surfaces)
    tables = [t.name for t in f.tables]
    sizes = {d: table_bytes(cfg, d) for d in ["fp32", *dtypes]}

    def variant(chosen: Dict[str, str]) -> Tuple[Dict[Cell, dict], int]:
        model = quantize_tables(copy.deepcopy(predictor.model), {t: chosen.get(t, "fp32") for t in tables})
        return deltas(scored(model, batches, tasks, f.surfaces), reference), embedding_bytes(model)

    out: dict = {"tables": {}, "all": {}, "tolerance": tolerance, "dtypes": list(dtypes)}
    out["calibration_tolerance"] = calibration_tolerance

    def within(d: Dict[Cell, dict]) -> bool:
        return worst_auc(d) <= tolerance and worst_calibration(d) <= calibration_tolerance

    for t in f.tables:
        entry = {"rows": t.num_embeddings, "dim": t.embedding_dim, "bytes": {d: sizes[d][t.name] for d in sizes}}
        entry["deltas"] = {d: variant({t.name: d})[0] for d in dtypes}
        out["tables"][t.name] = entry
        echo(f"  {t.name}: " + ", ".join(f"{d} worst |dAUC| {worst_auc(entry['deltas'][d]):.5f}" for d in dtypes))
    for d in dtypes:
        got, nbytes = variant({t: d for t in tables})
        out["all"][d] = {"deltas": got, "bytes": nbytes}
    choice = {
        t: min(
            (d for d in dtypes if within(out["tables"][t]["deltas"][d])),
            key=lambda d: sizes[d][t],
            default="fp32",
        )
        for t in tables
    }
    got, nbytes = variant(choice)
    while not within(got) and any(d != "fp32" for d in choice.values()):
        # The table whose own choice costs the most (each delta over its tolerance) goes back one dtype.
        def cost(t: str) -> float:
            d = out["tables"][t]["deltas"][choice[t]]
            return max(worst_auc(d) / tolerance, worst_calibration(d) / calibration_tolerance)

        costly = max((t for t in tables if choice[t] != "fp32"), key=cost)
        larger = [d for d in ["fp32", *dtypes] if sizes[d][costly] > sizes[choice[costly]][costly]]
        choice[costly] = min(larger, key=lambda d: sizes[d][costly])
        got, nbytes = variant(choice)
    out.update(choice=choice, choice_deltas=got, choice_bytes=nbytes)
    out["fp32_bytes"] = embedding_bytes(predictor.model)
    out["main_task"] = tasks[0]
    return out


def as_json(result: dict) -> dict:
    """``result`` with its (surface, task) keys as "surface/task" strings."""

    def keyed(d):
        return {f"{s}/{t}": v for (s, t), v in d.items()}

    out = dict(result, choice_deltas=keyed(result["choice_deltas"]))
    tables = result["tables"].items()
    out["tables"] = {n: dict(t, deltas={d: keyed(x) for d, x in t["deltas"].items()}) for n, t in tables}
    out["all"] = {d: dict(a, deltas=keyed(a["deltas"])) for d, a in result["all"].items()}
    return out


def serve_section(choice: Dict[str, str]) -> dict:
    """The choice as a config's ``serve:`` section (fp32 tables left to the default)."""
    return {"serve": {"embedding_dtype": "fp32", "table_dtypes": {t: d for t, d in choice.items() if d != "fp32"}}}


def write_choice(choice: Dict[str, str], path: Union[str, Path]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "# The AUC guard's choice of each table's served dtype (python -m pinads_rec.serve guard).\n"
        + yaml.safe_dump(serve_section(choice), sort_keys=False)
    )
    return path


def set_flags(choice: Dict[str, str]) -> str:
    """The choice as ``serve score / export / online`` flags."""
    return " ".join(f"--set table_dtypes.{t}={d}" for t, d in choice.items() if d != "fp32")


def report(result: dict) -> str:
    """The guard's tables as text: per table and dtype its size and the main task's AUC and
    calibration deltas per surface; every table at each dtype; the choice."""
    from pinads_rec.text_table import format_table

    main = result["main_task"]
    surfaces = [s for (s, task) in next(iter(result["all"].values()))["deltas"] if task == main]
    mib = 2.0**20

    def cells(d: Dict[Cell, dict]) -> List[str]:
        return [f"{d[(s, main)]['auc']:+.5f} / {100 * d[(s, main)]['calibration']:+.2f}%" for s in surfaces]

    head = ["table", "rows x dim", "dtype", "MiB"] + [f"{s} dAUC / dcal" for s in surfaces] + ["worst |dAUC|, any task"]
    rows = []
    for name, t in result["tables"].items():
        rows.append(
            [name, f"{t['rows']:,} x {t['dim']}", "fp32", f"{t['bytes']['fp32'] / mib:.3f}"]
            + [""] * len(surfaces)
            + [""]
        )
        for d in result["dtypes"]:
            rows.append(
                ["", "", d, f"{t['bytes'][d] / mib:.3f}"] + cells(t["deltas"][d]) + [f"{worst_auc(t['deltas'][d]):.5f}"]
            )
    whole = [["every table", "", "fp32", f"{result['fp32_bytes'] / mib:.3f}"] + [""] * len(surfaces) + [""]]
    for d, a in result["all"].items():
        ratio = result["fp32_bytes"] / a["bytes"]
        whole.append(
            ["every table", f"{ratio:.2f}x smaller", d, f"{a['bytes'] / mib:.3f}"]
            + cells(a["deltas"])
            + [f"{worst_auc(a['deltas']):.5f}"]
        )
    ratio = result["fp32_bytes"] / result["choice_bytes"]
    whole.append(
        ["the choice", f"{ratio:.2f}x smaller", "mixed", f"{result['choice_bytes'] / mib:.3f}"]
        + cells(result["choice_deltas"])
        + [f"{worst_auc(result['choice_deltas']):.5f}"]
    )
    choice = ", ".join(f"{t} {d}" for t, d in result["choice"].items())
    return (
        f"main task {main}: AUC delta / calibration change against FP32 per surface\n\n"
        + format_table(head, rows)
        + "\n\n"
        + format_table(head, whole)
        + f"\n\nthe choice (on every surface x task, |dAUC| <= {result['tolerance']} and |dcal| <= "
        + f"{100 * result['calibration_tolerance']:.2f}%): {choice}"
    )
