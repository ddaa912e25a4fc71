"""Shared fixtures: one tiny planted-truth dataset per test session, and configs pointing at it."""

import json
import os
import shutil
import tempfile

import pytest

# Ray on loopback: its nodes take 127.0.0.1 as their address (Ray's switch for machines without a
# cluster network), so the tests' Ray traffic stays on this machine's loopback. Read when Ray is
# imported, hence here, before any test imports it.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# OpenMP threads that wait for work sleep instead of spinning. make test runs two workers on two
# cores, and each one's torch (and every process it starts: CLIs, ranks, replicas) runs its
# intra-op pool on every core: on a busy machine spinning threads take the core a working one needs
# (test_continuous's rerun, in-process scoring: 104 s, 17 s passive, side by side). Threads and
# results are unchanged; read when torch loads, hence before any import of it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The tests' Spark JVMs (--engine spark, in-process and in the CLIs and benchmarks they start) run
# a few dozen small jobs each and exit: C1 alone, one compiler thread and the serial collector
# spend 40% less CPU on them (a Taobao-fixture build, cold then warm: 110 -> 65 CPU s) than the
# server JIT and GC tuned for long jobs. Results are unchanged; read when pyspark launches its JVM.
# Java ignores TMPDIR: its temporary root (Spark's local dirs, blockmgr-*, spark-*) is named here, and
# no hsperfdata file goes to /tmp (UsePerfData off, for the driver and for spark-submit's launcher
# JVM: only jps and jstat read it).
os.environ.setdefault(
    "PYSPARK_SUBMIT_ARGS",
    f"--driver-java-options '-XX:TieredStopAtLevel=1 -XX:CICompilerCount=1 -XX:+UseSerialGC -XX:-UsePerfData "
    f"-Djava.io.tmpdir={tempfile.gettempdir()}' pyspark-shell",
)
os.environ.setdefault("SPARK_LAUNCHER_OPTS", "-XX:-UsePerfData")

# Ray's temporary root of this test session's own (or the caller's RAY_TMPDIR, as .ci/run gives):
# every Ray a test starts keeps its sessions, sockets, logs and "current cluster" address under it,
# and what one run leaves there no later run can lean on. Each xdist worker gets a root of its own
# below the session's, so the Rays two workers run at once never share one. Short (Ray's unix socket
# paths under it are length-bound); an own root is removed when the session ends (pytest_unconfigure).
_OWN_RAY_ROOT = None
if "RAY_TMPDIR" not in os.environ:  # the session (xdist's controller, or pytest without it)
    _OWN_RAY_ROOT = os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="pinads_ray_")
if "PYTEST_XDIST_WORKER" in os.environ:  # a worker: below the session's root, which it inherits
    os.environ["RAY_TMPDIR"] = os.path.join(os.environ["RAY_TMPDIR"], os.environ["PYTEST_XDIST_WORKER"])
    os.makedirs(os.environ["RAY_TMPDIR"], exist_ok=True)


# Ray's token authentication (on by default for a local cluster) takes its token from RAY_AUTH_TOKEN,
# RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token, and the first ray.init on a machine without one writes
# ~/.ray/auth_token, which every later Ray on that machine then reads. A token of this session's own,
# in the environment the ranks, replicas and raylets inherit, leaves $HOME alone.
if "RAY_AUTH_TOKEN" not in os.environ and "RAY_AUTH_TOKEN_PATH" not in os.environ:
    import secrets

    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)


def pytest_unconfigure():
    if _OWN_RAY_ROOT:
        shutil.rmtree(_OWN_RAY_ROOT, ignore_errors=True)


def ray_temp_dir(prefix: str) -> str:
    """A new, empty directory under the session's Ray root for one Ray head's ``temp_dir``."""
    return tempfile.mkdtemp(prefix=prefix, dir=os.environ["RAY_TMPDIR"])


from pinads_rec import config  # noqa: E402 - after the environment the imports read
from pinads_rec.data.synth import generate  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(REPO, "configs", "demo.yaml")

