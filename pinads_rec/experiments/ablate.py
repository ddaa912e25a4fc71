"""Ablations: train variants of one model on the same data and seed, write the comparison.

    python -m pinads_rec.experiments.ablate --config configs/ablations/calibration.yaml [--quick] [--ranks 2]

An ablation file names a base experiment config, overrides for every variant, and the variants
(each a list of ``--set`` overrides), what to report and where:

    title: Surface-specific calibration
    description: one markdown paragraph: what is compared and why
    base: configs/demo.yaml
    overrides: [train.max_steps=1500]          # every variant
    quick: [synth.train_requests=4000, ...]    # added by --quick: a CI-sized run
    metrics: [auc, ne, calibration, ece]       # columns of the per-surface table
    chart: {metric: calibration, task: click}  # the PNG: this metric per surface, per variant
    out: docs/calibration.md
    variants:
      - {name: surface calibration, overrides: [model.calibration=surface]}
      - {name: no calibration, overrides: [model.calibration=none]}
      # evaluate another variant's trained model under other settings (no training):
      - {name: unified on shopping ads, eval_of: unified, overrides: ["data.row_filter={column: ad_type, values: [1]}"]}

Every variant is a real training run of ``pinads_rec/train.py`` under torchrun (gloo on CPU), in
a run directory named by a hash of its full config and of the package's source code
(``runs/ablations/<hash>``), on data generated
once for the base config (``pinads_rec.data.synth.ensure``: skipped when present). A finished
run of the same config and code is reused -- by an interrupted ablation resuming, or by another ablation that
needs the same model (the unified model of the segmentation table is the calibration table's).
The report (``ablate_report.py``) has, per variant, training examples/s and parameter counts, then
every metric per surface x task (with the oracle from the generator's true probabilities), and a
PNG chart.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import yaml

from pinads_rec import config
from pinads_rec.data import synth
from pinads_rec.experiments.ablate_report import METRIC_NAMES, slug, write_report
from pinads_rec.training.run_log import METRICS_FILE, read_run_log

REPO = Path(__file__).resolve().parents[2]


@dataclasses.dataclass
class Variant:
    name: str
    overrides: List[str] = dataclasses.field(default_factory=list)
    eval_of: Optional[str] = None


@dataclasses.dataclass
class Ablation:
    title: str
    base: str
    variants: List[Variant]
    description: str = ""
    overrides: List[str] = dataclasses.field(default_factory=list)
    quick: List[str] = dataclasses.field(default_factory=list)
    metrics: List[str] = dataclasses.field(default_factory=lambda: ["auc", "ne", "calibration"])
    chart: Dict[str, str] = dataclasses.field(default_factory=lambda: {"metric": "auc", "task": "click"})
    out: str = "docs/ablations.md"


def load_ablation(path: str) -> Ablation:
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise config.ConfigError(f"ablation file {path} does not exist") from None
    try:
        raw["variants"] = [Variant(**v) for v in raw.get("variants") or []]
        ab = Ablation(**raw)
    except TypeError as e:  # unknown or missing keys
        raise config.ConfigError(f"{path}: {e}") from None
    names = [v.name for v in ab.variants]
    if not names or len(set(names)) != len(names):
        raise config.ConfigError(f"{path}: variants need distinct names, got {names}")
    for v in ab.variants:
        if v.eval_of is not None and v.eval_of not in names[: names.index(v.name)]:
            raise config.ConfigError(f"{path}: variant {v.name!r}: eval_of {v.eval_of!r} is not an earlier variant")
    for m in ab.metrics + [ab.chart.get("metric")]:
        if m not in METRIC_NAMES:
            raise config.ConfigError(f"{path}: metric {m!r} is not one of {sorted(METRIC_NAMES)}")
    return ab


def run_summary(run_dir: Path) -> Optional[dict]:
    """The finished run's summary (metrics.jsonl's last evaluation line), if any."""
    if not (run_dir / METRICS_FILE).exists():
        return None
    return read_run_log(run_dir).summary


def _param_counts(cfg: config.ExperimentConfig) -> Dict[str, int]:
    import torch
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    from pinads_rec.models import build_model

    model = build_model(cfg.features, cfg.model, device=torch.device("meta"))
    tables = {n for n, m in model.named_modules() if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection))}
    emb = sum(p.numel() for n, p in model.named_parameters() if any(n.startswith(t + ".") for t in tables))
    return {"dense": sum(p.numel() for p in model.parameters()) - emb, "embedding": emb}


def source_digest() -> str:
    """A digest of the package's Python sources: a run trained by other code is not reused."""
    h = hashlib.sha1()
    for path in sorted((REPO / "pinads_rec").rglob("*.py")):
        h.update(str(path.relative_to(REPO)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def run_dir_for(ab: Ablation, overrides: List[str], runs: Path, ranks: int, source: Optional[str]) -> Path:
    """runs/<hash of the variant's whole config, its rank count, the run it evaluates and the code>."""
    cfg = config.to_dict(config.load(ab.base, overrides + ["train.run_dir=unset"]))
    key = json.dumps([cfg, ranks, source, source_digest()], sort_keys=True, default=str)
    return runs / hashlib.sha1(key.encode()).hexdigest()[:12]


def run_variant(
    ab: Ablation, v: Variant, overrides: List[str], run_dir: Path, ranks: int, finished: Dict[str, dict]
) -> dict:
    cfg = config.load(ab.base, overrides + [f"train.run_dir={run_dir}"])

    def comparable(c: dict) -> dict:  # a resumed run records the checkpoint's plan as its plan_file
        return dict(c, train={k: v for k, v in c["train"].items() if k not in ("plan_file", "max_steps")})

    wanted = comparable(json.loads(json.dumps(config.to_dict(cfg))))
    done = run_summary(run_dir)
    saved = run_dir / "config.json"
    if done is not None and saved.exists() and comparable(json.loads(saved.read_text())) == wanted:
        print(f"[{v.name}] reusing the finished run in {run_dir}", flush=True)
        return done
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    extra = []
    if v.eval_of is not None:  # evaluate the source's final model: resume it at its last step
        source = finished[v.eval_of]
        src_dir = Path(source["run_dir"]) / "checkpoints"
        latest = max(src_dir.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
        shutil.copytree(latest, run_dir / "checkpoints" / latest.name)
        extra = [f"train.max_steps={source['step']}"]
    print(f"[{v.name}] {'evaluating ' + v.eval_of if v.eval_of else 'training'} -> {run_dir}", flush=True)
    started = time.time()
    try:
        summary = train_py(ab.base, overrides + extra, run_dir, ranks)
    except RuntimeError as e:
        raise RuntimeError(f"variant {v.name!r}: {e}") from None
    print(f"[{v.name}] done in {time.time() - started:.0f} s", flush=True)
    return summary


def train_py(base: str, overrides: List[str], run_dir: Path, ranks: int) -> dict:
    """``pinads_rec/train.py`` under torchrun on ``ranks`` gloo processes, into ``run_dir`` (its output
    in ``train.log``): the run's summary. A failed run raises with the end of its log."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={ranks}",
        str(REPO / "pinads_rec" / "train.py"),
        "--config",
        str(base),
    ]
    for o in overrides + [f"train.run_dir={run_dir}"]:
        cmd += ["--set", o]
    with open(run_dir / "train.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO).returncode
    summary = run_summary(run_dir)
    if rc != 0 or summary is None:
        tail = (run_dir / "train.log").read_text().splitlines()[-15:]
        raise RuntimeError(f"train.py failed (exit {rc}); end of {run_dir}/train.log:\n" + "\n".join(tail))
    return summary


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="ablation YAML (configs/ablations/*.yaml)")
    p.add_argument("--quick", action="store_true", help="CI-sized data and steps (the file's `quick` overrides)")
    p.add_argument("--ranks", type=int, default=2, help="gloo processes per training run (default 2)")
    p.add_argument("--out", default=None, help="report path (default: the file's `out`; --quick: under runs/)")
    p.add_argument("--runs", default="runs/ablations", help="where the variants' run directories go")
    args = p.parse_args(argv)
    try:
        ab = load_ablation(args.config)
        common = ab.overrides + (ab.quick if args.quick else [])
        base_cfg = config.load(ab.base, common)
        for v in ab.variants:
            config.load(ab.base, common + v.overrides)  # every variant's config is valid before any run
    except config.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    tag = slug(ab.title) + ("-quick" if args.quick else "")
    out = Path(args.out or (f"runs/ablations/{tag}.md" if args.quick else ab.out))
    synth.ensure(base_cfg, Path(base_cfg.data.train_dir).parent, echo=lambda m: print(m, flush=True))
    results, params = {}, {}
    for v in ab.variants:
        overrides = common + v.overrides
        source = results[v.eval_of]["run_dir"] if v.eval_of else None
        run_dir = run_dir_for(ab, overrides, Path(args.runs), args.ranks, source)
        summary = run_variant(ab, v, overrides, run_dir, args.ranks, results)
        results[v.name] = dict(summary, run_dir=str(run_dir))
        if v.eval_of is None:
            params[v.name] = _param_counts(config.load(ab.base, overrides))
        else:
            params[v.name] = params[v.eval_of]
    command = f"python -m pinads_rec.experiments.ablate --config {args.config}" + (" --quick" if args.quick else "")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_report(ab, results, params, out, command, base_cfg)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
