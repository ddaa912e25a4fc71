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
    import pyarrow.parquet as pq
    import torch.distributed as dist

    from pinads_rec import parallel
    from pinads_rec.data.contract import ContractError
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

    # 4. Small splits: an eval split of one row group (fewer than the ranks) is evaluated whole, the
    #    rank without a row group replaying a masked batch; a row filter that keeps no row stops the
    #    run before its first step (the files' footers could not tell).
    one_group = f"{run_root}/one_group_eval"
    if rank == 0:
        os.makedirs(one_group)
        table = pq.read_table(f"{data_dir}/eval")
        pq.write_table(table, f"{one_group}/eval.parquet", row_group_size=table.num_rows)
        out["one_group_eval_rows"] = table.num_rows
    dist.barrier()
    cfg = load_tiny(data_dir, ["train.max_steps=2", f"train.run_dir={run_root}/small", f"data.eval_dir={one_group}"])
    summary = Trainer(cfg, env).run()
    out["one_group_eval_examples"] = [r["examples"] for r in summary["eval"] if r["surface"] == "all"]
    cfg = load_tiny(
        data_dir,
        [f"train.run_dir={run_root}/filtered", "data.row_filter={column: ad_type, values: [987654]}"],
    )
    try:
        Trainer(cfg, env).run()
        out["filtered_error"] = None
    except ContractError as e:
        out["filtered_error"] = str(e)

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


def test_an_eval_split_with_fewer_row_groups_than_ranks_is_evaluated_whole(two_rank_run):
    checks, _ = two_rank_run
    assert checks["one_group_eval_examples"] == [checks["one_group_eval_rows"]] * 3  # every task


def test_rows_filtered_away_stop_the_run_before_its_first_step(two_rank_run):
    checks, _ = two_rank_run
    error = checks["filtered_error"]
    assert error is not None and "epoch 0 ended before its first step" in error, error
    assert "rank 0 had no batch" in error and "data.row_filter" in error


# --- refused at set-up, before the model is built (one process, no process group needed) -------


def _setup_error(cfg):
    from pinads_rec import parallel
    from pinads_rec.data.contract import ContractError
    from pinads_rec.training.trainer import Trainer

    env = parallel.Distributed(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    trainer = Trainer(cfg, env)
    with pytest.raises(ContractError) as e:
        trainer.setup()
    assert not hasattr(trainer, "dmp"), "the data check comes before the model is sharded"
    return str(e.value)


def _empty_split(tiny_data, tmp_path, name):
    import pyarrow.parquet as pq

    cfg, data = tiny_data
    table = pq.read_table(f"{data}/{name}")
    (tmp_path / name).mkdir()
    pq.write_table(table.slice(0, 0), tmp_path / name / "empty.parquet")
    return str(tmp_path / name)


def test_a_train_split_without_rows_is_refused_at_setup(tiny_data, tmp_path):
    empty = _empty_split(tiny_data, tmp_path, "train")
    cfg = load_tiny(tiny_data[1], [f"data.train_dir={empty}", f"train.run_dir={tmp_path / 'run'}"])
    assert _setup_error(cfg) == f"data.train_dir {empty}: 0 rows (1 .parquet file(s), none with a row)"


def test_a_train_split_smaller_than_a_batch_is_refused_at_setup(tiny_data, tmp_path):
    cfg = load_tiny(
        tiny_data[1],
        ["data.batch_size=100000", "data.max_unique_users_per_batch=0", f"train.run_dir={tmp_path / 'run'}"],
    )
    assert "< data.batch_size 100000 x 1 rank(s) = 100000: no full batch per rank" in _setup_error(cfg)


def test_an_eval_split_without_rows_is_refused_at_setup(tiny_data, tmp_path):
    empty = _empty_split(tiny_data, tmp_path, "eval")
    cfg = load_tiny(tiny_data[1], [f"data.eval_dir={empty}", f"train.run_dir={tmp_path / 'run'}"])
    assert _setup_error(cfg) == f"data.eval_dir {empty}: 0 rows (1 .parquet file(s), none with a row)"
