"""Three ways to give the ads that keep arriving a row, side by side on the daily loop.

    python -m pinads_rec.experiments.id_mappings [--config configs/continuous_managed.yaml]
        [--out runs/id_mappings] [--ranks 2] [--report docs/continuous.md] [--set KEY=VALUE ...]

The drifting world's daily loop (``continuous.py``, its ``incremental`` strategy: yesterday's model
warm-started on each new day) three times over the same days, the ad table the same size each time
(``--config``'s item table, 500 rows for ids that reach 750), its ids mapped three ways:

- ``hashed``: ``hash: true``, an id beyond the table takes the row of id mod size, shared for good;
- ``vocabulary``: ``build.vocabularies`` fitted once on the first day's build (the loop's ``--raw``:
  each day built from the raw logs through it, in row groups of as many requests as the generator's,
  so that the calibration holdout, the latest row groups, leaves each variant the same rows to
  train on), an id it never kept in the unknown bucket;
- ``managed``: the config's own ``managed_collision`` (TorchRec's MCH, LRU).

The vocabulary loop runs first and generates the world (raw logs too); the others read the same
generated days. Each day's model is scored on the next day as serving scores it, over every row and
over the ads by age: launched that next day (``new``: no model saw them), first shown on the day
trained on (``recent``: younger than a day when the model was published), shown before it
(``older``). Finished runs are reused. ``--report`` writes the comparison between the
``ID_START`` / ``ID_END`` marks of the page (docs/continuous.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from pinads_rec import arguments, config
from pinads_rec.experiments.continuous import Loop, run_loop
from pinads_rec.experiments.continuous_report import metric_value

VARIANTS = {  # name -> (overrides of the config, built from the raw logs)
    "vocabulary": (["features.tables.item.managed_collision=null", "build.vocabularies=[{table: item}]"], True),
    "hashed": (["features.tables.item.managed_collision=null", "features.tables.item.hash=true"], False),
    "managed": ([], False),
}
SLICES = ("all", "new", "recent", "older")
ID_START, ID_END = "<!-- id-mappings:start -->", "<!-- id-mappings:end -->"


def run(config_path: str, overrides: List[str], out: Path, ranks: int, echo=print) -> Dict[str, List[dict]]:
    """Each variant's loop (``<out>/<variant>/``, the data in ``<out>/vocabulary/data``); its rows."""
    for name, (extra, _) in VARIANTS.items():  # every variant's config loads before the first loop runs
        try:
            config.load(config_path, overrides + extra)
        except config.ConfigError as e:
            raise config.ConfigError(f"variant {name}: {e}") from None
    results = {}
    for name, (extra, raw) in VARIANTS.items():
        where = out / name
        if name != "vocabulary":  # the same generated days as the vocabulary loop's
            where.mkdir(parents=True, exist_ok=True)
            if not (where / "data").exists():
                (where / "data").symlink_to((out / "vocabulary" / "data").resolve())
        if raw:  # day builds cut in row groups as the generator's: the calibration holdout takes the same rows
            cfg = config.load(config_path, overrides)
            extra = extra + [
                f"build.requests_per_row_group={int(cfg.synth.row_group_size // cfg.synth.candidates_per_request)}"
            ]
        # The comparison reads each day's run, never a serving artifact: nothing is published.
        loop = Loop(
            config_path, overrides + extra, where, strategies=("incremental",), ranks=ranks, raw=raw, publish=False
        )
        echo(f"--- {name}")
        results[name] = run_loop(loop, echo=echo)
    return results


def table_bytes(cfg: config.ExperimentConfig) -> int:
    """The ad table's rows (fp32) and, managed, its id map."""
    from pinads_rec.managed_collision import id_map_bytes

    t = cfg.features.table("item")
    return t.num_embeddings * t.embedding_dim * 4 + (id_map_bytes(t) if t.managed_collision else 0)


