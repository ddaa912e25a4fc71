"""The process group: joins the one torchrun / TorchX set up (NCCL with CUDA, gloo without), or a
world of one without a launcher; ``Distributed`` is what the rest of the package knows of it."""

from __future__ import annotations

import datetime
import logging
import os
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Distributed:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(timeout_s: float = 600.0) -> Distributed:
    """Joins the process group torchrun/TorchX set up (env://): NCCL with CUDA, gloo without.
    Without a launcher it runs as a world of one. ``timeout_s`` (train.collective_timeout_s): how
    long a collective waits for the other ranks before it fails (gloo: raises on the waiting rank;
    NCCL: the watchdog ends the process)."""
    if torch.cuda.is_available():
        backend = "nccl"
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        # NCCL collectives are asynchronous: the group's timeout is enforced by its watchdog thread,
        # which on a timeout aborts the communicators and tears the process down when async error
        # handling is on (torch's default, 3; 1 also cleans up) -- torchrun then stops the other
        # ranks. Its log names the rank, the collective and the timeout; the step is the one after
        # the last logged. With 0 a timed-out collective would never end the job: say so.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
        if os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0":
            logging.getLogger("pinads_rec.parallel").warning(
                "TORCH_NCCL_ASYNC_ERROR_HANDLING=0: a collective that times out (train.collective_timeout_s "
                "%g s) will not end the job; unset it (torch's default 3) or set 1",
                timeout_s,
            )
    else:
        backend, local_rank, device = "gloo", int(os.environ.get("LOCAL_RANK", 0)), torch.device("cpu")
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
            rdzv = os.environ.get(
                "PINADS_RDZV_FILE", os.path.join(tempfile.gettempdir(), f"pinads_rec_single_rdzv_{os.getpid()}")
            )
            init = f"file://{os.path.abspath(rdzv)}"
            dist.init_process_group(
                backend, init_method=init, rank=0, world_size=1, timeout=datetime.timedelta(seconds=timeout_s)
            )
        else:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return Distributed(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)
