"""How much of the oracle's click AUC the KuaiRand-shaped logs reveal at all.

    python benchmarks/kuairand_ceiling.py [--users 8000] [--seed 0]

The oracle of ``pinads_rec.data.shaped_logs.kuairand`` knows each user's *current interest*, a tag
that changes every few sessions and shows only in the newest clicks. The logs reveal it weakly:
tags are drawn by popularity, so most clicks share a popular tag with most candidates, and a
random exposure early in a session follows few clicks of the new interest. Whether a model's gap
to the oracle is the model's or the data's is measured here, on the random exposures (the config's
eval split), from the generator's hidden state (``write(world=...)``):

- **oracle**: the true probability; **without current interest**: the oracle blind to it;
- **non-history logit**: the exact click logit without its history terms (base, tab, activity,
  user bias, quality, duration, freshness -- what the ids and the other features can teach a model,
  here given exactly), alone and, as a generous **ceiling**, with point-in-time history features
  a model could compute: per candidate tag, its clicks in the last 30 minutes and 3 hours and in the
  whole history, each also as a share of the clicks divided by the tag's popularity; the clicks on
  the candidate's author; the number of clicks. LightGBM, 4-fold cross-validated on the eval rows.

It prints the AUCs and each one's lift ``(AUC - 0.5) / (oracle AUC - 0.5)``. Measured:
docs/datasets.md ("what the logs reveal").
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Dict

import numpy as np

from pinads_rec.data.shaped_logs import kuairand
from pinads_rec.data.shaped_logs.common import auc

SESSION_S, RECENT_S = 1800.0, 3 * 3600.0


def history_features(w: Dict[str, np.ndarray], rows: np.ndarray) -> np.ndarray:
    """[rows, 8]: per row (an impression), from the user's earlier clicks only (the best over the
    candidate's tags): clicks of the tag in the session window, the recent window and all history,
    the session's and the recent window's and all history's share of them over the tag's popularity,
    clicks on the candidate's author, the number of earlier clicks."""
    user, t, video, click = w["user"], w["time_ms"] / 1000.0, w["video"], w["click"]
    tags, author, popularity = w["video_tags"], w["video_author"], w["tag_popularity"]
    first_of_user = np.r_[0, np.flatnonzero(user[1:] != user[:-1]) + 1]  # the log is in (user, time) order
    start = np.repeat(first_of_user, np.diff(np.r_[first_of_user, len(user)]))
    out = np.zeros((len(rows), 8))
    for k, i in enumerate(rows):
        earlier = np.arange(start[i], i)
        earlier = earlier[click[earlier]]
        out[k, 7] = len(earlier)
        if not len(earlier):
            continue
        age = t[i] - t[earlier]
        clicked_tags = tags[video[earlier]]
        windows = [age < SESSION_S, age < RECENT_S, np.ones(len(earlier), bool)]
        for tag in tags[video[i]][tags[video[i]] >= 0]:
            has = (clicked_tags == tag).any(1)
            for j, on in enumerate(windows):
                out[k, j] = max(out[k, j], has[on].sum())
                share = has[on].sum() / max(on.sum(), 1) / (popularity[tag] * len(popularity))
                out[k, 3 + j] = max(out[k, 3 + j], share)
        out[k, 6] = (author[video[earlier]] == author[video[i]]).sum()
    return out


def main(argv=None) -> Dict[str, float]:
    import lightgbm as lgb
    from sklearn.model_selection import cross_val_predict

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", type=int, default=8000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    world: Dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        summary = kuairand.write(Path(tmp), users=args.users, seed=args.seed, world=world)
    rows = np.flatnonzero(world["is_rand"] == 1)
    y = world["click"][rows].astype(int)

    def fitted(x: np.ndarray) -> float:
        model = lgb.LGBMClassifier(n_estimators=300, learning_rate=0.05, num_leaves=31, verbose=-1)
        return auc(cross_val_predict(model, x, y, cv=4, method="predict_proba")[:, 1], y)

    base = world["logit_without_history"][rows, None]
    figures = {
        "oracle": auc(world["p_click"][rows], y),
        "oracle without current interest": summary["oracle_auc_random"]["click_without_current_interest"],
        "non-history logit alone": fitted(base),
        "ceiling: non-history logit + history features": fitted(np.c_[base, history_features(world, rows)]),
    }
    oracle = figures["oracle"]
    print(f"KuaiRand-shaped logs, {args.users} users: click on the {len(rows):,} random exposures")
    for name, value in figures.items():
        print(f"  {name:48s} AUC {value:.4f}  lift {(value - 0.5) / (oracle - 0.5):.2f}")
    return figures


if __name__ == "__main__":
    main()
