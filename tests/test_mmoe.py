"""The MMoE (pinads_rec/modules/mmoe.py): one logit per task and surface, and its BF16 experts equal to
autocast layer by layer."""

import torch

from pinads_rec.modules.mmoe import MMoE


def test_mmoe_gives_one_logit_per_task_and_surface():
    torch.manual_seed(0)
    mmoe = MMoE(in_features=10, num_tasks=3, num_surfaces=4, num_experts=2, expert_dims=[8, 6], tower_dims=[5])
    out = mmoe(torch.randn(7, 10))
    assert out.shape == (7, 3, 4)
    out.sum().backward()
    assert all(p.grad is not None for p in mmoe.parameters())


def test_mmoe_in_bf16_matches_autocast_layer_by_layer():
    # The experts cast their shared input once instead of autocast casting it per expert: the same
    # numbers, forward and backward, as the experts run one by one under autocast.
    torch.manual_seed(0)
    mmoe = MMoE(in_features=10, num_tasks=3, num_surfaces=4, num_experts=3, expert_dims=[8, 6], tower_dims=[5])
    x = torch.randn(7, 10, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mmoe.experts.module(x)
        reference = torch.stack([e(x) for e in mmoe.experts.module.experts], dim=1)
    assert out.dtype == torch.bfloat16 and torch.equal(out, reference)
    (grad,) = torch.autograd.grad(out.float().sum(), x)
    (reference_grad,) = torch.autograd.grad(reference.float().sum(), x)
    assert grad.dtype == torch.float32 and torch.allclose(grad, reference_grad, rtol=1e-2, atol=1e-3)