# Small enough to generate in about a second, big enough for several row groups per file.
TINY_SYNTH = [
    "synth.train_requests=400",
    "synth.eval_requests=160",
    "synth.calibration_requests=100",
    "synth.row_group_size=600",
    "synth.num_files=2",
    "synth.sequence_length=20",
]


# The demo_raw world: users with several requests (timelines) and the demo's sequence caps.
DEMO_RAW = ["synth.num_users=150", "synth.sequence_length=100"]


def tiny_overrides(data_dir, run_dir=None):
    """Overrides (also usable as train.py --set arguments) pointing the demo config at tiny data."""
    out = TINY_SYNTH + [
        f"data.train_dir={data_dir}/train",
        f"data.eval_dir={data_dir}/eval",
        f"data.calibration_dir={data_dir}/calibration",
        "data.batch_size=128",
        "data.shuffle_buffer_rows=1024",
        "data.num_workers=0",
    ]
    if run_dir is not None:
        out.append(f"train.run_dir={run_dir}")
    return out


def load_tiny(data_dir, extra=()):
    return config.load(DEMO, tiny_overrides(data_dir) + list(extra))


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """(config, data directory) of a tiny dataset in the contract, generated once per session."""
    out = tmp_path_factory.mktemp("tiny_data")
    cfg = load_tiny(out)
    generate(cfg, out)
    return cfg, out


def rows_of(table, features=None):
    """A contract table as one row per candidate, whatever its layout (the generator and the
    builder write per request: data/loader/storage_layout.py)."""
    from pinads_rec.data.loader.storage_layout import is_per_request, to_per_row

    features = features or config.load(DEMO).features
    return to_per_row(table, features) if is_per_request(table.schema, features) else table


def read_rows(path, features=None, columns=None):
    """A contract Parquet file or directory (files in name order) as one row per candidate."""
    import glob

    import pyarrow as pa
    import pyarrow.parquet as pq

    files = sorted(glob.glob(os.path.join(str(path), "**", "*.parquet"), recursive=True)) or [str(path)]
    tables = [rows_of(pq.read_table(f), features) for f in files]
    tables = [t.select(columns) for t in tables] if columns else tables
    return pa.concat_tables(tables) if len(tables) > 1 else tables[0]


TORCHX_TIMEOUT_S = 300


def torchx_train(tmp, job, config_path, overrides, timeout_s=TORCHX_TIMEOUT_S):
    """``torchx run -s local_cwd components/train.py:train -j JOB`` (harness.launch.torchx_train) with
    ``--config config_path --set overrides``; its combined output."""
    from pathlib import Path

    from pinads_rec.experiments.harness.launch import torchx_train as launch

    log = Path(tmp) / "torchx.log"
    try:
        rc = launch(config_path, list(overrides), job, log, timeout_s)
    except (FileNotFoundError, TimeoutError) as e:
        pytest.fail(f"{e}\n{log.read_text()[-6000:] if log.exists() else ''}")
    out = log.read_text()
    assert rc == 0, f"torchx exited {rc}:\n{out[-6000:]}"
    return out


def _train_few_steps(rank, world, result_dir, data_dir, run_root, variants):
    from pinads_rec import parallel
    from pinads_rec.training.trainer import Trainer

    env = parallel.init_distributed()
    out = {}
    for i, (name, overrides) in enumerate(variants):
        cfg = load_tiny(
            data_dir,
            list(overrides)
            + [f"train.run_dir={run_root}/{i}", "train.max_steps=3", "train.log_every=1", "model.calibration=none"],
        )
        summary = Trainer(cfg, env).run()
        out[name] = {
            "steps": summary["step"],
            "pipelined": summary["pipelined_modules"],
            "finite": all(r["ne"] == r["ne"] for r in summary["eval"]),
        }
    if rank == 0:
        with open(os.path.join(result_dir, "variants.json"), "w") as f:
            json.dump(out, f)


