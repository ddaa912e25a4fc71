"""KubeRay (serve/kuberay.py): the RayService manifest for a tiny trained run has the structure KubeRay
wants, passes the dry run (Ray Serve's own schema, the import path, the application built from the
args), and a broken one is refused naming what is wrong; ``python -m pinads_rec.serve kuberay``
writes it, and a missing run is one line and exit status 2. No cluster: nothing is applied."""

import copy
import os
import subprocess
import sys

import pytest
import yaml
from conftest import REPO

from pinads_rec import config

pytestmark = pytest.mark.slow

# Users with several requests (the raw logs' timelines), as test_build_demo.py.


@pytest.fixture(scope="module")
def tiny_run(served_run):
    """(run dir, raw logs dir): conftest's tiny demo run and the raw logs it was trained from."""
    return served_run[0], served_run[1]


@pytest.fixture(scope="module")
def manifest(tiny_run, tmp_path_factory):
    from pinads_rec.serve.kuberay import write_manifest
    from pinads_rec.serve.online import ServiceSpec

    run, raw = tiny_run
    spec = ServiceSpec(model=str(run), raw=str(raw), settings={"replicas": 3, "max_queued_requests": 40})
    out = write_manifest(spec, "registry.example/pinads_rec:1", 2, tmp_path_factory.mktemp("m") / "rayservice.yaml")
    return yaml.safe_load(out.read_text())


def _serve(manifest):
    return yaml.safe_load(manifest["spec"]["serveConfigV2"])


def _with_serve(manifest, edit):
    """A copy of the manifest with ``edit`` applied to its parsed serveConfigV2."""
    broken = copy.deepcopy(manifest)
    serve = _serve(broken)
    edit(serve)
    broken["spec"]["serveConfigV2"] = yaml.safe_dump(serve)
    return broken


def test_manifest_structure(manifest, tiny_run):
    import ray

    run, raw = tiny_run
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    assert manifest["metadata"]["name"] == "pinads-rec"
    assert isinstance(manifest["spec"]["serveConfigV2"], str)  # KubeRay takes a YAML string
    serve = _serve(manifest)
    assert serve["http_options"] == {"host": "0.0.0.0", "port": 8000}
    (app,) = serve["applications"]
    assert app["import_path"] == "pinads_rec.serve.online:build_app" and app["route_prefix"] == "/"
    assert app["args"] == {
        "model": str(run),
        "raw": str(raw),
        "vocabularies": None,
        "step": None,
        "precision": None,
        "settings": {"replicas": 3, "max_queued_requests": 40},
    }
    (dep,) = app["deployments"]
    assert dep["name"] == "RankingService"
    assert dep["num_replicas"] == 3 and "autoscaling_config" not in dep
    assert dep["max_ongoing_requests"] == 32 and dep["max_queued_requests"] == 40  # the run's, then the override
    assert dep["backpressure_config"] == {"status_code": 503, "retry_after_s": 1.0}
    assert dep["ray_actor_options"] == {"num_cpus": 2}  # 3 replicas on 2 pods of 4 CPUs: 2 a pod, 2 CPUs each

    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == ray.__version__
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"] == {"dashboard-host": "0.0.0.0", "num-cpus": "0"}
    (c,) = head["template"]["spec"]["containers"]
    assert c["image"] == "registry.example/pinads_rec:1"
    assert {"containerPort": 8000, "name": "serve"} in c["ports"]
    assert {"name": "OMP_NUM_THREADS", "value": "1"} in c["env"]
    (group,) = cluster["workerGroupSpecs"]
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 2
    (w,) = group["template"]["spec"]["containers"]
    assert w["resources"]["limits"] == {"cpu": "4", "memory": "8Gi"}
    assert "enableInTreeAutoscaling" not in cluster


def test_written_manifest_validates(manifest):
    """The file as written passes the dry run (validate raises ManifestError on a problem) and is the
    manifest ``build_manifest`` makes of the same spec."""
    from pinads_rec.serve.kuberay import build_manifest, validate
    from pinads_rec.serve.online import ServiceSpec

    assert validate(manifest) is None
    app = _serve(manifest)["applications"][0]
    spec = ServiceSpec(**app["args"])
    assert manifest == yaml.safe_load(yaml.safe_dump(build_manifest(spec, "registry.example/pinads_rec:1", 2)))


