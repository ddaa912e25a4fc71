"""What ``summary.json`` says of a split: rows, requests and bytes, the oracle's metrics per surface
and task (``oracle_metrics``), the sequences' lengths and, with long histories, what the dormant
term is worth; of a drifting world's day, also its ads, its trend and how well the earlier days'
truths still rank its impressions (``day_summary``, ``drift_summary``: the drift check).
"""

from __future__ import annotations

import time
from typing import Dict, List

import numpy as np

from pinads_rec import metrics
from pinads_rec.config import SynthConfig
from pinads_rec.data.synth.blocks import sequence_caps
from pinads_rec.data.synth.timeline import SplitPlan, Timeline
from pinads_rec.data.synth.truth import BURST_WINDOWS, STALE_DAYS, SURFACES, TASKS
from pinads_rec.data.synth.world import World


def oracle_metrics(surface: np.ndarray, labels: Dict[str, np.ndarray], probs: Dict[str, np.ndarray]) -> Dict[str, dict]:
    """Per surface (and "all") x task: rows, label rate, mean true p, oracle AUC and NE."""
    out = {}
    for si, name in [(None, "all")] + list(enumerate(SURFACES)):
        m = np.ones(len(surface), bool) if si is None else surface == si
        entry: dict = {"rows": int(m.sum())}
        for t in TASKS:
            y, p = labels[t][m], probs[t][m]
            entry[t] = {
                "rate": float(y.mean()) if len(y) else float("nan"),
                "mean_true_p": float(p.mean()) if len(p) else float("nan"),
                "oracle_auc": metrics.auc(p, y),
                "oracle_ne": metrics.normalized_entropy(p, y),
            }
        out[name] = entry
    return out


def _iso(t: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))


def _history_stats(tl: Timeline, s: SynthConfig, a: int, b: int) -> dict:
    """Mean sequence length per group, and the pins sequences' length quantiles, for the split's
    requests [a, b)."""
    out = {}
    for group, cap in sequence_caps(s).items():
        n, _ = getattr(tl, group).window(tl.user[a:b], tl.time[a:b], cap)
        out[f"mean_{group}_length"] = round(float(n.mean()), 2) if len(n) else 0.0
        if group == "pins" and len(n):
            out["pins_length"] = {
                "median": float(np.median(n)),
                "p90": float(np.quantile(n, 0.9)),
                "max": int(n.max()),
                "mean": round(float(n.mean()), 2),
            }
    return out


def burst_in_newest(tl: Timeline, user: np.ndarray, time: np.ndarray, window: int) -> np.ndarray:
    """Per request (long histories): whether its user's newest ``window`` pins events before it
    hold an event of the dormant burst."""
    n, idx = tl.pins.window(user, time, window)
    hits = np.bincount(np.repeat(np.arange(len(n)), n), weights=tl.pins_burst[idx], minlength=len(n))
    return hits > 0


def _dormant_summary(tl: Timeline, s: SynthConfig, a: int, b: int, surface, click, p_click, blind) -> dict:
    """Long histories: the dormant term's worth per surface, the click oracle AUC with the true
    probabilities and with the term removed from the logit (about the best a model blind to the
    old events can do), and how often the burst lies in the requests' newest events."""
    out: dict = {"surfaces": {}}
    for si, name in enumerate(SURFACES):
        m = surface == si
        full, without = metrics.auc(p_click[m], click[m]), metrics.auc(blind[m], click[m])
        out["surfaces"][name] = {
            "oracle_auc": full,
            "oracle_auc_without_dormant": without,
            "dormant_lift": full - without,
        }
    user, time = tl.user[a:b], tl.time[a:b]
    has = tl.dormant[user] > 0
    out["dormant_request_share"] = round(float(has.mean()), 4) if len(has) else 0.0
    # Requests of users with a dormant topic whose newest W pins events hold a burst event.
    out["burst_in_newest"] = {
        str(w): round(float(burst_in_newest(tl, user[has], time[has], w).mean()), 5) if has.any() else 0.0
        for w in BURST_WINDOWS
    }
    return out


