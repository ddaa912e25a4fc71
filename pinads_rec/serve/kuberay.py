"""The online ranking service on Kubernetes: the KubeRay ``RayService`` manifest that runs it, and its dry run.

    python -m pinads_rec.serve kuberay --run /mnt/pinads/runs/demo --raw /mnt/pinads/data/raw \\
        --image registry.example.com/pinads_rec:latest --workers 2 --set replicas=2 --out rayservice.yaml
    kubectl apply -f rayservice.yaml          # the KubeRay operator installed in the cluster
    kubectl port-forward svc/pinads-rec-serve-svc 8000   # KubeRay's Service in front of the HTTP proxies

``write_manifest`` writes one ``RayService`` (apiVersion ray.io/v1): its ``serveConfigV2`` (a YAML
string, as KubeRay wants it) deploys the same application ``online.py`` starts by hand, by import
path (``pinads_rec.serve.online:build_app``, args the ``ServiceSpec``), with ``RankingService``'s
replicas, backpressure and queue bounds from the run's ``serve:`` settings; its ``rayClusterConfig``
is a head pod (GCS, Serve's controller, an HTTP proxy; ``num-cpus: 0`` so no replica lands there)
and one worker group whose pods hold the replicas (each replica reserves its share of a pod's CPUs,
so Ray spreads them over the pods). The image is the repository's Dockerfile; it must hold the Ray
version this manifest names (``rayVersion``, the lock's).

**The model and the raw logs are not in the image.** Every pod reads the run directory, the raw logs
(and the vocabularies' build) at the paths the manifest names, which are made absolute: mount a
volume holding them at those paths, e.g. ``write_manifest(..., volume_claim="pinads-data",
mount_path="/mnt/pinads")`` mounts that PersistentVolumeClaim (ReadOnlyMany, or ReadWriteMany when
the trainer writes new checkpoints to it for the replicas' reload) at ``/mnt/pinads`` in every pod,
and the paths must then lie under it.

``validate`` is the dry run, everything that can be checked without a cluster: the RayService's
required fields, ``serveConfigV2`` parsed by Ray Serve's own schema (``ServeDeploySchema``, the one
the controller applies), every deployment option a known one with a value Ray accepts, and the import
path resolved and called with the args, so the application builds from the very run and raw logs the
pods will read. ``write_manifest`` runs it before writing anything.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import os
import re
from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml

from pinads_rec import config
from pinads_rec.serve.loading import ServeError

IMPORT_PATH = "pinads_rec.serve.online:build_app"
DEPLOYMENT = "RankingService"
SERVE_PORT = 8000  # the port KubeRay's serve Service targets (the head container's "serve" port)
MOUNT_VOLUME = "pinads-data"


class ManifestError(ServeError):
    """A RayService manifest KubeRay or Ray Serve would refuse (or deploy broken); names what is wrong."""


# --- the manifest ------------------------------------------------------------------------------------


def write_manifest(spec, image: str, workers: int, out: str, **options) -> Path:
    """Writes the RayService manifest serving ``spec`` (an ``online.ServiceSpec``) to ``out``, once
    ``validate`` passes; ``options`` are ``build_manifest``'s."""
    manifest = build_manifest(spec, image, workers, **options)
    validate(manifest)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump(manifest))
    return path


