"""The dense and sequence arch in BF16 vs FP32, with torch alone: what a GPU without TorchRec or
fbgemm can measure (the lent GPU machine: its own torch, no network; scripts/gpu_check.sh runs this
there). Side by side in one process, alternating.

    python benchmarks/arch_precision.py --device cuda [--config configs/prod_8gpu.yaml] [--rows 4096]
        [--repeats 20] [--torch-only] [--json out.json]
    python benchmarks/arch_precision.py --device cpu --rows 48 --repeats 1 --warmup 0   # smoke test

Built from the config's features and model sections with the project's own modules, never TorchRec's
embedding collections: per sequence group the ``SequenceArch`` encoder (modules/sequence.py: event
representation, Transformer + target attention, DIN, ...) fed synthetic event embeddings of the
group's width (what the EmbeddingCollection would return, ``GroupEncoder.encode``), the DCNv2 cross
network and the MMoE over the ranker's interaction width (dense + pooled sparse, synthetic, ++ the
sequence features). ``--rows`` rows a batch, ``synth.candidates_per_request`` rows a request, each
sequence between half and all of its ``max_length``.

Parts: the sequence arch with each of ``--encoders`` alone (default: transformer, din), the DCNv2
cross network, the MMoE, and the whole dense + sequence arch with the config's encoders. Modes:
inference (eval, no autograd, large layers' weights cast once, as served) and training (forward +
backward, autocast over FP32 weights, as trained). Reported: median ms a batch, rows/s, FP32/BF16,
and the largest |BF16 - FP32| difference of the whole arch's logits.

``--torch-only`` makes TorchRec and fbgemm absent for this process (Python's documented
``sys.modules[name] = None``) even where they are installed: the torch fallbacks
(modules/jagged.py, modules/torchrec_layers.py) then run, as they do on a machine without them.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch  # pinads_rec is imported after --torch-only had its say (main)

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda | cpu (default cuda)")
    p.add_argument("--config", default=str(REPO / "configs" / "demo.yaml"))
    p.add_argument("--set", dest="overrides", action="append", default=[], help="config override KEY=VALUE")
    p.add_argument("--rows", type=int, default=4096, help="rows a batch (default 4096)")
    p.add_argument("--encoders", nargs="+", default=["transformer", "din"], help="sequence encoders timed alone")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    p.add_argument("--torch-only", action="store_true", help="run without TorchRec / fbgemm even if installed")
    p.add_argument("--json", default=None, help="also write the figures here")
    return p.parse_args(argv)


def widths(features) -> Dict[str, int]:
    """The ranker's input widths from the config alone (FeatureLayout needs TorchRec's configs)."""
    dim = {s.name: features.table(s.table).embedding_dim for s in features.sparse}
    return {
        "query": sum(dim[s.name] for s in features.sparse if not s.user_side),
        "user": sum(dim[s.name] for s in features.sparse if s.user_side),
        "dense_and_pooled": sum(d.dim for d in features.dense) + sum(dim.values()),
    }


def make_inputs(cfg, rows: int, device, generator) -> dict:
    from pinads_rec.config_base import CANDIDATE_PREFIX

    per_request = max(1, round(cfg.synth.candidates_per_request))  # a mean in the config (float)
    U = max(1, rows // per_request)
    request_index = torch.arange(rows) * U // rows  # non-decreasing, every request gets rows
    w = widths(cfg.features)
    # The ids the counts (and a retrieval) compare: each candidate-side feature's, one per row, from
    # a few dozen values so that events match them.
    candidate_ids = {
        CANDIDATE_PREFIX + s.name: (torch.randint(0, 32, (rows,), generator=generator), torch.arange(rows))
        for s in cfg.features.sparse
        if not s.user_side
    }
    groups = {}
    for g in cfg.features.sequence_groups:
        lengths = torch.randint(g.max_length // 2, g.max_length + 1, (U,), generator=generator)
        n = int(lengths.sum())
        dim = cfg.features.table(g.features[0].table).embedding_dim
        event_ids = {f"{g.name}.{f.name}": (torch.randint(0, 32, (n,), generator=generator), None) for f in g.features}
        groups[g.name] = {
            "attributes": [torch.randn(n, dim, generator=generator) for _ in g.features],
            "offsets": torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]),
            "time_deltas": torch.rand(n, generator=generator) * 30 * 86400.0,
            "pretrained": torch.randn(n, g.embedding_dim, generator=generator) if g.embedding_column else None,
            "ids": {**event_ids, **candidate_ids},
        }
    inputs = {
        "groups": groups,
        "request_index": request_index,
        "query": torch.randn(rows, w["query"], generator=generator),
        "user": torch.randn(U, w["user"], generator=generator),
        "dense_and_pooled": torch.randn(rows, w["dense_and_pooled"], generator=generator),
    }
    return _to(inputs, device)


def _to(x, device):
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to(v, device) for v in x)
    return x.to(device) if x is not None else None


def build_parts(cfg, encoders: List[str]):
    """name -> (module, fn(module, inputs) -> output tensor)."""
    import dataclasses

    from torch import nn

    from pinads_rec.modules.cross_network import cross_network
    from pinads_rec.modules.mmoe import MMoE
    from pinads_rec.modules.sequence import SequenceArch

    f, m = cfg.features, cfg.model
    w = widths(f)
    attr_dim = f.table(f.sequence_groups[0].features[0].table).embedding_dim

    def sequence_arch(model_cfg) -> SequenceArch:
        groups = {g.name: model_cfg.sequence_for(g.name) for g in f.sequence_groups}
        return SequenceArch(f, groups, attr_dim, w["query"], w["user"])

    def run_sequence(arch, x):
        return torch_cat(
            [
                enc.encode(**x["groups"][name], request_index=x["request_index"], query=x["query"], user=x["user"])
                for name, enc in arch.groups.items()
            ]
        )

    class Whole(nn.Module):
        def __init__(self):
            super().__init__()
            self.sequence = sequence_arch(m)
            width = w["dense_and_pooled"] + self.sequence.output_dim
            self.width = width
            self.cross = cross_network(width, m.dcn.num_layers, m.dcn.low_rank)
            self.mmoe = MMoE(
                width, len(f.tasks), len(f.surfaces), m.mmoe.num_experts, m.mmoe.expert_dims, m.mmoe.tower_dims
            )

    def run_whole(whole, x):
        return whole.mmoe(whole.cross(torch_cat([x["dense_and_pooled"], run_sequence(whole.sequence, x)])))

    parts = {}
    for enc in encoders:
        alone = dataclasses.replace(m, sequence=dataclasses.replace(m.sequence, encoders=[enc]), sequence_groups={})
        parts[f"sequence arch: {enc}"] = (sequence_arch(alone), run_sequence)
    whole = Whole()
    parts["DCNv2 cross network"] = (whole.cross, lambda mod, x: mod(x["interaction"]))
    parts["MMoE"] = (whole.mmoe, lambda mod, x: mod(x["interaction"]))
    parts[f"whole dense + sequence arch ({'+'.join(m.sequence.encoders)})"] = (whole, run_whole)
    return parts, whole


def torch_cat(tensors):
    return torch.cat(tensors, dim=1) if len(tensors) > 1 else tensors[0]


def timed(fn: Callable[[], None], device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


def measure(parts, inputs, device, repeats: int, warmup: int) -> List[dict]:
    """Per part and mode, FP32 and BF16 timed alternately: median ms per batch."""
    from pinads_rec.modules.precision import set_precision

    rows = inputs["request_index"].shape[0]
    out = []
    for name, (module, fn) in parts.items():
        for mode in ("inference", "training"):
            models = {}
            for precision in ("fp32", "bf16"):
                model = copy.deepcopy(module).to(device).train(mode == "training")
                set_precision(model, precision, cast_weights=mode == "inference")
                models[precision] = model

            def step(model, mode=mode, fn=fn):
                if mode == "inference":
                    with torch.inference_mode():
                        fn(model, inputs)
                else:
                    fn(model, inputs).float().square().mean().backward()
                    model.zero_grad(set_to_none=True)

            times: Dict[str, List[float]] = {"fp32": [], "bf16": []}
            for i in range(warmup + repeats):
                for precision in ("fp32", "bf16") if i % 2 == 0 else ("bf16", "fp32"):
                    t = timed(lambda model=models[precision]: step(model), device)
                    if i >= warmup:
                        times[precision].append(t)
            ms = {p: statistics.median(t) for p, t in times.items()}
            out.append(
                {
                    "part": name,
                    "mode": mode,
                    "fp32_ms": ms["fp32"],
                    "bf16_ms": ms["bf16"],
                    "fp32_over_bf16": ms["fp32"] / ms["bf16"],
                    "bf16_rows_per_s": rows / ms["bf16"] * 1e3,
                    "fp32_rows_per_s": rows / ms["fp32"] * 1e3,
                }
            )
            print(f"  {name:<48} {mode:<9} fp32 {ms['fp32']:9.2f} ms  bf16 {ms['bf16']:9.2f} ms", flush=True)
    return out


def logit_difference(whole, run, inputs, device) -> float:
    from pinads_rec.modules.precision import set_precision

    logits = {}
    for precision in ("fp32", "bf16"):
        model = copy.deepcopy(whole).to(device).eval()
        set_precision(model, precision, cast_weights=True)
        with torch.inference_mode():
            logits[precision] = run(model, inputs).float()
    return float((logits["bf16"] - logits["fp32"]).abs().max())


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.torch_only:
        sys.modules["torchrec"] = sys.modules["fbgemm_gpu"] = None
    from pinads_rec import config
    from pinads_rec.modules import jagged, torchrec_layers
    from pinads_rec.modules.precision import fast_bf16

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: torch sees no CUDA device here (use --device cpu)", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = config.load(args.config, args.overrides)
    if not cfg.features.sequence_groups:
        print(f"{args.config}: no sequence groups, nothing of the sequence arch to measure", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    parts, whole = build_parts(cfg, args.encoders)
    inputs = make_inputs(cfg, args.rows, device, generator)
    inputs["interaction"] = torch.randn(args.rows, whole.width, generator=generator).to(device)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    header = {
        "device": device_name,
        "torch": torch.__version__,
        "fbgemm": jagged.HAVE_FBGEMM,
        "torchrec": torchrec_layers.HAVE_TORCHREC,
        "fast_bf16": fast_bf16(device)[1],
        "config": args.config,
        "overrides": args.overrides,
        "rows": args.rows,
        "threads": torch.get_num_threads(),
    }
    print(" ".join(f"{k}={v}" for k, v in header.items()), flush=True)
    figures = measure(parts, inputs, device, args.repeats, args.warmup)
    run_whole = list(parts.values())[-1][1]
    diff = logit_difference(whole, run_whole, inputs, device)
    print()
    print(f"{'part':<48} {'mode':<9} {'fp32 ms':>9} {'bf16 ms':>9} {'fp32/bf16':>9} {'bf16 rows/s':>12}")
    for r in figures:
        print(
            f"{r['part']:<48} {r['mode']:<9} {r['fp32_ms']:9.2f} {r['bf16_ms']:9.2f} "
            f"{r['fp32_over_bf16']:8.2f}x {r['bf16_rows_per_s']:12,.0f}"
        )
    print(f"max |bf16 - fp32| of the whole arch's logits (inference): {diff:.4g}")
    if args.json:
        Path(args.json).write_text(json.dumps({**header, "figures": figures, "max_logit_diff": diff}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
