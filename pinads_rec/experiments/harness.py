"""The one way this project runs code on several gloo ranks from Python (tests, experiments,
benchmarks), and what experiments measure around it.

Launching: ``run_ranks(fn, world_size, work_dir, *args)`` starts ``world_size`` fresh processes
(spawn), each joining a gloo process group through a FILE rendezvous in a private temporary
directory (no TCP port to collide), and calls ``fn(rank, world_size, work_dir, *args)`` in each.
A deadline bounds the whole run; a failed rank's traceback (``work_dir/error-<rank>.txt``) is
re-raised in the caller, every failed rank's, named by rank; the ranks die with the caller.
``rank_results(fn, ...)`` is the same for a ``fn(*args) -> dict`` whose per-rank results come back
(kept as ``work_dir/rank-<rank>.json``).

Measuring: ``CpuMeter`` (what other processes used meanwhile), ``wait_quiet``, ``rss_mib`` /
``peak_rss_mib``, ``measured_trainer`` (a rank's trainer built by ``Trainer.setup()`` in an empty
run directory) and ``measure_training``: that trainer and ``timed_steps`` of it, phase by phase, with
the time in collectives from torch.profiler (``pinads_rec.experiments.collectives``).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import math
import os
import resource
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


def _rank_main(
    rank: int, world: int, rdzv_file: str, work_dir: str, pg_timeout_s: float, quiet: bool, fn, args
) -> None:
    import multiprocessing

    import torch
    import torch.distributed as dist

    _die_with_parent()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    # A spawned child inherits "spawn" as its start method; torchrun's ranks fork their DataLoader
    # workers, so these do too.
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
    import torch.multiprocessing as mp

    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    for old in list(work.glob("error-*.txt")) + list(work.glob("rank-*.json")):
        old.unlink()
    rdzv_dir = tempfile.mkdtemp(prefix="pinads_rdzv_")  # a fresh rendezvous file per launch
    pg_timeout_s = timeout_s if collective_timeout_s is None else collective_timeout_s
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(rank, world_size, os.path.join(rdzv_dir, "rdzv"), str(work), pg_timeout_s, quiet, fn, args),
            name=f"rank-{rank}",
        )
        for rank in range(world_size)
    ]
    saved = os.environ.get("PYTHONHASHSEED")
    os.environ["PYTHONHASHSEED"] = saved or "0"  # read by the child interpreters as they start
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


# --------------------------------------------------------------------------------------------
# The machine: other processes' load, memory.
# --------------------------------------------------------------------------------------------


class CpuMeter:
    """How busy the machine was during a run: all CPU time (``/proc/stat``) minus this process's and
    its reaped children's (the ranks) = what other users' processes took, in cores on average."""

    def __init__(self):
        self.hz = os.sysconf("SC_CLK_TCK")
        self.start()

    @staticmethod
    def _busy_s(hz: int) -> float:
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return float("nan")
        # user nice system idle iowait irq softirq steal ...: all but idle and iowait
        return (sum(v[:8]) - v[3] - v[4]) / hz

    @staticmethod
    def _ours_s() -> float:
        total = 0.0
        for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
            u = resource.getrusage(who)
            total += u.ru_utime + u.ru_stime
        return total

    def start(self) -> None:
        self.t0, self.busy0, self.ours0 = time.monotonic(), self._busy_s(self.hz), self._ours_s()

    def stop(self) -> Dict[str, float]:
        wall = max(time.monotonic() - self.t0, 1e-9)
        busy, ours = self._busy_s(self.hz) - self.busy0, self._ours_s() - self.ours0
        return {"ours_cores": ours / wall, "other_cores": max(busy - ours, 0.0) / wall, "seconds": wall}


def wait_quiet(max_wait_s: float, threshold: float = 0.25, window_s: float = 2.0, echo=print) -> float:
    """Waits (up to ``max_wait_s``) until other processes use less than ``threshold`` cores over a
    ``window_s`` window; returns the last window's load."""
    deadline = time.monotonic() + max_wait_s
    told = False
    while True:
        m = CpuMeter()
        time.sleep(window_s)
        load = m.stop()["other_cores"]
        if load < threshold or time.monotonic() >= deadline:
            return load
        if not told:
            echo(f"  waiting for a quiet machine (other processes use {load:.2f} cores)")
            told = True