def build_manifest(
    spec,
    image: str,
    workers: int,
    *,
    name: str = "pinads-rec",
    namespace: Optional[str] = None,
    worker_cpus: int = 4,
    worker_memory: str = "8Gi",
    max_replicas: Optional[int] = None,
    volume_claim: Optional[str] = None,
    mount_path: Optional[str] = None,
) -> Dict[str, Any]:
    """The manifest as a dict. ``workers`` worker pods of ``worker_cpus`` CPUs and ``worker_memory``;
    ``max_replicas`` above ``serve.replicas``: Serve's autoscaling between the two (and KubeRay's
    autoscaler adding worker pods for them); ``volume_claim``: a PersistentVolumeClaim mounted at
    ``mount_path`` in every pod (where the run and the raw logs are)."""
    import ray

    from pinads_rec.serve.online import APP_NAME, ModelSource, _run_config

    if workers < 1 or worker_cpus < 1:
        raise ManifestError(f"--workers {workers}, worker_cpus {worker_cpus}: a RayService needs at least one of each")
    if volume_claim and not mount_path:
        raise ManifestError(f"volume_claim {volume_claim!r}: give the mount_path the run and raw logs lie under")
    # The pods resolve the paths from their own working directory (the image's /workspace): absolute ones only.
    spec = dataclasses.replace(
        spec,
        model=os.path.abspath(spec.model),
        raw=os.path.abspath(spec.raw),
        vocabularies=os.path.abspath(spec.vocabularies) if spec.vocabularies else None,
    )
    if mount_path:
        outside = [p for p in (spec.model, spec.raw, spec.vocabularies) if p and not _under(p, mount_path)]
        if outside:
            raise ManifestError(f"{', '.join(outside)}: not under mount_path {mount_path} (the pods would not see it)")
    run_dir, _ = ModelSource(spec.model, spec.step).newest()  # a missing run fails here, before any YAML
    settings = spec.serve_config(config.from_dict(_run_config(run_dir)))
    replicas = max(1, settings.replicas)
    per_worker = math.ceil(replicas / workers)
    # A replica reserves its share of a worker pod's CPUs: Ray then spreads the replicas over the pods
    # (online.py's own launch reserves none: one machine, torch threads sized by the replica).
    replica_cpus = max(1, worker_cpus // per_worker)
    deployment: Dict[str, Any] = {"name": DEPLOYMENT}
    autoscale = max_replicas is not None and max_replicas > replicas
    if autoscale:
        deployment["autoscaling_config"] = {
            "min_replicas": replicas,
            "max_replicas": max_replicas,
            "target_ongoing_requests": max(1, settings.max_batch_size),  # a full batch per replica
        }
    else:
        deployment["num_replicas"] = replicas
    deployment.update(
        max_ongoing_requests=settings.max_ongoing_requests,
        max_queued_requests=settings.max_queued_requests,
        backpressure_config={"status_code": 503, "retry_after_s": settings.retry_after_s},
        ray_actor_options={"num_cpus": replica_cpus},
    )
    serve_config = {
        "proxy_location": "EveryNode",  # every pod's proxy answers; KubeRay's Service balances over them
        "http_options": {"host": "0.0.0.0", "port": SERVE_PORT},
        "applications": [
            {
                "name": APP_NAME,
                "import_path": IMPORT_PATH,
                "route_prefix": "/",
                "args": dataclasses.asdict(spec),
                "deployments": [deployment],
            }
        ],
    }
    env = [
        # One thread for every process's stray OpenMP/MKL pool (proxy, controller, Ray's workers);
        # a replica sizes its own torch pool.
        {"name": "OMP_NUM_THREADS", "value": "1"},
        {"name": "MKL_NUM_THREADS", "value": "1"},
        {"name": "RAY_USAGE_STATS_ENABLED", "value": "0"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    mounts, volumes = [], []
    if volume_claim:
        volumes = [{"name": MOUNT_VOLUME, "persistentVolumeClaim": {"claimName": volume_claim}}]
        mounts = [{"name": MOUNT_VOLUME, "mountPath": mount_path}]

    def pod(container: str, cpus: int, memory: str, ports: List[dict]) -> Dict[str, Any]:
        c: Dict[str, Any] = {
            "name": container,
            "image": image,
            "imagePullPolicy": "IfNotPresent",
            "env": env,
            "resources": {
                "requests": {"cpu": str(cpus), "memory": memory},
                "limits": {"cpu": str(cpus), "memory": memory},
            },
            "ports": ports,
        }
        if mounts:
            c["volumeMounts"] = mounts
        spec_: Dict[str, Any] = {"containers": [c]}
        if volumes:
            spec_["volumes"] = volumes
        return {"spec": spec_}

    head_ports = [
        {"containerPort": 6379, "name": "gcs-server"},
        {"containerPort": 8265, "name": "dashboard"},
        {"containerPort": 10001, "name": "client"},
        {"containerPort": SERVE_PORT, "name": "serve"},
    ]
    max_workers = max(workers, math.ceil(max_replicas / per_worker)) if autoscale else workers
    cluster: Dict[str, Any] = {
        "rayVersion": ray.__version__,  # the image's Ray: the lock's, as here
        "headGroupSpec": {
            # num-cpus 0: GCS, Serve's controller and a proxy only; the replicas go to the workers.
            "rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0"},
            "template": pod("ray-head", 2, "4Gi", head_ports),
        },
        "workerGroupSpecs": [
            {
                "groupName": "rankers",
                "replicas": workers,
                "minReplicas": workers,
                "maxReplicas": max_workers,
                "rayStartParams": {},
                "template": pod(
                    "ray-worker", worker_cpus, worker_memory, [{"containerPort": SERVE_PORT, "name": "serve"}]
                ),
            }
        ],
    }
    if autoscale:
        cluster["enableInTreeAutoscaling"] = True
    metadata: Dict[str, Any] = {"name": name}
    if namespace:
        metadata["namespace"] = namespace
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": metadata,
        "spec": {"serveConfigV2": _yaml(serve_config), "rayClusterConfig": cluster},
    }


def _under(path: str, root: str) -> bool:
    return os.path.commonpath([path, os.path.abspath(root)]) == os.path.abspath(root)


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True  # the pods share one env list: written out twice, not as a YAML anchor


def _block_strings(dumper: yaml.SafeDumper, value: str):
    # serveConfigV2 as a literal block (|): readable in the manifest, as KubeRay's own samples write it.
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _block_strings)


