"""Launching through TorchX: the project component, the .torchxconfig defaults, what the cluster
schedulers would be sent (Slurm's sbatch script, Kubernetes' Volcano job, both as dry runs: no
cluster, no network), the image they run (Dockerfile), and one real training run of the demo
config on tiny generated data as two "nodes" of one process each (local_cwd scheduler, c10d
rendezvous on a free loopback port, gloo on CPU).

The dry-run checks build the job exactly as ``torchx run`` does (component lookup, .torchxconfig
component defaults, argument parsing) without starting anything, so they cost well under a second.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml
from conftest import read_rows, torchx_train

REPO = Path(__file__).resolve().parent.parent
LAUNCH_TIMEOUT_S = 300


def _load_component_module():
    # Loaded from its path: TorchX reads components/ as files and the repo root need not be on sys.path.
    spec = importlib.util.spec_from_file_location("pinads_components_train", REPO / "components" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _dryrun_info(component: str, *args: str, scheduler: str = "local_cwd", cfg: dict | None = None):
    """What ``torchx run --dryrun -s <scheduler> -cfg <cfg> <component> <args>`` builds from the repo
    root: the AppDryRunInfo (its ``request`` is what the scheduler would be sent). No workspace, as
    with ``--workspace ""``: nothing is built or pushed."""
    from torchx.runner import get_runner
    from torchx.runner.config import load_sections

    cwd = os.getcwd()
    os.chdir(REPO)  # component file paths and the script default are relative to the repo root
    try:
        defaults = load_sections(prefix="component", dirs=[str(REPO)])
        with get_runner(component_defaults=defaults) as runner:
            return runner.dryrun_component(component, list(args), scheduler, cfg=cfg or {})
    finally:
        os.chdir(cwd)


def _dryrun(component: str, *args: str):
    """The AppDef role ``torchx run -s local_cwd <component> <args>`` would launch from the repo root."""
    (role,) = _dryrun_info(component, *args)._app.roles
    return role


# What the component puts first on each node's PATH: the bin directory of the torchx that builds
# the job (here the venv's; torchrun_of_this_environment), "$PATH" expanded by the node's bash.
NODE_PATH = f"PATH={sysconfig.get_path('scripts')}:$PATH"


def _torchrun_argv(role) -> list[str]:
    """torchrun's argv of a role's ``bash -c`` command (macros not yet applied: $$ for $), the
    component's PATH prefix dropped."""
    assert role.entrypoint == "bash" and role.args[0] == "-c"
    argv = shlex.split(role.args[1].replace("$$", "$"))
    if argv[0] == NODE_PATH:
        argv = argv[1:]
    assert argv[0] == "torchrun"
    return argv


def _script_and_args(argv: list[str]) -> list[str]:
    """What follows torchrun's own options: the script and its arguments."""
    i = argv.index("--role") + 2
    return argv[i:]


@pytest.fixture(autouse=True)
def _no_foreign_torchxconfig(monkeypatch):
    # TORCHXCONFIG would replace the repository's .torchxconfig.
    monkeypatch.delenv("TORCHXCONFIG", raising=False)


# ---------------------------------------------------------------------------------------------
# Fast checks: how the command lines resolve.
# ---------------------------------------------------------------------------------------------


def test_split_overrides():
    m = _load_component_module()
    assert m.split_overrides(None) == []
    assert m.split_overrides("  ") == []
    assert m.split_overrides("train.max_steps=50") == ["train.max_steps=50"]
    assert m.split_overrides("a.b=1,c=2 d.e=x") == ["a.b=1", "c=2", "d.e=x"]
    # a comma or space inside a value stays: a split happens only before another key=
    assert m.split_overrides("train.sharding_types=[table_wise, row_wise],data.train_dir=/x y/z") == [
        "train.sharding_types=[table_wise, row_wise]",
        "data.train_dir=/x y/z",
    ]


def test_with_nproc():
    m = _load_component_module()
    assert m.with_nproc("1x2", 0) == "1x2"
    assert m.with_nproc("1x2", 8) == "1x8"
    assert m.with_nproc("1:2x4", 8) == "1:2x8"
    assert m.with_nproc("4", 2) == "1x2"
    with pytest.raises(ValueError):
        m.with_nproc("two", 0)


def test_repeated_set_guard():
    m = _load_component_module()
    base = ["/venv/bin/torchx", "run", "components/train.py:train"]
    assert m.repeated_set_flags(base + ["--set", "a=1"]) == 1
    assert m.repeated_set_flags(base + ["--set=a=1", "--set=b=2"]) == 2
    assert m.repeated_set_flags(base + ["--set=a=1", "--", "--set=b=2", "--set=c=3"]) == 1
    assert m.repeated_set_flags(["pytest", "--set=a=1", "--set=b=2"]) == 0  # not the torchx CLI


