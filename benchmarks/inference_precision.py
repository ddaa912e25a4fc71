"""Mixed-precision benchmark: FP32 vs BF16 inference and training, side by side in one process.

    .venv/bin/python benchmarks/inference_precision.py --run runs/demo [--rows 256 1024 4096]
        [--runs fp32=/tmp/ref_run bf16=/tmp/ref_run_bf16]

1. Inference latency: the run's trained weights loaded twice (``pinads_rec.serve.load_model``), large
   layers FP32 vs BF16 (cast once), timed alternately on the same eval batches at each batch size;
   median ms per batch and the FP32/BF16 ratio. Then the same for a fresh model (weights do not
   change speed) with the run's features and the layer widths of ``--wide-config``'s model section
   (configs/prod_8gpu.yaml: Transformer d_model 128 x 2 layers, DCNv2 3 x rank 256, 8 experts of
   [1024, 512]): does BF16 pay off once the large layers are large?
2. Accuracy: the whole eval set scored in both precisions; AUC per surface x task
   (``pinads_rec.metrics``) and the difference.
3. Where the time goes: per-module forward time (forward hooks, on a ``--profile-rows`` batch) in
   both precisions -- embedding lookups, each sequence encoder's Transformer (a large layer), target
   attention, DCNv2 (large), MMoE (experts large) -- so the end-to-end ratio can be read against the
   share of time the BF16 layers take (Amdahl).
4. Training throughput: 1-rank ``DistributedModelParallel`` train steps (the trainer's
   ``shard_train_task`` and ``parallel.make_optimizer``: forward, backward with the fused embedding
   optimizer, AdamW) on train batches, timed alternately: FP32; BF16 autocast with the MATH SDPA
   backend (what modules/transformer.py picks for BF16 CPU training); BF16 with every SDPA kernel
   allowed (SDPA then runs the fused flash-attention kernel; pinned by
   ``modules.transformer.set_attention_backends``) -- which confirms or refutes that choice.
5. With ``--runs``: final eval AUC of real training runs (their metrics.jsonl, through
   ``run_log.read_run_log``), e.g. one trained with ``model.precision.train=fp32`` and one with
   ``bf16``.

2 threads by default (``--threads``). Every table gives the median of the alternating repeats and
the ratio of the fastest repeats ("best-of": the least disturbed by other processes). The machine may
be shared: before each timed measurement the script waits (up to
``--quiet-wait`` s) for other processes to go quiet, and reports as ``bg cores`` how many cores they
used on average while it measured.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable, Dict, List, Sequence

import torch
from torch import nn

from pinads_rec.data.loader.batch import Batch
from pinads_rec.data.loader.dataset import LoaderSettings, ParquetBatches
from pinads_rec.experiments.harness import CpuMeter, wait_quiet
from pinads_rec.metrics import MetricAccumulator
from pinads_rec.modules.transformer import ALL_BACKENDS, set_attention_backends

REPO = Path(__file__).resolve().parents[1]

QUIET_WAIT = 0.0  # --quiet-wait
BEST: Dict[str, float] = {}  # the last alternate()'s fastest repeat per fn (least disturbed by other processes)


def median_ms(fn, batches: Sequence[Batch]) -> float:
    started = time.perf_counter()
    for b in batches:
        fn(b)
    return 1000 * (time.perf_counter() - started) / len(batches)


def alternate(fns: Dict[str, Callable], batches: Sequence[Batch], repeats: int) -> Dict[str, float]:
    """Median ms per batch of each fn, timed in alternating order after one warm-up each; the key
    "bg cores" holds the other processes' mean load meanwhile."""
    if QUIET_WAIT:
        wait_quiet(QUIET_WAIT)
    meter = CpuMeter()
    for fn in fns.values():
        fn(batches[0])
    times = defaultdict(list)
    names = list(fns)
    for i in range(repeats):
        for name in names if i % 2 == 0 else names[::-1]:
            times[name].append(median_ms(fns[name], batches))
    out = {name: statistics.median(t) for name, t in times.items()}
    BEST.clear()
    BEST.update({name: min(t) for name, t in times.items()})
    out["bg cores"] = meter.stop()["other_cores"]
    return out


def forward(model: nn.Module):
    @torch.inference_mode()
    def run(batch: Batch) -> torch.Tensor:
        return model(batch)

    return run


