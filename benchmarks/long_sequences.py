"""Long pins histories: what each sequence architecture costs as the history cap grows.

    python benchmarks/long_sequences.py [--config configs/demo.yaml] [--data DIR]
        [--caps 100 500 1000 4000] [--variants padded unpadded retrieval hstu] [--steps 20]
        [--warmup 5] [--ranks 1] [--skip-padded-above 1000] [--arch-units 16] [--arch-repeats 3]
        [--out runs/long_sequences]

Two parts, in one run on the same data:

(a) Training examples/s through the real trainer (``train.py``'s loop: ``Trainer.train_step`` of
    the trainer ``harness.measured_trainer`` builds, timed by ``train_throughput.measure_pipeline``
    on ``--ranks`` gloo processes of one thread each) at each pins cap
    (``features.sequence_groups.pins.max_length``) for each variant of the pins group's encoder
    (``VARIANTS``, those of configs/ablations/long_sequences.yaml): the padded Transformer (every
    request padded to the cap), the unpadded Transformer (length buckets), retrieval (the newest 100
    events through the Transformer, target-aware retrieval from the whole capped history) and HSTU.
    Printed: examples/s per cap and the ratio examples/s(cap 1000) / examples/s(cap 100) per
    variant (near-linear cost keeps it >= 1/3 for retrieval and the unpadded Transformer; the padded
    one is shown for contrast). The padded Transformer above ``--skip-padded-above`` (default 1000)
    is left out: quadratic in the padded length, it takes minutes a step at 4000 on one core.
    The data: ``--data`` (a directory holding train/), else the config's synthetic data with
    ``synth.long_history`` on (histories log-normal, median ~200, p90 ~1,500, max 4,000),
    generated once into ``data/long_sequences-bench`` (``pinads_rec.data.synth.ensure``).

(b) The sequence arch alone: ``TransformerStack`` (the Transformer encoder's layers, the demo's
    width 32, 2 layers, 2 heads) forward + backward on random events, ``--arch-units`` requests
    whose lengths are drawn from the same log-normal (median 200, p90 1,500, clipped to 4,000) and
    capped, one thread: padded to the cap vs length-bucketed (``modules.length_buckets.run_by_length``),
    the best of ``--arch-repeats``; the outputs at real positions must agree to 1e-5 (the script
    fails otherwise).

(c) Self-attention alone (SDPA, 2 heads of 16, forward + backward, one thread) over the same
    requests: padded to the cap with a key mask, per length bucket, and as torch nested jagged
    tensors (``layout=torch.jagged``: one SDPA call over the ragged batch, no padding at all).
    fbgemm has no fused jagged attention on CPU, so nested tensors stand for the jagged path. The
    outputs must agree to 1e-5.

Output: the tables on stdout and ``long_sequences.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

# A sibling script: ``python benchmarks/long_sequences.py`` puts benchmarks/ on sys.path.
from train_throughput import measure_pipeline

from pinads_rec import config
from pinads_rec.data import synth
from pinads_rec.experiments import harness

REPO = Path(__file__).resolve().parents[1]

PINS = "model.sequence_groups.pins"
VARIANTS: Dict[str, List[str]] = {
    "padded": [],
    "unpadded": [f"{PINS}.padding=buckets"],
    "retrieval": [f"{PINS}.encoders=[transformer, retrieval]", f"{PINS}.window=100", f"{PINS}.padding=buckets"],
    "hstu": [f"{PINS}.encoders=[hstu]", f"{PINS}.padding=buckets"],
}
LABELS = {
    "padded": "padded Transformer",
    "unpadded": "unpadded Transformer",
    "retrieval": "retrieval",
    "hstu": "HSTU",
}
LONG_HISTORY = ["synth.long_history.enabled=true"]
DATA = "data/long_sequences-bench"


def cap_override(cap: int) -> str:
    return f"features.sequence_groups.pins.max_length={cap}"


def window_fits(variant: str, cap: int) -> bool:
    """Retrieval reads the newest 100 events through the Transformer: a cap below that has no window."""
    return variant != "retrieval" or cap >= 100


def train_rates(args, common: List[str], out: Path) -> List[dict]:
    rows = []
    for variant in args.variants:
        for cap in args.caps:
            if variant == "padded" and cap > args.skip_padded_above:
                print(f"  {LABELS[variant]:<22} cap {cap:>5}: skipped (--skip-padded-above {args.skip_padded_above})")
                continue
            if not window_fits(variant, cap):
                continue
            overrides = common + [cap_override(cap)] + VARIANTS[variant]
            cfg = config.load(args.config, overrides)
            per_rank = harness.rank_results(
                measure_pipeline,
                args.ranks,
                out / "runs" / f"{variant}-{cap}",
                cfg,
                args.warmup,
                args.steps,
                0,  # loader in the rank: one core each, as many ranks as cores
                timeout_s=args.timeout,
            )
            wall = max(r["wall_s"] for r in per_rank)
            valid = sum(r["valid_rows_per_step"] for r in per_rank)
            row = {
                "variant": variant,
                "cap": cap,
                "ranks": args.ranks,
                "steps": args.steps,
                "step_ms": 1000.0 * wall / args.steps,
                "examples_per_s": valid * args.steps / wall,
            }
            rows.append(row)
            print(
                f"  {LABELS[variant]:<22} cap {cap:>5}: {row['examples_per_s']:>8,.0f} examples/s  "
                f"step {row['step_ms']:8.1f} ms",
                flush=True,
            )
    return rows


def rate_table(rows: List[dict], caps: List[int], variants: List[str]) -> List[str]:
    def rate(v, c):
        return next((r["examples_per_s"] for r in rows if (r["variant"], r["cap"]) == (v, c)), None)

    head = f"| {'variant':<22} | " + " | ".join(f"{'cap ' + str(c):>9}" for c in caps) + " | 1000 / 100 |"
    lines = [head, "|" + "-" * 24 + "|" + "|".join("-" * 10 + ":" for _ in caps) + "|" + "-" * 11 + ":|"]
    for v in variants:
        cells = [f"{rate(v, c):>9,.0f}" if rate(v, c) else f"{'-':>9}" for c in caps]
        lo, hi = rate(v, 100), rate(v, 1000)
        ratio = f"{hi / lo:>10.2f}" if lo and hi else f"{'-':>10}"
        lines.append(f"| {LABELS[v]:<22} | " + " | ".join(cells) + f" | {ratio} |")
    return lines


def history_lengths(n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` lengths from the synthetic histories' distribution (synth.long_history's defaults:
    log-normal, median 200, p90 1,500, at most 4,000)."""
    return synth.history_lengths(config.LongHistoryConfig(), rng.standard_normal(n))