def test_component_command_line():
    role = _dryrun(
        "components/train.py:train",
        "-j",
        "1x8",
        "--config",
        "configs/demo.yaml",
        "--set",
        "train.max_steps=50,data.batch_size=256",
        "--",
        "--set=train.lr=0.01",
    )
    argv = _torchrun_argv(role)
    assert argv[argv.index("--nnodes") + 1] == "1"
    assert argv[argv.index("--nproc_per_node") + 1] == "8"
    assert _script_and_args(argv) == [
        "pinads_rec/train.py",
        "--config",
        "configs/demo.yaml",
        "--set",
        "train.max_steps=50",
        "--set",
        "data.batch_size=256",
        "--set=train.lr=0.01",
    ]
    assert role.env["OMP_NUM_THREADS"] == "1" and role.env["PYTHONPATH"] == "."
    assert shlex.split(role.args[1].replace("$$", "$"))[0] == NODE_PATH  # the venv's torchrun, venv active or not
    assert role.num_replicas == 1
    assert (role.resource.gpu, role.resource.cpu, role.resource.memMB) == (8, 32, 8 * 16 * 1024)
    assert role.max_retries == 2

    role = _dryrun("components/train.py:train", "-j", "2x4", "--nproc", "2", "--gpu", "0")
    argv = _torchrun_argv(role)
    assert argv[argv.index("--nnodes") + 1] == "2"
    assert argv[argv.index("--nproc_per_node") + 1] == "2"
    assert role.num_replicas == 2 and role.resource.gpu == 0


def test_dist_ddp_forms():
    # form 1: explicit --script, the script's arguments after --
    role = _dryrun("dist.ddp", "-j", "1x2", "--script", "pinads_rec/train.py", "--", "--config", "configs/demo.yaml")
    assert _script_and_args(_torchrun_argv(role)) == ["pinads_rec/train.py", "--config", "configs/demo.yaml"]
    # form 2: bare positional; the script comes from .torchxconfig [component:dist.ddp], the
    # positional reaches train.py as an argument it ignores
    role = _dryrun("dist.ddp", "-j", "1x2", "pinads_rec/train.py")
    assert _script_and_args(_torchrun_argv(role)) == ["pinads_rec/train.py", "pinads_rec/train.py"]
    # another script on the command line still wins over the default
    role = _dryrun("dist.ddp", "-j", "1x1", "--script", "other.py")
    assert _script_and_args(_torchrun_argv(role)) == ["other.py"]
    # the ranks' PATH (local_cwd puts it before its own, in the repository root) starts with the
    # venv's bin directory, so `.venv/bin/torchx` finds torchrun from a shell without the venv
    assert role.env["PATH"].split(":")[0] == ".venv/bin" and (REPO / ".venv/bin/torchrun").is_file()
    assert role.env["OMP_NUM_THREADS"] == "1"


def test_train_ignores_stray_positional():
    from pinads_rec.train import DEFAULT_CONFIG, parse_args

    assert parse_args(["pinads_rec/train.py"]).config == DEFAULT_CONFIG
    assert parse_args(["configs/other.yaml"]).config == "configs/other.yaml"
    assert parse_args(["pinads_rec/train.py", "--config", "x.yaml"]).config == "x.yaml"


def test_train_reads_several_overrides_in_one_set():
    # Under TorchX --set cannot repeat: train.py splits one before each key=, as the component does.
    from pinads_rec.train import parse_args

    assert parse_args(["--set", "a.b=1,c.d=[x, y]", "--set", "e=2"]).overrides == ["a.b=1", "c.d=[x, y]", "e=2"]


def test_rdzv_port_0_picks_one_free_port_for_all_nodes():
    # Several nodes: dist.ddp would give each node's torchrun port 0 (separate stores that never
    # meet); the component picks one free port when the job is built and all nodes share it.
    role = _dryrun("components/train.py:train", "-j", "2x1", "--rdzv_port", "0", "--gpu", "0")
    argv = _torchrun_argv(role)
    port = int(argv[argv.index("--rdzv_endpoint") + 1].rsplit(":", 1)[1])
    assert 0 < port <= 65535 and role.port_map["c10d"] == port and role.num_replicas == 2
    # One node: dist.ddp's own localhost:0 (one torchrun, no one to meet).
    argv = _torchrun_argv(_dryrun("components/train.py:train", "-j", "1x2", "--rdzv_port", "0"))
    assert argv[argv.index("--rdzv_endpoint") + 1] == "localhost:0"
    with pytest.raises(ValueError, match="rdzv_port"):
        _dryrun("components/train.py:train", "-j", "2x1", "--rdzv_port", "-1")


