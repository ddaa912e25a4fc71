"""Reliability: a rank killed mid-run restarts and resumes; a crash while saving leaves the previous
checkpoint loadable; resuming on another world size restores model and optimizer state exactly."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, checkpoint_tensors, load_tiny, rows_of, tiny_overrides

from pinads_rec.experiments.harness import RanksFailed, run_ranks
from pinads_rec.training.hooks import Hook
from pinads_rec.training.run_log import read_run_log

pytestmark = pytest.mark.slow


# --- resume on another world size ------------------------------------------------------------


def _train_to_step_6(rank, world, result_dir, data_dir, run_dir):
    from pinads_rec.training.run_log import RunLog
    from pinads_rec.training.trainer import Trainer

    Trainer(load_tiny(data_dir, ["train.max_steps=6", f"train.run_dir={run_dir}"]), hooks=[RunLog()]).run()


def _resume(rank, world, result_dir, data_dir, source, run_dir):
    """Loads source's step-6 checkpoint on this world size, then saves it again from there."""
    from pinads_rec.training.run_log import RunLog
    from pinads_rec.training.trainer import Trainer

    if rank == 0:
        shutil.copytree(f"{source}/checkpoints/step-6", f"{run_dir}/checkpoints/step-6")
    torch.distributed.barrier()
    Trainer(load_tiny(data_dir, ["train.max_steps=6", f"train.run_dir={run_dir}"]), hooks=[RunLog()]).run()


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2)])
def test_resume_on_another_world_size_restores_model_and_optimizer(tiny_data, tmp_path, before, after):
    data_dir = str(tiny_data[1])
    first, second = tmp_path / f"run{before}", tmp_path / f"run{before}to{after}"
    run_ranks(_train_to_step_6, before, str(tmp_path / "a"), data_dir, str(first))
    run_ranks(_resume, after, str(tmp_path / "b"), data_dir, str(first), str(second))
    saved = checkpoint_tensors(first / "checkpoints/step-6", tmp_path / "saved.pt")
    resaved = checkpoint_tensors(second / "checkpoints/step-6", tmp_path / "resaved.pt")
    assert saved.keys() == resaved.keys()
    optimizer_keys = [k for k in saved if k.startswith("optimizer.state.")]
    assert any("momentum" in k for k in optimizer_keys), "fused embedding optimizer state is checkpointed"
    assert any(k.startswith("optimizer.state.dense.") for k in optimizer_keys)
    for key, value in saved.items():
        if ".calibration." in key:  # refit at the end of every run: same rows, summed in another order
            assert torch.allclose(value, resaved[key], atol=1e-4), key
        elif isinstance(value, torch.Tensor):
            assert torch.equal(value, resaved[key]), key
        else:
            assert value == resaved[key], key


# --- a rank that hangs ------------------------------------------------------------------------

HANG_TIMEOUT_S = 5
HANG_S = 120  # how long rank 1 stops answering


class _HangOnRank1(Hook):
    """Rank 1 stops answering after step 2 (writing when it began), far past the collective timeout."""

    def __init__(self, result_dir):
        self.result_dir = result_dir

    def on_step(self, trainer, record):
        if trainer.env.rank == 1 and record["step"] == 2:
            Path(self.result_dir, "hang-started").write_text(str(time.time()))
            time.sleep(HANG_S)


def _hang(rank, world, result_dir, data_dir, run_dir):
    from pinads_rec.training.trainer import Trainer

    cfg = load_tiny(
        data_dir,
        [
            "train.max_steps=6",
            "train.log_every=1",
            f"train.run_dir={run_dir}",
            f"train.collective_timeout_s={HANG_TIMEOUT_S}",
        ],
    )
    Trainer(cfg, hooks=[_HangOnRank1(result_dir)]).run()


