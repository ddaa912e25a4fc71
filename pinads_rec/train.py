"""Train the unified ranker: the script torchrun / TorchX launch on every rank.

    torchx run dist.ddp -j 1x2 --script pinads_rec/train.py -- --config configs/demo.yaml
    python -m pinads_rec.train --config configs/demo.yaml --set train.max_steps=100   # one process

Planner + DistributedModelParallel shard the embedding collections, ``TrainPipelineSparseDist``
overlaps the next batch's copy and input all-to-all with the current step, an eval pass reports
AUC / NE / log loss / calibration per surface x per task (with the oracle when the data has it), and
``torch.distributed.checkpoint`` saves and resumes the run. At the end the calibration layers are fit
on a calibration split (data.calibration_dir) or held-out training rows (data.calibration_holdout)
with the backbone frozen.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from tqdm import tqdm

# Launched as a script (torchx --script pinads_rec/train.py) outside the project's venv, the repo
# root is not on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pinads_rec import checkpoint, config, parallel  # noqa: E402
from pinads_rec.data.batch import Batch  # noqa: E402
from pinads_rec.data.contract import ContractError  # noqa: E402
from pinads_rec.data.dataset import LoaderSettings, ParquetBatches, make_loader  # noqa: E402
from pinads_rec.evaluate import MetricAccumulator, format_table  # noqa: E402
from pinads_rec.models import build_model  # noqa: E402
from pinads_rec.models.train_task import NonFiniteError, NonFiniteGuard, TrainTask, guard_gradients  # noqa: E402
from pinads_rec.modules.calibration import Calibration  # noqa: E402
from pinads_rec.modules.precision import PrecisionOverflow, fallback_count, set_precision  # noqa: E402

log = logging.getLogger("pinads_rec.train")
DEFAULT_CONFIG = "configs/demo.yaml"


class EndTogether:
    """Stops every rank's iteration at the same step: one rank running out of batches ends the
    epoch for all, instead of leaving the others blocked in a collective."""

    def __init__(self, batches: Iterator[Batch], group: Optional[dist.ProcessGroup]):
        self.batches, self.group = batches, group

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        batch = next(self.batches, None)
        flag = torch.tensor([0 if batch is None else 1])
        if self.group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        if not flag.item():
            raise StopIteration
        return batch


def pipelined_module_names(dmp, pipeline) -> List[str]:
    """Sharded modules whose input distribution the pipeline really overlaps (it silently skips
    modules whose inputs it cannot trace back to the batch)."""
    chosen = {id(m) for m in pipeline._pipelined_modules}
    return [name for name, m in dmp.named_modules() if id(m) in chosen]


def build(
    cfg: config.ExperimentConfig, env: parallel.Distributed, plan=None, group: Optional[dist.ProcessGroup] = None
):
    """The sharded train task; ``group`` (gloo) lets the non-finite guard's ranks agree."""
    torch.manual_seed(cfg.train.seed)
    # Embedding tables are created on the meta device: DMP allocates each rank's shards only.
    model = build_model(cfg.features, cfg.model, device=torch.device("meta"))
    set_precision(model, cfg.model.precision.train, fp16_overflow=cfg.model.precision.fp16_overflow)
    guard = NonFiniteGuard([t.name for t in cfg.features.tasks], cfg.train.nonfinite, group)
    return parallel.shard(TrainTask(model, guard), cfg, env, plan)


def guard_of(dmp) -> NonFiniteGuard:
    return next(m for m in dmp.modules() if isinstance(m, NonFiniteGuard))


def scoring_pass(
    dmp, env: parallel.Distributed, group, loader, what: str, spare: Optional[Batch] = None
) -> Iterator[Tuple[Batch, torch.Tensor]]:
    """Yields (batch, logits [B, T] on CPU) over one no-grad pass of ``loader``. Ranks that run out
    early replay their last batch (or ``spare``, when they had none) with every row marked invalid,
    so every rank takes part in every sharded forward; use ``batch.valid``."""
    batches, last = iter(loader), spare
    dmp.eval()
    try:
        with torch.no_grad():
            while True:
                batch = next(batches, None)
                flag = torch.tensor([0 if batch is None else 1])
                if group is not None:
                    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
                if not flag.item():
                    break
                if batch is None:
                    if last is None:
                        raise ContractError(
                            f"rank {env.rank} got no {what} rows: fewer row groups than the {env.world_size} ranks"
                        )
                    batch = dataclasses.replace(last, valid=torch.zeros_like(last.valid))
                last = batch
                _, (_, logits, _) = dmp(batch.to(env.device))
                yield batch, logits.float().cpu()
    finally:
        dmp.train()


def evaluate(dmp, cfg: config.ExperimentConfig, env: parallel.Distributed, group) -> List[dict]:
    """AUC / NE / calibration per surface x task over the eval files, gathered over the ranks."""
    tasks = [t.name for t in cfg.features.tasks]
    has_oracle = all(t.true_probability_column for t in cfg.features.tasks)
    acc = MetricAccumulator(tasks, cfg.features.surfaces, has_oracle)
    loader = make_loader(cfg.data.eval_dir, LoaderSettings.of(cfg), env.rank, env.world_size, shuffle=False)
    for batch, logits in scoring_pass(dmp, env, group, loader, f"eval ({cfg.data.eval_dir})"):
        acc.update(torch.sigmoid(logits), batch.labels, batch.surface, batch.true_probs, valid=batch.valid)
    return acc.compute()