def _yaml(data: Any) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False)


def dump(manifest: Dict[str, Any]) -> str:
    """The manifest as YAML, ``serveConfigV2`` as a literal block."""
    return _yaml(manifest)


# --- the dry run -------------------------------------------------------------------------------------

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def validate(manifest: Dict[str, Any]) -> None:
    """Everything about a RayService manifest that can be checked without a cluster; raises
    ManifestError naming the first problem. Builds the application (so the run and raw logs its args
    name must exist here, at the paths the pods will read)."""
    from ray.serve.schema import ServeDeploySchema

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ManifestError(f"RayService manifest: {what}")

    need(isinstance(manifest, dict), f"a mapping, not {type(manifest).__name__}")
    need(manifest.get("apiVersion") == "ray.io/v1", f"apiVersion {manifest.get('apiVersion')!r}, not 'ray.io/v1'")
    need(manifest.get("kind") == "RayService", f"kind {manifest.get('kind')!r}, not 'RayService'")
    name = (manifest.get("metadata") or {}).get("name")
    need(
        isinstance(name, str) and len(name) <= 63 and bool(_DNS_LABEL.match(name)),
        f"metadata.name {name!r} is not a DNS label (lower-case letters, digits, '-'; at most 63)",
    )
    spec = manifest.get("spec") or {}
    need(isinstance(spec.get("serveConfigV2"), str), "spec.serveConfigV2 must be a YAML string (KubeRay's field)")
    _check_cluster(spec.get("rayClusterConfig"), need)

    try:
        serve_config = yaml.safe_load(spec["serveConfigV2"])
    except yaml.YAMLError as e:
        raise ManifestError(f"spec.serveConfigV2 is not YAML: {e}") from None
    try:
        schema = ServeDeploySchema.model_validate(serve_config)
    except Exception as e:  # pydantic's ValidationError: its first line names the field
        raise ManifestError(f"spec.serveConfigV2 refused by Ray Serve's schema: {_one_line(e)}") from None
    need(bool(schema.applications), "spec.serveConfigV2 has no applications")
    for i, app_config in enumerate(schema.applications):
        raw = serve_config["applications"][i]
        _check_application(app_config, raw, f"spec.serveConfigV2.applications[{i}] ({app_config.name})")