def wide_models(cfg, wide_config: str) -> tuple:
    """(fp32 and bf16 fresh models with cfg's features and wide_config's model section, that config)."""
    import yaml

    from pinads_rec import config
    from pinads_rec.models import build_model
    from pinads_rec.serve.loading import prepare

    raw = config.to_dict(cfg)
    wide = yaml.safe_load(Path(wide_config).read_text())["model"]
    for section in ("sequence", "dcn", "mmoe"):
        raw["model"][section].update(wide.get(section, {}))
    wide_cfg = config.from_dict(raw)
    torch.manual_seed(0)
    fp32 = build_model(wide_cfg.features, wide_cfg.model)
    bf16 = copy.deepcopy(fp32)
    return {"fp32": prepare(fp32, "fp32"), "bf16": prepare(bf16, "bf16")}, wide_cfg


# --- 1-3: inference ---------------------------------------------------------------------------


def latency_table(
    models: Dict[str, nn.Module], cfg, eval_dir: str, rows: Sequence[int], batches: int, repeats: int
) -> List[str]:
    lines = [
        f"{'rows/batch':>10} {'fp32 ms':>9} {'bf16 ms':>9} {'fp32/bf16':>9} {'best-of ratio':>13} "
        f"{'bf16 rows/s':>12} {'bg cores':>8}"
    ]
    for n in rows:
        it = iter(ParquetBatches(eval_dir, LoaderSettings.of(cfg), shuffle=False, batch_size=n, drop_last=False))
        sample = [next(it) for _ in range(batches)]
        ms = alternate({k: forward(m) for k, m in models.items()}, sample, repeats)
        lines.append(
            f"{n:>10} {ms['fp32']:>9.1f} {ms['bf16']:>9.1f} {ms['fp32'] / ms['bf16']:>8.2f}x "
            f"{BEST['fp32'] / BEST['bf16']:>12.2f}x {1000 * n / ms['bf16']:>12,.0f} {ms['bg cores']:>8.2f}"
        )
        print(lines[-1], flush=True)
    return lines


def auc_table(models: Dict[str, nn.Module], cfg, eval_dir: str) -> tuple:
    tasks = [t.name for t in cfg.features.tasks]
    accs = {k: MetricAccumulator(tasks, cfg.features.surfaces) for k in models}
    rows = 0
    for batch in ParquetBatches(eval_dir, LoaderSettings.of(cfg), shuffle=False, batch_size=4096, drop_last=False):
        for k, m in models.items():
            probs = torch.sigmoid(forward(m)(batch).float())
            accs[k].update(probs, batch.labels, batch.surface, valid=batch.valid)
        rows += int(batch.valid.sum())
    res = {k: a.compute() for k, a in accs.items()}
    lines = [f"{'surface':<13} {'task':<11} {'n':>6} {'AUC fp32':>9} {'AUC bf16':>9} {'delta':>9}"]
    worst = 0.0
    for a, b in zip(res["fp32"], res["bf16"]):
        d = b["auc"] - a["auc"]
        worst = max(worst, abs(d))
        lines.append(
            f"{a['surface']:<13} {a['task']:<11} {a['examples']:>6} {a['auc']:>9.5f} {b['auc']:>9.5f} {d:>+9.5f}"
        )
    return lines, worst, rows


def _parts(model: nn.Module) -> Dict[str, List[nn.Module]]:
    parts: Dict[str, List[nn.Module]] = defaultdict(list)
    for name, m in model.named_modules():
        kind, leaf = type(m).__name__, name.rsplit(".", 1)[-1]
        if name in ("ebc", "user_ebc", "ec"):
            parts["embedding lookups (EBC/EC)"].append(m)
        elif leaf == "stack" and kind == "LargeLayer":
            parts["Transformer (large)"].append(m)
        elif kind == "GroupEncoder":
            parts["sequence encoders (incl. Transformer)"].append(m)
        elif kind == "TargetAttention":
            parts["target attention"].append(m)
        elif name == "cross":
            parts["DCNv2 cross (large)"].append(m)
        elif name == "mmoe":
            parts["MMoE (experts large)"].append(m)
        elif name in ("dense_norm", "calibration"):
            parts["dense norm + calibration"].append(m)
    return parts


