"""The documented launch commands, run as a new user runs them: ``.venv/bin/torchx`` from a fresh
shell (the venv not activated: PATH=/usr/bin:/bin, nothing else inherited), in the repository root.

Every ``torchx run`` command of README.md and docs/launching.md is built by TorchX's own CLI with
``--dryrun`` (which refuses a repeated flag, an unknown option, a bad component argument); each of
the three launch forms (``dist.ddp --script``, the bare ``dist.ddp`` and the project's component)
trains 2 steps for real with several overrides in one ``--set``, and must find torchrun by itself
(it used to fail at once with ``bash: line 1: torchrun: command not found``)."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import tiny_overrides

REPO = Path(__file__).resolve().parent.parent
TORCHX = str(REPO / ".venv" / "bin" / "torchx")
DOCS = ("README.md", "docs/launching.md")
LAUNCH_TIMEOUT_S = 300

pytestmark = pytest.mark.slow  # each test runs the torchx CLI


def fresh_shell_env(home: Path) -> dict:
    """The environment of a new login shell that has not activated the venv."""
    return {"PATH": "/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8"}


def documented_torchx_runs(text: str) -> list[str]:
    """The ``torchx run`` commands of a Markdown text's bash code blocks, continuation lines joined."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", "").splitlines():
            if re.match(r"(\w+=\S+\s+)*(\.venv/bin/)?torchx run\b", line.strip()):
                commands.append(line.strip())
    return commands


def as_user_types_it(command: str, *extra_run_options: str) -> tuple[list[str], dict]:
    """(argv, environment assignments) of a documented command, ``torchx`` being the venv's CLI
    called by its path and ``extra_run_options`` going right after ``run``."""
    words = shlex.split(command, comments=True)
    assignments = {}
    while "=" in words[0]:
        key, _, value = words.pop(0).partition("=")
        assignments[key] = value
    assert words[0] in ("torchx", ".venv/bin/torchx") and words[1] == "run", command
    return [TORCHX, "run", *extra_run_options, *words[2:]], assignments


def run_cli(argv: list[str], env: dict, timeout_s: float) -> tuple[int, str]:
    """Runs a command in the repository root: (exit status, combined output). Past ``timeout_s`` its
    whole process tree (torchx, torchrun, the ranks) is killed and the test fails."""
    proc = subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{shlex.join(argv)} ran past {timeout_s} s:\n{out[-4000:]}")
    return proc.returncode, out


def test_documented_torchx_commands_are_what_torchx_accepts(tmp_path):
    commands = [(doc, c) for doc in DOCS for c in documented_torchx_runs((REPO / doc).read_text())]
    assert len(commands) >= 10, commands  # the docs' launch examples were found
    for doc, command in commands:
        assert not re.search(r"--set\b.*\s--set\b", command), f"{doc}: a repeated --set, which TorchX refuses"
        extra = () if "--dryrun" in command.split() else ("--dryrun",)
        argv, assignments = as_user_types_it(command, *extra)
        rc, out = run_cli(argv, {**fresh_shell_env(tmp_path), **assignments}, timeout_s=120)
        assert rc == 0, f"{doc}: `{command}` (as `{shlex.join(argv)}`) exit {rc}:\n{out[-3000:]}"


# Three forms, as docs/launching.md gives them, pointed at the tiny data with several overrides in
# one --set; -s local_cwd -cfg log_dir=... keeps TorchX's per-rank logs out of the checkout.
FORMS = {
    "script": "torchx run -s local_cwd -cfg log_dir={logs} dist.ddp -j 1x2 --script pinads_rec/train.py "
    "-- --config configs/demo.yaml --set {overrides}",
    "bare": "torchx run -s local_cwd -cfg log_dir={logs} dist.ddp -j 1x2 pinads_rec/train.py --set {overrides}",
    "component": "torchx run -s local_cwd -cfg log_dir={logs} components/train.py:train -j 1x2 --gpu 0 "
    "--config configs/demo.yaml --set {overrides}",
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_each_launch_form_trains_from_a_fresh_shell(tiny_data, tmp_path, form):
    from pinads_rec.training.run_log import read_run_log

    _, data_dir = tiny_data
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(data_dir, run_dir) + ["train.max_steps=2", "train.warmup_steps=1", "train.log_every=1"]
    command = FORMS[form].format(logs=tmp_path / "torchx_logs", overrides=",".join(overrides))
    argv, _ = as_user_types_it(command)
    rc, out = run_cli(argv, fresh_shell_env(tmp_path), LAUNCH_TIMEOUT_S)
    assert "command not found" not in out, out[-3000:]
    assert rc == 0, f"{shlex.join(argv)} exit {rc}:\n{out[-4000:]}"
    # The one --set reached train.py whole: its run_dir, its step count, on 2 ranks.
    summary = read_run_log(run_dir).summary
    assert (summary["step"], summary["world_size"]) == (2, 2), summary
    assert summary["eval"], summary
    # Rank 0 fits the reference after the others are done; the table and the JSON carry it.
    assert "ref AUC" in out and {(r["surface"], r["task"]) for r in summary["reference"]["eval"]} == {
        (r["surface"], r["task"]) for r in summary["eval"]
    }
