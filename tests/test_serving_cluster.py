"""The online service on a Ray cluster (serve/online.py's ``start(address=...)``): two replicas on a
two-node Ray cluster started on this machine serve the same scores as the in-process ``Ranker``.

The cluster is Ray's own two-node cluster on one machine (``ray.cluster_utils.Cluster``: a head and a
second raylet joining it), this test's alone: its shutdown ends what it started, and nothing else's
Ray is touched (``ray stop`` would end every Ray on the machine). Its nodes are on loopback (conftest
sets Ray to it). Every wait has a deadline."""

import json
import os
import shutil
import socket
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import ray_temp_dir

pytestmark = pytest.mark.slow


SERVE_S = 150  # start(): connect, Serve's controller and proxy, both replicas loading the model


@pytest.fixture(scope="module")
def tiny_run(served_run):
    """(run dir, raw logs dir): conftest's tiny demo run and the raw logs it was trained from."""
    return served_run[0], served_run[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _within(seconds, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in a thread, failing the test (not hanging it) past ``seconds``."""
    out, error = [], []

    def run():
        try:
            out.append(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            error.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        raise TimeoutError(f"{getattr(fn, '__name__', fn)} still running after {seconds} s")
    if error:
        raise error[0]
    return out[0] if out else None


@pytest.fixture
def cluster():
    """The head's address of a two-node Ray cluster of this test's own (Ray's ``cluster_utils``: a
    second raylet on this machine, on loopback as conftest sets Ray); torn down after it."""
    import ray
    from ray import serve
    from ray._common.utils import get_default_ray_temp_dir
    from ray.cluster_utils import Cluster

    temp_dir = ray_temp_dir("rc_")
    # The head writes its address to $RAY_TMPDIR/ray/ray_current_cluster, Ray's default root, whatever
    # temp_dir it is given, and only a Ray started without one creates that directory: make it.
    os.makedirs(get_default_ray_temp_dir(), exist_ok=True)
    node = {"num_cpus": 1, "object_store_memory": 100_000_000}
    # In this thread (Ray installs signal handlers); Ray bounds each node's start itself.
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False, "temp_dir": temp_dir})
    try:
        cluster.add_node(**node)
        yield cluster.address
    finally:
        if ray.is_initialized():
            try:
                _within(60, serve.shutdown)
            finally:
                _within(30, ray.shutdown)
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _post(port: int, request: dict) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/", data=json.dumps(request).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
        return json.loads(r.read())


def _replicas():
    import ray._private.state as ray_state

    actors = ray_state.actors().values()
    return [a for a in actors if a["State"] == "ALIVE" and a["ActorClassName"].endswith("RankingService")]


def test_two_replicas_on_two_nodes_serve_the_in_process_scores(tiny_run, cluster):
    import ray

    from pinads_rec.serve.online import ModelSource, Ranker, ServiceSpec, start

    run, raw = tiny_run
    run_dir, step = ModelSource(str(run)).newest()
    ranker = Ranker(run_dir, step, str(raw), None, "fp32")
    requests = ranker.live.requests_from_logs(None, 160)[::8]  # 20, spread over the log (users with history)
    want = ranker.score(requests)

    http_port = _free_port()
    spec = ServiceSpec(
        model=str(run),
        raw=str(raw),
        precision="fp32",
        settings={
            "replicas": 2,
            "max_replicas_per_node": 1,
            "host": "127.0.0.1",
            "port": http_port,
            "reload_poll_s": 0,
        },
    )
    settings = _within(SERVE_S, start, spec, cluster, False)
    assert settings.replicas == 2 and settings.port == http_port

    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(nodes) == 2
    assert {a["Address"]["NodeID"] for a in _replicas()} == nodes  # one replica on each node

    with ThreadPoolExecutor(8) as pool:  # concurrent: both replicas, batches of several requests
        got = list(pool.map(lambda r: _post(http_port, r), requests))
    assert len(got) == len(want) == 20
    for i, (g, w) in enumerate(zip(got, want)):
        assert "error" not in w, w
        assert g["model_version"] == w["model_version"] == f"{run.name}@step-{step}"
        assert g["precision"] == "fp32"
        assert len(g["scores"]) == len(w["scores"]) > 0
        for cg, cw in zip(g["scores"], w["scores"]):
            assert cg.keys() == cw.keys() == set(ranker.tasks)
            for task in cw:
                assert cg[task] == pytest.approx(cw[task], abs=1e-6), (i, task)