def module_times(models: Dict[str, nn.Module], batch: Batch, repeats: int) -> Dict[str, Dict[str, float]]:
    """Median ms per named part of the forward (forward hooks), the models timed alternately; the
    rest of the total is glue (concatenation, gathers, the broadcast index_select)."""
    samples = {k: defaultdict(list) for k in models}
    for model in models.values():
        model._bench_spent, model._bench_starts = defaultdict(float), {}
        for part, mods in _parts(model).items():
            for m in mods:
                m.register_forward_pre_hook(
                    lambda mod, a, model=model: model._bench_starts.__setitem__(id(mod), time.perf_counter())
                )
                m.register_forward_hook(
                    lambda mod, a, out, part=part, model=model: model._bench_spent.__setitem__(
                        part, model._bench_spent[part] + time.perf_counter() - model._bench_starts[id(mod)]
                    )
                )
        forward(model)(batch)
    if QUIET_WAIT:
        wait_quiet(QUIET_WAIT)
    names = list(models)
    for i in range(repeats):
        for k in names if i % 2 == 0 else names[::-1]:
            model = models[k]
            model._bench_spent.clear()
            t = time.perf_counter()
            forward(model)(batch)
            samples[k]["total forward"].append(1000 * (time.perf_counter() - t))
            for part, v in model._bench_spent.items():
                samples[k][part].append(1000 * v)
    return {k: {part: statistics.median(v) for part, v in parts.items()} for k, parts in samples.items()}


OP_GROUPS = [  # (group, substrings of aten/fbgemm op names), first match wins
    ("matmul (addmm/mm/bmm)", ("addmm", "aten::mm", "bmm", "baddbmm", "matmul")),
    ("attention kernel (SDPA)", ("scaled_dot_product", "flash_attention")),
    ("layer norm", ("layer_norm",)),
    ("dtype casts / copies", ("copy_", "aten::to", "_to_copy")),
    ("concat / gather / jagged", ("cat", "index_select", "gather", "jagged", "take", "stack")),
    ("embedding lookups", ("embedding",)),
    (
        "elementwise / softmax",
        (
            "add",
            "mul",
            "gelu",
            "relu",
            "clamp",
            "softmax",
            "sigmoid",
            "div",
            "sub",
            "where",
            "masked_fill",
            "exp",
            "log",
            "sum",
            "mean",
        ),
    ),
]


def op_times(models: Dict[str, nn.Module], batch: Batch, repeats: int) -> Dict[str, Dict[str, float]]:
    """Self CPU ms per forward by operator group (torch.profiler), to show which work BF16 speeds up."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for k, model in models.items():
        run = forward(model)
        run(batch)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(repeats):
                run(batch)
        groups: Dict[str, float] = defaultdict(float)
        for e in prof.key_averages():
            if not (e.key.startswith("aten::") or e.key.startswith("fbgemm::")):
                continue
            group = next((g for g, keys in OP_GROUPS if any(x in e.key for x in keys)), "other ops")
            groups[group] += e.self_cpu_time_total / 1000 / repeats
        groups["all ops"] = sum(groups.values())
        out[k] = dict(groups)
    return out


# --- 4: training --------------------------------------------------------------------------------


def training_steps(cfg, train_dir: str, rows: int, batches: int, repeats: int) -> Dict[str, float]:
    import dataclasses

    from pinads_rec import parallel
    from pinads_rec.training.task import shard_train_task

    env = parallel.init_distributed()
    sample = []
    for b in ParquetBatches(train_dir, LoaderSettings.of(cfg), shuffle=False, batch_size=rows):
        sample.append(b)
        if len(sample) == batches:
            break
    # (train precision, the SDPA kernels allowed; None: the Transformer's automatic choice)
    variants = {
        "fp32": ("fp32", None),
        "bf16 (MATH SDPA, as shipped)": ("bf16", None),
        "bf16 (default SDPA: flash)": ("bf16", ALL_BACKENDS),
    }
    steps = {}
    for name, (precision, backends) in variants.items():
        c = dataclasses.replace(
            cfg,
            model=dataclasses.replace(cfg.model, precision=dataclasses.replace(cfg.model.precision, train=precision)),
        )
        dmp = shard_train_task(c, env)
        set_attention_backends(dmp, backends)
        optimizer, _ = parallel.make_optimizer(dmp, c.train, total_steps=1000)
        dmp.train()

        def step(batch, dmp=dmp, optimizer=optimizer):
            loss, _ = dmp(batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        steps[name] = step
    ms = alternate(steps, sample, repeats)
    busy = ms.pop("bg cores")
    out = {k: (1000 * rows / v, 1000 * rows / BEST[k]) for k, v in ms.items()}
    out["bg cores"] = busy
    return out


def transformer_micro(cfg, repeats: int, users: int = 512) -> Dict[str, float]:
    """Forward+backward ms of one sequence group's Transformer stack alone ([users, 1 + L, d])."""
    from torch.nn.attention import SDPBackend

    from pinads_rec.modules.transformer import TransformerStack

    g = cfg.features.sequence_groups[0]
    d = cfg.model.sequence.d_model
    enc = cfg.model.sequence
    stack = TransformerStack(d, enc.num_layers, enc.num_heads, enc.ffn_dim, enc.dropout).train()
    x = torch.randn(users, g.max_length + 1, d, requires_grad=True)
    lengths = torch.randint(1, g.max_length + 1, (users,))
    mask = torch.cat(
        [torch.ones(users, 1, dtype=torch.bool), torch.arange(g.max_length)[None, :] < lengths[:, None]], dim=1
    )

    def run(dtype, backends):
        def f(_):
            set_attention_backends(stack, backends)  # the variants share the stack's weights
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
                y = stack(x, mask)
            y.float().sum().backward()

        return f

    fns = {
        "fp32": run("fp32", None),
        "bf16 MATH": run("bf16", [SDPBackend.MATH]),
        "bf16 flash": run("bf16", ALL_BACKENDS),
    }
    return alternate(fns, [None], repeats)