def test_a_rank_left_waiting_in_a_collective_stops_naming_rank_and_step(tiny_data, tmp_path):
    """Rank 1 hangs after step 2; rank 0's next collective times out after train.collective_timeout_s
    and the run ends with a CollectiveError naming rank 0 and step 3 -- in seconds, not at the
    deadline (the default group's timeout is the run's, as train.py sets it)."""
    work = tmp_path / "work"
    with pytest.raises(RanksFailed) as failed:
        run_ranks(
            _hang,
            2,
            str(work),
            str(tiny_data[1]),
            str(tmp_path / "run"),
            timeout_s=180,
            collective_timeout_s=HANG_TIMEOUT_S,
        )
    assert not failed.value.timed_out, str(failed.value)[-3000:]
    error = failed.value.failures[0]
    expected = f"CollectiveError: rank 0, step 3: a collective did not complete within {HANG_TIMEOUT_S} s"
    assert expected in error and "(another rank stopped or hung?)" in error, error[-3000:]
    waited = (work / "error-0.txt").stat().st_mtime - float((work / "hang-started").read_text())
    # Stopped by its own timeout, before rank 1 answered again (how much sooner depends on the load).
    assert HANG_TIMEOUT_S <= waited < HANG_S, waited


# --- a crash while saving --------------------------------------------------------------------


def _crash_while_saving(rank, world, result_dir, data_dir, run_dir):
    from pinads_rec import parallel
    from pinads_rec.training import checkpoint
    from pinads_rec.training.run_log import RunLog
    from pinads_rec.training.task import shard_train_task
    from pinads_rec.training.trainer import Trainer

    env = parallel.init_distributed()
    cfg = load_tiny(data_dir, ["train.max_steps=4", "train.checkpoint_every=2", f"train.run_dir={run_dir}"])
    Trainer(cfg, env, hooks=[RunLog()]).run()
    dmp = shard_train_task(cfg, env)
    optimizer, schedule = parallel.make_optimizer(dmp, cfg.train, 10)

    # A crash at the commit (the rename of step-6.tmp to step-6), made real: a plain file squats
    # the final name, so the rename fails after every shard was written.
    squatter = Path(run_dir) / "checkpoints" / "step-6"
    squatter.write_text("not a checkpoint")
    with pytest.raises(OSError):
        checkpoint.save(Path(run_dir), checkpoint.TrainState(step=6), dmp, optimizer, schedule, cfg)
    squatter.unlink()
    latest = checkpoint.latest(Path(run_dir))
    assert latest.name == "step-4"
    assert (Path(run_dir) / "checkpoints/step-6.tmp").exists()
    state = checkpoint.load(latest, dmp, optimizer, schedule)
    assert state.step == 4
    checkpoint.save(Path(run_dir), checkpoint.TrainState(step=6), dmp, optimizer, schedule, cfg)
    assert checkpoint.latest(Path(run_dir)).name == "step-6"
    assert not (Path(run_dir) / "checkpoints/step-6.tmp").exists()
    with open(os.path.join(result_dir, "crash.json"), "w") as f:
        json.dump({"latest_after_crash": latest.name, "resumed_step": state.step}, f)


def test_crash_while_saving_keeps_the_previous_checkpoint(tiny_data, tmp_path):
    result_dir = run_ranks(_crash_while_saving, 1, str(tmp_path), str(tiny_data[1]), str(tmp_path / "run"))
    with open(os.path.join(result_dir, "crash.json")) as f:
        outcome = json.load(f)
    assert outcome == {"latest_after_crash": "step-4", "resumed_step": 4}
    assert sorted(p.name for p in (tmp_path / "run/checkpoints").iterdir()) == ["step-2", "step-4", "step-6"]


# --- a rank killed mid-run -------------------------------------------------------------------


# The LightGBM reference train.py fits after a run (a few seconds each): the runs compared with
# the steady one leave it out (the steady run keeps it: its start-up and exit are checked quiet).
NO_REFERENCE = ["reference.enabled=false"]


