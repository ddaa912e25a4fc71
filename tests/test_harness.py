"""The multi-process launcher (pinads_rec.experiments.harness.run_ranks): results come back, a
failing rank's traceback is raised naming the rank, a hung rank is stopped at the deadline."""

import json
import os
import time

import pytest

from pinads_rec.experiments import harness

pytestmark = pytest.mark.slow


def _sum_ranks(rank, world, result_dir, offset):
    import torch
    import torch.distributed as dist

    x = torch.tensor([rank + offset])
    dist.all_reduce(x)
    with open(os.path.join(result_dir, f"sum-{rank}.json"), "w") as f:
        json.dump({"sum": int(x), "world": world, "hash_seed": os.environ.get("PYTHONHASHSEED")}, f)


def _rank_one_fails(rank, world, result_dir):
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("rank one fails on purpose")
    dist.barrier()  # left waiting for rank 1 until the launcher stops it


def _rank_one_hangs(rank, world, result_dir):
    if rank == 1:
        time.sleep(3600)  # rank 0 waits for it in the launcher's closing barrier


def test_results_come_back(tmp_path):
    out = harness.run_ranks(_sum_ranks, 2, tmp_path, 10, timeout_s=120)
    for rank in (0, 1):
        got = json.loads((out / f"sum-{rank}.json").read_text())
        assert got == {"sum": 21, "world": 2, "hash_seed": "0"}
    assert not list(tmp_path.glob("error-*"))


def test_a_failing_rank_raises_its_traceback(tmp_path):
    with pytest.raises(harness.RanksFailed, match="rank one fails on purpose") as info:
        harness.run_ranks(_rank_one_fails, 2, tmp_path, timeout_s=120)
    assert 1 in info.value.failures and not info.value.timed_out  # rank 0 may fail too: its peer left
    assert "--- rank 1:" in str(info.value) and "ValueError" in str(info.value)


def test_a_hung_rank_is_stopped_at_the_deadline(tmp_path):
    started = time.monotonic()
    with pytest.raises(harness.RanksFailed, match="exceeded its 10 s deadline") as info:
        harness.run_ranks(_rank_one_hangs, 2, tmp_path, timeout_s=10)
    assert info.value.timed_out and time.monotonic() - started < 30