def summary(results: Dict[str, List[dict]]) -> Dict[str, dict]:
    """Per variant: the next-day click AUC of each slice averaged over the days after the first
    (day 0's model saw no earlier day: every ad is recent), the rows of each slice, examples/s."""
    out = {}
    for name, rows in results.items():
        later = [r for r in rows if r["day"] > 0]
        auc = {s: [metric_value(r["eval"][s], "auc") for r in later] for s in SLICES}
        out[name] = {
            "auc": {s: statistics.mean(v) if v and None not in v else None for s, v in auc.items()},
            "rows": {s: statistics.mean(metric_value(r["eval"][s], "examples") or 0 for r in later) for s in SLICES},
            "examples_per_s": statistics.mean(r["rows_trained"] / r["train_seconds"] for r in later),
            "train_seconds": statistics.mean(r["train_seconds"] for r in later),
            "days": len(later),
        }
    return out


def _f(x: Optional[float], spec: str = ".4f") -> str:
    return "-" if x is None else format(x, spec)


def report(results: Dict[str, List[dict]], config_path: str, overrides: List[str], ranks: int) -> str:
    from pinads_rec.experiments.harness.provenance import code_version
    from pinads_rec.experiments.markdown import table

    s = summary(results)
    sizes = {name: table_bytes(config.load(config_path, overrides + VARIANTS[name][0])) for name in VARIANTS}
    header = ["ad ids", "click AUC", "new ads", "recent ads", "older ads", "examples/s", "ad table MiB"]
    body = [
        [name] + [_f(v["auc"][k]) for k in SLICES] + [f"{v['examples_per_s']:,.0f}", f"{sizes[name] / 2**20:.2f}"]
        for name, v in s.items()
    ]
    m = s["managed"]["auc"]
    rows = s["managed"]["rows"]
    lines = [
        f"Generated by `python -m pinads_rec.experiments.id_mappings --config {config_path}"
        + "".join(f" --set {o}" for o in overrides)
        + f" --ranks {ranks}` (code {code_version()}): next-day click AUC averaged over the "
        f"{s['managed']['days']} days after the first; examples/s of each day's training (its rows over its "
        f"seconds, {ranks} gloo ranks, the three run one after the other).",
        "",
    ]
    lines += table(header, body, align="lrrrrrr")
    lines.append("")
    for other in ("hashed", "vocabulary"):
        o = s[other]["auc"]
        gaps = ", ".join(f"{k} {m[k] - o[k]:+.4f}" for k in SLICES if m[k] is not None and o[k] is not None)
        lines.append(f"- managed minus {other}: {gaps}.")
    lines.append(
        f"- Rows a next day holds, on average: {rows['all']:,.0f}; new ads {rows['new']:,.0f} "
        f"({rows['new'] / rows['all']:.0%}), recent {rows['recent']:,.0f} ({rows['recent'] / rows['all']:.0%}), "
        f"older {rows['older']:,.0f}."
    )
    return "\n".join(lines)


def write_report(text: str, out: Path) -> Path:
    page = out.read_text() if out.exists() else ""
    if ID_START in page and ID_END in page:
        page = page[: page.index(ID_START) + len(ID_START)] + "\n" + text + "\n" + page[page.index(ID_END) :]
    else:
        page += f"\n{ID_START}\n{text}\n{ID_END}\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/continuous_managed.yaml")
    config.add_overrides_flag(p, "an override of every variant's training (e.g. synth.drift.days=4)")
    p.add_argument("--out", default="runs/id_mappings", type=arguments.output_dir)
    p.add_argument("--ranks", type=arguments.positive_int, default=2)
    p.add_argument(
        "--report",
        default=None,
        type=arguments.output_file,
        help="write the comparison into this page (e.g. docs/continuous.md)",
    )
    args = p.parse_args(argv)
    try:
        results = run(args.config, args.overrides, Path(args.out), args.ranks)
    except config.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    text = report(results, args.config, args.overrides, args.ranks)
    print(text)
    (Path(args.out) / "id_mappings.json").write_text(json.dumps(summary(results), indent=1))
    if args.report:
        print(f"wrote {write_report(text, Path(args.report))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
