"""Mixed precision for the large layers (sequence-modeling article, "Serving Efficiency"; two-tower
article, BF16 in training).

The large layers -- the Transformer stacks, the DCNv2 cross network, the MMoE experts -- are wrapped
in ``LargeLayer``; everything else (embeddings, small projections, gates, towers, calibration, the
loss) stays float32. A ``LargeLayer`` takes and returns float32, so the choice is local:

- training: ``set_precision(model, "bf16")`` runs the wrapped layers under ``torch.autocast`` over
  float32 master weights (the optimizer never sees a 16-bit weight);
- inference: ``set_precision(model, "bf16", cast_weights=True)`` converts the wrapped layers'
  weights once, so no per-call weight cast is paid.

FP16 has a narrow range: the DCNv2 cross layer overflows on inputs of a few hundred. Every FP16
output is checked; an inf/NaN either raises ``PrecisionOverflow`` naming the layer or, with
``fp16_overflow: bf16``, the layer is re-run in BF16, counted, and stays in BF16 from then on --
never a silent inf/NaN score. (BF16 has float32's range: it degrades precision, not availability.)

``auto`` (the inference default) is BF16 where the device has fast BF16 units and FP32 elsewhere
(``resolve``): on a CPU without them BF16 is emulated and slower than FP32 (2.6x slower scoring
measured on an AMD EPYC without avx512_bf16, docs/serving.md).
"""

import logging
from pathlib import Path
from typing import Dict, FrozenSet, Optional, Tuple

import torch
from torch import nn

log = logging.getLogger(__name__)

DTYPES: Dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# What a precision setting may say: a dtype, or "auto" (resolve picks one for the device).
PRECISIONS = ("auto",) + tuple(DTYPES)
# x86 flags of BF16 dot-product units (/proc/cpuinfo): AMX tiles (Intel Sapphire Rapids on) and
# AVX512-BF16 (Intel Cooper Lake on, AMD Zen 4 on); oneDNN runs BF16 matmuls on them.
CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> Optional[FrozenSet[str]]:
    """The CPU's feature flags (Linux x86); None where /proc/cpuinfo has none to give."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return None


def fast_bf16(device: torch.device, flags: Optional[FrozenSet[str]] = None) -> Tuple[bool, str]:
    """(does ``device`` run BF16 matmuls natively, why) -- ``flags`` the CPU's, read when None."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return True, f"{name} has native BF16"
        return False, f"{name} has no native BF16"
    if device.type == "cpu":
        flags = cpu_flags() if flags is None else flags
        if flags is None:
            return False, "this CPU's feature flags are unknown (no x86 /proc/cpuinfo flags)"
        found = [f for f in CPU_BF16_FLAGS if f in flags]
        if found:
            return True, f"this CPU has {'/'.join(found)}"
        return False, "this CPU has no avx512_bf16/AMX"
    return False, f"no BF16 rule for {device.type} devices"


def resolve(precision: str, device: torch.device, what: str = "precision") -> str:
    """``precision`` itself, or for "auto" the dtype that fits ``device``: logged with the reason."""
    if precision != "auto":
        return precision
    fast, why = fast_bf16(device)
    chosen = "bf16" if fast else "fp32"
    log.info("%s auto -> %s: %s", what, chosen, why)
    return chosen


class PrecisionOverflow(RuntimeError):
    """A 16-bit layer produced inf/NaN."""


class LargeLayer(nn.Module):
    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.dtype = torch.float32
        self.fp16_overflow = "error"
        self.fallbacks = 0  # FP16 outputs redone in BF16
        self.layer_name = type(module).__name__  # replaced by its path in the model by set_precision

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        if self.dtype == torch.float32:
            return self.module(*args)
        out = self._run(self.dtype, args)
        if self.dtype == torch.float16 and not bool(torch.isfinite(out).all()):
            if self.fp16_overflow == "error":
                raise PrecisionOverflow(
                    f"{self.layer_name}: FP16 overflow (inf/NaN output, max |input| "
                    f"{max(float(a.abs().max()) for a in args if a.is_floating_point()):.3g}); use precision bf16, "
                    f"or set model.precision.fp16_overflow: bf16 to redo such layers in BF16"
                )
            # This layer runs in BF16 from now on (its weights too, when they were cast to FP16).
            self.fallbacks += 1
            self.dtype = torch.bfloat16
            if next(self.module.parameters()).dtype == torch.float16:
                self.module.to(torch.bfloat16)
            out = self._run(torch.bfloat16, args)
            if not bool(torch.isfinite(out).all()):  # not a range problem: a non-finite input
                raise PrecisionOverflow(f"{self.layer_name}: non-finite output in BF16 too (non-finite input?)")
        return out

    def _run(self, dtype: torch.dtype, args: Tuple[torch.Tensor, ...]) -> torch.Tensor:
        if next(self.module.parameters()).dtype == dtype:  # inference: weights already cast
            return self.module(*(a.to(dtype) if a.is_floating_point() else a for a in args)).float()
        with torch.autocast(device_type=args[0].device.type, dtype=dtype):  # float32 master weights
            return self.module(*args).float()


def set_precision(model: nn.Module, precision: str, cast_weights: bool = False, fp16_overflow: str = "error") -> None:
    """Run every LargeLayer of ``model`` in ``precision`` (fp32 | bf16 | fp16); ``cast_weights`` for
    inference converts their weights (back to float32 for fp32)."""
    dtype = DTYPES[precision]
    for name, m in model.named_modules():
        if isinstance(m, LargeLayer):
            m.dtype, m.fp16_overflow, m.layer_name = dtype, fp16_overflow, name
            if cast_weights:
                m.module.to(dtype)


def fallback_count(model: nn.Module) -> int:
    return sum(m.fallbacks for m in model.modules() if isinstance(m, LargeLayer))
