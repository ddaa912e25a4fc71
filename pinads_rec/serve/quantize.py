"""Embedding tables at serving size: each table of a loaded model served in FP32, FP16, INT8 or INT4
through TorchRec's quantized collections (``quantize_inference_model``: ``QuantEmbeddingBagCollection``
/ ``QuantEmbeddingCollection`` on fbgemm's int-n-bit inference kernels, one per-table dtype map).

INT8 and INT4 are row-wise: each row keeps its own FP16 scale and bias (4 bytes), so a row of width D
takes D + 4 bytes at INT8 and D / 2 + 4 at INT4, against 4 D at FP32 -- the saving grows with the
width (INT8: 3.2x at D = 16, 3.6x at D = 32). On CPU the rows are packed as fbgemm's CPU kernels
take them, unpadded; TorchRec pads each to 16 bytes for the GPU's loads (``row_alignment``), which
at D = 16 would give INT8 no more than FP16.

A managed-collision collection keeps its remapping module and gets the quantized collection inside
it (TorchRec swaps the inner EmbeddingBagCollection / EmbeddingCollection): the ids are remapped as
in training, the rows looked up at the table's dtype.

The dtypes come from the run's ``serve.embedding_dtype`` and ``serve.table_dtypes`` (or a launch's
own): ``table_dtypes(cfg)``. ``python -m pinads_rec.serve guard`` measures what each choice costs
in AUC (serve/guard.py).
"""

from __future__ import annotations

from typing import Dict, Iterable

import torch
from torch import nn

from pinads_rec import config

# serve.embedding_dtype's names -> the weight dtypes TorchRec's quantization takes.
DTYPES: Dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "int8": torch.int8,
    "int4": torch.quint4x2,
}


def table_dtypes(cfg: config.ExperimentConfig) -> Dict[str, str]:
    """Each table of ``features.tables`` -> its served dtype: ``serve.table_dtypes``'s, else
    ``serve.embedding_dtype``."""
    serve = cfg.serve
    return {t.name: serve.table_dtypes.get(t.name, serve.embedding_dtype) for t in cfg.features.tables}


def with_table_dtypes(cfg: config.ExperimentConfig, dtypes: Dict[str, str]) -> config.ExperimentConfig:
    """``cfg`` serving its tables at ``dtypes`` (every table named: embedding_dtype fp32, the rest exceptions)."""
    import dataclasses

    table_dtypes = {t: d for t, d in dtypes.items() if d != "fp32"}
    serve = dataclasses.replace(cfg.serve, embedding_dtype="fp32", table_dtypes=table_dtypes)
    return dataclasses.replace(cfg, serve=serve)


def row_alignment(device: torch.device) -> int:
    """Bytes each quantized row is padded to: none on CPU, TorchRec's 16 on a GPU."""
    from torchrec.quant.embedding_modules import DEFAULT_ROW_ALIGNMENT

    return 1 if device.type == "cpu" else DEFAULT_ROW_ALIGNMENT


def quantize_tables(model: nn.Module, dtypes: Dict[str, str]) -> nn.Module:
    """``model`` (eval mode, on its serving device) with its collections swapped for TorchRec's
    quantized ones at ``dtypes`` ({table: fp32 | fp16 | int8 | int4}), in place; unchanged when every
    table is fp32 (the float collections score exactly as trained)."""
    if all(d == "fp32" for d in dtypes.values()):
        return model
    from torchrec.inference.modules import quantize_inference_model
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
    from torchrec.quant.embedding_modules import quant_prep_customize_row_alignment

    device = next(model.parameters()).device
    quant_prep_customize_row_alignment(model, [EmbeddingBagCollection, EmbeddingCollection], row_alignment(device))
    return quantize_inference_model(model, per_table_weight_dtype={t: DTYPES[d] for t, d in dtypes.items()})


def table_bytes(cfg: config.ExperimentConfig, dtype: str, device: str = "cpu") -> Dict[str, int]:
    """Each table's bytes at ``dtype`` in fbgemm's row layout on ``device`` (rows x the rounded row size)."""
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import rounded_row_size_in_bytes

    ty = SparseType(dtype)
    align = row_alignment(torch.device(device))
    return {
        t.name: t.num_embeddings * rounded_row_size_in_bytes(t.embedding_dim, ty, align) for t in cfg.features.tables
    }


def embedding_bytes(model: nn.Module) -> int:
    """Bytes the model's embedding collections hold, measured: every distinct storage under its
    ``ebc``, ``user_ebc`` and ``ec`` (float tables' weights, or the quantized kernels' packed rows,
    which their per-table views share), once each."""
    seen: Dict[int, int] = {}
    for name in ("ebc", "user_ebc", "ec"):
        collection = getattr(model, name, None)
        if collection is not None:
            for t in _tensors(collection):
                # Empty buffers have no storage to ask; INT4 per-table views (UInt4Tensor) wrap the
                # packed rows, counted through the kernel's own tensor.
                if t.numel() == 0 or type(t) not in (torch.Tensor, nn.Parameter):
                    continue
                storage = t.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _tensors(module: nn.Module) -> Iterable[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()
    # The quantized kernels keep their rows in plain attributes (weights_host / weights_dev), not buffers.
    for m in module.modules():
        for attr in ("weights_host", "weights_dev", "weights_uvm"):
            t = getattr(m, attr, None)
            if isinstance(t, torch.Tensor):
                yield t