# ---------------------------------------------------------------------------------------------
# Clusters, as dry runs: what Slurm and Kubernetes would be sent for 2 nodes x 8 GPUs.
# ---------------------------------------------------------------------------------------------

CLUSTER_ARGS = ("-j", "2x8", "--config", "configs/prod_8gpu.yaml")
CLUSTER_SCRIPT = ["pinads_rec/train.py", "--config", "configs/prod_8gpu.yaml"]
CLUSTER_ENV = {"OMP_NUM_THREADS": "1", "PYTHONPATH": ".", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
IMAGE = "registry.example.com/ads/pinads_rec:1.0"


def _check_torchrun(argv: list[str], endpoint_host: str) -> None:
    """The venv's bin directory first on the node's PATH, then 2 nodes x 8 processes, c10d
    rendezvous on the first node's port 29500, our script."""
    assert argv[0] == NODE_PATH
    argv = argv[1:]
    assert argv[0] == "torchrun"
    assert argv[argv.index("--nnodes") + 1] == "2"
    assert argv[argv.index("--nproc_per_node") + 1] == "8"
    assert argv[argv.index("--rdzv_backend") + 1] == "c10d"
    assert argv[argv.index("--rdzv_endpoint") + 1] == f"${{{endpoint_host}:=localhost}}:29500"
    assert _script_and_args(argv) == CLUSTER_SCRIPT


def _sbatch_groups(script: str) -> list[tuple[list[str], list[str], list[str]]]:
    """The heterogeneous job groups of an sbatch script written by TorchX's Slurm scheduler, one per
    node: (its #SBATCH options, its srun options, the torchrun command srun runs)."""
    sbatch = [shlex.split(line[len("#SBATCH ") :]) for line in script.splitlines() if line.startswith("#SBATCH ")]
    sbatch = [opts for opts in sbatch if opts != ["hetjob"]]
    start = script.index("\nsrun ") + 1
    srun = shlex.split(script[start : script.index("\nexitcode=", start)].replace("\\\n", " "))
    assert srun[0] == "srun", srun
    groups, current = [], []
    for token in srun[1:] + [":"]:
        if token == ":":
            groups.append(current)
            current = []
        else:
            current.append(token)
    out = []
    for opts, group in zip(sbatch, groups):
        i = group.index("bash")
        assert group[i + 1] == "-c"
        out.append((opts, group[:i], shlex.split(group[i + 2])))
    assert len(out) == len(sbatch) == len(groups), (sbatch, groups)
    return out


def test_slurm_dryrun_sbatch_script():
    info = _dryrun_info(
        "components/train.py:train", *CLUSTER_ARGS, scheduler="slurm", cfg={"partition": "gpu", "time": "4:00:00"}
    )
    script = info.request.materialize()
    groups = _sbatch_groups(script)
    assert len(groups) == 2  # one heterogeneous group (one node, one srun task) per node
    for node, (sbatch, srun, torchrun) in enumerate(groups):
        for opt in (
            f"--job-name=train-{node}",
            "--partition=gpu",
            "--time=4:00:00",
            "--requeue",
            "--ntasks-per-node=1",
            "--cpus-per-task=32",  # 4 per process
            "--mem=131072",  # 16 GiB per process
            "--gpus-per-task=8",
        ):
            assert opt in sbatch, (opt, sbatch)
        (export,) = [o[len("--export=") :] for o in srun if o.startswith("--export=")]
        export = export.split(",")
        # ALL: the submitting shell's environment reaches every node; the torchrun the node runs
        # comes from the PATH prefix (the venv on the shared filesystem), activated or not.
        assert export[0] == "ALL"
        env = dict(kv.split("=", 1) for kv in export[1:])
        assert {k: env[k] for k in CLUSTER_ENV} == CLUSTER_ENV
        _check_torchrun(torchrun, "SLURM_JOB_NODELIST_HET_GROUP_0")
    assert "export TORCHX_MAX_RETRIES=2" in script  # requeued twice on failure; train.py resumes


def test_kubernetes_dryrun_volcano_job():
    try:
        import kubernetes  # noqa: F401  TorchX's Kubernetes scheduler builds the job with its models
    except ImportError:
        pytest.fail("the kubernetes package is missing: it is the project's `kubernetes` extra, in the locks")
    # TorchX warns that Volcano restarts (the component's max_retries=2) are unreliable: documented
    # in docs/launching.md, expected here.
    with pytest.warns(UserWarning, match="Volcano"):
        info = _dryrun_info(
            "components/train.py:train", *CLUSTER_ARGS, "--image", IMAGE, scheduler="kubernetes", cfg={"queue": "ml"}
        )
    job = yaml.safe_load(str(info.request))  # the YAML `torchx run --dryrun` prints: the job as submitted
    assert (job["apiVersion"], job["kind"]) == ("batch.volcano.sh/v1alpha1", "Job")
    assert job["spec"]["schedulerName"] == "volcano" and job["spec"]["queue"] == "ml"
    assert job["spec"]["maxRetry"] == 2
    tasks = job["spec"]["tasks"]
    assert [t["name"] for t in tasks] == ["train-0", "train-1"] and all(t["replicas"] == 1 for t in tasks)
    # the first node finds itself as localhost, the second through Volcano's host list of task train-0
    for task, endpoint_host in zip(tasks, ("TORCHX_RANK0_HOST", "VC_TRAIN_0_HOSTS")):
        (container,) = task["template"]["spec"]["containers"]
        assert container["image"] == IMAGE
        assert container["command"][:2] == ["bash", "-c"]
        _check_torchrun(shlex.split(container["command"][2]), endpoint_host)
        env = {e["name"]: e["value"] for e in container["env"]}
        assert {k: env[k] for k in CLUSTER_ENV} == CLUSTER_ENV
        assert container["resources"]["limits"] == {"cpu": "32000m", "memory": "131072M", "nvidia.com/gpu": "8"}
        assert container["ports"] == [{"containerPort": 29500, "name": "c10d"}]
    assert tasks[0]["template"]["spec"]["containers"][0]["env"][-1] == {
        "name": "TORCHX_RANK0_HOST",
        "value": "localhost",
    }


# ---------------------------------------------------------------------------------------------
# The image those schedulers run.
# ---------------------------------------------------------------------------------------------


def _dockerfile() -> list[tuple[str, str]]:
    """The Dockerfile's instructions (keyword, arguments), continuation lines joined, comments dropped."""
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), " ".join(rest.split())))
    return out


