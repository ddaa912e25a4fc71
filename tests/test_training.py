"""The training path on 2 gloo ranks: sharded == unsharded, the pipeline really pipelines, the loss
falls, the run's reports (metrics.jsonl, TensorBoard, run metadata, profiler trace) agree, and
resuming from a checkpoint continues exactly like an uninterrupted run.

One 2-process launch (each process pays the torchrec import once) records what every check needs
in a JSON file; each test asserts one check."""

import dataclasses
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import REPO, load_tiny, read_rows
from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

from pinads_rec.experiments.harness import run_ranks
from pinads_rec.metrics import oracle_lift
from pinads_rec.training.hooks import Hook
from pinads_rec.training.profiler import trace_path
from pinads_rec.training.run_log import METADATA_FILE, read_run_log
from pinads_rec.training.tensorboard_writer import METADATA_TAG

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


PROFILED = (2, 3)  # the steps of the long run's profiler trace


def as_float32(x):
    """What TensorBoard holds for the number ``x`` (it stores scalars as float32)."""
    return torch.tensor(x, dtype=torch.float32).item()


def tensorboard_events(run_dir):
    events = EventAccumulator(str(run_dir), size_guidance={SCALARS: 0})  # 0: keep every event
    events.Reload()
    return events


def tensorboard_scalars(run_dir):
    """{tag: {step: value}} of every scalar in the run directory's event files."""
    events = tensorboard_events(run_dir)
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def same_number(tensorboard_value, x):
    return torch.tensor(tensorboard_value).isnan().item() if x != x else tensorboard_value == as_float32(x)


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
    from pinads_rec.data.loader.contract import ContractError
    from pinads_rec.data.loader.dataset import LoaderSettings, ParquetBatches
    from pinads_rec.models.ranker import UnifiedRanker
    from pinads_rec.models.train_task import TrainTask
    from pinads_rec.training.profiler import StepProfiler
    from pinads_rec.training.run_log import RunLog
    from pinads_rec.training.task import shard_train_task
    from pinads_rec.training.tensorboard_writer import TensorBoardWriter
    from pinads_rec.training.trainer import Trainer

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

    # 2. Training: pipelined modules, falling loss, what the hooks see, TensorBoard and a profiler trace.
    cfg = load_tiny(
        data_dir,
        [
            f"train.run_dir={run_root}/long",
            "train.epochs=3",
            "train.log_every=1",
            "train.lr=0.003",
            "train.warmup_steps=5",
            f"train.profile_steps=[{PROFILED[0]}, {PROFILED[1]}]",
        ],
    )
    recorder = Recorder()
    summary = Trainer(cfg, env, hooks=[RunLog(), recorder, TensorBoardWriter(), StepProfiler()]).run()
    out["pipelined"] = summary["pipelined_modules"]
    out["eval_rows"] = len(summary["eval"])
    out["hook"] = {"events": recorder.events, "steps": recorder.steps, "summary": recorder.summary}

    # 3. Resume: an uninterrupted run vs one restarted from its step-4 checkpoint. b also gets a's
    #    TensorBoard events, as if a had run there and crashed after its step-4 checkpoint.
    base = ["train.max_steps=8", "train.log_every=1", "train.checkpoint_every=4"]
    Trainer(
        load_tiny(data_dir, base + [f"train.run_dir={run_root}/a"]), env, hooks=[RunLog(), TensorBoardWriter()]
    ).run()
    if rank == 0:
        shutil.copytree(f"{run_root}/a/checkpoints/step-4", f"{run_root}/b/checkpoints/step-4")
        for events in Path(f"{run_root}/a").glob("events.out.tfevents.*"):
            shutil.copy(events, f"{run_root}/b/")
    dist.barrier()
    Trainer(
        load_tiny(data_dir, base + [f"train.run_dir={run_root}/b"]), env, hooks=[RunLog(), TensorBoardWriter()]
    ).run()

    # 4. Small splits: an eval split of one row group (fewer than the ranks) is evaluated whole, the
    #    rank without a row group replaying a masked batch; a row filter that keeps no row stops the
    #    run before its first step (the files' footers could not tell).
    one_group = f"{run_root}/one_group_eval"
    if rank == 0:
        os.makedirs(one_group)
        table = read_rows(f"{data_dir}/eval")  # one row per candidate (the generator writes per request)
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


