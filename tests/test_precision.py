"""Precision (pinads_rec/modules/precision.py): BF16 large layers close to FP32, the FP16 overflow
check and its BF16 fallback, and ``auto`` resolving to BF16 only where the CPU has BF16 units."""

import pytest
import torch
from conftest import load_tiny
from torch import nn
from torchrec.modules.crossnet import LowRankCrossNet

from pinads_rec.data.loader.dataset import LoaderSettings, ParquetBatches
from pinads_rec.models import build_model
from pinads_rec.modules.precision import LargeLayer, PrecisionOverflow, fallback_count, set_precision


def _batch(cfg):
    return next(iter(ParquetBatches(cfg.data.eval_dir, LoaderSettings.of(cfg), shuffle=False)))


def test_bf16_large_layers_stay_close_to_fp32(tiny_data):
    _, data = tiny_data
    cfg = load_tiny(data)
    torch.manual_seed(0)
    model = build_model(cfg.features, cfg.model).eval()
    batch = _batch(cfg)
    with torch.no_grad():
        fp32 = torch.sigmoid(model(batch))
        set_precision(model, "bf16")  # training style: autocast over float32 weights
        autocast = torch.sigmoid(model(batch))
        set_precision(model, "bf16", cast_weights=True)  # inference: weights cast once
        cast = torch.sigmoid(model(batch))
    large = [m for m in model.modules() if isinstance(m, LargeLayer)]
    assert len(large) == 1 + 1 + len(cfg.features.sequence_groups)  # cross, experts, one Transformer per group
    assert all(next(m.module.parameters()).dtype == torch.bfloat16 for m in large)
    assert model.calibration.scale.dtype == torch.float32, "small layers stay float32"
    assert cast.dtype == torch.float32
    assert (autocast - fp32).abs().max() < 0.01 and (cast - fp32).abs().max() < 0.01


def test_fp16_overflow_fails_loudly_or_falls_back():
    torch.manual_seed(0)
    cross = LargeLayer(LowRankCrossNet(64, num_layers=3, low_rank=16))
    x = torch.full((4, 64), 300.0)  # a cross layer squares its input: far past FP16's 65504
    with torch.no_grad():
        assert torch.isfinite(cross(x)).all()  # fp32
        holder = nn.Sequential(cross)
        set_precision(holder, "fp16")
        with pytest.raises(PrecisionOverflow, match="0: FP16 overflow"):
            cross(x)
        set_precision(holder, "fp16", fp16_overflow="bf16")
        out = cross(x)
    assert torch.isfinite(out).all() and fallback_count(holder) == 1


@pytest.mark.parametrize(
    "flags, fast, why",
    [
        ({"avx2", "avx512f", "avx512_bf16"}, True, "this CPU has avx512_bf16"),
        ({"amx_tile", "amx_bf16", "avx512_bf16"}, True, "this CPU has amx_bf16/avx512_bf16"),
        ({"avx2", "avx512f", "avx512_vnni"}, False, "this CPU has no avx512_bf16/AMX"),
    ],
)
def test_auto_precision_is_bf16_only_on_a_cpu_with_bf16_units(flags, fast, why):
    from pinads_rec.modules.precision import fast_bf16

    assert fast_bf16(torch.device("cpu"), frozenset(flags)) == (fast, why)


def test_cpu_flags_come_from_cpuinfo(tmp_path):
    from pinads_rec.modules.precision import cpu_flags

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\n")
    assert cpu_flags(info) == {"fpu", "avx2", "avx512_bf16"}
    info.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")  # an ARM cpuinfo: no x86 flags line
    assert cpu_flags(info) is None and cpu_flags(tmp_path / "absent") is None


def test_auto_resolves_and_says_why_explicit_precisions_pass_through(caplog):
    from pinads_rec.modules.precision import fast_bf16, resolve

    cpu = torch.device("cpu")
    with caplog.at_level("INFO", logger="pinads_rec.modules.precision"):
        chosen = resolve("auto", cpu, "inference precision")
    fast, why = fast_bf16(cpu)
    assert chosen == ("bf16" if fast else "fp32")
    assert f"inference precision auto -> {chosen}: {why}" in caplog.text
    assert [resolve(p, cpu) for p in ("fp32", "bf16", "fp16")] == ["fp32", "bf16", "fp16"]


def test_inference_precision_defaults_to_auto():
    from pinads_rec import config

    assert config.PrecisionConfig().inference == "auto" and config.PrecisionConfig().train == "fp32"
