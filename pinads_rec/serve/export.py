"""Export: ``torch.export`` of a run's whole model behind a tensors-only signature, and its reload.

``FlatScorer`` puts the model -- embedding lookups included -- behind plain tensors (each of the
batch's KeyedJaggedTensors as values + lengths, the per-group dicts, ``request_index``, ``surface``;
out: probabilities [B, T]). ``export_program`` traces it non-strict with every batch dimension
dynamic (one request of one candidate up to large batches); ``export_run`` saves that program as a
``.pt2`` archive that also carries the run's config (``EXPORT_CONFIG``). A fresh process reloads it
with ``load_exported`` (no model code needed, only fbgemm's operators) and gets the same scores
through the same ``score_request`` / ``score_batch`` as the ``Predictor``. FP16 cannot be exported:
its overflow check branches on values (docs/serving.md).
"""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import torch
from torch import nn

from pinads_rec import config
from pinads_rec.data.loader.batch import Batch
from pinads_rec.features import FeatureLayout
from pinads_rec.library_notices import without_warning
from pinads_rec.serve.batching import RequestBatcher, file_order_batches
from pinads_rec.serve.loading import ServeError
from pinads_rec.serve.scoring import Predictor, RowScorer

EXPORT_CONFIG = "pinads_rec_config.json"

# The exported program's positional inputs, in order (``flat_inputs`` builds them from a Batch).
EXPORT_INPUTS = (
    "dense",
    "sparse_values",
    "sparse_lengths",
    "user_values",
    "user_lengths",
    "sequence_values",
    "sequence_lengths",
    "sequence_time_deltas",
    "sequence_embeddings",
    "sequence_bag_sizes",
    "request_index",
    "surface",
)


def flat_inputs(batch: Batch) -> tuple:
    return (
        batch.dense,
        batch.sparse.values(),
        batch.sparse.lengths(),
        batch.user_sparse.values(),
        batch.user_sparse.lengths(),
        batch.sequences.values(),
        batch.sequences.lengths(),
        dict(batch.sequence_time_deltas),
        dict(batch.sequence_embeddings),
        dict(batch.sequence_bag_sizes),
        batch.request_index,
        batch.surface,
    )


def _kjt(keys: List[str], values: torch.Tensor, lengths: torch.Tensor, rows: int):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    # Each KJT's stride from its own lengths: user slots, requests and rows may all differ.
    stride = lengths.shape[0] // len(keys) if keys else rows
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, stride=stride)


class FlatScorer(nn.Module):
    """``model`` behind plain tensors (what torch.export traces): rebuilds the Batch's KeyedJaggedTensors
    from values and lengths, returns probabilities [B, T]."""

    def __init__(self, model: nn.Module, features: config.FeaturesConfig):
        super().__init__()
        self.model = model
        self.layout = FeatureLayout.of(features)

    def forward(
        self,
        dense,
        sparse_values,
        sparse_lengths,
        user_values,
        user_lengths,
        sequence_values,
        sequence_lengths,
        sequence_time_deltas: Dict[str, torch.Tensor],
        sequence_embeddings: Dict[str, torch.Tensor],
        sequence_bag_sizes: Dict[str, torch.Tensor],
        request_index,
        surface,
    ) -> torch.Tensor:
        rows = dense.shape[0]
        batch = Batch(
            dense=dense,
            sparse=_kjt(self.layout.row_keys, sparse_values, sparse_lengths, rows),
            user_sparse=_kjt(self.layout.user_keys, user_values, user_lengths, rows),
            sequences=_kjt(self.layout.sequence_keys, sequence_values, sequence_lengths, rows),
            sequence_time_deltas=sequence_time_deltas,
            sequence_embeddings=sequence_embeddings,
            sequence_bag_sizes=sequence_bag_sizes,
            request_index=request_index,
            surface=surface,
            labels=dense.new_empty(0),
            valid=torch.empty(0, dtype=torch.bool),
        )
        return torch.sigmoid(self.model(batch).float())


@contextmanager
def _quiet_torchrec_export_warnings():
    # TorchRec warns that KJT.to_dict is slow under non-strict export: it is, once, at export time.
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


@contextmanager
def _fbgemm_fake_classes():
    # The quantized collections' kernels hold fbgemm's TorchScript counters, which export traces
    # through TorchRec's fake versions of them, registered for the trace only.
    from torchrec.pt2.utils import deregister_fake_classes, register_fake_classes

    register_fake_classes()
    try:
        yield
    finally:
        deregister_fake_classes()


