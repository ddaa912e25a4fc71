"""Raw-log build benchmark: the DuckDB builder under a memory cap, against pandas, Polars and the
same builder on Spark.

    python benchmarks/build.py [--events 50000000] [--impressions 5000000] [--users 1000000]
                               [--memory-limit 1GB] [--threads N] [--pandas-events auto|N|0]
                               [--polars-events N|0] [--spark-events N|0] [--smoke] [--out DIR]

1. **Generates** a Taobao-like raw log in Parquet (numpy, in chunks: memory bounded by the chunk):
   ``raw_sample.parquet`` (impressions: user, time_stamp, adgroup_id, pid, nonclk, clk; a request is
   (time_stamp, user, pid) with 1-3 ads), ``behavior_log.parquet`` (user, time_stamp, btag, cate,
   brand; not sorted; 22 days, the last 8 of which hold the impressions) and ``ad_feature.parquet``
   (the ad side table; a few ads missing, some brands null). Users' activity is skewed (log-normal).
   Its in-memory size is the Arrow size of the three tables (strings decoded).
2. **Builds** it with ``python -m pinads_rec.data.build --memory-limit CAP`` in a child process,
   measuring wall time, rows/s, the child's peak RSS (its VmHWM, polled from /proc; a fresh
   address space after exec, unlike ru_maxrss which carries the parent's peak over fork + exec),
   the peak size of the spill directory (polled) and the output's size.
3. **pandas**: a straightforward in-memory implementation of the same build (read, join, per-user
   point-in-time newest-N sequences through ``merge_asof``, per-request grouping), on the largest
   size it handles here: sizes doubling from 1/32 of the full log until a run fails or its RSS
   passes ``--rss-guard`` (it is then stopped). The builder runs on that size too, and both outputs
   must be equal.
4. **Polars** (streaming engine, ``collect(engine="streaming")``): the core step alone (the
   behaviour group's point-in-time newest-N sequences per request), against the builder given the
   same single-group config; their sequences must be equal.
5. **Spark** (``--engine spark``, ``local[--threads]``, the driver given ``--spark-memory-limit``): the
   whole build on the full log (or ``--spark-events``), its output equal to the DuckDB builder's;
   peak RSS summed over its process tree (the Python driver, Spark's JVM, the Python UDF workers:
   polled), its spill the peak size of ``SPARK_LOCAL_DIRS`` (polled). The ratio says how many
   times the cores Spark needs to build in DuckDB's time: where a cluster starts to pay.

Prints one table and the ratios (and writes them to ``<out>/build_benchmark.json``). ``--smoke``: a
tiny log (seconds), for the test. ``--builder-module`` times another build module with the same CLI
(a candidate change) against the same log.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Dict, List, Optional
from zoneinfo import ZoneInfo

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pinads_rec.data import build_output
from pinads_rec.experiments.harness.meters import status_mib, tree_rss_mib

REPO = Path(__file__).resolve().parents[1]
MB = 2**20

TZ = "Asia/Shanghai"
BEHAVIOUR_START = "2017-04-22"  # behaviour: 22 days; impressions: the last 8
IMPRESSIONS_START, EVAL_START, END = "2017-05-06", "2017-05-13", "2017-05-14"
PIDS = ("430548_1007", "430539_1007")  # the two placements (surfaces p1, p2)
BTAGS = ("pv", "cart", "fav", "buy")
BTAG_P = (0.90, 0.03, 0.03, 0.04)
BEHAVIOUR_MAX, PURCHASE_MAX, PURCHASE_GAP_S = 50, 20, 60

FEATURES = f"""
features:
  columns: {{request_id: request_id, timestamp: timestamp, surface: surface}}
  surfaces: [p1, p2]
  tasks: [{{name: click, label_column: click}}]
  tables:
    - {{name: user, num_embeddings: 1000000, embedding_dim: 8, hash: true}}
    - {{name: ad, num_embeddings: 1000000, embedding_dim: 8, hash: true}}
    - {{name: cate, num_embeddings: 100000, embedding_dim: 8, hash: true}}
    - {{name: brand, num_embeddings: 1000000, embedding_dim: 8, hash: true}}
    - {{name: campaign, num_embeddings: 1000000, embedding_dim: 8, hash: true}}
    - {{name: customer, num_embeddings: 1000000, embedding_dim: 8, hash: true}}
    - {{name: btag, num_embeddings: 5, embedding_dim: 8}}
  sparse:
    - {{name: user_id, column: user_id, table: user, user_side: true}}
    - {{name: adgroup_id, column: adgroup_id, table: ad}}
    - {{name: cate_id, column: cate_id, table: cate}}
    - {{name: brand, column: brand, table: brand}}
    - {{name: campaign_id, column: campaign_id, table: campaign}}
    - {{name: customer, column: customer, table: customer}}
  dense:
    - {{name: price, column: price, norm: log}}
  sequence_groups:
    - name: behaviour
      timestamp_column: beh_ts
      max_length: {BEHAVIOUR_MAX}
      features:
        - {{name: cate, column: beh_cate, table: cate}}
        - {{name: brand, column: beh_brand, table: brand}}
        - {{name: btag, column: beh_btag, table: btag}}
    - name: purchase
      timestamp_column: buy_ts
      max_length: {PURCHASE_MAX}
      features:
        - {{name: cate, column: buy_cate, table: cate}}
        - {{name: brand, column: buy_brand, table: brand}}