def test_dockerfile_installs_the_cuda_lock_and_the_project():
    steps = _dockerfile()
    assert steps[0][0] == "FROM"
    # The lock's wheels are for the Python it was resolved with: this interpreter's minor version.
    assert steps[0][1].startswith(f"python:{sys.version_info.major}.{sys.version_info.minor}."), steps[0]
    (workdir,) = [arg for kw, arg in steps if kw == "WORKDIR"]
    copies = [arg.split() for kw, arg in steps if kw == "COPY"]
    runs = [arg for kw, arg in steps if kw == "RUN"]
    # the lock's layer first, then the repository into the working directory, where torchrun runs
    # pinads_rec/train.py and the component's PYTHONPATH=. finds the package
    assert copies == [["locks/cuda.txt", "locks/cuda.txt"], [".", "."]] and workdir.startswith("/")
    assert runs == [
        "python -m pip install --no-deps -r locks/cuda.txt",
        "python -m pip install --no-deps -e . && python -m pip check",
    ]
    assert (REPO / "locks" / "cuda.txt").is_file(), "the Dockerfile installs locks/cuda.txt, which is missing"


def test_dockerignore_keeps_the_project_and_drops_the_host_environment():
    # TorchX's workspace layer (kubernetes without --workspace "") copies the repository over the
    # image with these rules too: walk the tree as it does.
    import fsspec
    from torchx.workspace.api import walk_workspace

    shipped = set()
    for folder, _, files in walk_workspace(fsspec.filesystem("file"), str(REPO), ".dockerignore"):
        shipped |= {os.path.relpath(os.path.join(folder, name.rsplit("/", 1)[-1]), REPO) for name in files}
    for needed in ("pyproject.toml", "pinads_rec/train.py", "pinads_rec/data/loader/reader.py", "configs/demo.yaml"):
        assert needed in shipped, needed
    for dropped in (".venv", ".git", "data", "runs"):
        assert not any(f == dropped or f.startswith(dropped + "/") for f in shipped), dropped


# ---------------------------------------------------------------------------------------------
# One real launch: torchx -> 2 torchrun agents ("nodes") -> 1 gloo rank each of
# pinads_rec/train.py, c10d rendezvous on a free loopback port, demo config on tiny data.
# ---------------------------------------------------------------------------------------------

