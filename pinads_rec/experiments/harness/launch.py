"""The one way this project runs code on several gloo ranks from Python (tests, experiments,
benchmarks).

``run_ranks(fn, world_size, work_dir, *args)`` starts ``world_size`` fresh processes, each
joining a gloo process group through a FILE rendezvous in a private temporary directory (no TCP port
to collide), and calls ``fn(rank, world_size, work_dir, *args)`` in each. A deadline bounds the whole
run; a failed rank's traceback (``work_dir/error-<rank>.txt``) is re-raised in the caller, every
failed rank's, named by rank; the ranks die with the caller. ``rank_results(fn, ...)`` is the same
for a ``fn(*args) -> dict`` whose per-rank results come back (kept as ``work_dir/rank-<rank>.json``).

The processes are forked from a forkserver that has imported torch, TorchRec and the project once
(started on the first launch, with ``PYTHONHASHSEED=0``): a rank starts in milliseconds instead of
the seconds a fresh interpreter takes to import them, and each rank is still a clean fork of a
process that never ran a collective or a thread pool. The caller's environment at launch time is the
rank's, as under spawn, but for what is read while importing (torch's, the project's): that is the
first launch's. A caller that sets its own ``PYTHONHASHSEED`` gets spawned ranks under that seed.

``train_py`` and ``torchx_train`` launch ``pinads_rec/train.py`` itself, under torchrun or TorchX: the
one launcher of each kind the experiments, benchmarks and tests share.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
import tempfile
import time
import traceback
import warnings
from multiprocessing.connection import wait as wait_for_exits
from pathlib import Path
from typing import Callable, Dict, List, Optional

# Seconds the other ranks get to finish (and write their own traceback) once one rank has failed.
FAILURE_GRACE_S = 3.0

# What the forkserver imports once, so that no rank pays for it: torch, the sharding stack and the
# project's training path. (An import error here only costs the rank its own import later.)
PRELOADED_MODULES = ["torch", "torch.distributed", "torchrec", "fbgemm_gpu", "pinads_rec.train"]
_forkserver_is_ours = False


class RanksFailed(RuntimeError):
    """One or more ranks raised or died, or the run passed its deadline. ``failures`` maps each
    failed rank to its traceback (or how it ended); ``timed_out`` says whether the deadline struck."""

    def __init__(self, message: str, failures: Dict[int, str], timed_out: bool):
        super().__init__(message)
        self.failures, self.timed_out = failures, timed_out


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent dies (no orphan left in a collective)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def quiet_library_logs() -> None:
    """TorchRec / fbgemm / torch log lines (INFO per table and the like) down to errors; a logger
    given its own level (e.g. the experiment's) still speaks."""
    for noisy in ("torchrec", "torch", "fbgemm_gpu"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    logging.getLogger().setLevel(logging.ERROR)  # fbgemm's "Successfully loaded" INFO lines


def _rank_context():
    """The multiprocessing context the ranks start from: this process's forkserver, preloaded and
    started with ``PYTHONHASHSEED=0`` (so that the planner's ties break alike from run to run), or
    spawn where the caller asks for another hash seed, or a forkserver was already started by
    someone else (its hash seed unknown)."""
    import multiprocessing.forkserver as forkserver

    import torch.multiprocessing as mp

    global _forkserver_is_ours
    if os.environ.get("PYTHONHASHSEED", "0") != "0":
        return mp.get_context("spawn")
    if not _forkserver_is_ours:
        if forkserver._forkserver._forkserver_pid is not None:
            return mp.get_context("spawn")
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOADED_MODULES)
        saved = os.environ.get("PYTHONHASHSEED")
        os.environ["PYTHONHASHSEED"] = "0"  # read by the server's interpreter as it starts
        try:
            forkserver.ensure_running()
        finally:
            if saved is None:
                del os.environ["PYTHONHASHSEED"]
            else:
                os.environ["PYTHONHASHSEED"] = saved
        _forkserver_is_ours = True
    return mp.get_context("forkserver")


def _rank_main(
    rank: int,
    world: int,
    rdzv_file: str,
    work_dir: str,
    pg_timeout_s: float,
    quiet: bool,
    environ: Dict[str, str],
    fn,
    args,
) -> None:
    import multiprocessing

    import torch
    import torch.distributed as dist

    _die_with_parent()
    # A forkserver's child inherits the server's environment, not the caller's: take the caller's.
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    # A child inherits its parent's start method; torchrun's ranks fork their DataLoader workers,
    # so these do too.
    multiprocessing.set_start_method("fork", force=True)
    torch.set_num_threads(1)  # one thread per rank: 1 and N ranks get the same compute per process
    if quiet:
        quiet_library_logs()
        warnings.simplefilter("ignore")  # TorchRec/fbgemm deprecation chatter, once per rank and run
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{rdzv_file}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        fn(rank, world, work_dir, *args)
        # Leave together: a rank tearing gloo down while a peer is still connecting (an ``fn``
        # without collectives returns at once) fails the peer's init_process_group. (``fn`` may
        # have ended the group itself, as train.main does.)
        if dist.is_initialized():
            dist.barrier()
    except BaseException:
        with open(os.path.join(work_dir, f"error-{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable,
    world_size: int,
    work_dir,
    *args,
    timeout_s: float = 300,
    quiet: bool = False,
    collective_timeout_s: Optional[float] = None,
) -> Path:
    """Runs ``fn(rank, world_size, work_dir, *args)`` on ``world_size`` gloo ranks (one torch thread
    each, ``PYTHONHASHSEED=0`` so that the planner's ties break alike from run to run); returns
    ``work_dir`` (a Path), where ``fn`` writes what the caller reads. Raises ``RanksFailed`` naming
    every failed rank with its traceback, or the deadline. ``fn`` and ``args`` must pickle (``fn`` a
    module-level function). ``quiet``: the ranks log library messages at ERROR only.
    ``collective_timeout_s``: the default process group's timeout (as train.py sets it from
    train.collective_timeout_s); None: the deadline."""
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    for old in list(work.glob("error-*.txt")) + list(work.glob("rank-*.json")):
        old.unlink()
    rdzv_dir = tempfile.mkdtemp(prefix="pinads_rdzv_")  # a fresh rendezvous file per launch
    pg_timeout_s = timeout_s if collective_timeout_s is None else collective_timeout_s
    ctx = _rank_context()
    environ = dict(os.environ)
    environ.setdefault("PYTHONHASHSEED", "0")  # read by a spawned child's interpreter as it starts
    rdzv_file = os.path.join(rdzv_dir, "rdzv")
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(rank, world_size, rdzv_file, str(work), pg_timeout_s, quiet, environ, fn, args),
            name=f"rank-{rank}",
        )
        for rank in range(world_size)
    ]
    saved = os.environ.get("PYTHONHASHSEED")
    os.environ["PYTHONHASHSEED"] = environ["PYTHONHASHSEED"]
    deadline = time.monotonic() + timeout_s
    timed_out, killed = False, set()
    try:
        try:
            for p in procs:
                p.start()
        finally:
            if saved is None:
                del os.environ["PYTHONHASHSEED"]
        running = list(procs)
        while running:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            wait_for_exits([p.sentinel for p in running], timeout=min(left, 1.0))
            running = [p for p in procs if p.exitcode is None]
            if any(p.exitcode not in (None, 0) for p in procs):
                # The others are likely blocked in a collective with the failed rank: give them a
                # moment to fail on their own (and write their traceback), then stop them.
                wait_for_exits([p.sentinel for p in running], timeout=FAILURE_GRACE_S)
                break
    finally:
        for rank, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                killed.add(rank)
        for p in procs:
            if p.pid is not None:  # started
                p.join(10)
        shutil.rmtree(rdzv_dir, ignore_errors=True)
    failures = {}
    for rank, p in enumerate(procs):
        error = work / f"error-{rank}.txt"
        if error.exists():
            failures[rank] = error.read_text().rstrip()
        elif p.exitcode not in (0, None) and rank not in killed:
            failures[rank] = f"exited with code {p.exitcode} (no Python traceback)"
    if timed_out or failures:
        head = f"{world_size}-rank run in {work} "
        head += f"exceeded its {timeout_s:g} s deadline" if timed_out else f"failed on rank(s) {sorted(failures)}"
        parts = [head] + [f"--- rank {rank}:\n{text}" for rank, text in sorted(failures.items())]
        raise RanksFailed("\n".join(parts), failures, timed_out)
    return work


