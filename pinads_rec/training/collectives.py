"""Collective errors named: a gloo collective that times out or loses its peers raises an error with
nothing in it about the run; :class:`NamedCollectiveErrors` re-raises it as a
:class:`CollectiveError` naming the rank and where it was (``rank 0, step 3: ...``)."""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist


class CollectiveError(RuntimeError):
    """A collective of this rank timed out or lost its peers: another rank stopped or hangs. The
    message names this rank and the step (or phase) it was in."""


def collective_failure(e: BaseException) -> Optional[str]:
    """ "timeout" or "failed" when ``e`` is a collective's error (gloo raises RuntimeErrors from its
    transport, NCCL DistErrors), None for anything else."""
    text = str(e)
    if not (isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and "gloo/" in text)):
        return None
    return "timeout" if "timed out" in text.lower() or "timeout" in text.lower() else "failed"


class NamedCollectiveErrors:
    """Re-raises a collective's timeout or failure inside as a CollectiveError naming the rank and
    ``where``: on gloo the waiting rank's collective raises after train.collective_timeout_s with
    nothing in it about the run. (On NCCL the watchdog ends the process itself, naming the rank and
    the collective: parallel.init_distributed.) Anything else passes through untouched."""

    def __init__(self, rank: int, where: str, timeout_s: float):
        self.rank, self.where, self.timeout_s = rank, where, timeout_s

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        kind = collective_failure(exc) if exc is not None else None
        if kind is None:
            return False
        if kind == "timeout":
            what = f"a collective did not complete within {self.timeout_s:g} s (another rank stopped or hung?)"
        else:
            what = f"a collective failed, another rank stopped? ({str(exc).strip().splitlines()[0][:300]})"
        raise CollectiveError(f"rank {self.rank}, {self.where}: {what}") from exc
