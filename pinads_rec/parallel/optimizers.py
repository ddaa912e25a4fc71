"""The optimizers: the embedding tables' (fused into backward where sharded, the same kind where
replicated), AdamW for the dense layers, and the dense layers' LR schedule."""

from __future__ import annotations

import torch
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from pinads_rec.config import TrainConfig
from pinads_rec.parallel.initialization import EMBEDDING_PARAM


def embedding_optimizer(train: TrainConfig, device: torch.device):
    """(optimizer class, kwargs) for embedding tables, whichever way they are sharded."""
    kind = train.embedding_optimizer
    if kind == "adam" and device.type != "cuda":
        raise ValueError("train.embedding_optimizer: adam is CUDA-only in fbgemm; use rowwise_adagrad on CPU")
    return {
        "rowwise_adagrad": (RowWiseAdagrad, {"lr": train.embedding_lr, "eps": 1e-8}),
        "adagrad": (torch.optim.Adagrad, {"lr": train.embedding_lr, "eps": 1e-8}),
        "sgd": (torch.optim.SGD, {"lr": train.embedding_lr}),
        "adam": (torch.optim.Adam, {"lr": train.embedding_lr}),
    }[kind]


def attach_embedding_optimizer(model: nn.Module, train: TrainConfig, device: torch.device) -> None:
    optim_cls, kwargs = embedding_optimizer(train, device)
    for module in model.modules():
        if isinstance(module, (EmbeddingBagCollection, EmbeddingCollection)):
            apply_optimizer_in_backward(optim_cls, module.parameters(), kwargs)


# torch.optim.AdamW's implementations, by train.dense_optimizer_kernel: one fused kernel, one
# multi-tensor (foreach) kernel per operation, or a Python loop over the parameters.
DENSE_ADAMW_KERNELS = {
    "fused": {"fused": True},
    "foreach": {"fused": False, "foreach": True},
    "for_loop": {"fused": False, "foreach": False},
}


def make_optimizer(dmp: DistributedModelParallel, train: TrainConfig, total_steps: int):
    """AdamW for the dense layers (its kernel: train.dense_optimizer_kernel); the embedding optimizer
    for every table -- fused into backward for sharded tables, and a plain optimizer of the same kind
    for replicated (data_parallel) ones, so a table trains the same whichever way it is sharded. The
    LR schedule (linear warm-up, then linear decay to final_lr_ratio) applies to the dense layers."""
    unfused = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    tables = {k: v for k, v in unfused.items() if any(p in k for p in EMBEDDING_PARAM)}
    layers = {k: v for k, v in unfused.items() if k not in tables}
    kernel = DENSE_ADAMW_KERNELS[train.dense_optimizer_kernel]
    dense = KeyedOptimizerWrapper(
        layers, lambda params: torch.optim.AdamW(params, lr=train.lr, weight_decay=train.weight_decay, **kernel)
    )
    parts = [("dense", dense), ("sparse", dmp.fused_optimizer)]
    if tables:
        optim_cls, kwargs = embedding_optimizer(train, next(iter(tables.values())).device)
        parts.append(("replicated_tables", KeyedOptimizerWrapper(tables, lambda p: optim_cls(p, **kwargs))))
    optimizer = CombinedOptimizer(parts)
    schedule = torch.optim.lr_scheduler.LambdaLR(dense, lr_lambda=lr_multiplier(train, total_steps))
    return optimizer, schedule


def lr_multiplier(train: TrainConfig, total_steps: int):
    warmup, final = train.warmup_steps, train.final_lr_ratio

    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        span = max(total_steps - warmup, 1)
        return 1.0 - (1.0 - final) * min(max(step - warmup, 0) / span, 1.0)

    return f