def split_summary(tl: Timeline, plan: SplitPlan, files: List[dict]) -> dict:
    surface = np.concatenate([f.pop("_surface") for f in files])
    labels = {t: np.concatenate([f["_labels"][t] for f in files]) for t in TASKS}
    probs = {t: np.concatenate([f["_probs"][t] for f in files]) for t in TASKS}
    metrics = oracle_metrics(surface, labels, probs)
    n = plan.num_requests
    a, b = plan.first_request, plan.first_request + n
    dormant = None
    if plan.synth.long_history.enabled:
        blind = np.concatenate([f["_blind"] for f in files])
        dormant = _dormant_summary(tl, plan.synth, a, b, surface, labels["click"], probs["click"], blind)
    for f in files:
        del f["_labels"], f["_probs"], f["_blind"], f["_stale"]
    start, end = tl.boundaries[plan.name]
    out = {
        "requests": n,
        "rows": int(plan.row_offsets[-1]),
        "files": files,
        "bytes": sum(f["bytes"] for f in files),
        "surfaces": metrics,
        "request_ids": [a, b - 1],
        "time_range": [int(tl.time[a]), int(tl.time[b - 1])],
        "window": [start, end],
        "window_utc": [_iso(start), _iso(end)],
        "users": int(len(np.unique(tl.user[a:b]))),
        **_history_stats(tl, plan.synth, a, b),
    }
    if dormant is not None:
        out["dormant"] = dormant
    return out


def day_summary(world: World, tl: Timeline, plan: SplitPlan, files: List[dict], day: int) -> dict:
    """A drifting world's day ``day``: its ads (launched that day, retired at its start, shown; the
    share of its impressions that went to the ads launched that day), its trending topic, the
    oracle's AUC per task, and ``stale_truth_auc``: j -> the click AUC on its impressions of the
    truth of day ``day - j`` (blocks.stale_logits), j = 0 .. STALE_DAYS; then split_summary's numbers."""
    drift = world.drift
    click = np.concatenate([f["_labels"]["click"] for f in files])
    stale = np.concatenate([f["_stale"] for f in files])
    a, b = plan.first_request, plan.first_request + plan.num_requests
    items = tl.cand_item[tl.cand_offsets[a] : tl.cand_offsets[b]]
    out = split_summary(tl, plan, files)
    return {
        "day": day,
        "impressions": out["rows"],
        "new_ad_share": round(float((drift.launch[items] == day).mean()), 5),
        "launched_ads": int((drift.launch == day).sum()),
        "retired_ads": int((drift.retire == day).sum()),
        "live_ads": int(((drift.launch <= day) & (day < drift.retire)).sum()),
        "item_ids": [int(items.min()), int(items.max())],
        "trend_topic": int(drift.trend[day]),
        "oracle_auc": {t: out["surfaces"]["all"][t]["oracle_auc"] for t in TASKS},
        "stale_truth_auc": {str(j): metrics.auc(stale[:, j], click) for j in range(min(day, STALE_DAYS) + 1)},
        **out,
    }


def drift_summary(days: Dict[str, dict]) -> dict:
    """The drift check over a drifting world's days (``day_summary``): per j = 0 .. STALE_DAYS, the
    mean over the days d >= j of the click AUC of day d - j's truth on day d's impressions, of the
    oracle's on the same days, and of their difference (``drop``)."""
    stale_truth = {}
    for j in range(STALE_DAYS + 1):
        pairs = [(v["stale_truth_auc"][str(j)], v["oracle_auc"]["click"]) for v in days.values() if v["day"] >= j]
        if pairs:
            stale, oracle = np.array(pairs).T
            stale_truth[str(j)] = {
                "days": len(pairs),
                "auc": float(stale.mean()),
                "oracle_auc": float(oracle.mean()),
                "drop": float((oracle - stale).mean()),
            }
    shares = [v["new_ad_share"] for v in days.values() if v["day"] > 0]
    return {"stale_truth": stale_truth, "new_ad_share": float(np.mean(shares)) if shares else 0.0}
