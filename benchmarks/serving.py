"""Online serving load benchmark: the Ray Serve ranking service (serve/online.py) driven over loopback
HTTP by an open-loop load generator, variant by variant, beside the model alone in one process.

    .venv/bin/python benchmarks/serving.py [--run runs/demo] [--raw data/demo/raw] [--vocabularies BUILD]
        [--variants batched/fp32/1 unbatched/fp32/1 batched/auto/1 batched/fp32/2] [--rates 2 4 8 ...]
        [--requests-per-point 600] [--seconds-per-point 10] [--bound-ms 500] [--tight-bound-ms 25]
        [--max-batch-size N] [--batch-wait-ms MS] [--split eval] [--pool 400]
        [--out-csv serving.csv] [--chart docs/serving/serving_latency.png] [--smoke]

The requests are real: the raw logs' first ``--pool`` requests of build split ``--split``
(``LiveFeatures.requests_from_logs``: each with its candidates and the user's behaviour-log rows),
serialized once and sent in turn (cycled).

1. **Model alone** (the ceiling on this machine): ``Ranker.score``'s steps called in this process,
   ``--alone-batches`` batches of 1, ``--max-batch-size`` and ``--alone-batch`` requests each
   (after up to two of them as warm-up), timed apart: the arrival checks (``Ranker.check``, once per
   request), the feature path (``live.build``: the build's SQL on DuckDB), the loader's
   ``BatchBuilder`` and the model's forward. Requests/s and rows (candidates)/s per precision of the
   variants.
2. **The service**, one variant at a time (``batched|unbatched / fp32|auto|bf16 / replicas``):
   Ray started once on a temporary directory, the HTTP proxy on a free port of 127.0.0.1, and per
   variant the application of ``online.application`` (what ``online.start`` deploys, with Ray's
   log forwarding to this process off; batching off is ``max_batch_size=1``; model reload off)
   deployed, warmed up with ``--warmup-requests``, then a sweep of offered rates (``--rates``,
   default a geometric ladder). At each rate the generator (aiohttp, this process) sends request i
   at t0 + i / rate whatever has come back (open loop: queueing shows as latency, then as 503s once
   the replicas' and the proxy's queues are full), ``min(rate x --seconds-per-point,
   --requests-per-point)`` requests, and waits for all. Latency is measured from
   the request's scheduled time (a generator falling behind counts against the service, and its own
   lag is printed: ``lag p99``). A response is ok when it is 200 with one score per candidate. A
   variant's sweep stops after the first point with a 503 or an error or p99 above ``--bound-ms``
   (saturated: beyond the rate the replicas keep up with, the queue, and so the latency, grows with
   every request of the point).
3. The summary: the most requests/s each variant sustains with p99 <= ``--bound-ms`` and <=
   ``--tight-bound-ms`` (no 503s, no errors), batched / unbatched at both bounds (acceptance: >= 5x at
   ``--bound-ms``), and the share of the model-alone rows/s the best variant sustains at the tight
   bound. "(>=)" marks a variant still within the bound at its highest rate.

CPU: the machine has few cores and the generator shares them with the service. Per point,
``client cores`` is this process's CPU time (``time.process_time``) / wall, ``server cores`` the Ray
processes' (this process's descendants, from /proc), ``bg cores`` everything else's (/proc/stat).
``--quiet-wait`` waits, before each variant, for other processes to go quiet.
"""

from __future__ import annotations

import os

# Ray on loopback (its nodes take 127.0.0.1, Ray's switch for machines without a cluster network): the
# benchmark's traffic stays on this machine. Read when Ray is imported.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import argparse
import asyncio
import csv
import dataclasses
import json
import math
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

DEFAULT_VARIANTS = ["batched/fp32/1", "unbatched/fp32/1", "batched/auto/1", "batched/fp32/2"]
SMOKE = {
    "pool": 16,
    "rates": [4.0, 8.0],
    "requests_per_point": 8,
    "seconds_per_point": 2.0,
    "warmup_requests": 4,
    "alone_batches": 1,
    "alone_batch": 8,
    "quiet_wait": 0.0,
}