def run_aucs(runs: Dict[str, str]) -> List[str]:
    """AUC per surface x task of finished runs (their run directories), side by side."""
    from pinads_rec.training.run_log import read_run_log

    evals = {}
    for name, path in runs.items():
        evals[name] = read_run_log(path).summary
        if evals[name] is None:
            raise SystemExit(f"{path}: no summary in its metrics.jsonl (a finished train.py run writes one)")
    names = list(runs)
    head = f"{'surface':<13} {'task':<11} " + " ".join(f"{'AUC ' + n:>11}" for n in names)
    if len(names) == 2:
        head += f" {'delta':>9}"
    lines = [head]
    base = evals[names[0]]["eval"]
    for i, row in enumerate(base):
        vals = [evals[n]["eval"][i]["auc"] for n in names]
        line = f"{row['surface']:<13} {row['task']:<11} " + " ".join(f"{v:>11.5f}" for v in vals)
        if len(names) == 2:
            line += f" {vals[1] - vals[0]:>+9.5f}"
        lines.append(line)
    lines.append(
        "train examples/s (whole run, as logged): "
        + ", ".join(f"{n} {evals[n]['train_examples_per_s']:,.0f}" for n in names)
    )
    return lines


def main(argv=None) -> int:
    from pinads_rec.serve.loading import find_checkpoint, load_model, run_config

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", default="runs/demo", help="a trained run (train.run_dir)")
    p.add_argument("--data", default=None, help="eval data (default: the run's data.eval_dir)")
    p.add_argument("--train-data", default=None, help="train data for the training steps (default: data.train_dir)")
    p.add_argument("--rows", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--batches", type=int, default=3, help="distinct batches per latency measurement")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--profile-rows", type=int, default=4096)
    p.add_argument("--train-rows", type=int, default=None, help="rows per training step (default: data.batch_size)")
    p.add_argument("--train-repeats", type=int, default=5)
    p.add_argument("--skip", nargs="*", default=[], choices=["latency", "auc", "profile", "train", "micro"])
    p.add_argument(
        "--wide-config",
        default=str(REPO / "configs/prod_8gpu.yaml"),
        help="config whose model section sizes the wide-layer latency check ('' to skip)",
    )
    p.add_argument(
        "--runs",
        nargs="*",
        default=[],
        metavar="NAME=RUN_DIR",
        help="finished training runs whose final eval AUCs to compare (e.g. fp32=... bf16=...)",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=120.0,
        help="seconds to wait, before each timed measurement, for other processes to go quiet",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    global QUIET_WAIT
    QUIET_WAIT = args.quiet_wait

    from pinads_rec.serve.batching import unbounded_users

    # Batches of exactly --rows real rows: no unique-user bound closing them early and padding them
    # (serving batches files the same way, pinads_rec.serve.batching.unbounded_users).
    run_cfg = run_config(args.run, find_checkpoint(args.run))
    cfg = unbounded_users(run_cfg)
    eval_dir = args.data or cfg.data.eval_dir
    models = {k: load_model(args.run, k)[0] for k in ("fp32", "bf16")}
    print(
        f"run {args.run} ({find_checkpoint(args.run).name}), eval {eval_dir}, {args.threads} threads, "
        f"median of {args.repeats} alternating repeats\n",
        flush=True,
    )
    report = []
    if "latency" not in args.skip:
        print("1. inference latency, large layers FP32 vs BF16 (weights cast once)", flush=True)
        report += ["1. inference latency"] + latency_table(models, cfg, eval_dir, args.rows, args.batches, args.repeats)
        if args.wide_config:
            wide, wide_cfg = wide_models(cfg, args.wide_config)
            m = wide_cfg.model
            title = (
                f"1b. inference latency, fresh model with {args.wide_config}'s layer widths (Transformer "
                f"d_model {m.sequence.d_model} x {m.sequence.num_layers}, ffn {m.sequence.ffn_dim}; DCNv2 "
                f"{m.dcn.num_layers} x rank {m.dcn.low_rank}; {m.mmoe.num_experts} experts {m.mmoe.expert_dims})"
            )
            print(title, flush=True)
            report += [title] + latency_table(wide, wide_cfg, eval_dir, args.rows, args.batches, args.repeats)
            del wide
    if "auc" not in args.skip:
        lines, worst, n = auc_table(models, cfg, eval_dir)
        report += [f"\n2. eval AUC, {n:,} rows, FP32 vs BF16 inference"] + lines
        report.append(f"max |delta AUC| = {worst:.5f} ({'within' if worst <= 0.001 else 'OUTSIDE'} 0.001)")
        print("\n".join(report[-len(lines) - 2 :]), flush=True)
    if "profile" not in args.skip:
        batch = next(
            iter(ParquetBatches(eval_dir, LoaderSettings.of(cfg), shuffle=False, batch_size=args.profile_rows))
        )
        t = module_times(models, batch, args.repeats)
        lines = [
            f"{'part of the forward (median ms)':<40} {'fp32 ms':>8} {'bf16 ms':>8} {'fp32/bf16':>9} {'fp32 share':>10}"
        ]
        for part in sorted(t["fp32"], key=lambda k: (k == "total forward", -t["fp32"][k])):
            a, b = t["fp32"][part], t["bf16"].get(part, float("nan"))
            lines.append(f"{part:<40} {a:>8.1f} {b:>8.1f} {a / b:>8.2f}x {a / t['fp32']['total forward']:>9.0%}")
        ops = op_times(models, batch, args.repeats)
        lines += [
            "",
            f"{'operator group (self CPU ms/forward)':<40} {'fp32 ms':>8} {'bf16 ms':>8} "
            f"{'fp32/bf16':>9} {'fp32 share':>10}",
        ]
        for group in sorted(ops["fp32"], key=lambda k: (k == "all ops", -ops["fp32"][k])):
            a, b = ops["fp32"][group], ops["bf16"].get(group, 0.0)
            lines.append(
                f"{group:<40} {a:>8.1f} {b:>8.1f} {a / b if b else float('inf'):>8.2f}x "
                f"{a / ops['fp32']['all ops']:>9.0%}"
            )
        report += [
            f"\n3. where the time goes ({args.profile_rows}-row batch, {batch.num_requests} requests; "
            "Transformer time is inside the sequence encoders)"
        ] + lines
        print("\n".join(report[-len(lines) - 1 :]), flush=True)
    if "train" not in args.skip:
        rows = args.train_rows or cfg.data.batch_size
        rates = training_steps(run_cfg, args.train_data or cfg.data.train_dir, rows, args.batches, args.train_repeats)
        busy = rates.pop("bg cores")
        lines = [f"{'training step (1-rank DMP)':<32} {'examples/s':>11} {'vs fp32':>8} {'best-of vs fp32':>15}"]
        for k, (v, best) in rates.items():
            lines.append(f"{k:<32} {v:>11,.0f} {v / rates['fp32'][0]:>7.2f}x {best / rates['fp32'][1]:>14.2f}x")
        report += [f"\n4. training throughput, {rows}-row batches (bg cores {busy:.2f})"] + lines
        print("\n".join(report[-len(lines) - 1 :]), flush=True)
    if "micro" not in args.skip:
        ms = transformer_micro(cfg, args.repeats)
        busy = ms.pop("bg cores")
        g = cfg.features.sequence_groups[0]
        best = dict(BEST)
        lines = [f"{'Transformer fwd+bwd':<20} {'ms':>8} {'vs fp32':>8} {'best-of vs fp32':>15}"]
        for k, v in ms.items():
            lines.append(f"{k:<20} {v:>8.1f} {ms['fp32'] / v:>7.2f}x {best['fp32'] / best[k]:>14.2f}x")
        report += [
            f"\n   SDPA backend micro-benchmark: group {g.name!r} Transformer alone, 512 users x "
            f"{g.max_length + 1} tokens (bg cores {busy:.2f})"
        ] + lines
        print("\n".join(report[-len(lines) - 1 :]), flush=True)
    if args.runs:
        runs = dict(r.split("=", 1) for r in args.runs)
        lines = run_aucs(runs)
        report += ["\n5. final eval AUC of real training runs"] + lines
        print("\n".join(report[-len(lines) - 1 :]), flush=True)
    print("\n" + "=" * 80 + "\n" + "\n".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