def rss_mib(field: str = "VmRSS") -> float:
    """This process's RSS (VmRSS) or peak RSS (VmHWM) in MiB. Not ru_maxrss: Linux carries the
    high-water mark over fork + exec, so a spawned rank would report its launcher's peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def peak_rss_mib() -> float:
    return rss_mib("VmHWM")


# --------------------------------------------------------------------------------------------
# Inside a rank: the instrumented training loop.
# --------------------------------------------------------------------------------------------

PHASES = ("data", "forward", "backward", "optimizer")


class _Step:
    """One plain training step of a set-up Trainer, phase by phase (``phase(name)``: a context
    manager marking it, e.g. for the profiler); ``run()`` returns (phase seconds, batch, loss)."""

    def __init__(self, trainer, phase=None):
        self.dmp, self.optimizer, self.schedule = trainer.dmp, trainer.optimizer, trainer.schedule
        self.batches = trainer.epoch_batches(0)
        self.phase = phase or (lambda name: contextlib.nullcontext())
        self.rank = _dist_rank()
        self.done = 0

    def run(self):
        t0 = time.perf_counter()
        with self.phase("data"):
            try:
                batch = next(self.batches)
            except StopIteration:
                raise RuntimeError(f"rank {self.rank}: the data ran out after {self.done} steps") from None
        t1 = time.perf_counter()
        with self.phase("forward"):
            loss, _ = self.dmp(batch)
        t2 = time.perf_counter()
        with self.phase("backward"):
            loss.backward()
        t3 = time.perf_counter()
        with self.phase("optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.schedule.step()
        t4 = time.perf_counter()
        self.done += 1
        return (t1 - t0, t2 - t1, t3 - t2, t4 - t3), batch, loss


def _dist_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()  # every rank starts the window together


def timed_steps(trainer, warmup: int, steps: int, comms_steps: int = 0) -> dict:
    """Plain training steps of a set-up ``Trainer`` (its sharded model, optimizer, LR schedule and
    epoch-0 batches; not its pipeline): ``warmup`` untimed, ``steps`` timed phase by phase with
    ``time.perf_counter``, then ``comms_steps`` under torch.profiler for the collectives.

    - data: ``next(batches)``: the loader and EndTogether's one-element all_reduce;
    - forward: ``loss, _ = dmp(batch)`` (TorchRec's input/output all-to-alls included);
    - backward: ``loss.backward()`` (dense gradients, DDP's all_reduce, the embedding gradients'
      all-to-alls and the fused embedding optimizer, which updates the tables inside backward);
    - optimizer: ``optimizer.step(); optimizer.zero_grad()`` and the LR schedule (the dense AdamW).

    The profiler records every op (~1 us each, ~10% of a CPU step here), so the timed steps run
    without it and the collectives are read from the steps after them: per phase, the ms per step
    with a collective in flight (``comms_<phase>_ms``, collectives.PhaseProfile; DDP's all_reduce is
    left out of backward's and timed over the timed steps by a comm hook, ``ddp_allreduce_ms``).
    Also returned: the data wait's median and max, what the batches held, the peak RSS after the
    timed steps, every timed step's phases (``per_step_ms``) and the profiled steps' collectives
    (``comms_per_step``) and phases (``comms_phase_ms``)."""
    from pinads_rec.experiments.collectives import DdpAllReduceTimer, PhaseProfile

    ddp = DdpAllReduceTimer().install(trainer.dmp)
    step = _Step(trainer)
    trainer.dmp.train()
    for _ in range(warmup):
        step.run()
    _barrier()
    ddp.seconds = 0.0
    per_step: Dict[str, List[float]] = {k: [] for k in PHASES}  # ms
    ids = requests = 0.0
    started = time.perf_counter()
    for i in range(steps):
        seconds, batch, loss = step.run()
        for k, dt in zip(PHASES, seconds):
            per_step[k].append(round(1000.0 * dt, 3))
        ids += (batch.sparse.values().numel() + batch.sequences.values().numel()) / batch.batch_size
        requests += batch.num_requests
        if not math.isfinite(float(loss.detach())):
            raise RuntimeError(f"rank {step.rank}: loss is {float(loss.detach())} at step {warmup + i}")
    wall = time.perf_counter() - started
    ddp_ms = 1000.0 * ddp.seconds / steps
    peak = peak_rss_mib()  # before the profiler's event buffers

    comms = {"ms": {}, "ops": {}, "phase_ms": {}}
    if comms_steps:
        profile = PhaseProfile()
        step.phase = profile.phase
        _barrier()
        profile.start()
        phase_s = [0.0] * len(PHASES)
        for _ in range(comms_steps):
            phase_s = [a + b for a, b in zip(phase_s, step.run()[0])]
        profile.stop()
        comms = profile.summary(comms_steps, exclude={"backward": ("all_reduce",)})  # DDP's: ddp_allreduce_ms
        comms["phase_ms"] = {k: 1000.0 * s / comms_steps for k, s in zip(PHASES, phase_s)}
    data_sorted = sorted(per_step["data"])
    return {
        "steps": steps,
        "wall_s": wall,
        "batch_rows": batch.batch_size,
        **{f"{k}_ms": sum(v) / steps for k, v in per_step.items()},
        "data_p50_ms": data_sorted[len(data_sorted) // 2],
        "data_max_ms": data_sorted[-1],
        "comms_steps": comms_steps,
        **{f"comms_{short}_ms": comms["ms"].get(k, 0.0) for k, short in zip(PHASES, ("data", "fwd", "bwd", "opt"))},
        "ddp_allreduce_ms": ddp_ms,
        "ids_per_example": ids / steps,
        "requests_per_batch": requests / steps,
        "peak_rss_mib": peak,
        "per_step_ms": per_step,
        "comms_per_step": comms["ops"],  # "<phase> <op>": [collectives started per step, their ms per step]
        "comms_phase_ms": comms["phase_ms"],  # the profiled steps' own phase times
    }


def embedding_size(dmp) -> Dict[str, float]:
    """This rank's embedding rows and MiB (fp32): its shards of sharded tables, and a full replica
    of data-parallel ones."""
    from pinads_rec import parallel

    rows = numel = 0
    for name, t in dmp.state_dict().items():
        if any(p in name for p in parallel.EMBEDDING_PARAM):
            local = [piece for _, _, piece in parallel.local_pieces(t)]
            rows += sum(x.shape[0] for x in local)
            numel += sum(x.numel() for x in local)
    return {"embedding_rows": rows, "embedding_mib": numel * 4 / 2**20}


def plan_summary(dmp) -> str:
    """``table:sharding_type@ranks`` for every sharded table, e.g. ``user:table_wise@0``."""
    parts = []
    for module_plan in dmp.plan.plan.values():
        for table, ps in sorted(module_plan.items()):
            ranks = "+".join(str(r) for r in (ps.ranks or []))
            parts.append(f"{table}:{ps.sharding_type}@{ranks}")
    return " ".join(parts)


@contextlib.contextmanager
def measured_trainer(cfg, total_steps: int, num_workers: int):
    """The trainer ``train.py`` builds on this rank (``Trainer(cfg).setup()``), for a measurement:
    ``train.max_steps = total_steps`` (the LR schedule), ``data.num_workers = num_workers`` and an
    empty temporary run directory (nothing resumed, nothing written; removed on exit)."""
    import dataclasses

    from pinads_rec.training.trainer import Trainer

    with tempfile.TemporaryDirectory(prefix="pinads_timed_run_") as run_dir:
        cfg = dataclasses.replace(
            cfg,
            data=dataclasses.replace(cfg.data, num_workers=num_workers),
            train=dataclasses.replace(cfg.train, max_steps=total_steps, run_dir=run_dir),
        )
        yield Trainer(cfg).setup()


def measure_training(cfg, warmup: int, steps: int, num_workers: int = 0, comms_steps: int = 0) -> dict:
    """One rank's measurement (run it with ``rank_results``): the trainer of ``measured_trainer``
    (``train.max_steps`` = all the steps), then ``timed_steps``; with the rank's RSS before the
    model, its embedding size and sharding plan."""
    import torch.distributed as dist

    base_rss = rss_mib()
    with measured_trainer(cfg, warmup + steps + comms_steps, num_workers) as trainer:
        size = embedding_size(trainer.dmp)
        timed = timed_steps(trainer, warmup, steps, comms_steps)
    return {
        "rank": _dist_rank(),
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        **timed,
        "base_rss_mib": base_rss,
        **size,
        "plan": plan_summary(trainer.dmp),
    }
