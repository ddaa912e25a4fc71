"""Run a function on N gloo ranks in fresh processes, with a file rendezvous (no ports to collide)
and a deadline, so a stuck collective fails the test instead of hanging the suite."""

import datetime
import os
import time
import traceback

import torch.multiprocessing as mp


def _entry(rank, fn, world_size, rdzv_file, result_dir, args):
    import torch
    import torch.distributed as dist

    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size)
    )
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{rdzv_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        fn(rank, world_size, result_dir, *args)
    except BaseException:
        with open(os.path.join(result_dir, f"error-{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size, tmp_path, *args, timeout_s=300):
    """Runs fn(rank, world_size, result_dir, *args) on every rank; raises with the rank's traceback."""
    rdzv = os.path.join(tmp_path, "rdzv")
    result_dir = os.path.join(tmp_path, "results")
    os.makedirs(result_dir, exist_ok=True)
    ctx = mp.start_processes(
        _entry, args=(fn, world_size, rdzv, result_dir, args), nprocs=world_size, join=False, start_method="spawn"
    )
    deadline = time.time() + timeout_s
    try:
        while not ctx.join(timeout=1):
            if time.time() > deadline:
                raise TimeoutError(f"{world_size}-rank run exceeded {timeout_s}s")
    except Exception:
        errors = [
            open(os.path.join(result_dir, f)).read() for f in sorted(os.listdir(result_dir)) if f.startswith("error-")
        ]
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        raise RuntimeError("\n".join(errors) or "a rank failed") from None
    return result_dir