@dataclasses.dataclass(frozen=True)
class Variant:
    """One service configuration: ``batched/fp32/1`` = batching on, FP32 large layers, one replica."""

    name: str
    batched: bool
    precision: str
    replicas: int

    @classmethod
    def parse(cls, text: str) -> "Variant":
        parts = text.split("/")
        if len(parts) != 3 or parts[0] not in ("batched", "unbatched") or parts[1] not in ("fp32", "bf16", "auto"):
            raise argparse.ArgumentTypeError(f"{text!r}: give batched|unbatched/fp32|bf16|auto/REPLICAS")
        try:
            replicas = int(parts[2])
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: replicas must be a number") from None
        return cls(text, parts[0] == "batched", parts[1], replicas)

    def settings(self, port: int, max_batch_size: int, batch_wait_ms: float) -> dict:
        """ServeConfig overrides: loopback, this port, no model reload, batching as the variant says
        (on: ``max_batch_size`` and ``batch_wait_ms``; off: one request at a time)."""
        return {
            "host": "127.0.0.1",
            "port": port,
            "replicas": self.replicas,
            "max_batch_size": max_batch_size if self.batched else 1,
            "batch_wait_ms": batch_wait_ms if self.batched else 0.0,
            "reload_poll_s": 0.0,
        }


# --- CPU meters -----------------------------------------------------------------------------------