def _result_to_json(rank: int, world: int, work_dir: str, fn, args) -> None:
    with open(os.path.join(work_dir, f"rank-{rank}.json"), "w") as f:
        json.dump(fn(*args), f)


def rank_results(
    fn: Callable[..., dict], world_size: int, work_dir, *args, timeout_s: float = 300, quiet: bool = True
) -> List[dict]:
    """``fn(*args)`` on every rank (run by ``run_ranks``); its JSON-able results in rank order."""
    work = run_ranks(_result_to_json, world_size, work_dir, fn, args, timeout_s=timeout_s, quiet=quiet)
    return [json.loads((work / f"rank-{rank}.json").read_text()) for rank in range(world_size)]


def torchx_train(
    config_path: str,
    overrides: List[str],
    job: str,
    log_path: Path,
    timeout_s: float,
    watch: Optional[Callable[[int], object]] = None,
) -> int:
    """``torchx run -s local_cwd components/train.py:train -j JOB --rdzv_port 0 --gpu 0 --config
    config_path --set overrides`` from the repository root (pinads_rec/train.py on gloo ranks; a free
    port picked when the job is built, so launches never collide), its combined output in
    ``log_path``: the launch's exit status. ``watch(pid)``: a context manager held while it runs
    (a memory meter of the process tree). Past ``timeout_s`` the whole tree is killed and
    ``TimeoutError`` raised. The one TorchX launcher of the tests and benchmarks."""
    import signal
    import subprocess
    import sys
    from contextlib import nullcontext

    repo = Path(__file__).resolve().parents[3]
    exe = Path(sys.executable).parent / "torchx"
    exe = str(exe) if exe.exists() else shutil.which("torchx")
    if not exe:
        raise FileNotFoundError("the torchx CLI is not installed (the project's torchx dependency)")
    env = dict(os.environ)
    env.pop("TORCHXCONFIG", None)  # no user scheduler defaults
    # PATH as it is: the component has the ranks find the torchrun beside this torchx.
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        exe,
        "run",
        "-s",
        "local_cwd",
        "-cfg",
        f"log_dir={log_path.parent / 'torchx_logs'}",
        "components/train.py:train",
    ]
    cmd += ["-j", job, "--rdzv_port", "0", "--gpu", "0", "--config", str(config_path), "--set", ",".join(overrides)]
    with open(log_path, "w") as log:
        print(" ".join(cmd), file=log, flush=True)
        proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        with watch(proc.pid) if watch is not None else nullcontext():
            try:
                return proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # torchx, the torchrun agents and the ranks share the session
                proc.wait()
                raise TimeoutError(f"torchx launch exceeded {timeout_s} s (output in {log_path})") from None