def train_few_steps(tmp_path, data_dir, variants):
    """Trains each (name, overrides) of ``variants`` on the tiny data for 3 steps on 2 gloo ranks
    (one launch for all): name -> {"steps", "pipelined" (the modules TrainPipelineSparseDist
    pipelined), "finite" (every eval NE)}."""
    from pinads_rec.experiments.harness import run_ranks

    result_dir = run_ranks(
        _train_few_steps, 2, str(tmp_path), str(data_dir), str(tmp_path / "runs"), list(variants), timeout_s=600
    )
    with open(os.path.join(result_dir, "variants.json")) as f:
        return json.load(f)


def checkpoint_tensors(checkpoint_dir, out_file):
    """Every tensor of a DCP checkpoint, unsharded, as one flat dict of dotted keys (written to
    ``out_file`` on the way: ``dcp_to_torch_save``)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(checkpoint_dir), str(out_file))
    return _flatten(torch.load(out_file, weights_only=False))


def _flatten(tree, prefix=""):
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flatten(sub, f"{prefix}{key}.").items()}
    return {prefix[:-1]: tree}


def demo_raw(root):
    """(config with the tiny world's split boundaries, raw dir, build out dir): the demo's raw logs of
    a tiny world (users with several requests, the demo's sequence caps) generated and built."""
    import time

    from pinads_rec.config import SplitConfig
    from pinads_rec.data import build as B
    from pinads_rec.data import synth as S

    cfg = load_tiny(root / "synth", DEMO_RAW)
    S.generate(cfg, root / "synth", raw=True)
    bounds = S.split_boundaries(cfg.synth)

    def iso(t):
        return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))

    cfg.build.splits = [
        SplitConfig("train", end=iso(bounds["train"][1])),
        SplitConfig("calibration", start=iso(bounds["calibration"][0]), end=iso(bounds["calibration"][1])),
        SplitConfig("eval", start=iso(bounds["eval"][0])),
    ]
    B.build(cfg, str(root / "synth" / "raw"), str(root / "built"))
    return cfg, root / "synth" / "raw", root / "built"


def _train_config(rank, world, result_dir, config_path, overrides):
    """One rank of a ``Trainer`` run of ``config_path`` with ``overrides`` (``run_ranks``' target)."""
    from pinads_rec import parallel
    from pinads_rec.training.run_log import RunLog
    from pinads_rec.training.trainer import Trainer

    Trainer(config.load(config_path, overrides), parallel.init_distributed(), hooks=[RunLog()]).run()


def train_tiny(tmp, config_path, overrides) -> str:
    """A tiny run of ``config_path`` trained on 2 ranks into ``tmp/run``: 8 steps, checkpoints at 4 and 8."""
    from pinads_rec.experiments.harness import run_ranks

    run = tmp / "run"
    steps = ["train.max_steps=8", "train.warmup_steps=2", "train.checkpoint_every=4", "train.keep_checkpoints=2"]
    run_ranks(
        _train_config, 2, str(tmp), config_path, list(overrides) + steps + [f"train.run_dir={run}"], timeout_s=300
    )
    return run


@pytest.fixture(scope="session")
def served_run(tmp_path_factory, worker_id):
    """(run dir, raw logs, build dir) of what the serving tests serve: a tiny demo run trained on the
    demo_raw world (checkpoints at steps 4 and 8), its raw logs, and their build. Made once per test
    session, not once per pytest-xdist worker: the first worker to need it makes it under a file
    lock in the directory the workers' temporary roots share; the others wait, then read it (no test
    writes into it)."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if worker_id != "master":
        root = root.parent
    tmp = root / "served_run"
    with FileLock(str(tmp) + ".lock"):
        if not (tmp / "complete").exists():
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            demo_raw(tmp)
            train_tiny(tmp, DEMO, tiny_overrides(tmp / "synth") + DEMO_RAW)
            (tmp / "complete").touch()
    return tmp / "run", tmp / "synth" / "raw", tmp / "built"
