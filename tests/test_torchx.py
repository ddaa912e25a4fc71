"""Launching through TorchX: the project component, the .torchxconfig defaults and one real 2-rank
training run of the demo config on tiny generated data (local_cwd scheduler, gloo on CPU).

The dry-run checks build the job exactly as ``torchx run`` does (component lookup, .torchxconfig
component defaults, argument parsing) without starting anything, so they cost well under a second.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LAUNCH_TIMEOUT_S = 300


def _load_component_module():
    # Loaded from its path: TorchX reads components/ as files and the repo root need not be on sys.path.
    spec = importlib.util.spec_from_file_location("pinads_components_train", REPO / "components" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _dryrun(component: str, *args: str):
    """The AppDef role ``torchx run -s local_cwd <component> <args>`` would launch from the repo root."""
    from torchx.runner import get_runner
    from torchx.runner.config import load_sections

    cwd = os.getcwd()
    os.chdir(REPO)  # component file paths and the script default are relative to the repo root
    try:
        defaults = load_sections(prefix="component", dirs=[str(REPO)])
        with get_runner(component_defaults=defaults) as runner:
            info = runner.dryrun_component(component, list(args), "local_cwd", cfg={})
    finally:
        os.chdir(cwd)
    (role,) = info._app.roles
    return role


def _torchrun_argv(role) -> list[str]:
    import shlex

    assert role.entrypoint == "bash" and role.args[0] == "-c"
    argv = shlex.split(role.args[1])
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


def test_train_ignores_stray_positional():
    from pinads_rec.train import DEFAULT_CONFIG, parse_args

    assert parse_args(["pinads_rec/train.py"]).config == DEFAULT_CONFIG
    assert parse_args(["configs/other.yaml"]).config == "configs/other.yaml"
    assert parse_args(["pinads_rec/train.py", "--config", "x.yaml"]).config == "x.yaml"


# ---------------------------------------------------------------------------------------------
# One real launch: torchx -> torchrun -> 2 gloo ranks of pinads_rec/train.py, demo config.
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


def _torchx_executable() -> str:
    exe = Path(sys.executable).parent / "torchx"
    if exe.exists():
        return str(exe)
    found = shutil.which("torchx")
    if not found:
        pytest.skip("torchx CLI not installed")
    return found


def test_torchx_launch_trains_two_ranks(tmp_path):
    from pinads_rec import config
    from pinads_rec.data.synth import generate

    data, run_dir = tmp_path / "data", tmp_path / "run"
    overrides = TINY_DATA + [
        f"data.train_dir={data / 'train'}",
        f"data.eval_dir={data / 'eval'}",
        f"data.calibration_dir={data / 'calibration'}",
        f"train.run_dir={run_dir}",
        "data.batch_size=128",
        "train.max_steps=4",
        "train.log_every=2",
    ]
    generate(config.load(REPO / "configs" / "demo.yaml", overrides), data)

    env = dict(os.environ)
    env.pop("TORCHXCONFIG", None)
    # local_cwd runs `bash -c "torchrun ..."`: torchrun must be the one of this interpreter.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    cmd = [
        _torchx_executable(),
        "run",
        "-s",
        "local_cwd",
        "-cfg",
        f"log_dir={tmp_path / 'logs'}",
        "components/train.py:train",
        "-j",
        "1x2",
        "--config",
        "configs/demo.yaml",
        "--set",
        ",".join(overrides),
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchx, torchrun and the ranks share the session
        out, _ = proc.communicate()
        pytest.fail(f"torchx launch exceeded {LAUNCH_TIMEOUT_S} s:\n{out[-6000:]}")
    assert proc.returncode == 0, f"torchx exited {proc.returncode}:\n{out[-6000:]}"
    from pinads_rec.training.run_log import read_run_log

    assert (run_dir / "metrics.jsonl").exists(), f"no metrics.jsonl in {run_dir}:\n{out[-3000:]}"
    log = read_run_log(run_dir)
    assert log.summary is not None and isinstance(log.summary.get("eval"), list) and log.summary["eval"], log
    assert log.summary["world_size"] == 2 and log.summary["step"] == 4
    assert any("loss" in step for step in log.steps)  # train.log_every=2 logged steps