data: {{calibration_holdout: 0.0}}
model: {{calibration: none}}
"""

BUILD = f"""
build:
  impressions:
    path: [raw_sample.parquet]
    user: user
    time: time_stamp
    request_key: [time_stamp, user, pid]
    item: adgroup_id
  side_tables:
    - name: ad
      path: [ad_feature.parquet]
      key: {{adgroup_id: adgroup_id}}
      defaults: {{cate_id: "0", campaign_id: "0", customer: "0", brand: "0", price: "0.0"}}
  sequences:
    - group: behaviour
      path: [behavior_log.parquet]
      user: user
      time: time_stamp
      columns:
        beh_cate: cate
        beh_brand: brand
        beh_btag: "CASE btag WHEN 'pv' THEN 1 WHEN 'cart' THEN 2 WHEN 'fav' THEN 3 ELSE 4 END"
    - group: purchase
      path: [behavior_log.parquet]
      user: user
      time: time_stamp
      filter: "btag IN ('cart', 'fav', 'buy')"
      min_gap_s: {PURCHASE_GAP_S}
      columns: {{buy_cate: cate, buy_brand: brand}}
  columns:
    user_id: user
    adgroup_id: adgroup_id
    cate_id: ad.cate_id
    brand: ad.brand
    campaign_id: ad.campaign_id
    customer: ad.customer
    price: ad.price
    surface: "CASE pid WHEN '{PIDS[0]}' THEN 'p1' ELSE 'p2' END"
    click: clk
  splits:
    - {{name: train, start: "{IMPRESSIONS_START}", end: "{EVAL_START}"}}
    - {{name: eval, start: "{EVAL_START}", end: "{END}"}}
  timezone: {TZ}
"""

# The core step alone (for the Polars comparison): the behaviour group only, one candidate column.
CORE_FEATURES = f"""
features:
  columns: {{request_id: request_id, timestamp: timestamp, surface: surface}}
  surfaces: [p1, p2]
  tasks: [{{name: click, label_column: click}}]
  tables:
    - {{name: user, num_embeddings: 1000000, embedding_dim: 8, hash: true}}
    - {{name: cate, num_embeddings: 100000, embedding_dim: 8, hash: true}}
    - {{name: brand, num_embeddings: 1000000, embedding_dim: 8, hash: true}}
    - {{name: btag, num_embeddings: 5, embedding_dim: 8}}
  sparse:
    - {{name: user_id, column: user_id, table: user, user_side: true}}
  sequence_groups:
    - name: behaviour
      timestamp_column: beh_ts
      max_length: {BEHAVIOUR_MAX}
      features:
        - {{name: cate, column: beh_cate, table: cate}}
        - {{name: brand, column: beh_brand, table: brand}}
        - {{name: btag, column: beh_btag, table: btag}}
data: {{calibration_holdout: 0.0}}
model: {{calibration: none}}
build:
  impressions:
    path: [raw_sample.parquet]
    user: user
    time: time_stamp
    request_key: [time_stamp, user, pid]
    item: adgroup_id
  sequences:
    - group: behaviour
      path: [behavior_log.parquet]
      user: user
      time: time_stamp
      columns:
        beh_cate: cate
        beh_brand: brand
        beh_btag: "CASE btag WHEN 'pv' THEN 1 WHEN 'cart' THEN 2 WHEN 'fav' THEN 3 ELSE 4 END"
  columns:
    user_id: user
    surface: "CASE pid WHEN '{PIDS[0]}' THEN 'p1' ELSE 'p2' END"
    click: clk
  splits:
    - {{name: all, start: "{IMPRESSIONS_START}", end: "{END}"}}
  timezone: {TZ}