def test_autoscaling_and_volume(tiny_run, tmp_path):
    from pinads_rec.serve.kuberay import ManifestError, build_manifest, validate
    from pinads_rec.serve.online import ServiceSpec

    run, raw = tiny_run
    spec = ServiceSpec(model=str(run), raw=str(raw), settings={"replicas": 2})
    root = os.path.commonpath([str(run), str(raw)])
    m = build_manifest(spec, "img", 1, max_replicas=6, volume_claim="pinads-data", mount_path=root)
    validate(m)
    dep = _serve(m)["applications"][0]["deployments"][0]
    assert "num_replicas" not in dep
    batch = config.ServeConfig().max_batch_size  # the run's (its config's default): a full batch a replica
    assert dep["autoscaling_config"] == {"min_replicas": 2, "max_replicas": 6, "target_ongoing_requests": batch}
    cluster = m["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    group = cluster["workerGroupSpecs"][0]
    assert (group["minReplicas"], group["maxReplicas"]) == (1, 3)  # 2 replicas a pod: 6 need 3 pods
    for pod in (cluster["headGroupSpec"]["template"], group["template"]):
        assert pod["spec"]["volumes"] == [
            {"name": "pinads-data", "persistentVolumeClaim": {"claimName": "pinads-data"}}
        ]
        assert pod["spec"]["containers"][0]["volumeMounts"] == [{"name": "pinads-data", "mountPath": root}]
    with pytest.raises(ManifestError, match="not under mount_path"):
        build_manifest(spec, "img", 1, volume_claim="pinads-data", mount_path=str(tmp_path))


def _set_import_path(path):
    def edit(serve):
        serve["applications"][0]["import_path"] = path

    return edit


def _set_option(key, value):
    def edit(serve):
        serve["applications"][0]["deployments"][0][key] = value

    return edit


def _set_arg(key, value):
    def edit(serve):
        serve["applications"][0]["args"][key] = value

    return edit


@pytest.mark.parametrize(
    "edit, message",
    [
        (_set_import_path("pinads_rec.serve.online:no_such_builder"), "does not resolve"),
        (_set_import_path("no_such_module.app:build_app"), "does not resolve"),
        (_set_import_path("build_app"), "refused by Ray Serve's schema.*invalid import path"),
        (_set_option("num_replica", 2), "unknown option.*num_replica"),
        (_set_option("name", "Ranker"), "no deployment 'Ranker'"),
        (_set_option("autoscaling_config", {"min_replicas": 1, "max_replicas": 4}), "num_replicas"),
        (_set_option("max_ongoing_requests", "many"), "refused by Ray Serve's schema"),
        (_set_arg("model", "runs/demo"), "must be absolute"),
        (_set_arg("raw", "/no/such/raw"), "is not a directory"),
        (_set_arg("modle", "/tmp"), "does not build"),
    ],
    ids=[
        "unknown-builder",
        "unknown-module",
        "malformed-import-path",
        "unknown-option",
        "unknown-deployment",
        "replicas-and-autoscaling",
        "option-type",
        "relative-path",
        "missing-raw",
        "unknown-arg",
    ],
)
def test_broken_serve_config_refused(manifest, edit, message):
    from pinads_rec.serve.kuberay import ManifestError, validate

    with pytest.raises(ManifestError, match=message) as e:
        validate(_with_serve(manifest, edit))
    assert "\n" not in str(e.value)  # the command line prints one line


def test_broken_cluster_refused(manifest):
    from pinads_rec.serve.kuberay import ManifestError, validate

    def broken(edit):
        m = copy.deepcopy(manifest)
        edit(m)
        return m

    cases = [
        (lambda m: m.update(kind="RayCluster"), "kind 'RayCluster'"),
        (lambda m: m["metadata"].update(name="Pinads_Rec"), "not a DNS label"),
        (lambda m: m["spec"].update(serveConfigV2=yaml.safe_load(m["spec"]["serveConfigV2"])), "YAML string"),
        (lambda m: m["spec"].pop("rayClusterConfig"), "rayClusterConfig is missing"),
        (lambda m: m["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"].update({"num-cpus": 0}), "strings"),
        (lambda m: m["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].update(replicas=5), "maxReplicas"),
        (
            lambda m: m["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"].update(containers=[]),
            "empty",
        ),
    ]
    for edit, message in cases:
        with pytest.raises(ManifestError, match=message):
            validate(broken(edit))


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "pinads_rec.serve", "kuberay", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_cli_writes_manifest(tiny_run, tmp_path):
    from pinads_rec.serve.kuberay import validate

    run, raw = tiny_run
    out = tmp_path / "rayservice.yaml"
    r = _cli(
        "--run", str(run), "--raw", str(raw), "--image", "x", "--workers", "2", "--set", "replicas=2", "--out", str(out)
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"kubectl apply -f {out}" in r.stdout
    m = yaml.safe_load(out.read_text())
    assert _serve(m)["applications"][0]["deployments"][0]["num_replicas"] == 2
    assert m["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] == 2
    validate(m)


def test_cli_missing_run(tiny_run, tmp_path):
    _, raw = tiny_run
    out = tmp_path / "rayservice.yaml"
    r = _cli("--run", str(tmp_path / "no_run"), "--raw", str(raw), "--image", "x", "--out", str(out))
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("serve error:") and "no_run" in lines[0], r.stderr
    assert not out.exists()