def _check_cluster(cluster: Any, need) -> None:
    need(isinstance(cluster, dict), "spec.rayClusterConfig is missing")
    need(bool(cluster.get("rayVersion")), "spec.rayClusterConfig.rayVersion is missing (the image's Ray version)")
    head = cluster.get("headGroupSpec")
    need(isinstance(head, dict), "spec.rayClusterConfig.headGroupSpec is missing")
    groups = [("headGroupSpec", head)] + [
        (f"workerGroupSpecs[{i}]", g) for i, g in enumerate(cluster.get("workerGroupSpecs") or [])
    ]
    for where, group in groups:
        where = f"spec.rayClusterConfig.{where}"
        need(isinstance(group, dict), f"{where} is not a mapping")
        params = group.get("rayStartParams")
        need(isinstance(params, dict), f"{where}.rayStartParams is missing")
        need(
            all(isinstance(v, str) for v in params.values()),
            f"{where}.rayStartParams values must be strings (KubeRay's map[string]string): {params}",
        )
        containers = ((group.get("template") or {}).get("spec") or {}).get("containers") or []
        need(bool(containers), f"{where}.template.spec.containers is empty")
        need(all(c.get("image") and c.get("name") for c in containers), f"{where}: a container without name or image")
    for i, group in enumerate(cluster.get("workerGroupSpecs") or []):
        where = f"spec.rayClusterConfig.workerGroupSpecs[{i}]"
        need(bool(group.get("groupName")), f"{where}.groupName is missing")
        lo, n, hi = group.get("minReplicas", 0), group.get("replicas", 0), group.get("maxReplicas", 2**31 - 1)
        need(
            all(isinstance(v, int) for v in (lo, n, hi)) and 0 <= lo <= n <= hi,
            f"{where}: minReplicas {lo} <= replicas {n} <= maxReplicas {hi} does not hold",
        )


def _check_application(app_config, raw: Dict[str, Any], where: str) -> None:
    """The import path resolves to the builder, the builder builds an Application from the args, and
    each deployment option names a deployment of it, a known option and a value Ray accepts."""
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve._private.build_app import build_app
    from ray.serve.schema import DeploymentSchema

    target = app_config.import_path
    module_name, _, attr = target.partition(":") if ":" in target else target.rpartition(".")
    try:
        builder = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ManifestError(f"{where}: import_path {target!r} does not resolve: {_one_line(e)}") from None
    _check_paths(app_config.args or {}, where)
    try:
        app = call_user_app_builder_with_args_if_necessary(builder, app_config.args or {})
    except Exception as e:  # whatever the builder raises, the controller would raise it too
        raise ManifestError(f"{where}: {target}(args) does not build: {_one_line(e)}") from None
    deployments = {d.name: d for d in build_app(app, name=app_config.name).deployments}
    known = set(DeploymentSchema.model_fields)
    settable = set(inspect.signature(next(iter(deployments.values())).options).parameters)
    for options in raw.get("deployments") or []:
        dname = options.get("name")
        if dname not in deployments:
            raise ManifestError(
                f"{where}: no deployment {dname!r} in the application (it has {', '.join(deployments)})"
            )
        unknown = sorted(set(options) - known)
        if unknown:
            raise ManifestError(
                f"{where}: deployment {dname}: unknown option(s) {', '.join(unknown)} "
                "(Ray Serve would ignore them silently)"
            )
        try:
            deployments[dname].options(**{k: v for k, v in options.items() if k in settable and k != "name"})
        except (TypeError, ValueError) as e:
            raise ManifestError(f"{where}: deployment {dname}: {_one_line(e)}") from None


def _check_paths(args: Dict[str, Any], where: str) -> None:
    # The builder reads the run's config only; the raw logs are first read by the replicas, in the pods.
    for key in ("model", "raw", "vocabularies"):
        value = args.get(key)
        if value is None:
            continue
        if not os.path.isabs(str(value)):
            raise ManifestError(f"{where}: args.{key} {value!r} must be absolute (the pods read it from a volume)")
        if not os.path.isdir(str(value)):
            raise ManifestError(f"{where}: args.{key} {value!r} is not a directory here")


def _one_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return " ".join(lines[:3]) if lines else type(error).__name__
