"""One rule for every command line (issue #47, docs/reliability.md "One rule for every command line"):
a user's mistake in an argument, a path or an override is one line on stderr naming it, exit status
2, no traceback -- and it is caught before the work starts, so every case here is fast.

Each case runs a command's ``main(argv)`` in this process (the ``python -m`` modules call it; the
last test runs one as ``python -m`` to show the exit status and the stderr of a fresh process). An
argparse refusal is argparse's standard form, the usage then ``prog: error: argument --flag: ...``:
that usage is allowed before the one error line, nothing else is.
"""

import importlib
import os
import subprocess
import sys

import pytest
from conftest import DEMO, REPO

ABLATION = os.path.join(REPO, "configs", "ablations", "calibration.yaml")
STABILITY = os.path.join(REPO, "configs", "stability.yaml")
CONTINUOUS = os.path.join(REPO, "configs", "continuous.yaml")

MAINS = {
    "data.build": "pinads_rec.data.build.cli",
    "data.synth": "pinads_rec.data.synth.cli",
    "data.inspect": "pinads_rec.data.inspect.cli",
    "data.shaped_logs": "pinads_rec.data.shaped_logs.__main__",
    "plan": "pinads_rec.plan.cli",
    "train": "pinads_rec.train",
    "serve": "pinads_rec.serve.cli",
    "reference": "pinads_rec.reference.cli",
    "experiments.scaling": "pinads_rec.experiments.scaling",
    "experiments.ablate": "pinads_rec.experiments.ablate",
    "experiments.stability": "pinads_rec.experiments.stability",
    "experiments.continuous": "pinads_rec.experiments.continuous",
    "experiments.id_mappings": "pinads_rec.experiments.id_mappings",
    "config_reference": "pinads_rec.config_reference",
}

# Placeholders in a case's arguments (the fixture `world` makes them): {demo} the demo config, {dir}
# an empty directory, {file} a regular file, {bad_yaml} a config that is not YAML, {missing} a path
# where nothing is, {plan} a plan JSON that is not a plan.
BUILD = ["--config", "{demo}", "--raw", "{dir}", "--out", "{dir}/out"]
SYNTH = ["--config", "{demo}", "--out", "{dir}/out"]
RUN = ["--run", "{dir}"]  # an existing directory: the case's own mistake is what is refused
# The demo config with its data where the case's own mistake is the one refused (no data is read).
DATA = ["--set", "data.train_dir={dir}", "--set", "data.eval_dir={dir}", "--set", "data.calibration_dir={dir}"]
TRAIN = ["--config", "{demo}", *DATA, "--set", "train.run_dir={dir}/run"]
REFERENCE = ["--config", "{demo}", *DATA]
MANAGED = ["--set", "features.tables.item.managed_collision.eviction=lru"]