"""


def epoch(day: str) -> int:
    return int(datetime.fromisoformat(day).replace(tzinfo=ZoneInfo(TZ)).timestamp())


# --------------------------------------------------------------------------------------------
# The generated raw log.
# --------------------------------------------------------------------------------------------


class _ActiveUsers:
    """Users 1..n drawn by a skewed (log-normal) activity, by inverse CDF: a few heavy users, a long tail."""

    def __init__(self, n: int, rng: np.random.Generator):
        w = rng.lognormal(0.0, 1.0, n)
        self.cdf = np.cumsum(w) / w.sum()

    def draw(self, rng: np.random.Generator, m: int) -> np.ndarray:
        return np.minimum(np.searchsorted(self.cdf, rng.random(m)), len(self.cdf) - 1).astype(np.int64) + 1


def _skewed(rng: np.random.Generator, m: int, n: int, power: float = 3.0) -> np.ndarray:
    """Ids 1..n, popular ones first (u^power puts most draws near 1)."""
    return np.minimum((n * rng.random(m) ** power).astype(np.int64), n - 1) + 1


def sizes_for(events: int, impressions: int, users: int) -> Dict[str, int]:
    """The other dimensions scaled with the log (Taobao's shape: ~0.85M ads, ~6k categories)."""
    return {
        "events": events,
        "impressions": impressions,
        "users": max(users, 10),
        "ads": max(impressions // 25, 50),
        "cates": max(impressions // 1000, 20),
        "brands": max(impressions // 50, 50),
    }


def generate(raw: Path, events: int, impressions: int, users: int, seed: int = 0, chunk: int = 4_000_000) -> dict:
    """Writes the three Parquet files; returns the sizes and their in-memory (Arrow) bytes."""
    raw.mkdir(parents=True, exist_ok=True)
    s = sizes_for(events, impressions, users)
    rng = np.random.default_rng(seed)
    active = _ActiveUsers(s["users"], rng)
    in_memory = {}

    # Ads: all ids but ~0.5% (missing keys get the declared defaults), a quarter of brands null.
    ads = np.arange(1, s["ads"] + 1, dtype=np.int64)
    ads = ads[rng.random(len(ads)) >= 0.005]
    brand = _skewed(rng, len(ads), s["brands"], 2.0)
    ad_table = pa.table(
        {
            "adgroup_id": ads,
            "cate_id": _skewed(rng, len(ads), s["cates"], 2.0),
            "campaign_id": rng.integers(1, max(len(ads) // 2, 2), len(ads)),
            "customer": rng.integers(1, max(len(ads) // 4, 2), len(ads)),
            "brand": pa.array(brand, mask=rng.random(len(ads)) < 0.25),
            "price": np.round(rng.lognormal(4.0, 1.2, len(ads)), 2),
        }
    )
    pq.write_table(ad_table, raw / "ad_feature.parquet")
    in_memory["ad_feature"] = ad_table.nbytes

    # Behaviour: not sorted (each chunk draws users and times over the whole span).
    start, end = epoch(BEHAVIOUR_START), epoch(END)
    tags = pa.array(BTAGS)
    total = 0
    with pq.ParquetWriter(raw / "behavior_log.parquet", _BEHAVIOUR_SCHEMA) as writer:
        for lo in range(0, events, chunk):
            m = min(chunk, events - lo)
            table = pa.table(
                {
                    "user": active.draw(rng, m),
                    "time_stamp": rng.integers(start, end, m),
                    "btag": pa.DictionaryArray.from_arrays(rng.choice(4, m, p=BTAG_P).astype(np.int8), tags),
                    "cate": _skewed(rng, m, s["cates"], 2.0),
                    "brand": _skewed(rng, m, s["brands"], 2.0),
                },
                schema=_BEHAVIOUR_SCHEMA,
            )
            writer.write_table(table, row_group_size=1_000_000)
            total += table.cast(_BEHAVIOUR_SCHEMA_PLAIN).nbytes
    in_memory["behavior_log"] = total

    # Impressions: requests (time, user, placement) of 1-3 distinct ads, until `impressions` rows.
    start = epoch(IMPRESSIONS_START)
    total, written = 0, 0
    with pq.ParquetWriter(raw / "raw_sample.parquet", _IMPRESSION_SCHEMA) as writer:
        while written < impressions:
            m = min(chunk // 2, impressions - written)  # requests; with 1.5 ads each, enough rows
            n_ads = rng.choice(3, m, p=(0.6, 0.3, 0.1)) + 1
            req = np.repeat(np.arange(m), n_ads)[: impressions - written]
            slot = np.arange(len(req)) - np.repeat(np.cumsum(n_ads) - n_ads, n_ads)[: len(req)]
            base = _skewed(rng, m, s["ads"], 3.0)
            clk = (rng.random(len(req)) < 0.05).astype(np.int64)
            order = rng.permutation(len(req))  # impression logs are not sorted either
            table = pa.table(
                {
                    "user": active.draw(rng, m)[req][order],
                    "time_stamp": rng.integers(start, end, m)[req][order],
                    "adgroup_id": ((base[req] - 1 + slot) % s["ads"] + 1)[order],
                    "pid": pa.DictionaryArray.from_arrays(
                        (rng.random(m) >= 0.6).astype(np.int8)[req][order], pa.array(PIDS)
                    ),
                    "nonclk": 1 - clk[order],
                    "clk": clk[order],
                },
                schema=_IMPRESSION_SCHEMA,
            )
            writer.write_table(table, row_group_size=1_000_000)
            total += table.cast(_IMPRESSION_SCHEMA_PLAIN).nbytes
            written += len(req)
    in_memory["raw_sample"] = total
    return {**s, "in_memory_bytes": in_memory, "in_memory_total": sum(in_memory.values())}


_DICT = pa.dictionary(pa.int8(), pa.string())
_BEHAVIOUR_SCHEMA = pa.schema(
    [("user", pa.int64()), ("time_stamp", pa.int64()), ("btag", _DICT), ("cate", pa.int64()), ("brand", pa.int64())]
)
_BEHAVIOUR_SCHEMA_PLAIN = pa.schema([f.with_type(pa.string()) if f.name == "btag" else f for f in _BEHAVIOUR_SCHEMA])
_IMPRESSION_SCHEMA = pa.schema(
    [
        ("user", pa.int64()),
        ("time_stamp", pa.int64()),
        ("adgroup_id", pa.int64()),
        ("pid", _DICT),
        ("nonclk", pa.int64()),
        ("clk", pa.int64()),
    ]
)
_IMPRESSION_SCHEMA_PLAIN = pa.schema([f.with_type(pa.string()) if f.name == "pid" else f for f in _IMPRESSION_SCHEMA])


# --------------------------------------------------------------------------------------------
# The same build in pandas (in memory), and the core step in Polars (streaming engine).
# --------------------------------------------------------------------------------------------

SEQUENCE_GROUPS = (  # (name, btag filter, min gap, max length, the group's columns: contract name <- log column)
    ("behaviour", None, 0, BEHAVIOUR_MAX, {"beh_ts": "time_stamp", "beh_cate": "cate", "beh_brand": "brand"}),
    ("purchase", ("cart", "fav", "buy"), PURCHASE_GAP_S, PURCHASE_MAX, {"buy_ts": "time_stamp", "buy_cate": "cate"}),
)
SEQUENCE_TAIL = {"behaviour": {"beh_btag": "btag_code"}, "purchase": {"buy_brand": "brand"}}


def _lists(offsets: np.ndarray, values) -> pa.ListArray:
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values))


def pandas_build(raw: Path, out: Path) -> None:
    """The build in plain pandas: every table in memory; sequences by merge_asof (the number of the
    user's events strictly before the request) and a merge on (user, position) of the newest N."""
    import pandas as pd

    imp = pd.read_parquet(raw / "raw_sample.parquet")
    ads = pd.read_parquet(raw / "ad_feature.parquet")
    beh = pd.read_parquet(raw / "behavior_log.parquet")
    imp["pid"] = imp["pid"].astype(str)  # lexical order, as SQL sorts text
    beh["btag"] = beh["btag"].astype(str)
    start, mid, end = epoch(IMPRESSIONS_START), epoch(EVAL_START), epoch(END)
    # Request ids: (time_stamp, user, pid) numbered in that order, as the builder's dense_rank.
    imp["request_id"] = imp.groupby(["time_stamp", "user", "pid"], sort=True).ngroup() + 1
    imp = imp[(imp.time_stamp >= start) & (imp.time_stamp < end)]
    # A (request, ad) twice: keep the one with the highest label.
    imp = imp.sort_values(["request_id", "adgroup_id", "clk"], ascending=[True, True, False], kind="stable")
    imp = imp.drop_duplicates(["request_id", "adgroup_id"], keep="first")
    imp = imp.merge(ads, on="adgroup_id", how="left", sort=False)
    for c in ("cate_id", "campaign_id", "customer", "brand"):
        imp[c] = imp[c].fillna(0).astype(np.int64)
    imp["price"] = imp["price"].fillna(0.0)
    imp["surface"] = np.where(imp["pid"] == PIDS[0], "p1", "p2")
    imp = imp.sort_values(["request_id", "adgroup_id"], kind="stable")

    req = imp.groupby("request_id", sort=True).agg(user=("user", "first"), t=("time_stamp", "min")).reset_index()
    req["split"] = np.where(req["t"] < mid, "train", "eval")
    counts = imp.groupby("request_id", sort=True).size().to_numpy()
    cand_offsets = np.concatenate([[0], np.cumsum(counts)])
    columns: Dict[str, pa.Array] = {
        "request_id": pa.array(req["request_id"].to_numpy()),
        "timestamp": pa.array(req["t"].to_numpy()),
        "user_id": pa.array(req["user"].to_numpy()),
    }

    beh["btag_code"] = beh["btag"].map({"pv": 1, "cart": 2, "fav": 3}).fillna(4).astype(np.int32)
    for name, tags, gap, max_len, cols in SEQUENCE_GROUPS:
        cols = {**cols, **SEQUENCE_TAIL[name]}
        ids = [c for k, c in cols.items() if not k.endswith("_ts")]
        ev = beh[beh["btag"].isin(tags)] if tags else beh
        ev = ev[["user", "time_stamp", *dict.fromkeys(ids)]].sort_values(["user", "time_stamp", *ids], kind="stable")
        ev["pos"] = ev.groupby("user").cumcount() + 1
        # n = the position of the user's last event strictly before (request time - gap)
        left = req[["request_id", "user", "t"]].assign(cut=req["t"] - gap).sort_values("cut", kind="stable")
        right = ev[["user", "time_stamp", "pos"]].sort_values("time_stamp", kind="stable")
        n = pd.merge_asof(
            left, right, left_on="cut", right_on="time_stamp", by="user", allow_exact_matches=False
        ).set_index("request_id")["pos"]
        n = n.reindex(req["request_id"]).fillna(0).astype(np.int64).to_numpy()
        k = np.minimum(n, max_len)
        offsets = np.concatenate([[0], np.cumsum(k)])
        within = np.arange(offsets[-1]) - np.repeat(offsets[:-1], k)
        wanted = pd.DataFrame({"user": np.repeat(req["user"].to_numpy(), k), "pos": np.repeat(n, k) - within})
        got = wanted.merge(ev, on=["user", "pos"], how="left", sort=False)  # newest first, request by request
        for out_col, src in cols.items():
            columns[out_col] = _lists(offsets, got[src].to_numpy())

    for c in ("adgroup_id", "cate_id", "brand", "campaign_id", "customer", "price", "surface"):
        columns[c] = _lists(cand_offsets, imp[c].to_numpy())
    columns["click"] = _lists(cand_offsets, imp["clk"].to_numpy())
    table = pa.table(columns)
    splits = req["split"].to_numpy()
    for split in ("train", "eval"):
        rows = req.index[splits == split].to_numpy()
        part = table.take(rows).sort_by([("timestamp", "ascending"), ("request_id", "ascending")])
        (out / split).mkdir(parents=True, exist_ok=True)
        pq.write_table(part, out / split / "part-00000.parquet")


def polars_core(raw: Path, out: Path) -> None:
    """The core step on Polars' streaming engine: for every request (time_stamp, user, pid) the
    behaviour group's newest-N events strictly before it, newest first."""
    import polars as pl

    cols = ["cate", "brand", "btag"]
    imp = pl.scan_parquet(raw / "raw_sample.parquet")
    start, end = epoch(IMPRESSIONS_START), epoch(END)
    req = (
        imp.select("time_stamp", "user", pl.col("pid").cast(pl.String))
        .unique()
        .sort("time_stamp", "user", "pid")
        .with_row_index("request_id", offset=1)
        .filter((pl.col("time_stamp") >= start) & (pl.col("time_stamp") < end))
    )
    btag = (
        pl.col("btag").cast(pl.String).replace_strict({"pv": 1, "cart": 2, "fav": 3}, default=4, return_dtype=pl.Int32)
    )
    ev = (
        pl.scan_parquet(raw / "behavior_log.parquet")
        .select("user", "time_stamp", "cate", "brand", btag)
        .sort("user", "time_stamp", *cols)
        .with_columns(pos=pl.int_range(1, pl.len() + 1, dtype=pl.Int64).over("user"))
    )
    before = req.sort("time_stamp").join_asof(
        ev.select("user", pl.col("time_stamp").alias("t"), "pos").sort("t"),
        left_on="time_stamp",
        right_on="t",
        by="user",
        allow_exact_matches=False,
    )
    per_user = ev.group_by("user").agg(pl.col("time_stamp", *cols).sort_by("pos").name.prefix("all_"))
    n = pl.col("pos").fill_null(0)
    k = pl.min_horizontal(n, BEHAVIOUR_MAX)
    names = {"time_stamp": "beh_ts", "cate": "beh_cate", "brand": "beh_brand", "btag": "beh_btag"}
    result = (
        before.join(per_user, on="user", how="left")
        .select(
            "request_id",
            pl.col("time_stamp").alias("timestamp"),
            *[
                pl.col("all_" + c)
                .fill_null(pl.lit([], dtype=pl.List(t)))
                .list.slice(n - k, k)
                .list.reverse()
                .alias(names[c])
                for c, t in {"time_stamp": pl.Int64, "cate": pl.Int64, "brand": pl.Int64, "btag": pl.Int32}.items()
            ],
        )
        .sort("timestamp", "request_id")
    )
    (out / "all").mkdir(parents=True, exist_ok=True)
    result.sink_parquet(out / "all" / "part-00000.parquet", engine="streaming")


# --------------------------------------------------------------------------------------------
# Measuring a child process.
# --------------------------------------------------------------------------------------------


def disk_bytes(path: Path) -> int:
    """Bytes allocated on disk under path (st_blocks: what a spill file really takes)."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                pass  # removed while walking
    return total


def measure(cmd: List[str], temp=None, env=None, rss_guard_mb: float = 0, timeout_s: float = 0, tree: bool = False):
    """Runs cmd, polling its peak RSS (VmHWM; with ``tree``, the largest sum of VmRSS over it and
    its descendants) and the size of ``temp`` (a directory, or a function of the process id giving
    it). Stops it when its RSS passes rss_guard_mb or it runs past timeout_s (0: no limit);
    ``stopped`` then says why."""
    started = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    peak = {"rss_mib": 0.0, "temp": 0, "stopped": None}
    done = threading.Event()

    def sample():
        while not done.is_set():
            hwm = tree_rss_mib(proc.pid) if tree else status_mib(proc.pid, "VmHWM")
            if hwm:
                peak["rss_mib"] = max(peak["rss_mib"], hwm)
            spill = temp(proc.pid) if callable(temp) else temp
            if spill is not None and spill.exists():
                peak["temp"] = max(peak["temp"], disk_bytes(spill))
            why = None
            rss = tree_rss_mib(proc.pid) if tree else status_mib(proc.pid, "VmRSS")
            if rss_guard_mb and (rss or 0) > rss_guard_mb:
                why = f"RSS past the {rss_guard_mb / 1024:.0f} GiB guard"
            elif timeout_s and time.time() - started > timeout_s:
                why = f"past {timeout_s:.0f} s"
            if why and proc.poll() is None:
                peak["stopped"] = why
                proc.kill()
            done.wait(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate()
    done.set()
    sampler.join()
    return {
        "ok": proc.returncode == 0 and not peak["stopped"],
        "seconds": time.time() - started,
        "peak_rss_mb": peak["rss_mib"],
        "temp_peak_mb": peak["temp"] / MB,
        "stopped": peak["stopped"],
        "stdout": out,
        "stderr": err,
    }


def _script(*args: str) -> List[str]:
    return [sys.executable, str(Path(__file__).resolve()), *args]


def _env(threads: int) -> dict:
    env = dict(os.environ, POLARS_MAX_THREADS=str(threads))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def run_builder(
    raw: Path, out: Path, config: Path, cap: str, threads: int, module: str, engine: str = "duckdb", **guards
) -> dict:
    cmd = [sys.executable, "-m", module, "--config", str(config), "--raw", str(raw), "--out", str(out)]
    cmd += ["--memory-limit", cap, "--threads", str(threads), "--engine", engine]
    env = _env(threads)
    if engine == "spark":  # Spark spills under SPARK_LOCAL_DIRS; its JVM and UDF workers are children
        spill = out.parent / f"{out.name}-spark-local"
        spill.mkdir(parents=True, exist_ok=True)
        env["SPARK_LOCAL_DIRS"] = str(spill)
        r = measure(cmd, temp=spill, env=env, tree=True, **guards)
    else:
        # The build writes (and spills) into its temporary directory beside --out, named by its pid.
        spill = lambda pid: build_output.work_dir(out.resolve(), pid) / ".build_tmp"  # noqa: E731
        r = measure(cmd, temp=spill, env=env, **guards)
    if r["ok"]:
        r["summary"] = json.loads((out / "summary.json").read_text())
    return r


def output_mb(out: Path) -> float:
    return sum(f.stat().st_size for f in out.rglob("*.parquet")) / MB


def equal_outputs(a: Path, b: Path, splits: List[str], columns: Optional[List[str]] = None) -> str:
    """'' when every column of every split holds the same values in a and b (b's types cast to
    a's); else what differs. One column at a time, so a large output fits."""
    for split in splits:
        fa, fb = sorted((a / split).glob("*.parquet")), sorted((b / split).glob("*.parquet"))
        schema = pq.read_schema(fa[0])
        names = columns or schema.names
        other = set(pq.read_schema(fb[0]).names)
        missing = [c for c in names if c not in other]
        if missing:
            return f"{split}: {b} lacks {missing}"
        for c in names:
            ca = pq.read_table(fa, columns=[c]).column(c).combine_chunks()
            cb = pq.read_table(fb, columns=[c]).column(c).combine_chunks().cast(schema.field(c).type)
            if not ca.equals(cb):
                rows = len(ca) if len(ca) != len(cb) else next(i for i in range(len(ca)) if ca[i] != cb[i])
                return f"{split}.{c} differs (lengths {len(ca)} vs {len(cb)}; first difference at row {rows})"
    return ""


# --------------------------------------------------------------------------------------------
# The benchmark.
# --------------------------------------------------------------------------------------------


def _available_mb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _scaled(args, events: int) -> Dict[str, int]:
    f = events / args.events
    return {"events": events, "impressions": max(int(args.impressions * f), 100), "users": max(int(args.users * f), 10)}


def _row(engine: str, size: dict, cap: str, r: dict, out: Optional[Path]) -> dict:
    return {
        "engine": engine,
        "events": size["events"],
        "impressions": size["impressions"],
        "cap": cap,
        "seconds": round(r["seconds"], 2),
        "impressions_per_s": round(size["impressions"] / r["seconds"]) if r["ok"] else None,
        "events_per_s": round(size["events"] / r["seconds"]) if r["ok"] else None,
        "peak_rss_mb": round(r["peak_rss_mb"]),
        "temp_peak_mb": round(r["temp_peak_mb"]),
        "output_mb": round(output_mb(out)) if r["ok"] and out is not None else None,
        "ok": r["ok"],
        "note": r["stopped"] or ("" if r["ok"] else r["stderr"].strip().splitlines()[-1][:100]),
    }


def _generate(work: Path, size: dict, seed: int) -> dict:
    raw = work / f"raw-{size['events']}"
    if not (raw / "info.json").exists():  # a log is generated once per size
        info = generate(raw, size["events"], size["impressions"], size["users"], seed)
        (raw / "config.yaml").write_text(FEATURES + BUILD)
        (raw / "core.yaml").write_text(CORE_FEATURES)
        (raw / "info.json").write_text(json.dumps(info))
    return {"raw": raw, **json.loads((raw / "info.json").read_text())}


def _print_row(r: dict) -> None:
    rate = lambda v: f"{v:,}" if v else "-"  # noqa: E731
    out = f"{r['output_mb']:,}" if r["output_mb"] is not None else "-"
    print(
        f"| {r['engine']} | {r['events']:,} | {r['impressions']:,} | {r['cap']} | {r['seconds']:,.1f} | "
        f"{rate(r['impressions_per_s'])} | {rate(r['events_per_s'])} | {r['peak_rss_mb']:,} | {r['temp_peak_mb']:,} | "
        f"{out} | {'yes' if r['ok'] else 'no: ' + r['note']} |",
        flush=True,
    )


HEADER = (
    "| engine | events | impressions | memory cap | wall s | impressions/s | events/s | peak RSS MiB | "
    "temp peak MiB | output MiB | finished |\n|---|---|---|---|---|---|---|---|---|---|---|"
)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, default=50_000_000, help="behaviour events of the full log")
    ap.add_argument("--impressions", type=int, default=5_000_000, help="impressions of the full log")
    ap.add_argument("--users", type=int, default=1_000_000, help="users of the full log (scaled with smaller ones)")
    ap.add_argument("--memory-limit", default="1GB", help="the builder's --memory-limit")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads of every engine")
    ap.add_argument(
        "--pandas-events",
        default="auto",
        help="events of the pandas comparison: auto (the largest of 1/32, 1/16, ... of the full log that "
        "finishes under the RSS guard), a number, or 0 (none)",
    )
    ap.add_argument("--polars-events", type=int, default=None, help="events of the Polars comparison (default: full)")
    ap.add_argument("--spark-events", type=int, default=None, help="events of the Spark build (default: full; 0: none)")
    ap.add_argument(
        "--spark-memory-limit",
        default="4GB",
        help="the Spark build's --memory-limit: its driver's heap (local[N]: driver and executors in one JVM; "
        "at least 512MB)",
    )
    ap.add_argument(
        "--rss-guard-gb", type=float, default=None, help="stop a child past this RSS (default: 85%% of MemAvailable)"
    )
    ap.add_argument("--timeout-s", type=float, default=0, help="stop a child running longer (0: no limit)")
    ap.add_argument("--builder-module", default="pinads_rec.data.build", help="the build module timed")
    ap.add_argument("--out", default=None, help="work directory (default: a temporary one, removed)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="a tiny log (seconds): checks the script works")
    ap.add_argument("--pandas-child", nargs=2, metavar=("RAW", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--polars-child", nargs=2, metavar=("RAW", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.pandas_child:
        pandas_build(Path(args.pandas_child[0]), Path(args.pandas_child[1]))
        return 0
    if args.polars_child:
        polars_core(Path(args.polars_child[0]), Path(args.polars_child[1]))
        return 0
    if args.smoke:
        args.events, args.impressions, args.users = 60_000, 6_000, 600
        args.pandas_events = args.pandas_events if args.pandas_events != "auto" else "30000"
        args.memory_limit = "256MB"
        args.spark_memory_limit = "1GB"
    guard_mb = (args.rss_guard_gb * 1024) if args.rss_guard_gb else 0.85 * _available_mb()
    guards = {"rss_guard_mb": guard_mb, "timeout_s": args.timeout_s}
    with tempfile.TemporaryDirectory(prefix="build_bench_") as tmp:
        work = Path(args.out or tmp)
        work.mkdir(parents=True, exist_ok=True)
        return _benchmark(args, work, guards)


def _benchmark(args, work: Path, guards: dict) -> int:
    cap, threads, rows, notes = args.memory_limit, args.threads, [], []
    load = os.getloadavg()[0]
    print(f"{threads} thread(s), memory cap {cap}, RSS guard {guards['rss_guard_mb'] / 1024:.1f} GiB, load {load:.2f}")

    def report(row: dict) -> dict:
        rows.append(row)
        _print_row(row)
        return row

    full = _generate(work, _scaled(args, args.events), args.seed)
    print(
        f"log: {full['events']:,} events, {full['impressions']:,} impressions, {full['users']:,} users; "
        f"in memory (Arrow) {full['in_memory_total'] / MB:,.0f} MiB, on disk "
        f"{sum(f.stat().st_size for f in full['raw'].glob('*.parquet')) / MB:,.0f} MiB"
    )
    print(HEADER)
    built = run_builder(
        full["raw"], work / "duckdb-full", full["raw"] / "config.yaml", cap, threads, args.builder_module, **guards
    )
    main_row = report(_row("DuckDB builder", full, cap, built, work / "duckdb-full"))

    # pandas, on the largest size it handles (or the one given).
    pandas_row = duck_row = None
    if args.pandas_events != "0":
        if args.pandas_events == "auto":
            sizes = [args.events // 2**k for k in range(5, -1, -1)]
        else:
            sizes = [int(args.pandas_events)]
        best = None
        for events in sizes:
            log = _generate(work, _scaled(args, events), args.seed)
            out = work / f"pandas-{events}"
            r = measure(_script("--pandas-child", str(log["raw"]), str(out)), env=_env(threads), **guards)
            row = report(_row("pandas", log, "-", r, out))
            if not r["ok"]:
                break
            best = (log, row, out)
        if best:
            log, pandas_row, pandas_out = best
            out = work / f"duckdb-{log['events']}"
            if log["events"] == full["events"]:
                duck_row, out = main_row, work / "duckdb-full"
            else:
                r = run_builder(
                    log["raw"], out, log["raw"] / "config.yaml", cap, threads, args.builder_module, **guards
                )
                duck_row = report(_row("DuckDB builder", log, cap, r, out))
            if duck_row["ok"]:
                diff = equal_outputs(out, pandas_out, ["train", "eval"])
                notes.append(f"pandas output {'== builder output' if not diff else '!= builder output: ' + diff}")
                if diff:
                    pandas_row["ok"] = False

    # Polars' streaming engine: the core step, against the builder given the same one-group config.
    polars_row = core_row = None
    if args.polars_events != 0:
        log = _generate(work, _scaled(args, args.polars_events or args.events), args.seed)
        out = work / f"polars-{log['events']}"
        tmp = work / f"polars-tmp-{log['events']}"
        tmp.mkdir(exist_ok=True)
        env = dict(_env(threads), POLARS_TEMP_DIR=str(tmp))
        r = measure(_script("--polars-child", str(log["raw"]), str(out)), temp=tmp, env=env, **guards)
        polars_row = report(_row("Polars streaming (core step)", log, "-", r, out))
        core_out = work / f"duckdb-core-{log['events']}"
        r = run_builder(log["raw"], core_out, log["raw"] / "core.yaml", cap, threads, args.builder_module, **guards)
        core_row = report(_row("DuckDB builder (core step)", log, cap, r, core_out))
        if polars_row["ok"] and core_row["ok"]:
            columns = ["request_id", "timestamp", "beh_ts", "beh_cate", "beh_brand", "beh_btag"]
            diff = equal_outputs(core_out, out, ["all"], columns)
            notes.append(f"Polars sequences {'== builder sequences' if not diff else '!= builder sequences: ' + diff}")
            if diff:
                polars_row["ok"] = False

    # The same build on Spark local[threads], its output equal to the builder's.
    spark_row = spark_duck = None
    if args.spark_events != 0:
        log = _generate(work, _scaled(args, args.spark_events or args.events), args.seed)
        out = work / f"spark-{log['events']}"
        spark_cap = args.spark_memory_limit
        config = log["raw"] / "config.yaml"
        r = run_builder(log["raw"], out, config, spark_cap, threads, args.builder_module, "spark", **guards)
        spark_row = report(_row(f"Spark local[{threads}] builder", log, spark_cap, r, out))
        duck_out = work / "duckdb-full"
        if log["events"] == full["events"]:
            spark_duck = main_row
        else:
            duck_out = work / f"duckdb-{log['events']}"
            r = run_builder(
                log["raw"], duck_out, log["raw"] / "config.yaml", cap, threads, args.builder_module, **guards
            )
            spark_duck = report(_row("DuckDB builder", log, cap, r, duck_out))
        if spark_row["ok"] and spark_duck["ok"]:
            diff = equal_outputs(duck_out, out, ["train", "eval"])
            notes.append(f"Spark output {'== builder output' if not diff else '!= builder output: ' + diff}")
            if diff:
                spark_row["ok"] = False

    print()
    cap_mb = _parse_mb(cap)
    in_mem = full["in_memory_total"] / MB
    if main_row["ok"]:
        print(
            f"builder: {main_row['impressions_per_s']:,} impressions/s, {main_row['events_per_s']:,} events/s; "
            f"peak RSS {main_row['peak_rss_mb']:,} MiB = {main_row['peak_rss_mb'] / cap_mb:.2f}x the {cap} cap, "
            f"{main_row['peak_rss_mb'] / in_mem:.2f}x the log's in-memory size ({in_mem:,.0f} MiB); "
            f"temp disk peak {main_row['temp_peak_mb']:,} MiB"
        )
    if pandas_row and duck_row and pandas_row["ok"] and duck_row["ok"]:
        print(
            f"pandas / builder at {pandas_row['events']:,} events: wall "
            f"{pandas_row['seconds'] / duck_row['seconds']:.2f}x, "
            f"peak RSS {pandas_row['peak_rss_mb'] / duck_row['peak_rss_mb']:.2f}x"
        )
    if polars_row and core_row and polars_row["ok"] and core_row["ok"]:
        print(
            f"Polars / builder (core step) at {polars_row['events']:,} events: wall "
            f"{polars_row['seconds'] / core_row['seconds']:.2f}x, peak RSS "
            f"{polars_row['peak_rss_mb'] / core_row['peak_rss_mb']:.2f}x"
        )
    if spark_row and spark_duck and spark_row["ok"] and spark_duck["ok"]:
        ratio = spark_row["seconds"] / spark_duck["seconds"]
        print(
            f"Spark local[{threads}] / DuckDB at {spark_row['events']:,} events: wall {ratio:.2f}x, peak RSS "
            f"{spark_row['peak_rss_mb'] / spark_duck['peak_rss_mb']:.2f}x; Spark needs ~{ratio * threads:.0f} cores "
            f"to build this log in DuckDB's {threads}-core time (if it scales linearly)"
        )
    for n in notes:
        print(n)
    print(f"load average now {os.getloadavg()[0]:.2f} (at start {load:.2f})")
    result = {"rows": rows, "notes": notes, "log": {k: v for k, v in full.items() if k != "raw"}, "threads": threads}
    (work / "build_benchmark.json").write_text(json.dumps(result, indent=2) + "\n")
    failed = [r for r in rows if r["engine"].startswith("DuckDB") and not r["ok"]] + [n for n in notes if "!=" in n]
    return 1 if failed else 0


def _parse_mb(text: str) -> float:
    units = {"KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    t = text.strip().upper().replace(" ", "")
    for u, f in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if t.endswith(u):
            return float(t[: -len(u)]) * f / MB
    return float(t) / MB


if __name__ == "__main__":
    sys.exit(main())