TINY_DATA = [
    "synth.train_requests=400",
    "synth.eval_requests=200",
    "synth.calibration_requests=100",
    "synth.num_files=2",
    "synth.row_group_size=512",  # several row groups per file: every rank gets eval rows
    "synth.num_users=2000",
    "synth.num_items=5000",
]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """``torchx run -s local_cwd components/train.py:train -j 2x1 --rdzv_port 0`` on tiny data:
    (combined output, run_dir, data dir)."""
    from pinads_rec import config
    from pinads_rec.data.synth import generate

    tmp = tmp_path_factory.mktemp("torchx_2x1")
    data, run_dir = tmp / "data", tmp / "run"
    overrides = TINY_DATA + [
        f"data.train_dir={data / 'train'}",
        f"data.eval_dir={data / 'eval'}",
        f"data.calibration_dir={data / 'calibration'}",
        f"train.run_dir={run_dir}",
        "data.batch_size=128",
        "train.max_steps=4",
        "train.log_every=2",
        "reference.enabled=false",  # the LightGBM reference after the run: nothing here reads it
    ]
    generate(config.load(REPO / "configs" / "demo.yaml", overrides), data)

    out = torchx_train(tmp, "2x1", "configs/demo.yaml", overrides, LAUNCH_TIMEOUT_S)
    return out, run_dir, data


@pytest.mark.slow
def test_two_nodes_train_and_evaluate(two_nodes):
    from pinads_rec.training.run_log import read_run_log

    out, run_dir, _ = two_nodes
    assert (run_dir / "metrics.jsonl").exists(), f"no metrics.jsonl in {run_dir}:\n{out[-3000:]}"
    log = read_run_log(run_dir)
    assert log.summary is not None and isinstance(log.summary.get("eval"), list) and log.summary["eval"], log
    assert log.summary["world_size"] == 2 and log.summary["step"] == 4
    assert any("loss" in step for step in log.steps)  # train.log_every=2 logged steps


@pytest.mark.slow
def test_each_node_ran_one_rank(two_nodes):
    # TorchX's log dir keeps, per torchrun agent (a node, after the c10d rendezvous), a folder per
    # attempt and local rank: two agents with local rank 0 only, so every rank saw LOCAL_WORLD_SIZE=1
    # and WORLD_SIZE=2, and the planner's Topology (local world size from LOCAL_WORLD_SIZE,
    # parallel.plan_sharding) had 2 hosts of 1 rank. (Folders, not output: rank 1 may print nothing.)
    out, run_dir, _ = two_nodes
    logs = run_dir.parent / "torchx_logs"
    (app,) = (logs / "torchx").iterdir()
    agents = sorted((app / "torchelastic" / "train").iterdir())
    ranks = [sorted(r.name for r in attempt.iterdir()) for agent in agents for attempt in agent.glob("attempt_*")]
    assert len(agents) == 2 and ranks == [["0"], ["0"]], (agents, ranks, out[-3000:])
    assert sorted(r.name for r in (app / "train").iterdir()) == ["0", "1"]  # TorchX's two replicas
    assert "sharding plan for 2 host(s) x 1 cpu rank(s)" in out, out[-3000:]  # what the planner was told


def _split_truth(split_dir: Path, tasks: list[str]) -> dict:
    """(surface, task) -> (rows, positives) of a split as written, "all" included."""
    import pyarrow.compute as pc

    table = read_rows(split_dir, columns=["surface"] + tasks)
    truth = {}
    for surface in pc.unique(table["surface"]).to_pylist() + ["all"]:
        rows = table if surface == "all" else table.filter(pc.equal(table["surface"], surface))
        for task in tasks:
            truth[(surface, task)] = (rows.num_rows, int(pc.sum(rows[task]).as_py()))
    return truth


@pytest.mark.slow
def test_every_eval_and_calibration_row_read_once(two_nodes):
    # The row groups are dealt over the ranks of both nodes: the evaluation (one pass over the eval
    # split) counted each row once -- no row twice, none missed -- and so did the calibration fit
    # (one pass over the calibration split, gathered from both ranks).

    from pinads_rec.training.run_log import read_run_log

    out, run_dir, data = two_nodes
    rows = read_run_log(run_dir).summary["eval"]
    tasks = sorted({r["task"] for r in rows})
    assert {(r["surface"], r["task"]): (r["examples"], r["positives"]) for r in rows} == _split_truth(
        data / "eval", tasks
    )
    (fitted,) = re.findall(r"calibration \(\w+\) fit on (\d+) unseen rows", out)
    assert int(fitted) == read_rows(data / "calibration").num_rows