def export_program(model: nn.Module, features: config.FeaturesConfig, example: Batch):
    """``torch.export`` (non-strict) of the whole prepared model on an example batch; every batch
    dimension dynamic, sizes 0 and 1 included (``backed_size_oblivious``: a single request of a single
    candidate is served by the same program)."""
    import torch.fx.experimental._config as fx_config

    if any(getattr(m, "dtype", None) == torch.float16 for m in model.modules()):
        raise ServeError(
            "fp16 cannot be exported: its overflow check (inf/NaN -> error or BF16 redo) "
            "branches on the output's values; export fp32 or bf16"
        )
    flat = FlatScorer(model, features).eval()
    args = flat_inputs(example)
    auto = torch.export.Dim.AUTO
    dynamic = tuple({k: {0: auto} for k in a} if isinstance(a, dict) else {0: auto} for a in args)
    try:
        with fx_config.patch(backed_size_oblivious=True), _quiet_torchrec_export_warnings(), _fbgemm_fake_classes():
            with torch.no_grad():
                # One eager call first: the quantized collections cache their features' order on
                # their first call, through a torch.tensor(data=...) the non-strict tracer cannot take.
                flat(*args)
                return torch.export.export(flat, args, dynamic_shapes=dynamic, strict=False)
    except Exception as e:  # torch.export's errors run to pages: keep the cause, point at the guide
        first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise ServeError(
            f"torch.export of the model ({type(model).__name__}) failed: {first} (docs/serving.md, "
            f"'Export', lists what the model code must avoid)"
        ) from e


def export_run(
    run_dir: Union[str, Path],
    out: Union[str, Path],
    data_dir: Optional[str] = None,
    precision: Optional[str] = None,
    example_rows: int = 64,
    serve: Optional[Dict[str, Any]] = None,
) -> Path:
    """Exports a run's model to ``out`` (.pt2), traced on the first ``example_rows`` rows of
    ``data_dir`` (default: the run's eval data); ``serve``: serve.* settings over the run's (its
    tables' dtypes: a quantized model exports with its quantized collections)."""
    predictor = Predictor.from_run(run_dir, precision, serve=serve)
    cfg = predictor.cfg
    example = next(iter(file_order_batches(cfg, data_dir or cfg.data.eval_dir, example_rows)))
    program = export_program(predictor.model, cfg.features, example)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "config": config.to_dict(cfg),
        "inputs": list(EXPORT_INPUTS),
        "tasks": predictor.tasks,
        "precision": cfg.model.precision.inference,  # as served: auto resolved
        "run": str(run_dir),
    }
    # The quantized kernels' packed rows are shared by TorchRec's per-table views of them, and the
    # archive warns of such groups; the reload scores as the eager model (tests/test_quantized_tables.py).
    with without_warning("No complete tensor found in the group!", UserWarning):
        torch.export.save(program, str(out), extra_files={EXPORT_CONFIG: json.dumps(meta, default=str)})
    return out


class ExportedScorer(RowScorer):
    """A ``.pt2`` written by ``export`` (or ``export_run``), reloaded: same ``score_request`` and
    ``score_batch`` as the Predictor, no model code involved."""

    def __init__(self, path: Union[str, Path]):
        import fbgemm_gpu  # noqa: F401  (registers the fbgemm operators the graph calls)

        extra = {EXPORT_CONFIG: ""}
        serde = logging.getLogger("torch._export.serde.serialize")
        level = serde.level
        serde.setLevel(logging.ERROR)  # "Symbol uN did not appear in the graph": unbacked sizes, expected
        try:
            self.program = torch.export.load(str(path), extra_files=extra)
        finally:
            serde.setLevel(level)
        if not extra[EXPORT_CONFIG]:
            raise ServeError(f"{path}: not written by pinads_rec.serve export (no {EXPORT_CONFIG} inside)")
        self.meta = json.loads(extra[EXPORT_CONFIG])
        self.cfg = config.from_dict(self.meta["config"])
        self.module = self.program.module()
        self._batcher = RequestBatcher(self.cfg)

    @torch.inference_mode()
    def score_batch(self, batch: Batch) -> torch.Tensor:
        return self.module(*flat_inputs(batch))


def load_exported(path: Union[str, Path]) -> ExportedScorer:
    """The ``.pt2`` at ``path`` (written by ``export_run``), ready to score."""
    return ExportedScorer(path)