# (command, arguments, what the one line must contain)
CASES = [
    # a config file that cannot be read
    ("data.build", ["--config", "{missing}", *BUILD[2:]], "{missing} does not exist"),
    ("data.build", ["--config", "{dir}", *BUILD[2:]], "{dir} is a directory"),
    ("train", ["--config", "{bad_yaml}"], "not valid YAML: expected ',' or ']'"),
    ("train", ["--config", "{missing}"], "{missing} does not exist"),
    ("data.synth", ["--config", "{dir}", "--out", "{dir}/out"], "{dir} is a directory"),
    ("data.inspect", ["--config", "{bad_yaml}"], "not valid YAML"),
    ("plan", ["--config", "{dir}"], "{dir} is a directory"),
    ("plan", ["--compare-config", "{missing}"], "{missing} does not exist"),
    ("reference", ["--config", "{missing}"], "{missing} does not exist"),
    ("experiments.scaling", ["--config", "{bad_yaml}", "--sweep", "ranks=1", "--out", "{dir}/s"], "not valid YAML"),
    ("experiments.ablate", ["--config", "{missing}"], "config file {missing} does not exist"),
    ("experiments.ablate", ["--config", "{bad_yaml}"], "{bad_yaml}: not valid YAML"),
    ("experiments.stability", ["--config", "{missing}"], "{missing} does not exist"),
    ("experiments.continuous", ["--config", "{dir}", "--out", "{dir}/c"], "{dir} is a directory"),
    ("experiments.id_mappings", ["--config", "{bad_yaml}", "--out", "{dir}/m"], "not valid YAML"),
    # --set: an unknown key, a value that is not YAML, a key under a value, a list element not there
    ("data.build", [*BUILD, "--set", "build.nope=1"], "build.nope: unknown key"),
    ("data.build", [*BUILD, "--set", "build.timezone=[UTC"], "override build.timezone: the value '[UTC'"),
    ("train", ["--config", "{demo}", "--set", "train.lr.x=1"], "override train.lr.x: train.lr is not a mapping"),
    ("train", ["--config", "{demo}", "--set", "features.tables.nope.num_embeddings=5"], "no element named 'nope'"),
    ("train", ["--config", "{demo}", "--set", "train.nope=1"], "train.nope: unknown key"),
    ("data.synth", [*SYNTH, "--set", "synth.nope=1"], "synth.nope: unknown key"),
    ("data.inspect", ["--config", "{demo}", "--set", "data.batch_size=[1"], "override data.batch_size"),
    ("plan", ["--set", "model.nope=1"], "model.nope: unknown key"),
    ("reference", ["--config", "{demo}", "--set", "reference.nope=1"], "reference.nope: unknown key"),
    ("experiments.stability", ["--config", STABILITY, "--set", "synth.nope=1"], "synth.nope: unknown key"),
    (
        "experiments.continuous",
        ["--config", CONTINUOUS, "--set", "train.lr=[", "--out", "{dir}/c"],
        "override train.lr",
    ),
    ("serve", ["online", *RUN, "--raw", "{dir}", "--set", "bogus=1"], "--set 'bogus=1'"),
    # counts: zero, negative, not a number
    ("data.build", [*BUILD, "--threads", "0"], "argument --threads: 0 is not a count"),
    ("data.synth", [*SYNTH, "--train-requests", "0"], "argument --train-requests: 0 is not a count"),
    ("data.synth", [*SYNTH, "--seed", "x"], "argument --seed"),
    ("data.shaped_logs", ["taobao", "--out", "{dir}/raw", "--users", "-3"], "argument --users: -3 is not a count"),
    ("plan", ["--world-size", "0"], "argument --world-size: 0 is not a count"),
    ("plan", ["--batch-size", "-1"], "argument --batch-size: -1 is not a count"),
    ("plan", ["--compare", "world_size=two"], "--compare: world_size='two'"),
    ("serve", ["score", *RUN, "--batch-size", "0"], "argument --batch-size: 0 is not a count"),
    ("serve", ["requests", *RUN, "--raw", "{dir}", "--limit", "0"], "argument --limit: 0 is not a count"),
    ("serve", ["kuberay", *RUN, "--raw", "{dir}", "--image", "i", "--workers", "0"], "argument --workers: 0"),
    ("experiments.scaling", ["--sweep", "ranks=1", "--steps", "0"], "--steps"),
    ("experiments.scaling", ["--sweep", "ranks=1", "--num-workers", "-1"], "argument --num-workers: -1 is not a count"),
    ("experiments.scaling", ["--sweep", "ranks=1", "--timeout", "-5"], "argument --timeout: -5 is not a duration"),
    ("experiments.ablate", ["--config", ABLATION, "--ranks", "0"], "argument --ranks: 0 is not a count"),
    ("experiments.stability", ["--nproc", "0"], "argument --nproc: 0 is not a count"),
    ("experiments.continuous", ["--ranks", "-1"], "argument --ranks: -1 is not a count"),
    ("experiments.continuous", ["--window", "0"], "argument --window: 0 is not a count"),
    ("experiments.id_mappings", ["--ranks", "0"], "argument --ranks: 0 is not a count"),
    # an output path under a regular file, or a directory where a file is expected
    ("data.build", ["--config", "{demo}", "--raw", "{dir}", "--out", "{file}/out"], "is a file, not a directory"),
    ("data.synth", ["--config", "{demo}", "--out", "{file}/out"], "argument --out: {file}/out: {file} is a file"),
    ("data.inspect", ["--config", "{demo}", "--json", "{dir}"], "argument --json: {dir} is a directory"),
    ("data.inspect", ["--data", "{dir}", "--draft-config", "{file}/x.yaml"], "argument --draft-config"),
    ("data.shaped_logs", ["kuairand", "--out", "{file}"], "argument --out: {file} is a file"),
    ("plan", ["--out", "{dir}"], "argument --out: {dir} is a directory"),
    ("serve", ["export", *RUN, "--out", "{file}/model.pt2"], "argument --out: {file}/model.pt2: {file} is a file"),
    ("serve", ["export-ads", *RUN, "--out", "{dir}"], "argument --out: {dir} is a directory"),
    ("serve", ["requests", *RUN, "--raw", "{dir}", "--out", "{dir}"], "argument --out: {dir} is a directory"),
    ("experiments.scaling", ["--sweep", "ranks=1", "--out", "{file}"], "argument --out: {file} is a file"),
    ("experiments.ablate", ["--config", ABLATION, "--out", "{dir}"], "argument --out: {dir} is a directory"),
    ("experiments.stability", ["--out", "{file}/x.md"], "argument --out: {file}/x.md: {file} is a file"),
    ("experiments.continuous", ["--report", "{dir}"], "argument --report: {dir} is a directory"),
    ("experiments.id_mappings", ["--out", "{file}"], "argument --out: {file} is a file"),
    # an input that is not there: data, raw logs, a run, a plan file
    ("data.build", ["--config", "{demo}", "--raw", "{missing}", "--out", "{dir}/o"], "argument --raw: {missing}"),
    ("data.build", [*BUILD, "--day", "2024-01-01", "--vocabularies", "{missing}"], "argument --vocabularies"),
    ("data.build", [*BUILD, "--day", "yesterday"], "--day 'yesterday': not a day"),
    ("data.inspect", ["--config", "{demo}", "--data", "{missing}"], "argument --data: {missing} does not exist"),
    ("data.inspect", ["--config", "{demo}", "--set", "data.train_dir={missing}"], "directory {missing} does not"),
    ("train", [*TRAIN, "--set", "data.train_dir={missing}"], "data.train_dir: {missing} does not exist"),
    ("train", [*TRAIN, "--set", "data.calibration_dir={missing}"], "data.calibration_dir: {missing} does not"),
    ("train", [*TRAIN, "--set", "train.plan_file={missing}"], "train.plan_file: {missing} does not exist"),
    ("train", [*TRAIN, "--set", "train.plan_file={plan}"], "train.plan_file: {plan} is not a plan"),
    (
        "train",
        [*TRAIN, "--set", "train.init_from={missing}"],
        "train.init_from {missing}: no complete checkpoint there",
    ),
    ("train", [*TRAIN, "--set", "train.run_dir={file}"], "train.run_dir: {file} is a file"),
    ("train", [*TRAIN, *MANAGED, "--set", "train.sharding_types=[table_wise]"], "TorchRec shards row_wise only"),
    ("plan", ["--set", "train.plan_file={missing}"], "train.plan_file: cannot read {missing}"),
    ("serve", ["score", "--run", "{missing}"], "serve error: {missing}: no checkpoint under {missing}/checkpoints"),
    ("serve", ["export", "--run", "{file}"], "serve error: {file}: no checkpoint under"),
    ("serve", ["score", *RUN, "--data", "{missing}"], "argument --data: {missing} does not exist"),
    ("serve", ["online", *RUN, "--raw", "{missing}"], "argument --raw: {missing} does not exist"),
    ("reference", [*REFERENCE, "--set", "data.eval_dir={missing}"], "data.eval_dir: {missing} does not exist"),
    ("reference", [*REFERENCE, "--run", "{missing}"], "--run {missing}: no metrics.jsonl"),
    # a command or an option that does not exist
    ("serve", ["scroe", *RUN], "invalid choice: 'scroe'"),
    ("data.shaped_logs", ["netflix", "--out", "{dir}"], "invalid choice: 'netflix'"),
    ("data.inspect", [], "give --config, or --data with --draft-config"),
    ("config_reference", ["--write"], "unrecognized arguments: --write"),
    ("experiments.continuous", ["--strategies", "weekly"], "--strategies: weekly"),
    ("experiments.scaling", ["--sweep", "cores=1"], "unknown dimension 'cores'"),
]


