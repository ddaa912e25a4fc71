"""The Transformer encoder (pinads_rec/modules/transformer.py): shapes, padding never changing an
output, empty sequences, extra tokens, and the attention kernel automatic unless pinned."""

import torch
from sequence_inputs import L, W
from sequence_inputs import padded as _padded
from sequence_inputs import perturb_padding as _perturb_padding

from pinads_rec.modules.transformer import (
    ALL_BACKENDS,
    TransformerEncoder,
    automatic_backends,
    set_attention_backends,
)


def test_transformer_encoder_shapes_padding_and_empty_sequences():
    torch.manual_seed(0)
    enc = TransformerEncoder(W, 2, 2, 16, 0.0, ["summary", "mean", "transact"], transact_recent=2).eval()
    assert enc.output_dim == (1 + 1 + 1 + 2) * W
    events, mask = _padded([3, 0, 6, 1])
    tokens = torch.randn(4, 2, W)
    pooled, encoded = enc(events, mask, tokens)
    assert pooled.shape == (4, enc.output_dim) and encoded.shape == (4, L, W)
    assert torch.isfinite(pooled).all()
    again, again_encoded = enc(_perturb_padding(events, mask), mask, tokens)
    torch.testing.assert_close(again, pooled)
    torch.testing.assert_close(again_encoded[mask], encoded[mask])
    # empty sequence: TransAct's max-pool and latest tokens are zeros
    assert (pooled[1, 2 * W :] == 0).all()
    # the extra tokens are attended to
    assert not torch.allclose(enc(events, mask, torch.randn(4, 2, W))[0], pooled)


def _attention_kernels(module, *inputs):
    """The SDPA kernels (aten ops) one forward + backward of ``module`` ran."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        module(*inputs)[0].sum().backward()
    return {e.key for e in prof.key_averages() if e.key.startswith("aten::_scaled_dot_product")}


def test_attention_kernel_is_automatic_unless_pinned():
    """SDPA picks among all its kernels (MATH alone in CPU BF16 training); set_attention_backends
    pins a list on every layer (a benchmark's comparison) and None gives the choice back."""
    bf16 = torch.zeros(1, dtype=torch.bfloat16)
    assert automatic_backends(bf16, training=True) == [torch.nn.attention.SDPBackend.MATH]
    assert automatic_backends(bf16, training=False) == list(ALL_BACKENDS)
    assert automatic_backends(bf16.float(), training=True) == list(ALL_BACKENDS)

    torch.manual_seed(0)
    enc = TransformerEncoder(W, 2, 2, 16, 0.0, ["summary"], transact_recent=0)
    events, mask = _padded([3, 6])
    math = "aten::_scaled_dot_product_attention_math"
    automatic = _attention_kernels(enc, events, mask)
    assert automatic and math not in automatic  # FP32 on CPU: a fused kernel
    assert set_attention_backends(enc, [torch.nn.attention.SDPBackend.MATH]) == 2
    assert _attention_kernels(enc, events, mask) == {math}
    assert set_attention_backends(enc, None) == 2
    assert _attention_kernels(enc, events, mask) == automatic