class TrainFailed(RuntimeError):
    """A ``train_py`` launch exited non-zero; the message ends with the last lines of its log."""


def train_py(
    config_path: str, overrides: List[str], ranks: int, log_path: Path, echo: Optional[Callable[[str], object]] = None
) -> Dict[str, object]:
    """``pinads_rec/train.py --config config_path --set ...`` on ``ranks`` gloo processes under
    ``torchrun --standalone`` (a free rendezvous port of its own) from the repository root, its
    combined output in ``log_path``; ``echo`` is given the command first. Returns the launch's
    ``seconds`` and the ranks' peak RSS (``rank_peak_rss_mb`` in process-id order, ``peak_rss_mb`` the
    largest: ``meters.RankMemory``, the ranks' own high-water marks). A failed launch raises
    ``TrainFailed`` with the end of the log."""
    import subprocess
    import sys

    from pinads_rec.experiments.harness.meters import RankMemory

    repo = Path(__file__).resolve().parents[3]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    cmd += [str(repo / "pinads_rec" / "train.py"), "--config", str(config_path)]
    for o in overrides:
        cmd += ["--set", o]
    if echo is not None:
        echo("  $ " + " ".join(c if len(c) < 120 else c[:117] + "..." for c in cmd))
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=repo)
        with RankMemory(proc.pid) as memory:
            rc = proc.wait()
    if rc != 0:
        tail = log_path.read_text().strip().splitlines()[-15:]
        raise TrainFailed(f"train.py failed (exit {rc}); end of {log_path}:\n" + "\n".join(tail))
    peaks = memory.peaks()
    return {
        "seconds": time.perf_counter() - started,
        "peak_rss_mb": max(peaks) if peaks else None,
        "rank_peak_rss_mb": peaks,
    }
