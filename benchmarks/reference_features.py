"""What the reference's AUC rests on: the run's reference (pinads_rec.reference) refitted without
each group of its features, on the same rows, beside the whole; and the main task's largest
features by LightGBM's gain.

    python benchmarks/reference_features.py --config configs/demo.yaml [--set KEY=VALUE ...] [--top 15]

Groups: the history matches (per sequence group and all of them), the item's and the user's rates,
the dense features. Prints the main task's (the first task's) AUC per surface for each variant and
the top features' share of the gain. Why: when the reference beats the model on a surface, which of
its features does it is where to look in the model (README, "What the demo shows").
"""

from __future__ import annotations

import argparse
from typing import Dict, List, Optional, Sequence

import numpy as np

from pinads_rec import config
from pinads_rec.experiments import markdown
from pinads_rec.reference import fit as reference


def groups(names: List[str], cfg: config.ExperimentConfig, history: np.ndarray) -> Dict[str, np.ndarray]:
    """Variant name -> the features it keeps."""
    dense = {d.name for d in cfg.features.dense}
    out = {"all features": np.ones(len(names), bool), "no history matches": ~history}
    for g in cfg.features.sequence_groups:
        columns = {e.column for e in g.features}
        of_group = np.array(["~" in n and n.split("~")[1].split(":")[0].split(".")[0] in columns for n in names])
        if of_group.any():
            out[f"no {g.name} matches"] = ~of_group
    out["no item rates"] = np.array(["item rate" not in n for n in names])
    out["no user rates"] = np.array(["user rate" not in n for n in names])
    out["no dense features"] = np.array([n not in dense for n in names])
    return out


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    config.add_overrides_flag(p, "a config override (e.g. reference.max_train_rows=100000)")
    p.add_argument("--top", type=int, default=15, help="the main task's features shown by gain")
    args = p.parse_args(argv)
    cfg = config.load(args.config, args.overrides)
    fitted = reference.fit(cfg)
    names = fitted.features.names()
    task = cfg.features.tasks[0]
    aucs: Dict[str, dict] = {}
    for variant, keep in groups(names, cfg, fitted.features.history()).items():
        scores = fitted.scores
        if not keep.all():
            scores = np.zeros_like(fitted.scores)
            for t in range(len(cfg.features.tasks)):
                y = (fitted.y_train[:, t] > 0.5).astype(np.int64)
                model = reference.lightgbm_classifier(cfg.reference).fit(fitted.x_train[:, keep], y)
                scores[:, t] = model.predict_proba(fitted.x_eval[:, keep])[:, 1]
        rows = reference.measure(cfg, fitted.eval_split, fitted.keep_eval, scores)
        aucs[variant] = {r["surface"]: r["auc"] for r in rows if r["task"] == task.name}
        print(f"   {variant}: {len(names) - int((~keep).sum())} features", flush=True)
    surfaces = list(next(iter(aucs.values())))
    print(f"\n{task.name} AUC of the reference per surface ({cfg.reference.max_train_rows:,} training rows at most)\n")
    body = [[v] + [f"{a[s]:.4f}" for s in surfaces] for v, a in aucs.items()]
    print("\n".join(markdown.table(["features"] + surfaces, body)))
    y = (fitted.y_train[:, 0] > 0.5).astype(np.int64)
    gain = reference.lightgbm_classifier(cfg.reference).fit(fitted.x_train, y).booster_.feature_importance("gain")
    share = gain / max(gain.sum(), 1e-12)
    top = np.argsort(-share)[: args.top]
    print(f"\n{task.name}: the largest features by share of LightGBM's gain\n")
    print("\n".join(markdown.table(["feature", "gain share"], [[names[i], f"{share[i]:.3f}"] for i in top])))
    return {"auc": aucs, "gain": {names[i]: float(share[i]) for i in top}}


if __name__ == "__main__":
    main()
