"""The instrumented training loop, inside a rank: ``measured_trainer`` (the trainer ``train.py``
builds, by ``Trainer.setup()`` in an empty run directory: nothing resumed, nothing written) and
``timed_steps`` of it, phase by phase (data, forward, backward, optimizer), with the time in
collectives from torch.profiler (``pinads_rec.experiments.collectives``); ``measure_training`` is
both, with the rank's memory and sharding plan."""

from __future__ import annotations

import contextlib
import math
import tempfile
import time
from typing import Dict, List

from pinads_rec.experiments.harness.meters import peak_rss_mib, rss_mib

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


def one_rank_step_ms(cfg, work, warmup: int, steps: int) -> float:
    """ms per training step (forward + backward + optimizer) of ``cfg`` on one rank after ``warmup``
    steps: ``measure_training`` in a process of its own under ``work``."""
    from pinads_rec.experiments.harness.launch import rank_results

    (out,) = rank_results(measure_training, 1, work, cfg, warmup, steps, 0, timeout_s=600)
    return sum(out[f"{k}_ms"] for k in ("forward", "backward", "optimizer"))