def test_tensorboard_holds_every_step_record_of_the_metrics_log(two_rank_run):
    _, run_root = two_rank_run
    scalars = tensorboard_scalars(f"{run_root}/long")
    steps = read_run_log(f"{run_root}/long").steps
    keys = [k for k in steps[0] if k != "step"]
    assert sorted(t for t in scalars if t.startswith("train/")) == sorted(f"train/{k}" for k in keys)
    for key in keys:
        assert scalars[f"train/{key}"] == {r["step"]: as_float32(r[key]) for r in steps}, key


def test_tensorboard_holds_every_eval_cell_of_the_metrics_log_summary(two_rank_run):
    _, run_root = two_rank_run
    scalars = tensorboard_scalars(f"{run_root}/long")
    summary = read_run_log(f"{run_root}/long").summary
    metrics = ["auc", "ne", "log_loss", "calibration", "ece", "gauc", "gauc_coverage"]
    metrics += ["oracle_auc", "oracle_ne", "calibration_vs_truth"]
    expected = {}
    for row in summary["eval"]:
        cell = f"{row['surface']}/{row['task']}"
        expected.update({f"eval/{m}/{cell}": row[m] for m in metrics})
        expected[f"eval/lift/{cell}"] = oracle_lift(row)
    assert sorted(t for t in scalars if t.startswith("eval/")) == sorted(expected)
    for tag, x in expected.items():
        [(step, value)] = scalars[tag].items()
        assert step == summary["step"] and same_number(value, x), (tag, value, x)


def test_tensorboard_holds_the_summary_numbers(two_rank_run):
    _, run_root = two_rank_run
    scalars = tensorboard_scalars(f"{run_root}/long")
    summary = read_run_log(f"{run_root}/long").summary
    for key in [
        "train_examples_per_s",
        "train_seconds",
        "nonfinite_skipped",
        "fp16_fallbacks",
        "world_size",
        "global_batch",
    ]:
        assert scalars[f"summary/{key}"] == {summary["step"]: as_float32(summary[key])}, key


def test_tensorboard_text_is_the_run_metadata_file(two_rank_run):
    _, run_root = two_rank_run
    [text] = tensorboard_events(f"{run_root}/long").Tensors(f"{METADATA_TAG}/text_summary")
    fenced = text.tensor_proto.string_val[0].decode()
    assert fenced.startswith("```json\n") and fenced.endswith("\n```")
    assert json.loads(fenced[len("```json") : -len("```")]) == json.loads(
        (Path(run_root) / "long" / METADATA_FILE).read_text()
    )


def test_run_metadata_names_the_code_the_packages_and_the_world(two_rank_run):
    _, run_root = two_rank_run
    meta = json.loads((Path(run_root) / "long" / METADATA_FILE).read_text())
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    assert meta["git_commit"] == (head.stdout.strip() if head.returncode == 0 else "unknown")
    assert meta["packages"]["torch"] == torch.__version__
    assert set(meta["packages"]) == {"torch", "torchrec", "fbgemm_gpu", "torchx", "pyarrow"}
    assert "not installed" not in meta["packages"].values()
    assert (meta["world_size"], meta["device"]) == (2, "cpu")
    assert meta["config"]["train"]["run_dir"] == f"{run_root}/long"
    assert meta["hostname"] and meta["start_time"]


@pytest.mark.parametrize("rank", [0, 1])
def test_profiler_trace_spans_the_profiled_steps_on_every_rank(two_rank_run, rank):
    _, run_root = two_rank_run
    trace = json.loads(trace_path(f"{run_root}/long", *PROFILED, rank).read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {f"step {s}" for s in range(PROFILED[0], PROFILED[1] + 1)} <= names
    assert not {f"step {PROFILED[0] - 1}", f"step {PROFILED[1] + 1}"} & names
    assert len(trace["traceEvents"]) > 100  # the ops of the steps, not only the spans


def test_a_resumed_run_replaces_the_tensorboard_steps_after_its_checkpoint(two_rank_run):
    _, run_root = two_rank_run
    losses = [(e.step, e.value) for e in tensorboard_events(f"{run_root}/b").Scalars("train/loss")]
    first_run, resumed = read_losses(f"{run_root}/a"), read_losses(f"{run_root}/b")
    expected = {s: first_run[s] for s in range(1, 5)} | resumed  # a's steps 5-8 hidden (purge_step)
    assert losses == [(s, as_float32(expected[s])) for s in range(1, 9)]


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
    from pinads_rec.data.loader.contract import ContractError
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
