"""Raw logs in the exact layout of Taobao's "Ad Display/Click Data" (Tianchi dataset 56), with a
planted truth kept aside: the four CSVs ``configs/datasets/taobao_ad.yaml`` reads, as the public
dataset has them, plus ``truth.csv`` (the true click probability of every impression).

This is not the demo's generator in another layout: its world is a shopping site's.

- **Users** browse in *sessions* over 22 days (2017-04-22..05-13, Beijing time). Each session has
  an intent category -- one of the user's 2-4 favourite categories (40%) or any category, drawn by
  popularity (60%) -- and most of its page views, carts, favourites and buys (``behavior_log.csv``)
  fall in that category.
- **Impressions** (``raw_sample.csv``, 2017-05-06..05-13) happen mostly inside sessions, seconds
  after one of its events; a request is one user at one second on one placement and holds 1 ad
  (80%), 2-3, or up to 8. Ads are shown by a recommender that already knows a little: some from the
  session's intent category, some from a favourite, the rest by popularity.
- **The click** is drawn from ``sigmoid(logit)`` with the logit a sum of: a base rate, the
  placement (``430539_1007`` lower), the ad's quality, the user's propensity, a small profile
  effect (shopping level), **the ad's category being the session's intent** (visible only in the
  newest behaviour events before the impression), **the ad's category being a favourite** (visible
  in the older history), and the ad's brand having been viewed in the session.
- Quirks of the real files: ``NULL`` brands in ``ad_feature.csv`` and ``behavior_log.csv``, some
  ads shown but missing from ``ad_feature.csv``, the ``user_profile.csv`` header ending with a
  space, blank ``pvalue_level`` / ``new_user_class_level``, users without a profile row, a few
  impressions logged twice, neither log sorted.

Ids are drawn from the real ranges (users to 1.14M, ads to 847k, categories to 12,960, brands to
461k). ``write`` returns (and saves as ``summary.json``) the counts and the oracle's click AUC per
placement and Beijing day.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict

import numpy as np
import pandas as pd

from pinads_rec.data.shaped_logs.common import auc, beijing, daily_oracle_auc, sigmoid, zipf_weights

PIDS = ("430548_1007", "430539_1007")
BEHAVIOUR_START, IMPRESSION_START, END = beijing(2017, 4, 22), beijing(2017, 5, 6), beijing(2017, 5, 14)

# The planted logit's terms (see the module docstring).
BASE = -4.0
PLACEMENT = np.array([0.0, -0.4])
QUALITY_SD = 0.5
USER_SD = 0.4
SHOPPING_LEVEL_3 = 0.2
INTENT = 2.2
FAVOURITE = 1.0
SESSION_BRAND = 0.5


def write(raw: Path, users: int = 40000, seed: int = 0) -> Dict:
    """Writes raw_sample.csv, ad_feature.csv, user_profile.csv, behavior_log.csv and truth.csv into
    ``raw``; returns the summary (also written as summary.json)."""
    rng = np.random.default_rng(seed)
    raw = Path(raw)
    raw.mkdir(parents=True, exist_ok=True)

    # --- catalogue: categories, brands (each of one category), campaigns, advertisers, ads ---
    n_cates, n_brands, n_ads = 600, 6000, max(2000, users // 2)
    cate_ids = rng.choice(np.arange(1, 12961), n_cates, replace=False)
    cate_pop = zipf_weights(n_cates, 1.0, rng)
    cate_cdf = np.cumsum(cate_pop)
    brand_ids = rng.choice(np.arange(1, 461498), n_brands, replace=False)
    brand_cate = rng.choice(n_cates, n_brands, p=cate_pop)  # popular categories have more brands
    brands_of = [np.flatnonzero(brand_cate == c) for c in range(n_cates)]
    ad_ids = rng.choice(np.arange(1, 846812), n_ads, replace=False)
    ad_cate = rng.choice(n_cates, n_ads, p=cate_pop)
    ad_brand = _brand_of(rng, brands_of, ad_cate)
    ad_brand[rng.random(n_ads) < 0.25] = -1  # NULL brand
    ad_quality = rng.normal(0.0, QUALITY_SD, n_ads)
    ad_cdf = np.cumsum(zipf_weights(n_ads, 0.8, rng))
    ads_of = [np.flatnonzero(ad_cate == c) for c in range(n_cates)]
    n_customers = max(500, n_ads // 6)
    ad_customer = rng.integers(1, 255876, n_customers)[rng.integers(0, n_customers, n_ads)]
    ad_campaign = rng.choice(np.arange(1, 423437), n_ads, replace=False)
    ad_campaign[1::3] = ad_campaign[0::3][: len(ad_campaign[1::3])]  # campaigns of 1-2 ads
    ad_price = np.round(rng.lognormal(4.0, 1.4, n_ads), 2)

    # --- users and profiles ---
    user_ids = rng.choice(np.arange(1, 1141730), users, replace=False)
    user_bias = rng.normal(0.0, USER_SD, users)
    shopping = rng.integers(1, 4, users)
    n_fav = rng.integers(2, 5, users)

    beh_user, beh_time, beh_tag, beh_cate, beh_brand = [], [], [], [], []
    imp = {k: [] for k in ("user", "time", "ad", "pid", "p")}
    tags = np.array(["pv", "cart", "fav", "buy"])
    for u in range(users):
        favs = rng.choice(n_cates, n_fav[u], replace=False, p=cate_pop)
        n_sessions = 1 + rng.poisson(13)
        starts = np.sort(rng.integers(BEHAVIOUR_START, END - 3600, n_sessions))
        for start in starts:
            intent = rng.choice(favs) if rng.random() < 0.4 else _draw(rng, cate_cdf)
            n_events = 1 + rng.geometric(0.2)
            times = start + np.cumsum(rng.exponential(60.0, n_events)).astype(np.int64)
            times = times[times < END]
            if len(times) == 0:
                continue
            kind = rng.random(len(times))
            cates = np.where(
                kind < 0.75,
                intent,
                np.where(kind < 0.87, rng.choice(favs, len(times)), _draw(rng, cate_cdf, len(times))),
            )
            brands = _brand_of(rng, brands_of, cates)
            brands[rng.random(len(times)) < 0.05] = -1
            beh_user.append(np.full(len(times), u))
            beh_time.append(times)
            beh_tag.append(rng.choice(4, len(times), p=[0.89, 0.05, 0.03, 0.03]))
            beh_cate.append(cates)
            beh_brand.append(brands)
            if start < IMPRESSION_START:
                continue
            session_brands = set(brands[(cates == intent) & (brands >= 0)].tolist())
            # Requests inside the session, seconds after one of its events: the intent shows in the
            # newest events before them.
            for _ in range(rng.choice(3, p=[0.25, 0.45, 0.30])):
                t = int(times[rng.integers(0, len(times))] + rng.integers(1, 40))
                _request(rng, imp, u, t, intent, favs, session_brands, ads_of, ad_cate, ad_brand, ad_cdf)
        # Requests outside any session: no current intent.
        for _ in range(rng.poisson(2.0)):
            t = int(rng.integers(IMPRESSION_START, END))
            _request(rng, imp, u, t, -1, favs, set(), ads_of, ad_cate, ad_brand, ad_cdf)
    logit_parts = np.array(imp["p"])  # per impression: (intent, favourite, session brand) hits
    ad = np.array(imp["ad"])
    usr = np.array(imp["user"])
    pid = np.array(imp["pid"])
    t = np.array(imp["time"])
    logit = (
        BASE
        + PLACEMENT[pid]
        + ad_quality[ad]
        + user_bias[usr]
        + SHOPPING_LEVEL_3 * (shopping[usr] == 3)
        + INTENT * logit_parts[:, 0]
        + FAVOURITE * logit_parts[:, 1]
        + SESSION_BRAND * logit_parts[:, 2]
    )
    p = sigmoid(logit)
    clk = (rng.random(len(p)) < p).astype(np.int64)

    samples = pd.DataFrame(
        {"user": user_ids[usr], "time_stamp": t, "adgroup_id": ad_ids[ad], "pid": np.array(PIDS)[pid]}
    )
    samples["nonclk"], samples["clk"] = 1 - clk, clk
    truth = samples[["user", "time_stamp", "adgroup_id", "pid"]].assign(p_click=np.round(p, 6))
    # A request shows an ad once: repeats of (user, second, placement, ad) drawn above are dropped
    # (the truth key stays unique); then a few rows are logged twice, as in the real file.
    keep = ~samples.duplicated(["user", "time_stamp", "adgroup_id", "pid"]).to_numpy()
    samples, truth, p, clk, pid, t = samples[keep], truth[keep], p[keep], clk[keep], pid[keep], t[keep]
    twice = samples.sample(frac=0.001, random_state=seed)
    out = pd.concat([samples, twice]).sample(frac=1.0, random_state=seed + 1)
    out.to_csv(raw / "raw_sample.csv", index=False)
    truth.to_csv(raw / "truth.csv", index=False)

    shown_missing = rng.choice(n_ads, max(1, n_ads // 100), replace=False)  # shown, absent from ad_feature.csv
    present = np.setdiff1d(np.arange(n_ads), shown_missing)
    ads = pd.DataFrame(
        {
            "adgroup_id": ad_ids[present],
            "cate_id": cate_ids[ad_cate[present]],
            "campaign_id": ad_campaign[present],
            "customer": ad_customer[present],
            "brand": np.where(ad_brand[present] >= 0, brand_ids[np.maximum(ad_brand[present], 0)].astype(str), "NULL"),
            "price": ad_price[present],
        }
    )
    ads.sample(frac=1.0, random_state=seed).to_csv(raw / "ad_feature.csv", index=False)

    with_profile = rng.random(users) >= 0.08
    n = int(with_profile.sum())
    profile = pd.DataFrame(
        {
            "userid": user_ids[with_profile],
            "cms_segid": rng.integers(0, 97, n),
            "cms_group_id": rng.integers(0, 13, n),
            "final_gender_code": rng.integers(1, 3, n),
            "age_level": rng.integers(0, 7, n),
            "pvalue_level": np.where(rng.random(n) < 0.3, np.nan, rng.integers(1, 4, n)),
            "shopping_level": shopping[with_profile],
            "occupation": rng.integers(0, 2, n),
            # The real header ends with a space.
            "new_user_class_level ": np.where(rng.random(n) < 0.25, np.nan, rng.integers(1, 5, n)),
        }
    )
    profile.sample(frac=1.0, random_state=seed).to_csv(raw / "user_profile.csv", index=False, float_format="%.0f")

    bu, bt, bb = np.concatenate(beh_user), np.concatenate(beh_time), np.concatenate(beh_brand)
    behaviour = pd.DataFrame(
        {
            "user": user_ids[bu],
            "time_stamp": bt,
            "btag": tags[np.concatenate(beh_tag)],
            "cate": cate_ids[np.concatenate(beh_cate)],
            "brand": np.where(bb >= 0, brand_ids[np.maximum(bb, 0)].astype(str), "NULL"),
        }
    )
    behaviour.sample(frac=1.0, random_state=seed).to_csv(raw / "behavior_log.csv", index=False)

    day = pd.to_datetime(t, unit="s", utc=True).tz_convert("Asia/Shanghai").strftime("%m-%d").to_numpy()
    summary = {
        "users": users,
        "impressions": int(len(out)),
        "requests": int(samples.groupby(["user", "time_stamp", "pid"]).ngroups),
        "behaviour_events": int(len(behaviour)),
        "ads": n_ads,
        "click_rate": float(clk.mean()),
        "oracle_click_auc": {PIDS[k]: auc(p[pid == k], clk[pid == k]) for k in range(len(PIDS))},
        "oracle_click_auc_by_day": daily_oracle_auc(day, pid, PIDS, p, clk),
        "planted_logit": {
            "base": BASE,
            "placement": dict(zip(PIDS, PLACEMENT.tolist())),
            "ad_quality_sd": QUALITY_SD,
            "user_sd": USER_SD,
            "shopping_level_3": SHOPPING_LEVEL_3,
            "session_intent_category": INTENT,
            "favourite_category": FAVOURITE,
            "session_brand": SESSION_BRAND,
        },
    }
    (raw / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _request(rng, imp, u, t, intent, favs, session_brands, ads_of, ad_cate, ad_brand, ad_cdf) -> None:
    """One request of user ``u`` at second ``t``: its placement, its ads (by the recommender's mix)
    and, per ad, which planted terms hold."""
    pid = int(rng.random() < 0.4)
    k = rng.choice([1, 2, 3, 4, 6, 8], p=[0.80, 0.10, 0.05, 0.025, 0.015, 0.01])
    for _ in range(k):
        r = rng.random()
        pool = ads_of[intent] if intent >= 0 and r < 0.3 else ads_of[rng.choice(favs)] if r < 0.5 else None
        a = int(rng.choice(pool)) if pool is not None and len(pool) else int(_draw(rng, ad_cdf))
        c = ad_cate[a]
        imp["user"].append(u)
        imp["time"].append(t)
        imp["ad"].append(a)
        imp["pid"].append(pid)
        imp["p"].append((c == intent, c in favs, ad_brand[a] in session_brands))


def _draw(rng: np.random.Generator, cdf: np.ndarray, size=None):
    """Indices drawn with the probabilities whose cumulative sums are ``cdf`` (a search, not
    ``rng.choice(p=...)``, which re-validates the whole vector on every call)."""
    return np.minimum(np.searchsorted(cdf, rng.random(size) * cdf[-1]), len(cdf) - 1)


def _brand_of(rng: np.random.Generator, brands_of, cates: np.ndarray) -> np.ndarray:
    """A brand of each category (uniformly among its brands), -1 where it has none."""
    out = np.full(len(cates), -1)
    for i, c in enumerate(cates):
        if len(brands_of[c]):
            out[i] = brands_of[c][rng.integers(len(brands_of[c]))]
    return out
