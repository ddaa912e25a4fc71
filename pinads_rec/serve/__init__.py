"""Serving a trained run: ``python -m pinads_rec.serve score|export|export-ads`` (docs/serving.md).

- ``loading.py``: checkpoint -> unsharded CPU model in the inference precision (``load_model``)
- ``batching.py``: rows -> ``Batch`` with the loader's contract checks (one request; files in order)
- ``scoring.py``: ``Predictor`` (model -> probabilities [N, T]), ``score_directory`` (Parquet -> Parquet)
- ``export.py``: ``torch.export`` of the whole model to a ``.pt2`` and its reload (``load_exported``)
- ``ad_table.py``: the two-tower ad table: precomputed ad vectors written, read and scored from
- ``cli.py``: the command line (``main``)

The names a user calls are re-exported here; everything else is imported from its module.
"""

from pinads_rec.serve.cli import main
from pinads_rec.serve.export import load_exported
from pinads_rec.serve.loading import load_model
from pinads_rec.serve.scoring import Predictor

__all__ = ["Predictor", "load_exported", "load_model", "main"]