@pytest.fixture
def world(tmp_path):
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("a regular file\n")
    (tmp_path / "bad.yaml").write_text("features: [1\n")
    (tmp_path / "plan.json").write_text('{"topology": {}}\n')
    names = {"dir": "dir", "file": "file", "bad_yaml": "bad.yaml", "missing": "missing", "plan": "plan.json"}
    return {"demo": DEMO, **{k: str(tmp_path / v) for k, v in names.items()}}


def _one_line(err: str) -> str:
    """stderr's message: its one line, or argparse's error line after its usage."""
    lines = err.strip().splitlines()
    assert lines, "nothing on stderr"
    if lines[0].startswith("usage:"):
        assert all(line.startswith(" ") for line in lines[1:-1]), err  # the usage, wrapped
        assert ": error: " in lines[-1], err
    else:
        assert len(lines) == 1, err
    return lines[-1]


@pytest.mark.parametrize(
    "command, argv, words",
    CASES,
    ids=[f"{c}-{i}" for i, (c, _, _) in enumerate(CASES)],
)
def test_a_mistake_is_one_line_and_exit_2_before_any_work(command, argv, words, world, capsys, monkeypatch):
    from pinads_rec import parallel

    def work_started(*args, **kwargs):
        raise AssertionError("the process group was started: the mistake was not caught before the work")

    # A train case the checks let through would otherwise train here, and end this process (os._exit).
    monkeypatch.setattr(parallel, "init_distributed", work_started)
    argv = [a.format(**world) for a in argv]
    main = importlib.import_module(MAINS[command]).main
    try:
        status = main(argv)
    except SystemExit as e:
        status = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    assert status == 2, (argv, out, err)
    assert words.format(**world) in _one_line(err), err
    assert out == "", out  # nothing was done


def test_every_command_has_a_case():
    assert {c for c, _, _ in CASES} == set(MAINS)


def test_python_m_exits_2_with_one_line():
    """A fresh process: its library imports add nothing to stderr, and ``python -m`` exits 2."""
    done = subprocess.run(
        [sys.executable, "-m", "pinads_rec.train", "--config", DEMO, "--set", "train.nope=1"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert "train.nope: unknown key" in _one_line(done.stderr), done.stderr