def _proc_cpu_s(pid: int) -> Optional[float]:
    """utime + stime of process ``pid`` (seconds), None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _descendants_cpu(pid: int) -> Dict[int, float]:
    """CPU seconds of each live descendant of ``pid`` (Ray's GCS, raylet, proxy, replicas...)."""
    from pinads_rec.experiments.harness.meters import children

    out, todo = {}, children(pid)
    while todo:
        p = todo.pop()
        if p in out:
            continue
        cpu = _proc_cpu_s(p)
        if cpu is not None:
            out[p] = cpu
            todo += children(p)
    return out


def _machine_busy_s() -> float:
    from pinads_rec.experiments.harness.meters import CpuMeter

    return CpuMeter._busy_s(os.sysconf("SC_CLK_TCK"))


class Cores:
    """Cores used meanwhile by this process (the load generator), its descendants (Ray: the
    service) and all other processes (background)."""

    def __init__(self):
        self.t0, self.client0 = time.monotonic(), time.process_time()
        self.server0, self.busy0 = _descendants_cpu(os.getpid()), _machine_busy_s()

    def stop(self) -> Dict[str, float]:
        wall = max(time.monotonic() - self.t0, 1e-9)
        client = time.process_time() - self.client0
        now = _descendants_cpu(os.getpid())
        server = sum(cpu - self.server0.get(p, 0.0) for p, cpu in now.items())
        busy = _machine_busy_s() - self.busy0
        return {
            "client_cores": client / wall,
            "server_cores": server / wall,
            "bg_cores": max(busy - client - server, 0.0) / wall,
        }


def wait_quiet(max_wait_s: float) -> float:
    """The harness's wait for a quiet machine, this process's Ray counted as its own."""
    from pinads_rec.experiments.harness.meters import wait_quiet as harness_wait_quiet

    return harness_wait_quiet(max_wait_s, meter=Cores, other="bg_cores", echo=lambda m: print(m, flush=True))


# --- the model alone ------------------------------------------------------------------------------


class Laps:
    """Seconds spent per step, each step timed from the end of the one before."""

    def __init__(self, steps: Sequence[str]):
        self.spent = dict.fromkeys(steps, 0.0)
        self.start()

    def start(self) -> None:
        self.t = time.perf_counter()

    def __call__(self, step: str) -> None:
        now = time.perf_counter()
        self.spent[step] += now - self.t
        self.t = now


def model_alone(run_dir, step, args, requests: List[dict], precision: str, sizes: Sequence[int]) -> List[dict]:
    """``Ranker.score``'s steps timed apart on batches of each size (module docstring, 1.)."""
    import torch

    from pinads_rec.serve.online import Ranker

    torch.set_num_threads(os.cpu_count() or 1)
    ranker = Ranker(run_dir, step, args.raw, args.vocabularies, precision)
    out = []
    for size in sizes:
        batches = [[requests[(b * size + i) % len(requests)] for i in range(size)] for b in range(args.alone_batches)]
        for batch in batches[:2]:  # warm-up
            ranker.score(batch)
        lap = Laps(["check", "features", "batcher", "model"])
        rows = 0
        t0 = time.perf_counter()
        for batch in batches:
            lap.start()
            for request in batch:
                ranker.check(request)
            lap("check")
            table = ranker.live.build(batch)
            lap("features")
            loader_batch = ranker.predictor.requests_batch(table, "request")
            lap("batcher")
            with torch.inference_mode():
                ranker.predictor.score_batch(loader_batch)[loader_batch.valid].tolist()
            lap("model")
            rows += sum(len(r["candidates"]) for r in batch)
        wall = time.perf_counter() - t0
        n = args.alone_batches
        out.append(
            {
                "precision": ranker.precision,
                "requested": precision,
                "requests_per_batch": size,
                **{f"{k}_ms": v / n * 1000 for k, v in lap.spent.items()},
                "total_ms": wall / n * 1000,
                "requests_per_s": n * size / wall,
                "rows_per_s": rows / wall,
                "features_share": lap.spent["features"] / wall,
            }
        )
    del ranker
    return out


# --- the load generator ---------------------------------------------------------------------------


async def _send(session, url: str, bodies: List[bytes], candidates: List[int], n: int, rate: float, offset: int):
    """Open loop: request i leaves at t0 + i / rate; per request (status, ok, rows, scheduled, sent, done)."""
    import aiohttp

    loop = asyncio.get_running_loop()
    t0 = loop.time() + 0.05
    results = []

    async def one(i: int) -> None:
        scheduled = t0 + i / rate
        delay = scheduled - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        k = (offset + i) % len(bodies)
        sent, status, ok, precision = loop.time(), -1, False, None
        try:
            async with session.post(url, data=bodies[k], headers={"Content-Type": "application/json"}) as resp:
                payload = await resp.read()
                status = resp.status
                if status == 200:
                    body = json.loads(payload)
                    ok = len(body.get("scores", ())) == candidates[k]
                    precision = body.get("precision")
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            pass
        results.append((status, ok, candidates[k], scheduled, sent, loop.time(), precision))

    await asyncio.gather(*(one(i) for i in range(n)))
    return t0, results


def _percentile(values: List[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


async def _point(url, bodies, candidates, n, rate, offset, timeout_s, connections) -> dict:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=connections)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        cores = Cores()
        t0, results = await _send(session, url, bodies, candidates, n, rate, offset)
        used = cores.stop()
    ok = [r for r in results if r[1]]
    latency = [(r[5] - r[3]) * 1000 for r in ok]
    elapsed = max(max(r[5] for r in results) - t0, 1e-9)
    precisions = sorted({r[6] for r in ok if r[6]})
    return {
        "offered_rps": rate,
        "sent": n,
        "ok": len(ok),
        "ok_rps": len(ok) / elapsed,
        "rows_per_s": sum(r[2] for r in ok) / elapsed,
        "p50_ms": _percentile(latency, 50),
        "p95_ms": _percentile(latency, 95),
        "p99_ms": _percentile(latency, 99),
        "max_ms": max(latency, default=float("nan")),
        "n_503": sum(r[0] == 503 for r in results),
        "n_errors": sum(not r[1] and r[0] != 503 for r in results),  # other statuses, bad bodies, failures
        "lag_p99_ms": _percentile([(r[4] - r[3]) * 1000 for r in results], 99),
        "served_precision": "+".join(precisions),
        "seconds": elapsed,
        **used,
    }


async def _warm(url: str, bodies: List[bytes], count: int, concurrency: int) -> int:
    """``count`` requests, ``concurrency`` at a time: the replicas' first batches (lazy kernels)."""
    import aiohttp

    ok = 0
    gate = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:

        async def one(i: int) -> None:
            nonlocal ok
            async with gate, session.post(url, data=bodies[i % len(bodies)]) as resp:
                await resp.read()
                ok += resp.status == 200

        await asyncio.gather(*(one(i) for i in range(count)))
    return ok


# --- the service ----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    """Ray on a temporary directory, the HTTP proxy on ``port``, and one variant's application at a
    time (``online.application``, as ``online.start`` deploys it). ``close`` stops everything."""

    def __init__(self, args, cfg, port: int):
        self.args, self.cfg, self.port = args, cfg, port
        self.tmp: Optional[str] = None
        self.started = False

    def deploy(self, variant: Variant) -> float:
        import ray
        from ray import serve

        from pinads_rec.serve import online

        t0 = time.perf_counter()
        spec = online.ServiceSpec(
            self.args.run,
            self.args.raw,
            self.args.vocabularies,
            self.args.step,
            variant.precision,
            variant.settings(self.port, self.args.max_batch_size, self.args.batch_wait_ms),
        )
        settings = spec.serve_config(self.cfg)
        if not self.started:
            self.tmp = tempfile.mkdtemp(prefix="rsb_", dir=os.environ.get("RAY_TMPDIR"))  # where Ray's own root goes
            ray.init(
                include_dashboard=False,
                object_store_memory=200_000_000,
                _temp_dir=self.tmp,
                log_to_driver=False,  # this process is the load generator: no printing of the replicas' logs
            )
            serve.start(http_options={"host": settings.host, "port": settings.port})
            self.started = True
        else:
            serve.delete(online.APP_NAME)
        online.deploy(spec, settings)
        return time.perf_counter() - t0

    def close(self) -> None:
        if self.started:
            import ray
            from ray import serve

            try:
                serve.shutdown()
            finally:
                ray.shutdown()
                self.started = False
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)


# --- reporting ------------------------------------------------------------------------------------

POINT_HEADER = (
    f"{'variant':<18} {'offered/s':>9} {'sent':>5} {'ok/s':>7} {'rows/s':>8} {'p50 ms':>8} {'p95 ms':>8} "
    f"{'p99 ms':>8} {'503s':>5} {'errors':>6} {'lag p99':>7} {'client cores':>12} {'server cores':>12} "
    f"{'bg cores':>8}"
)


def point_line(name: str, p: dict) -> str:
    return (
        f"{name:<18} {p['offered_rps']:>9,.1f} {p['sent']:>5} {p['ok_rps']:>7,.1f} {p['rows_per_s']:>8,.0f} "
        f"{p['p50_ms']:>8,.1f} {p['p95_ms']:>8,.1f} {p['p99_ms']:>8,.1f} {p['n_503']:>5} {p['n_errors']:>6} "
        f"{p['lag_p99_ms']:>7,.1f} {p['client_cores']:>12.2f} {p['server_cores']:>12.2f} {p['bg_cores']:>8.2f}"
    )


ALONE_HEADER = (
    f"{'precision':<14} {'req/batch':>9} {'checks ms':>9} {'features ms':>11} {'batcher ms':>10} {'model ms':>8} "
    f"{'total ms':>8} {'req/s':>8} {'rows/s':>8} {'features %':>10}"
)


def alone_line(a: dict) -> str:
    label = a["precision"] if a["requested"] == a["precision"] else f"{a['requested']} -> {a['precision']}"
    return (
        f"{label:<14} {a['requests_per_batch']:>9} {a['check_ms']:>9.1f} {a['features_ms']:>11.1f} "
        f"{a['batcher_ms']:>10.1f} {a['model_ms']:>8.1f} {a['total_ms']:>8.1f} {a['requests_per_s']:>8,.1f} "
        f"{a['rows_per_s']:>8,.0f} {a['features_share'] * 100:>9.0f}%"
    )


def met(p: dict, bound_ms: float) -> bool:
    return p["ok"] > 0 and p["n_503"] == 0 and p["n_errors"] == 0 and p["p99_ms"] <= bound_ms


def best_within(points: List[dict], bound_ms: float) -> tuple:
    """(most ok requests/s over the points meeting the bound, or 0; its point; True when the
    highest rate measured still met it: the figure is a lower bound)."""
    good = [p for p in points if met(p, bound_ms)]
    if not good:
        return 0.0, None, False
    top = max(good, key=lambda p: p["ok_rps"])
    return top["ok_rps"], top, bool(points) and met(points[-1], bound_ms)


def _rate_text(rate: float, lower_bound: bool) -> str:
    return f"{rate:,.1f}{' (>=)' if lower_bound else ''}"


def summary(variants: List[Variant], points: Dict[str, List[dict]], alone: List[dict], args) -> List[str]:
    lines = []
    bounds = [args.bound_ms] + ([args.tight_bound_ms] if args.tight_bound_ms != args.bound_ms else [])
    for bound in bounds:
        cells = []
        for v in variants:
            rate, _, lower = best_within(points[v.name], bound)
            cells.append(f"{v.name} {_rate_text(rate, lower)}")
        lines.append(f"max requests/s with p99 <= {bound:g} ms: " + ", ".join(cells))
    # batched vs unbatched: of the same precision and replicas where the variants have such a pair
    pairs = sorted(
        ((b, u) for b in variants for u in variants if b.batched and not u.batched),
        key=lambda pair: (pair[0].precision, pair[0].replicas) != (pair[1].precision, pair[1].replicas),
    )
    for b, u in pairs[:1]:
        for bound in bounds:
            rb, _, lower_b = best_within(points[b.name], bound)
            ru, _, lower_u = best_within(points[u.name], bound)
            if ru > 0:
                ratio = f"{rb / ru:.2f}x"
                if lower_b and not lower_u:
                    ratio += " (>=)"
                elif lower_u and not lower_b:
                    ratio += " (<=)"
            else:
                ratio = "n/a (unbatched meets the bound at no rate measured)" if rb > 0 else "n/a"
            line = f"{b.name} / {u.name} at p99 <= {bound:g} ms: {_rate_text(rb, lower_b)} / {_rate_text(ru, lower_u)}"
            line += f" req/s = {ratio}"
            if bound == args.bound_ms:
                verdict = "met" if (rb / ru >= 5.0 if ru > 0 else rb > 0) else "NOT met"
                line += f" (acceptance: >= 5x) -> {verdict}"
            lines.append(line)
    ceiling = {}
    for a in alone:
        if a["rows_per_s"] > ceiling.get(a["requested"], {}).get("rows_per_s", 0):
            ceiling[a["requested"]] = a
    best = None
    for v in variants:
        _, top, lower = best_within(points[v.name], args.tight_bound_ms)
        if top and (best is None or top["rows_per_s"] > best[1]["rows_per_s"]):
            best = (v, top, lower)
    if best is None:
        lines.append(f"best variant at p99 <= {args.tight_bound_ms:g} ms: none meets it at any rate measured")
    elif best[0].precision not in ceiling:
        lines.append(
            f"best variant at p99 <= {args.tight_bound_ms:g} ms: {best[0].name} (the model alone not measured)"
        )
    else:
        v, top, lower = best
        c = ceiling[v.precision]
        lines.append(
            f"best variant at p99 <= {args.tight_bound_ms:g} ms: {v.name}, {_rate_text(top['ok_rps'], lower)} req/s = "
            f"{top['rows_per_s']:,.0f} rows/s = {top['rows_per_s'] / c['rows_per_s'] * 100:.0f}% of the model alone's "
            f"{c['rows_per_s']:,.0f} rows/s ({c['precision']}, {c['requests_per_batch']} requests/batch, one process)"
        )
    return lines


def chart(path: str, variants: List[Variant], points: Dict[str, List[dict]], alone: List[dict], args, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, v in enumerate(variants):
        ps = [p for p in points[v.name] if p["ok"] > 0]
        x = [p["ok_rps"] for p in ps]
        c = colors[i % len(colors)]
        ax.plot(x, [p["p99_ms"] for p in ps], "o-", color=c, label=f"{v.name} p99")
        ax.plot(x, [p["p50_ms"] for p in ps], "s--", color=c, alpha=0.6, markersize=4, label=f"{v.name} p50")
    for bound in sorted({args.bound_ms, args.tight_bound_ms}):
        ax.axhline(bound, color="gray", linestyle=":", linewidth=1)
        ax.text(ax.get_xlim()[0], bound, f" p99 bound {bound:g} ms", va="bottom", fontsize=8, color="gray")
    if alone:
        top = max(alone, key=lambda a: a["requests_per_s"])
        ax.axvline(top["requests_per_s"], color="black", linestyle=":", linewidth=1)
        ax.text(
            top["requests_per_s"],
            ax.get_ylim()[1],
            f"model alone\n{top['requests_per_s']:,.0f} req/s ",
            ha="right",
            va="top",
            fontsize=8,
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("throughput (ok requests/s)")
    ax.set_ylabel("latency from scheduled send (ms)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- main -----------------------------------------------------------------------------------------


def ladder(start: float, factor: float, stop: float) -> List[float]:
    out, r = [], start
    while r <= stop * (1 + 1e-9):
        out.append(round(r, 2))
        r *= factor
    return out


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", default="runs/demo", help="the trained run (default: %(default)s)")
    p.add_argument("--raw", default="data/demo/raw", help="its raw logs (default: %(default)s)")
    p.add_argument("--vocabularies", default=None, help="the build holding the vocabularies, when the config has some")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    p.add_argument("--split", default="eval", help="build split the requests come from (default: %(default)s)")
    p.add_argument("--pool", type=int, default=400, help="distinct requests, sent in turn (default: %(default)s)")
    p.add_argument("--variants", nargs="+", type=Variant.parse, default=None, help=f"default: {DEFAULT_VARIANTS}")
    p.add_argument("--rates", nargs="+", type=float, default=None, help="offered requests/s (default: the ladder)")
    p.add_argument("--min-rate", type=float, default=2.0, help="the ladder's first rate (default: %(default)s)")
    p.add_argument("--rate-factor", type=float, default=2**0.5, help="the ladder's step (default: sqrt 2)")
    p.add_argument("--max-rate", type=float, default=2048.0, help="the ladder's last rate (default: %(default)s)")
    p.add_argument("--requests-per-point", type=int, default=600, help="at most this many per rate")
    p.add_argument("--seconds-per-point", type=float, default=10.0, help="and at most this long a send window")
    p.add_argument("--bound-ms", type=float, default=500.0, help="the p99 bound of the acceptance (batched >= 5x)")
    p.add_argument("--tight-bound-ms", type=float, default=25.0, help="the p99 bound of the goal")
    p.add_argument("--max-batch-size", type=int, default=None, help="batched variants (default: the run's serve:)")
    p.add_argument("--batch-wait-ms", type=float, default=None, help="batched variants (default: the run's serve:)")
    p.add_argument("--warmup-requests", type=int, default=48, help="per variant, before its sweep")
    p.add_argument("--timeout-s", type=float, default=60.0, help="client timeout per request")
    p.add_argument("--connections", type=int, default=1000, help="the client's connection limit")
    p.add_argument("--alone-batches", type=int, default=8, help="model alone: batches timed per size")
    p.add_argument("--alone-batch", type=int, default=128, help="model alone: the large batch (requests)")
    p.add_argument("--no-alone", action="store_true", help="skip the model-alone measurement")
    p.add_argument("--quiet-wait", type=float, default=60.0, help="seconds to wait for a quiet machine per variant")
    p.add_argument("--out-csv", default=None, help="every point as CSV")
    p.add_argument("--chart", default=None, help="PNG: p99 and p50 latency vs throughput per variant")
    p.add_argument("--smoke", action="store_true", help="a few requests at two rates (the test suite's setting)")
    args = p.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            if p.get_default(key) == getattr(args, key):
                setattr(args, key, value)
    args.variants = args.variants or [Variant.parse(v) for v in DEFAULT_VARIANTS]
    args.rates = args.rates or ladder(args.min_rate, args.rate_factor, args.max_rate)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # finally blocks run: Ray is shut down

    from pinads_rec.data.build.live import LiveFeatures
    from pinads_rec.serve.loading import find_checkpoint, run_config
    from pinads_rec.serve.online import ModelSource, version_of

    run_dir, step = ModelSource(args.run, args.step).newest()
    cfg = run_config(run_dir, find_checkpoint(run_dir, step))
    args.max_batch_size = args.max_batch_size or cfg.serve.max_batch_size
    args.batch_wait_ms = cfg.serve.batch_wait_ms if args.batch_wait_ms is None else args.batch_wait_ms
    live = LiveFeatures(cfg, args.raw, args.vocabularies, cfg.serve.max_candidates, cfg.serve.max_events)
    requests = live.requests_from_logs(args.split, args.pool)
    del live
    if not requests:
        raise SystemExit(f"{args.raw}: no requests in split {args.split!r}")
    bodies = [json.dumps(r).encode() for r in requests]
    candidates = [len(r["candidates"]) for r in requests]
    mean_candidates = sum(candidates) / len(candidates)
    cores = os.cpu_count() or 1
    header = (
        f"serving load: {version_of(run_dir, step)}; {len(requests)} distinct {args.split} requests of {args.raw} "
        f"(mean {mean_candidates:.1f} candidates, {statistics.mean(len(b) for b in bodies) / 1024:.1f} KiB), sent in "
        f"turn; {cores} cores; batched = max_batch_size {args.max_batch_size}, batch_wait_ms "
        f"{args.batch_wait_ms:g}; backpressure {cfg.serve.max_ongoing_requests} ongoing / replica + "
        f"{cfg.serve.max_queued_requests} queued; open loop, <= {args.requests_per_point} requests or "
        f"{args.seconds_per_point:g} s per rate"
    )
    print(header + "\n", flush=True)

    alone: List[dict] = []
    if not args.no_alone:
        if args.quiet_wait:
            wait_quiet(args.quiet_wait)
        sizes = sorted({1, args.max_batch_size, args.alone_batch})
        print(f"model alone: Ranker's steps in this process, {cores} torch threads, {args.alone_batches} batches")
        print(ALONE_HEADER, flush=True)
        for precision in dict.fromkeys(v.precision for v in args.variants):
            for a in model_alone(run_dir, step, args, requests, precision, sizes):
                alone.append(a)
                print(alone_line(a), flush=True)
        print()

    points: Dict[str, List[dict]] = {v.name: [] for v in args.variants}
    deploys: Dict[str, float] = {}
    service = Service(args, cfg, _free_port())
    url = f"http://127.0.0.1:{service.port}/"
    try:
        print("service: latency from each request's scheduled send time", flush=True)
        print(POINT_HEADER, flush=True)
        offset = 0
        for v in args.variants:
            deploys[v.name] = service.deploy(v)
            warm = asyncio.run(_warm(url, bodies, args.warmup_requests, 2 * v.replicas * args.max_batch_size))
            if warm < args.warmup_requests:
                raise SystemExit(f"{v.name}: {args.warmup_requests - warm} of the warm-up requests failed")
            if args.quiet_wait:
                wait_quiet(args.quiet_wait)
            for rate in args.rates:
                n = max(1, min(args.requests_per_point, round(rate * args.seconds_per_point)))
                p = asyncio.run(_point(url, bodies, candidates, n, rate, offset, args.timeout_s, args.connections))
                offset += n
                p.update(variant=v.name, batched=v.batched, precision=v.precision, replicas=v.replicas)
                points[v.name].append(p)
                print(point_line(v.name, p), flush=True)
                if p["n_503"] or p["n_errors"] or p["ok"] == 0 or p["p99_ms"] > args.bound_ms:
                    break
                time.sleep(0.5)
    finally:
        service.close()

    print("\n" + header + "\n")
    if alone:
        print(ALONE_HEADER)
        print("-" * len(ALONE_HEADER))
        for a in alone:
            print(alone_line(a))
        print()
    print(POINT_HEADER)
    print("-" * len(POINT_HEADER))
    for v in args.variants:
        for p in points[v.name]:
            print(point_line(v.name, p))
    served = {
        v.name: "+".join(sorted({p["served_precision"] for p in points[v.name] if p["served_precision"]}))
        for v in args.variants
    }
    print(
        "\ndeploy + model load s: "
        + ", ".join(f"{name} {s:.1f} (serves {served[name] or '?'})" for name, s in deploys.items())
    )
    client = [p["client_cores"] for ps in points.values() for p in ps]
    if client:
        print(f"load generator CPU: {statistics.mean(client):.2f} cores on average, {max(client):.2f} at most")
    print()
    for line in summary(args.variants, points, alone, args):
        print(line)

    rows = [p for v in args.variants for p in points[v.name]]
    if args.out_csv and rows:
        Path(args.out_csv).parent.mkdir(parents=True, exist_ok=True)
        first = ["variant", "batched", "precision", "replicas", "offered_rps"]
        with open(args.out_csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=first + [k for k in rows[0] if k not in first])
            writer.writeheader()
            writer.writerows(rows)
        print(f"\nwrote {len(rows)} points -> {args.out_csv}")
    if args.chart:
        title = f"{version_of(run_dir, step)}, {cores} cores, mean {mean_candidates:.1f} candidates/request (open loop)"
        chart(args.chart, args.variants, points, alone, args, title)
        print(f"wrote {args.chart}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