def calibrate(dmp, cfg: config.ExperimentConfig, env: parallel.Distributed, group) -> None:
    """Fits the calibration layers on the backbone's logits over the calibration split
    (data.calibration_dir) or the held-out training rows (data.calibration_holdout), gathered from
    every rank so all ranks fit the same maps."""
    layer = next(m for m in dmp.modules() if isinstance(m, Calibration))
    if layer.mode == "none":
        return
    layer.reset()  # identity: the pass below sees the raw logits
    settings = LoaderSettings.of(cfg)
    if cfg.data.calibration_dir:
        loader = make_loader(cfg.data.calibration_dir, settings, env.rank, env.world_size, shuffle=False)
    else:
        loader = make_loader(cfg.data.train_dir, settings, env.rank, env.world_size, shuffle=False, part="holdout")
    # The split may have fewer row groups than there are ranks: those without one replay a
    # (masked) training batch in the collective forwards.
    train_part = ParquetBatches(
        cfg.data.train_dir, settings, env.rank, env.world_size, shuffle=False, drop_last=False, part="train"
    )
    spare = next(iter(train_part))
    parts = [
        torch.cat([logits, batch.labels, batch.surface.unsqueeze(1).float()], dim=1)[batch.valid]
        for batch, logits in scoring_pass(dmp, env, group, loader, "calibration", spare)
    ]
    rows = torch.cat(parts)
    if group is not None:
        gathered = [None] * env.world_size
        dist.all_gather_object(gathered, rows, group=group)
        rows = torch.cat(gathered)
    T = len(cfg.features.tasks)
    layer.fit(rows[:, :T], rows[:, T : 2 * T], rows[:, 2 * T].long())
    if env.is_main:
        log.info(
            "calibration (%s) fit on %d unseen rows: scale %s, bias %s",
            layer.mode,
            rows.shape[0],
            [[round(v, 3) for v in r] for r in layer.scale.tolist()],
            [[round(v, 3) for v in r] for r in layer.bias.tolist()],
        )