def _torchrun(run_dir, data_dir, max_restarts, extra=(), env=None):
    overrides = tiny_overrides(data_dir, run_dir) + ["train.epochs=3", "train.checkpoint_every=5", "train.log_every=1"]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        str(max_restarts),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "localhost:0",
        "pinads_rec/train.py",
        "--config",
        "configs/demo.yaml",
    ]
    for o in overrides + list(extra):
        cmd += ["--set", o]
    # OMP_NUM_THREADS set: torchrun would set it to 1 anyway, with a warning.
    env = dict(env or os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


# Interpreter start-up hook (site imports ``sitecustomize`` from PYTHONPATH) for the steady run: at
# the exit of every process it raises a FutureWarning and logs a warning on a logger whose one
# message the project drops, neither of them anything the project silences -- so they must show.
PLANTED = """
import atexit, logging, warnings

def _planted():
    warnings.warn("pinads test warning", FutureWarning)
    logging.getLogger("torch.fx._symbolic_trace").warning("pinads test log warning")

atexit.register(_planted)
"""
PLANTED_MESSAGES = ("pinads test warning", "pinads test log warning")
# torch's own log lines (torchrun, torch.fx, ...) are glog-style, "W1201 13:37:45.562000 <pid> ..."
# (after "[rank0]:" in a rank, or after a progress bar on the same line); Python's warnings and
# logging say Warning / WARNING.
TORCH_WARNING = re.compile(r"W\d{4} \d\d:\d\d:\d\d\.\d+ ")


def library_warning_lines(output: str) -> list:
    """Lines of a run's output that are a library's warning: Python's (``...Warning:``, ``WARNING``)
    or torch's glog-style ones, except the project's own loggers' and the planted ones."""
    lines = []
    for line in output.splitlines():
        if not ("Warning" in line or "WARNING" in line or TORCH_WARNING.search(line)):
            continue
        if " pinads_rec." in line or any(m in line for m in PLANTED_MESSAGES):
            continue
        lines.append(line)
    return lines


@pytest.fixture(scope="module")
def steady_run(tiny_data, tmp_path_factory):
    """(run directory, output) of one uninterrupted 2-rank torchrun of train.py, with the planted
    warnings of PLANTED; the reference for the killed-rank test and the quiet start's evidence."""
    tmp = tmp_path_factory.mktemp("steady")
    (tmp / "site").mkdir()
    (tmp / "site" / "sitecustomize.py").write_text(PLANTED)
    path = [str(tmp / "site")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    proc = _torchrun(tmp / "run", str(tiny_data[1]), 0, env=dict(os.environ, PYTHONPATH=os.pathsep.join(path)))
    out, _ = proc.communicate(timeout=300)
    (tmp / "steady.log").write_text(out)
    assert proc.returncode == 0, out[-3000:]
    return tmp / "run", out


def test_start_up_prints_no_library_warning(steady_run):
    """A 2-rank run prints none of TorchRec's / torch's / torchrun's start-up warnings
    (docs/reliability.md, "A quiet start")."""
    _, out = steady_run
    assert library_warning_lines(out) == []


def test_an_unrelated_warning_still_shows(steady_run):
    """What the project silences is exact: the planted FutureWarning and the planted message on a
    logger with a dropped message reach the output of both ranks."""
    _, out = steady_run
    for message in PLANTED_MESSAGES:
        assert out.count(message) >= 2, f"{message!r} shown {out.count(message)} times:\n{out[-3000:]}"


def _rank_pid(run_dir, rank):
    """The pid of the worker process of `rank` training into run_dir."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
            environ = open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "pinads_rec/train.py" in cmdline and str(run_dir) in cmdline and f"RANK={rank}" in environ:
            return int(pid)
    return None


def _kill_rank_after_first_checkpoint(run_dir, rank, killed):
    deadline = time.time() + 240
    while time.time() < deadline:
        if (Path(run_dir) / "checkpoints/step-5").exists():
            pid = _rank_pid(run_dir, rank)
            if pid:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
        time.sleep(0.02)


def _final_eval(run_dir):
    return read_run_log(run_dir).summary


def test_killed_rank_restarts_resumes_and_matches_an_uninterrupted_run(tiny_data, steady_run, tmp_path):
    data_dir = str(tiny_data[1])
    steady, killed_run = steady_run[0], tmp_path / "killed"
    killed = []
    proc = _torchrun(killed_run, data_dir, max_restarts=1, extra=NO_REFERENCE)
    watcher = threading.Thread(target=_kill_rank_after_first_checkpoint, args=(killed_run, 1, killed))
    watcher.start()
    out, _ = proc.communicate(timeout=300)
    watcher.join()
    (tmp_path / "killed_run.log").write_text(out)
    assert killed, "rank 1 was never seen running"
    assert proc.returncode == 0, out[-3000:]

    assert "resumed from" in out and "checkpoints/step-" in out, "the restarted ranks resumed from a checkpoint"
    final = _final_eval(killed_run)
    reference = _final_eval(steady)
    assert final["step"] == reference["step"]
    for ours, theirs in zip(final["eval"], reference["eval"]):
        assert (ours["surface"], ours["task"]) == (theirs["surface"], theirs["task"])
        assert ours["auc"] == pytest.approx(theirs["auc"], abs=1e-3), (ours["surface"], ours["task"])


def test_a_killed_warm_started_day_relaunched_ends_as_the_uninterrupted_day(tiny_data, steady_run, tmp_path):
    """A day of the continuous loop (docs/continuous.md) warm-starts from yesterday's model. Killed
    -9 mid-day with no restart left, the job fails; the scheduler's relaunch of the same command
    resumes from the day's own checkpoint (resume wins over train.init_from) and ends as the
    uninterrupted warm-started day does."""
    data_dir = str(tiny_data[1])
    warm = [f"train.init_from={steady_run[0]}"] + NO_REFERENCE
    reference_run, day_run = tmp_path / "reference", tmp_path / "day"
    proc = _torchrun(reference_run, data_dir, max_restarts=0, extra=warm)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]

    killed = []
    proc = _torchrun(day_run, data_dir, max_restarts=0, extra=warm)
    watcher = threading.Thread(target=_kill_rank_after_first_checkpoint, args=(day_run, 1, killed))
    watcher.start()
    out, _ = proc.communicate(timeout=300)
    watcher.join()
    assert killed, "rank 1 was never seen running"
    assert proc.returncode != 0, "the killed day ended without a restart"

    proc = _torchrun(day_run, data_dir, max_restarts=0, extra=warm)
    out, _ = proc.communicate(timeout=300)
    (tmp_path / "relaunch.log").write_text(out)
    assert proc.returncode == 0, out[-3000:]
    assert "resumed from" in out and "checkpoints/step-" in out, "the relaunch resumed the day's checkpoint"
    final, reference = _final_eval(day_run), _final_eval(reference_run)
    assert final["step"] == reference["step"]
    for ours, theirs in zip(final["eval"], reference["eval"], strict=True):
        assert (ours["surface"], ours["task"]) == (theirs["surface"], theirs["task"])
        assert ours["auc"] == pytest.approx(theirs["auc"], abs=1e-3), (ours["surface"], ours["task"])


# --- bad data on one rank ends the whole job ---------------------------------------------------


def test_bad_row_group_on_one_rank_stops_every_rank_with_a_clear_error(tiny_data, tmp_path):
    """The rank that meets the bad row group exits with the message; torchrun then stops the other
    rank, which would otherwise wait in a collective until the timeout."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    data = tmp_path / "data"
    shutil.copytree(tiny_data[1], data)
    bad_file = sorted((data / "train").glob("*.parquet"))[-1]
    table = rows_of(pq.read_table(bad_file))  # rewritten one row per candidate, spoiled
    table = table.set_column(
        table.schema.get_field_index("advertiser_id"), "advertiser_id", pc.multiply(table["advertiser_id"], -1)
    )
    pq.write_table(table, bad_file, row_group_size=600)

    # A rank left waiting would sit in its collective for the hour of train.collective_timeout_s,
    # far past the 300 s this waits (a hang guard, not a measure: the job ends in seconds).
    proc = _torchrun(tmp_path / "run", str(data), max_restarts=0, extra=["train.collective_timeout_s=3600"])
    try:
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"a rank was left waiting for the collective timeout:\n{proc.communicate()[0][-3000:]}")
    assert proc.returncode != 0
    assert "data error:" in out and str(bad_file) in out and "'advertiser_id'" in out and "negative id" in out
