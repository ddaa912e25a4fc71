"""The online ranking service: raw ad requests in over HTTP, calibrated probabilities out, on Ray Serve.

    python -m pinads_rec.serve online --run runs/demo --raw data/demo/raw
    curl -s localhost:8000/ -d @request.json

Ray Serve runs it: its HTTP proxy takes the requests, queues them (``serve.max_queued_requests``,
then 503 with Retry-After: backpressure, never an unbounded queue) and routes them to
``serve.replicas`` copies of ``RankingService``, each a Ray actor holding one ``Ranker``. A replica
checks each request on arrival (a bad one gets 400 naming the field and the value, before it can
join a batch), then ``DynamicBatcher`` gathers the requests that queued while the previous batch ran
(up to ``serve.max_batch_size``; an idle replica waits at most ``serve.batch_wait_ms`` for company)
into one call of ``Ranker.score``:

1. the run's feature path on the raw requests, once for the batch (``data.build.live``: the build's
   own SQL, its side tables, vocabularies, point-in-time sequences);
2. the loader's ``BatchBuilder`` (id hashing, managed-collision spreading, time deltas): one user
   slot per request, so the user-side work (user features, sequence encoders) runs once per request
   and its candidates share it (request-level broadcasting);
3. the model, in the run's inference precision; the calibrated probability per candidate and task.

A request the batch's build refuses (an id a plain table cannot hold) is found by building the
batch's requests one by one: it gets its 400, the others their scores.

**Model updates.** A replica looks for a newer model every ``serve.reload_poll_s`` (``ModelSource``:
a run's newest checkpoint, or the daily loop's newest published day), loads it beside the serving
one and swaps it in between two batches: no request is dropped, and every response names the
version that scored it (``model_version``).

The same application runs on a Ray cluster (``--address``) and on Kubernetes under KubeRay's
RayService (``kuberay.py`` writes its manifest): only where Ray runs changes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from pinads_rec import config
from pinads_rec.data.build.live import LiveFeatures, RequestError
from pinads_rec.data.loader.contract import ContractError
from pinads_rec.serve.dynamic_batching import DynamicBatcher
from pinads_rec.serve.loading import ServeError, find_checkpoint, with_serve_settings
from pinads_rec.serve.scoring import Predictor
from pinads_rec.training import checkpoint as ckpt_lib

log = logging.getLogger(__name__)

APP_NAME = "pinads_rec"


# --- which model -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where the served model comes from: a run directory (its newest complete checkpoint, or
    ``step``), or a directory of the daily loop's published runs (``<loop out>/<strategy>``: one run
    a day, named by its date; the newest day with a complete checkpoint)."""

    path: str
    step: Optional[int] = None

    def newest(self) -> Tuple[Path, int]:
        """(run directory, checkpoint step) of the model to serve now."""
        root = Path(self.path)
        if (root / "checkpoints").is_dir() or self.step is not None:
            return root, int(find_checkpoint(root, self.step).name.split("-")[1])
        days = (
            sorted((d for d in root.iterdir() if d.is_dir() and ckpt_lib.latest(d) is not None), key=lambda d: d.name)
            if root.is_dir()
            else []
        )
        if not days:
            raise ServeError(
                f"{self.path}: neither a run directory (checkpoints/) nor a directory of published runs holding one"
            )
        return days[-1], int(ckpt_lib.latest(days[-1]).name.split("-")[1])