def best_times(step, hows: Sequence[str], repeats: int) -> Tuple[Dict[str, torch.Tensor], Dict[str, float]]:
    """``step(how)`` once per ``how`` (warm-up; its output kept for the comparison), then ``repeats``
    interleaved rounds (a busy moment hits every ``how``): outputs and the best seconds per ``how``."""
    outputs = {how: step(how) for how in hows}
    best = {how: float("inf") for how in hows}
    for _ in range(repeats):
        for how in hows:
            t = time.perf_counter()
            step(how)
            best[how] = min(best[how], time.perf_counter() - t)
    return outputs, best


def arch_times(caps: List[int], units: int, repeats: int, seed: int = 0) -> List[dict]:
    """(b): the Transformer's layers forward + backward, padded to the cap vs length-bucketed."""
    from pinads_rec.modules.length_buckets import run_by_length
    from pinads_rec.modules.transformer import TransformerStack

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(seed)
        stack = TransformerStack(d_model=32, num_layers=2, num_heads=2, ffn_dim=128, dropout=0.0)
        drawn = history_lengths(units, np.random.default_rng(seed))  # the same requests at each cap
        rows = []
        for cap in caps:
            lengths = torch.from_numpy(np.minimum(drawn, cap))
            mask = torch.arange(cap)[None, :] < lengths[:, None]
            x = torch.randn(units, cap, 32) * mask[..., None]

            def step(how: str, x=x, mask=mask):
                stack.zero_grad()
                xi = x.clone().requires_grad_(True)
                y = stack(xi, mask) if how == "padded" else run_by_length(stack, xi, mask)
                y = y * mask[..., None]
                y.sum().backward()
                return y.detach()

            outputs, best = best_times(step, ("padded", "buckets"), repeats)
            diff = float((outputs["padded"] - outputs["buckets"]).abs().max())
            row = {
                "cap": cap,
                "units": units,
                "mean_length": float(lengths.float().mean()),
                "padded_ms": 1000.0 * best["padded"],
                "buckets_ms": 1000.0 * best["buckets"],
                "max_abs_diff": diff,
            }
            rows.append(row)
            print(
                f"  cap {cap:>5} (mean length {row['mean_length']:7.1f}): padded {row['padded_ms']:9.1f} ms, "
                f"buckets {row['buckets_ms']:8.1f} ms, padded / buckets "
                f"{row['padded_ms'] / row['buckets_ms']:6.2f}x, max |diff| {diff:.1e}",
                flush=True,
            )
            if not diff <= 1e-5:
                raise AssertionError(f"cap {cap}: padded and bucketed outputs differ by {diff:.3g} (> 1e-5)")
        return rows
    finally:
        torch.set_num_threads(threads)


