"""The training path on 2 gloo ranks: sharded == unsharded, the pipeline really pipelines, the loss
falls, and resuming from a checkpoint continues exactly like an uninterrupted run.

One 2-process launch (each process pays the torchrec import once) records what every check needs
in a JSON file; each test asserts one check."""

import dataclasses
import json
import os
import shutil

import pytest
import torch
from conftest import load_tiny

from pinads_rec.experiments.harness import run_ranks
from pinads_rec.training.run_log import read_run_log
from pinads_rec.training.trainer import Hook

pytestmark = pytest.mark.slow


def copy_full_weights(dmp, full_state):
    """Writes an unsharded model's weights into a sharded one, shard by shard."""
    from pinads_rec import parallel

    with torch.no_grad():
        for name, value in dmp.state_dict().items():
            full = full_state[name]
            if not any(p in name for p in parallel.EMBEDDING_PARAM):
                value.copy_(full)
                continue
            for (r, c), (h, w), local in parallel.local_pieces(value):
                local.copy_(full[r : r + h, c : c + w])


def read_losses(run_dir):
    return {r["step"]: r["loss"] for r in read_run_log(run_dir).steps}


class Recorder(Hook):
    """Everything the hooks are shown, in order, as JSON would hold it."""

    def __init__(self):
        self.events, self.steps, self.summary = [], [], None

    def on_start(self, trainer):
        self.events.append("start")

    def on_step(self, trainer, record):
        self.events.append("step")
        self.steps.append(json.loads(json.dumps(record)))

    def on_evaluation(self, trainer, summary):
        self.events.append("evaluation")
        self.summary = json.loads(json.dumps(summary, default=float))

    def on_end(self, trainer):
        self.events.append("end")


def _checks(rank, world, result_dir, data_dir, run_root):
    import torch.distributed as dist

    from pinads_rec import parallel
    from pinads_rec.data.dataset import LoaderSettings, ParquetBatches
    from pinads_rec.models.ranker import UnifiedRanker
    from pinads_rec.models.train_task import TrainTask
    from pinads_rec.training.run_log import RunLog
    from pinads_rec.training.trainer import Trainer, shard_train_task

    env = parallel.init_distributed()
    out = {}

    # 1. Sharded logits equal the unsharded model's with the same weights, under several plans, and
    #    without request-level broadcasting (the sharded model fed per-row user data).
    for plan in ("default", "table_wise", "row_wise", "column_wise", "broadcast_off"):
        extra = {"default": [], "broadcast_off": ["model.broadcast=false"]}.get(
            plan, [f"train.sharding_types=[{plan}]"]
        )
        cfg = load_tiny(data_dir, extra)
        torch.manual_seed(0)
        full = TrainTask(UnifiedRanker(cfg.features, cfg.model))
        dmp = shard_train_task(cfg, env)
        copy_full_weights(dmp, full.state_dict())
        batch = next(iter(ParquetBatches(cfg.data.eval_dir, LoaderSettings.of(cfg), rank, world, shuffle=False)))
        if plan == "broadcast_off":  # the reference sees the same rows deduplicated into requests
            reference_cfg = load_tiny(data_dir)
            reference_batch = next(
                iter(ParquetBatches(cfg.data.eval_dir, LoaderSettings.of(reference_cfg), rank, world, shuffle=False))
            )
            out["broadcast_off_batch"] = {
                "rows": batch.batch_size,
                "requests": batch.num_requests,
                "reference_requests": reference_batch.num_requests,
            }
        else:
            reference_batch = batch
        dmp.eval()
        full.eval()
        with torch.no_grad():
            sharded = dmp(batch)[1][1]
            reference = full(reference_batch)[1][1]
        out[f"logit_diff_{plan}"] = float((sharded - reference).abs().max())

    # The dense AdamW's kernel follows train.dense_optimizer_kernel.
    out["dense_adamw"] = {}
    for kernel in ("fused", "foreach", "for_loop"):
        _, schedule = parallel.make_optimizer(dmp, dataclasses.replace(cfg.train, dense_optimizer_kernel=kernel), 10)
        adamw = schedule.optimizer._optimizer
        out["dense_adamw"][kernel] = [type(adamw).__name__, adamw.defaults["fused"], adamw.defaults["foreach"]]

    # 2. Training: pipelined modules, falling loss, what the hooks see.
    cfg = load_tiny(
        data_dir,
        [
            f"train.run_dir={run_root}/long",
            "train.epochs=3",
            "train.log_every=1",
            "train.lr=0.003",
            "train.warmup_steps=5",
        ],
    )
    recorder = Recorder()
    summary = Trainer(cfg, env, hooks=[RunLog(), recorder]).run()
    out["pipelined"] = summary["pipelined_modules"]
    out["eval_rows"] = len(summary["eval"])
    out["hook"] = {"events": recorder.events, "steps": recorder.steps, "summary": recorder.summary}

    # 3. Resume: an uninterrupted run vs one restarted from its step-4 checkpoint.
    base = ["train.max_steps=8", "train.log_every=1", "train.checkpoint_every=4"]
    Trainer(load_tiny(data_dir, base + [f"train.run_dir={run_root}/a"]), env, hooks=[RunLog()]).run()
    if rank == 0:
        shutil.copytree(f"{run_root}/a/checkpoints/step-4", f"{run_root}/b/checkpoints/step-4")
    dist.barrier()
    Trainer(load_tiny(data_dir, base + [f"train.run_dir={run_root}/b"]), env, hooks=[RunLog()]).run()

    if rank == 0:
        with open(os.path.join(result_dir, "checks.json"), "w") as f:
            json.dump(out, f)