def replica_threads(settings: config.ServeConfig) -> int:
    """torch threads of one replica: ``serve.threads``, else the cores but one (the HTTP proxy's, busy
    decoding requests at full load) over the replicas."""
    if settings.threads > 0:
        return settings.threads
    return max(1, ((os.cpu_count() or 1) - 1) // max(1, settings.replicas))


def gpus_per_replica(settings: config.ServeConfig) -> float:
    """A CUDA replica's share of a GPU for Ray's placement: a GPU each, or an equal share where the
    replicas outnumber this machine's GPUs (several replicas then share one)."""
    if resolve_device(settings.device) != "cuda":
        return 0
    gpus = torch.cuda.device_count()  # 0 on a driver without one: the cluster's nodes have them
    return min(1.0, gpus / settings.replicas) if gpus else 1.0


def resolve_device(device: str) -> str:
    """``serve.device`` as torch names it: auto is cuda where torch sees a GPU."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def version_of(run_dir: Path, step: int) -> str:
    return f"{run_dir.name}@step-{step}"


# --- one replica's model and feature path --------------------------------------------------------------


class Ranker:
    """One served model: its feature path (``LiveFeatures``) and ``Predictor``; ``score(requests)``
    answers a batch of raw requests (plain Python: the deployment, the tests and the benchmark's
    model-alone ceiling call it alike)."""

    def __init__(
        self,
        run_dir: Path,
        step: int,
        raw_dir: str,
        vocabularies: Optional[str],
        precision: Optional[str],
        settings: Optional[config.ServeConfig] = None,
    ):
        device = resolve_device(settings.device if settings else "auto")
        tables = None  # the launch's table dtypes, else the run's
        if settings:
            tables = {"embedding_dtype": settings.embedding_dtype, "table_dtypes": settings.table_dtypes}
        self.predictor = Predictor.from_run(run_dir, precision, step, device=device, serve=tables)
        cfg = self.predictor.cfg
        self.cfg, self.version = cfg, version_of(run_dir, step)
        self.precision = cfg.model.precision.inference
        self.tasks = [t.name for t in cfg.features.tasks]
        self.device = str(self.predictor.device)
        bounds = settings or cfg.serve  # the launch's settings, else the run's
        self.live = LiveFeatures(cfg, raw_dir, vocabularies, bounds.max_candidates, bounds.max_events)

    def check(self, request: Any) -> None:
        """Raises RequestError for a request that can never be scored (its fields against the raw logs)."""
        self.live.raw_tables([request], "request")

    def score(self, requests: List[dict], checked: bool = False) -> List[dict]:
        """Per request: ``{"scores": [{task: p} per candidate]}``, or ``{"error": ...}`` for a
        request the feature path or the loader's checks refused; every one with the model version.
        ``checked``: each request passed ``check`` already (the service's, on arrival)."""
        try:
            return self._score(requests, checked)
        except (RequestError, ContractError) as e:
            if len(requests) == 1:
                return [self._refused(e)]
        return [self._score_alone(request, checked) for request in requests]  # one by one: only the bad refused

    def _score_alone(self, request: dict, checked: bool) -> dict:
        try:
            return self._score([request], checked)[0]
        except (RequestError, ContractError) as e:
            return self._refused(e)

    def _refused(self, error: Exception) -> dict:
        return {"error": str(error), "model_version": self.version}

    def _score(self, requests: List[dict], checked: bool) -> List[dict]:
        rows = self.live.build(requests, checked=checked)
        batch = self.predictor.requests_batch(rows, "request")
        probs = self.predictor.score_batch(batch)[batch.valid].tolist()
        out, at = [], 0
        for n in batch_candidates(rows, self.cfg):
            scores = [dict(zip(self.tasks, p)) for p in probs[at : at + n]]
            out.append({"scores": scores, "model_version": self.version, "precision": self.precision})
            at += n
        return out


def batch_candidates(rows, cfg: config.ExperimentConfig) -> List[int]:
    """Candidates per request row of the build's per-request table."""
    import pyarrow.compute as pc

    candidate = next(c for c in rows.column_names if c not in _request_level(cfg))
    return pc.list_value_length(rows.column(candidate)).to_pylist()


def _request_level(cfg: config.ExperimentConfig) -> set:
    from pinads_rec.data.loader.storage_layout import request_level_columns

    return set(request_level_columns(cfg.features))


# --- the Ray Serve deployment ---------------------------------------------------------------------


@dataclasses.dataclass
class ServiceSpec:
    """What a replica needs to start: the model source, the raw logs, the build with the vocabularies,
    the precision (None: the run's ``model.precision.inference``), the service settings."""

    model: str
    raw: str
    vocabularies: Optional[str] = None
    step: Optional[int] = None
    precision: Optional[str] = None
    settings: Dict[str, Any] = dataclasses.field(default_factory=dict)  # ServeConfig fields overriding the run's

    def serve_config(self, cfg: config.ExperimentConfig) -> config.ServeConfig:
        return with_serve_settings(cfg, self.settings).serve


def serve_settings(assignments: List[str]) -> Dict[str, Any]:
    """``KEY=VALUE`` strings -> ServeConfig fields (typed as the dataclass declares them; checked when
    applied, ``loading.with_serve_settings``). ``table_dtypes.<table>=<dtype>`` is one table's exception."""
    fields = {f.name: f.type for f in dataclasses.fields(config.ServeConfig)}
    out: Dict[str, Any] = {}
    for item in assignments:
        key, sep, value = item.partition("=")
        key = key.removeprefix("serve.")
        head, dot, table = key.partition(".")
        if sep and head == "table_dtypes" and dot:
            out.setdefault("table_dtypes", {})[table] = value
            continue
        if not sep or key not in fields:
            raise config.ConfigError(f"--set {item!r}: give KEY=VALUE with KEY one of {', '.join(fields)}")
        kind = {"int": int, "float": float}.get(str(fields[key]), str)
        try:
            out[key] = kind(value)
        except ValueError:
            raise config.ConfigError(f"--set {item!r}: {key} takes a {fields[key]}") from None
    return out


def write_requests(spec: "ServiceSpec", split: Optional[str], limit: int, out: str) -> int:
    """The raw log's first ``limit`` requests of ``split`` as JSON lines (``LiveFeatures.requests_from_logs``)."""
    run_dir, step = ModelSource(spec.model, spec.step).newest()
    from pinads_rec.serve.loading import run_config

    cfg = run_config(run_dir, find_checkpoint(run_dir, step))
    settings = spec.serve_config(cfg)
    live = LiveFeatures(cfg, spec.raw, spec.vocabularies, settings.max_candidates, settings.max_events)
    lines = [json.dumps(r) for r in live.requests_from_logs(split, limit)]
    text = "\n".join(lines) + "\n"
    if out == "-":
        print(text, end="")
    else:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
    return len(lines)


def _deployment():
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import JSONResponse

    @serve.deployment(name="RankingService")
    class RankingService:
        def __init__(self, spec: dict):
            self.spec = ServiceSpec(**spec)
            self.source = ModelSource(self.spec.model, self.spec.step)
            run_dir, step = self.source.newest()
            settings = self.spec.serve_config(config.from_dict(_run_config(run_dir)))
            torch.set_num_threads(replica_threads(settings))
            self.settings = settings
            self.ranker = self._load(run_dir, step)
            # One ranker call per batch, formed when the previous one is done (dynamic_batching.py says
            # why not @serve.batch); the ranker read per batch, so a reload swaps it between two.
            self.batcher = DynamicBatcher(
                lambda requests: self.ranker.score(requests, checked=True),
                settings.max_batch_size,
                settings.batch_wait_ms / 1000.0,
            )
            if settings.reload_poll_s > 0 and self.spec.step is None:
                self._watcher = asyncio.get_event_loop().create_task(self._watch(settings.reload_poll_s))

        def _load(self, run_dir: Path, step: int) -> Ranker:
            return Ranker(run_dir, step, self.spec.raw, self.spec.vocabularies, self.spec.precision, self.settings)

        async def _watch(self, every_s: float) -> None:
            while True:
                await asyncio.sleep(every_s)
                try:
                    run_dir, step = self.source.newest()
                    if version_of(run_dir, step) != self.ranker.version:
                        started = time.perf_counter()
                        fresh = await asyncio.to_thread(self._load, run_dir, step)
                        self.ranker = fresh  # the next batch scores with it; the running one finishes as it began
                        log.info("now serving %s (loaded in %.1f s)", fresh.version, time.perf_counter() - started)
                except Exception as e:  # a half-written day, a bad checkpoint: keep serving the current one
                    log.warning("model reload skipped: %s", e)

        async def __call__(self, request: Request):
            if request.url.path.rstrip("/").endswith("/version"):  # GET /version: what is serving now
                ranker = self.ranker
                return JSONResponse(
                    {"model_version": ranker.version, "precision": ranker.precision, **self.batcher.stats()}
                )
            try:
                body = json.loads(await request.body())
            except (ValueError, UnicodeDecodeError) as e:
                return JSONResponse({"error": f"the body is not JSON: {e}"}, status_code=400)
            try:
                self.ranker.check(body)
            except RequestError as e:
                return JSONResponse({"error": str(e), "model_version": self.ranker.version}, status_code=400)
            result = await self.batcher.submit(body)
            return JSONResponse(result, status_code=400 if "error" in result else 200)

    return RankingService


def _run_config(run_dir: Path) -> dict:
    from pinads_rec.serve.loading import run_config

    return config.to_dict(run_config(run_dir, find_checkpoint(run_dir, None)))


def application(spec: ServiceSpec, settings: config.ServeConfig):
    """The Ray Serve application: ``settings.replicas`` replicas of the deployment, backpressure."""
    from ray.serve.config import BackpressureConfig

    per_node = {"max_replicas_per_node": settings.max_replicas_per_node} if settings.max_replicas_per_node else {}
    return (
        _deployment()
        .options(
            **per_node,
            num_replicas=settings.replicas,
            max_ongoing_requests=settings.max_ongoing_requests,
            max_queued_requests=settings.max_queued_requests,
            backpressure_config=BackpressureConfig(status_code=503, retry_after_s=settings.retry_after_s),
            # torch's threads are sized by the replica (cores / replicas); a CUDA replica holds a GPU.
            ray_actor_options={"num_cpus": 0, "num_gpus": gpus_per_replica(settings)},
        )
        .bind(dataclasses.asdict(spec))
    )


def build_app(args: Dict[str, Any]):
    """The import path Ray's ``serve run`` / KubeRay's ``serveConfigV2`` name
    (``pinads_rec.serve.online:build_app``): ``args`` are ``ServiceSpec``'s fields."""
    spec = ServiceSpec(**args)
    run_dir, _ = ModelSource(spec.model, spec.step).newest()
    return application(spec, spec.serve_config(config.from_dict(_run_config(run_dir))))


# Fresh connections that must each find the route before the service counts as started: the proxies
# of nodes on one machine share the port (SO_REUSEPORT), the kernel spreading connections over them.
ROUTE_CONFIRMATIONS = 16
ROUTE_TIMEOUT_S = 60.0


def wait_until_routed(host: str, port: int, timeout_s: float = ROUTE_TIMEOUT_S) -> None:
    """Returns once the HTTP proxy on ``host:port`` routes ``/`` to the application. ``serve.run``
    returns when the replicas are up, but a proxy learns the route a moment later (the controller
    pushes route tables asynchronously) and answers 404 meanwhile: a request sent right after
    start would fail. Polls the proxy's route table (``/-/routes``) until ROUTE_CONFIRMATIONS
    connections in a row list the route."""
    import urllib.error
    import urllib.request

    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}/-/routes"
    deadline, confirmed = time.monotonic() + timeout_s, 0
    while confirmed < ROUTE_CONFIRMATIONS:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                routed = json.loads(response.read()).get("/") == APP_NAME
        except (OSError, ValueError, AttributeError):  # refused, 503 (not ready), not JSON yet
            routed = False
        confirmed = confirmed + 1 if routed else 0
        if not routed:
            if time.monotonic() > deadline:
                raise ServeError(
                    f"the HTTP proxy on {host}:{port} did not route '/' to {APP_NAME} within {timeout_s:g} s"
                )
            time.sleep(0.1)


def deploy(spec: ServiceSpec, settings: config.ServeConfig) -> None:
    """The application deployed on the running Serve instance, returning once its HTTP proxy routes
    it (``wait_until_routed``): what ``start`` and the serving benchmark both do."""
    from ray import serve

    serve.run(application(spec, settings), name=APP_NAME, route_prefix="/")
    wait_until_routed(settings.host, settings.port)


def start(spec: ServiceSpec, address: Optional[str] = None, blocking: bool = True, ray_tmp: Optional[str] = None):
    """Starts Ray (or joins the cluster at ``address``), the HTTP proxy on ``serve.host:port``, and
    the application; with ``blocking``, serves until interrupted, then shuts Ray down."""
    import ray
    from ray import serve

    run_dir, _ = ModelSource(spec.model, spec.step).newest()
    settings = spec.serve_config(config.from_dict(_run_config(run_dir)))
    if address:
        ray.init(address=address)
    else:
        ray.init(
            include_dashboard=False,
            object_store_memory=200_000_000,  # the requests are small; Ray's default takes 30% of RAM
            _temp_dir=ray_tmp,
        )
    try:
        serve.start(http_options={"host": settings.host, "port": settings.port})
        deploy(spec, settings)
    except BaseException:
        serve.shutdown()
        ray.shutdown()
        raise
    log.info("serving %s on http://%s:%d/", spec.model, settings.host, settings.port)
    if not blocking:
        return settings
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return settings