def attention_times(caps: List[int], units: int, repeats: int, seed: int = 0) -> List[dict]:
    """(c): self-attention alone (SDPA, 2 heads of 16, forward + backward) over the same requests:
    padded to the cap with a key mask, per length bucket, and as torch nested jagged tensors (one
    SDPA call over the ragged batch, no padding at all). fbgemm has no fused jagged attention on
    CPU (its jagged ops are bmm and softmax pieces), so nested tensors stand for the jagged path."""
    import warnings

    import torch.nn.functional as F

    from pinads_rec.modules.length_buckets import run_by_length

    H, d = 2, 16
    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    def attend(x, mask):  # x [u, l, H * d], mask [u, l]
        q = x.unflatten(-1, (H, d)).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, q, q, attn_mask=mask[:, None, None, :])
        return y.transpose(1, 2).flatten(-2)

    try:
        drawn = history_lengths(units, np.random.default_rng(seed))
        rows = []
        for cap in caps:
            lengths = np.minimum(drawn, cap)
            g = torch.Generator().manual_seed(seed)
            seqs = [torch.randn(int(n), H * d, generator=g) for n in lengths]
            mask = torch.arange(cap)[None, :] < torch.from_numpy(lengths)[:, None]
            padded_x = torch.zeros(units, cap, H * d)
            for u, s in enumerate(seqs):
                padded_x[u, : len(s)] = s

            def step(how: str, seqs=seqs, padded_x=padded_x, mask=mask):
                if how == "nested":
                    parts = [s.clone().requires_grad_(True) for s in seqs]
                    with warnings.catch_warnings():  # "nested tensors are a prototype": measured anyway
                        warnings.simplefilter("ignore")
                        nt = torch.nested.as_nested_tensor(parts, layout=torch.jagged)
                        q = nt.unflatten(-1, (H, d)).transpose(1, 2)
                        y = F.scaled_dot_product_attention(q, q, q).transpose(1, 2).flatten(-2)
                    y.values().sum().backward()
                    return torch.cat(y.unbind()).detach()
                x = padded_x.clone().requires_grad_(True)
                y = attend(x, mask) if how == "padded" else run_by_length(attend, x, mask)
                (y * mask[..., None]).sum().backward()
                return y.detach()[mask]

            outputs, best = best_times(step, ("padded", "buckets", "nested"), repeats)
            diff = max(float((outputs["padded"] - outputs[h]).abs().max()) for h in ("buckets", "nested"))
            row = {"cap": cap, "units": units, "mean_length": float(lengths.mean()), "max_abs_diff": diff}
            row.update({f"{h}_ms": 1000.0 * best[h] for h in best})
            rows.append(row)
            print(
                f"  cap {cap:>5} (mean length {row['mean_length']:7.1f}): padded {row['padded_ms']:8.1f} ms, "
                f"buckets {row['buckets_ms']:8.1f} ms, nested {row['nested_ms']:8.1f} ms; "
                f"nested / buckets {row['nested_ms'] / row['buckets_ms']:5.2f}x, max |diff| {diff:.1e}",
                flush=True,
            )
            if not diff <= 1e-5:
                raise AssertionError(f"cap {cap}: attention outputs differ by {diff:.3g} (> 1e-5)")
        return rows
    finally:
        torch.set_num_threads(threads)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "demo.yaml"))
    ap.add_argument(
        "--data", default=None, help="a data directory holding train/, eval/, calibration/ (default: generated)"
    )
    ap.add_argument("--caps", type=int, nargs="+", default=[100, 500, 1000, 4000])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--skip-padded-above", type=int, default=1000, help="padded Transformer caps above this: skipped")
    ap.add_argument("--train-requests", type=int, default=4000, help="requests of the generated data")
    ap.add_argument("--arch-units", type=int, default=16, help="(b): requests per forward + backward")
    ap.add_argument("--arch-repeats", type=int, default=3)
    ap.add_argument("--no-train", action="store_true", help="(b) only")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per training measurement")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default="runs/long_sequences")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(args.data or DATA)
    splits = [f"data.{s}_dir={root / s}" for s in ("train", "eval", "calibration")]
    if args.data:
        common = splits + list(args.set)
    else:
        sizes = [f"synth.train_requests={args.train_requests}", "synth.eval_requests=200"]
        common = LONG_HISTORY + sizes + ["synth.calibration_requests=200"] + splits + list(args.set)
    try:
        base = None if args.no_train else config.load(args.config, common)
        for variant in [] if args.no_train else args.variants:  # every config valid before any run
            for cap in args.caps:
                if window_fits(variant, cap):
                    config.load(args.config, common + [cap_override(cap)] + VARIANTS[variant])
    except config.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    result: dict = {"caps": args.caps, "variants": args.variants}
    if base is not None:
        if not args.data:
            synth.ensure(base, DATA, echo=lambda m: print(m, flush=True))
        print(f"(a) training examples/s, {args.ranks} rank(s), {args.steps} steps after {args.warmup}")
        result["train"] = train_rates(args, common, out)
        print("\n".join(["", *rate_table(result["train"], args.caps, args.variants), ""]))
        print(
            "acceptance: examples/s(cap 1000) / examples/s(cap 100) >= 1/3 for retrieval and the unpadded Transformer"
        )
    print(f"(b) the sequence arch alone: 2-layer Transformer, {args.arch_units} requests, forward + backward, 1 thread")
    result["arch"] = arch_times(args.caps, args.arch_units, args.arch_repeats)
    print(f"(c) self-attention alone: padded / length buckets / torch nested jagged, {args.arch_units} requests")
    result["attention"] = attention_times(args.caps, args.arch_units, args.arch_repeats)
    (out / "long_sequences.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out / 'long_sequences.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