@pytest.fixture(scope="module")
def two_rank_run(tiny_data, tmp_path_factory):
    _, data_dir = tiny_data
    tmp = tmp_path_factory.mktemp("two_rank_training")
    run_root = str(tmp / "runs")
    result_dir = run_ranks(_checks, 2, str(tmp), str(data_dir), run_root, timeout_s=400)
    with open(os.path.join(result_dir, "checks.json")) as f:
        return json.load(f), run_root


@pytest.mark.parametrize("plan", ["default", "table_wise", "row_wise", "column_wise", "broadcast_off"])
def test_sharded_logits_equal_unsharded(two_rank_run, plan):
    checks, _ = two_rank_run
    assert checks[f"logit_diff_{plan}"] < 1e-5


def test_pipeline_overlaps_both_sharded_collections(two_rank_run):
    checks, _ = two_rank_run
    assert sorted(name.rsplit(".", 1)[-1] for name in checks["pipelined"]) == ["ebc", "ec", "user_ebc"]


@pytest.mark.parametrize(
    "kernel,flags", [("fused", [True, None]), ("foreach", [False, True]), ("for_loop", [False, False])]
)
def test_dense_optimizer_kernel_chooses_the_adamw_implementation(two_rank_run, kernel, flags):
    checks, _ = two_rank_run
    assert checks["dense_adamw"][kernel] == ["AdamW"] + flags


def test_without_broadcasting_every_row_is_its_own_request(two_rank_run):
    checks, _ = two_rank_run
    assert checks["broadcast_off_batch"]["requests"] == checks["broadcast_off_batch"]["rows"]


def test_with_broadcasting_rows_share_requests(two_rank_run):
    checks, _ = two_rank_run
    assert checks["broadcast_off_batch"]["reference_requests"] < checks["broadcast_off_batch"]["requests"]


def test_training_lowers_the_loss(two_rank_run):
    _, run_root = two_rank_run
    losses = read_losses(f"{run_root}/long")
    steps = sorted(losses)
    assert len(steps) >= 20
    first = sum(losses[s] for s in steps[:5]) / 5
    last = sum(losses[s] for s in steps[-5:]) / 5
    assert last < 0.8 * first, (first, last)


def test_evaluation_has_a_row_per_surface_and_task(two_rank_run):
    checks, _ = two_rank_run
    assert checks["eval_rows"] == 4 * 3  # (3 surfaces + all) x 3 tasks


def test_hooks_are_called_in_order(two_rank_run):
    checks, _ = two_rank_run
    events = checks["hook"]["events"]
    assert events[0] == "start" and events[-2:] == ["evaluation", "end"]
    assert set(events[1:-2]) == {"step"}


def test_a_hook_sees_the_metrics_log_step_records(two_rank_run):
    checks, run_root = two_rank_run
    assert json.dumps(checks["hook"]["steps"]) == json.dumps(read_run_log(f"{run_root}/long").steps)


def test_a_hook_sees_the_metrics_log_summary(two_rank_run):
    checks, run_root = two_rank_run
    assert json.dumps(checks["hook"]["summary"]) == json.dumps(read_run_log(f"{run_root}/long").summary)


def test_resumed_run_starts_after_the_checkpoint(two_rank_run):
    _, run_root = two_rank_run
    assert sorted(read_losses(f"{run_root}/b")) == [5, 6, 7, 8]


@pytest.mark.parametrize("step", [5, 6, 7, 8])
def test_resume_continues_like_an_uninterrupted_run(two_rank_run, step):
    _, run_root = two_rank_run
    a, b = read_losses(f"{run_root}/a"), read_losses(f"{run_root}/b")
    assert b[step] == pytest.approx(a[step], abs=1e-6)