def train(cfg: config.ExperimentConfig, env: parallel.Distributed) -> dict:
    run_dir = Path(cfg.train.run_dir)
    data_group = dist.new_group(backend="gloo") if env.world_size > 1 else None
    latest = checkpoint.latest(run_dir)
    if latest is not None:
        checkpoint.check_compatible(latest, cfg)
        if cfg.train.plan_file is None:
            # Same sharding types and kernels as the checkpoint: its optimizer state then loads even
            # on another world size (TorchRec cannot reshard optimizer state across sharding types).
            cfg = dataclasses.replace(
                cfg, train=dataclasses.replace(cfg.train, plan_file=str(latest / checkpoint.PLAN_FILE))
            )
    dmp = build(cfg, env, group=data_group)
    guard = guard_of(dmp)
    settings = LoaderSettings.of(cfg)
    pin_memory = env.device.type == "cuda"
    loader = make_loader(
        cfg.data.train_dir, settings, env.rank, env.world_size, shuffle=True, pin_memory=pin_memory, part="train"
    )
    dataset = loader.dataset
    for later in (cfg.data.eval_dir, cfg.data.calibration_dir):  # their errors before training, not after it
        if later:
            ParquetBatches(later, settings, env.rank, env.world_size, shuffle=False)
    steps_per_epoch = max(dataset.num_rows // (cfg.data.batch_size * env.world_size), 1)
    total_steps = cfg.train.max_steps or cfg.train.epochs * steps_per_epoch
    optimizer, schedule = parallel.make_optimizer(dmp, cfg.train, total_steps)
    guard_gradients(schedule.optimizer._optimizer, cfg.train.nonfinite, guard)  # the dense AdamW

    state = checkpoint.TrainState(world_size=env.world_size)
    if latest is not None:
        state = checkpoint.load(latest, dmp, optimizer, schedule)
        if state.world_size != env.world_size:
            # Row groups are dealt to ranks by world size: the same global position is the best
            # resume point there is (exact only when the world size is unchanged).
            state.batches_in_epoch = state.batches_in_epoch * state.world_size // env.world_size
            state.world_size = env.world_size
        if env.is_main:
            log.info("resumed from %s (step %d, epoch %d)", latest, state.step, state.epoch)

    pipeline = TrainPipelineSparseDist(dmp, optimizer, env.device, execute_all_batches=True)
    metrics_log = run_dir / "metrics.jsonl"
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(config.to_dict(cfg), indent=1))
    bar = tqdm(
        total=total_steps,
        initial=state.step,
        disable=not env.is_main,
        unit="step",
        mininterval=1.0 if sys.stderr.isatty() else 15.0,
        dynamic_ncols=True,
    )
    global_batch = cfg.data.batch_size * env.world_size
    begun, started = time.perf_counter(), None
    examples, window_loss, window_n, logit_abs_max = 0, 0.0, 0, 0.0
    pipelined = None

    done = bool(cfg.train.max_steps) and state.step >= cfg.train.max_steps
    for epoch in range(state.epoch, cfg.train.epochs):
        if done:
            break
        dataset.set_epoch(epoch)
        batches = iter(loader)
        for _ in range(state.batches_in_epoch):  # resume at the same place in the epoch
            next(batches)
        it = EndTogether(batches, data_group)
        while True:
            try:
                loss, logits, labels = pipeline.progress(it)
            except StopIteration:
                break
            except NonFiniteError as e:
                raise NonFiniteError(f"step {state.step + 1}, epoch {epoch}: {e}") from None
            if pipelined is None:
                pipelined = pipelined_module_names(dmp, pipeline)
                if env.is_main:
                    log.info("TrainPipelineSparseDist pipelines %s", pipelined or "NOTHING (model not traceable)")
            schedule.step()
            state.step += 1
            state.batches_in_epoch += 1
            if started is None:
                # Rates leave the first step out: it starts the loader's workers and traces the
                # pipeline, seconds that would dominate a short run's examples/s.
                started = time.perf_counter()
            else:
                examples += labels.shape[0] * env.world_size
            window_loss += float(loss)
            window_n += 1
            logit_abs_max = max(logit_abs_max, float(logits.abs().max()))
            bar.update(1)
            if state.step % cfg.train.log_every == 0:
                rate = examples / (time.perf_counter() - started) if examples else 0.0
                record = {
                    "step": state.step,
                    "epoch": epoch,
                    "loss": window_loss / window_n,
                    "logit_abs_max": logit_abs_max,
                    "nonfinite_skipped": guard.skipped,
                    "fp16_fallbacks": fallback_count(dmp),
                    "lr": schedule.get_last_lr()[0],
                    "examples_per_s": rate,
                }
                bar.set_postfix(loss=f"{record['loss']:.4f}", ex_s=f"{rate:,.0f}")
                if env.is_main:
                    with metrics_log.open("a") as f:
                        f.write(json.dumps(record) + "\n")
                window_loss, window_n, logit_abs_max = 0.0, 0, 0.0
            if cfg.train.checkpoint_every and state.step % cfg.train.checkpoint_every == 0:
                checkpoint.save(run_dir, state, dmp, optimizer, schedule, cfg)
            if cfg.train.max_steps and state.step >= cfg.train.max_steps:
                done = True
                break
        if not done:
            state.epoch, state.batches_in_epoch = epoch + 1, 0
    bar.close()
    now = time.perf_counter()
    elapsed = now - begun
    throughput = examples / (now - started) if examples else 0.0

    pipeline.detach()
    calibrate(dmp, cfg, env, data_group)
    checkpoint.save(run_dir, state, dmp, optimizer, schedule, cfg)
    rows = evaluate(dmp, cfg, env, data_group)
    summary = {
        "step": state.step,
        "train_examples_per_s": throughput,
        "train_seconds": elapsed,
        "pipelined_modules": pipelined or [],
        "nonfinite_skipped": guard.skipped,
        "fp16_fallbacks": fallback_count(dmp),
        "world_size": env.world_size,
        "global_batch": global_batch,
        "eval": rows,
    }
    if env.is_main:
        print(f"\ntrained {state.step} steps on {env.world_size} rank(s): {throughput:,.0f} examples/s")
        print(format_table(rows))
        with metrics_log.open("a") as f:
            f.write(json.dumps(summary, default=float) + "\n")
    return summary


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config_path", nargs="?", help=argparse.SUPPRESS)
    p.add_argument("--config", default=None, help=f"experiment YAML (default {DEFAULT_CONFIG})")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any config field, e.g. --set train.max_steps=100 (repeatable)",
    )
    args = p.parse_args(argv)
    args.config = (
        args.config
        or (args.config_path if args.config_path and args.config_path.endswith((".yaml", ".yml")) else None)
        or DEFAULT_CONFIG
    )
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    # force: importing torchrec already configured the root logger. Libraries stay at WARNING (fbgemm
    # logs every table's arguments at INFO); the project's own messages at INFO.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s", force=True)
    logging.getLogger("pinads_rec").setLevel(logging.INFO)
    try:
        cfg = config.load(args.config, args.overrides)
    except config.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    env = parallel.init_distributed()
    try:
        train(cfg, env)
    except (ContractError, checkpoint.IncompatibleCheckpoint, NonFiniteError, PrecisionOverflow) as e:
        # A DataLoader worker's error arrives wrapped with its traceback; the user needs the last line.
        message = str(e).strip().splitlines()[-1]
        kind = {ContractError: "data error", checkpoint.IncompatibleCheckpoint: "checkpoint error"}.get(
            type(e), "numerics error"
        )
        print(f"[rank {env.rank}] {kind}: {message}", file=sys.stderr, flush=True)
        # Exit at once: the launcher then stops the other ranks instead of leaving them in a collective.
        os._exit(2)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
