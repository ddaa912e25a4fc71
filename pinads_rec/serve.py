"""Inference for a trained run: checkpoint -> unsharded CPU model -> probabilities; and export.

    python -m pinads_rec.serve score --run runs/demo [--data data/demo/eval] [--out predictions.parquet]
                                     [--precision fp32|bf16|fp16] [--batch-size 4096]
    python -m pinads_rec.serve export --run runs/demo --out model.pt2 [--precision bf16]
    python -m pinads_rec.serve export-ads --run runs/two_tower --data data/demo/eval --out ads.parquet

Loading: the trainer's DCP checkpoint (``<run>/checkpoints/step-N/``) holds the state dict of
``DistributedModelParallel(TrainTask(model))``: keys ``model.<param>`` with the embedding tables as
sharded tensors. DCP reshards on load, so reading those keys into a *plain* state dict of the
unsharded model (``model.`` + its own keys) gives full-shape tensors on one process, whatever plan
or world size wrote them. The model is built from the checkpoint's own config, put in eval mode,
and its large layers (Transformer, DCNv2, MMoE experts) are cast to the inference precision
(``model.precision.inference``, BF16 by default; sequence-modeling article, "Serving Efficiency").

Scoring one request (``Predictor.score_request``): the request's rows go through the loader's
contract checks and ``BatchBuilder``, so the batch holds one user (U = 1) and the user-side work --
user features, sequence encoders -- runs once for all N candidates (request-level broadcasting,
unified-surfaces article).

Export: ``torch.export`` (non-strict) of the whole model -- embedding lookups included -- behind a
tensors-only signature (``FlatScorer``), every batch dimension dynamic (one request of one candidate
up to large batches), saved as a ``.pt2`` archive that also carries the run's config. A fresh process
reloads it with ``load_exported`` (no model code needed, only fbgemm's operators) and gets the same
scores. FP16 cannot be exported: its overflow check branches on values (docs/serving.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from torch import nn

from pinads_rec import config
from pinads_rec.data.batch import Batch, BatchBuilder
from pinads_rec.data.contract import ContractError, RowGroupChecker, check_schema, contract_columns
from pinads_rec.data.dataset import LoaderSettings, ParquetBatches
from pinads_rec.data.reader import AS_READ_PREFIX, RowGroupReader, list_files, list_row_groups
from pinads_rec.data.shuffle import ShufflePool, read_requests
from pinads_rec.features import FeatureLayout
from pinads_rec.models import build_model
from pinads_rec.modules.precision import DTYPES, set_precision
from pinads_rec.training import checkpoint as ckpt_lib

log = logging.getLogger("pinads_rec.serve")

CONFIG_FILE = "config.json"
# The trainer checkpoints DMP(TrainTask(model)): the model's keys sit under "model." in the state
# dict saved as the DCP entry "model".
CHECKPOINT_PREFIX = "model."
EXPORT_CONFIG = "pinads_rec_config.json"


class ServeError(ValueError):
    """A run, checkpoint or export that cannot be served; the message says what and where."""


# --------------------------------------------------------------------------------------------
# Loading a trained run.
# --------------------------------------------------------------------------------------------


def find_checkpoint(run_dir: Union[str, Path], step: Optional[int] = None) -> Path:
    """``<run_dir>/checkpoints/step-<step>`` (the latest complete one when step is None)."""
    run_dir = Path(run_dir)
    if step is not None:
        path = run_dir / "checkpoints" / f"step-{step}"
        if not (path / ckpt_lib.STATE_FILE).exists():
            raise ServeError(f"{path}: no complete checkpoint there")
        return path
    path = ckpt_lib.latest(run_dir)
    if path is None:
        raise ServeError(
            f"{run_dir}: no checkpoint under {run_dir / 'checkpoints'} (train first, or point --run at a train.run_dir)"
        )
    return path


def run_config(run_dir: Union[str, Path], checkpoint: Optional[Path] = None) -> config.ExperimentConfig:
    """The config the weights were trained with: the checkpoint's own copy, else ``<run>/config.json``."""
    raw = None
    if checkpoint is not None and (checkpoint / ckpt_lib.STATE_FILE).exists():
        raw = json.loads((checkpoint / ckpt_lib.STATE_FILE).read_text()).get("config")
    if raw is None:
        path = Path(run_dir) / CONFIG_FILE
        if not path.exists():
            raise ServeError(f"{run_dir}: no {CONFIG_FILE} and no config in the checkpoint")
        raw = json.loads(path.read_text())
    try:
        return config.from_dict(raw)
    except config.ConfigError as e:
        raise ServeError(f"{run_dir}: the run's config no longer loads ({e})") from None


def load_weights(model: nn.Module, path: Path) -> None:
    """Reads a trainer checkpoint's model weights into the unsharded ``model`` (in place)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    reader = FileSystemReader(str(path))
    saved = {k[len("model.") :] for k in reader.read_metadata().state_dict_metadata if k.startswith("model.")}
    own = model.state_dict()
    missing = sorted(k for k in own if CHECKPOINT_PREFIX + k not in saved)
    if missing:
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise ServeError(
            f"checkpoint {path} lacks weights of this model ({shown}); was it written by another model or code version?"
        )
    state = {CHECKPOINT_PREFIX + k: v for k, v in own.items()}
    # no_dist: read every shard in this one process, even inside an initialized process group.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load({"model": state}, storage_reader=reader, no_dist=True)
    model.load_state_dict({k: state[CHECKPOINT_PREFIX + k] for k in own})


def prepare(model: nn.Module, precision: str, fp16_overflow: str = "error") -> nn.Module:
    """Eval mode, large layers cast to ``precision`` (fp32 | bf16 | fp16), no gradients."""
    if precision not in DTYPES:
        raise ServeError(f"precision must be one of {sorted(DTYPES)}, got {precision!r}")
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    set_precision(model, precision, cast_weights=True, fp16_overflow=fp16_overflow)
    return model


def load_model(
    run_dir: Union[str, Path],
    precision: Optional[str] = None,
    step: Optional[int] = None,
    fp16_overflow: Optional[str] = None,
) -> Tuple[nn.Module, config.ExperimentConfig]:
    """(unsharded model with the trained weights, ready to score; the run's config)."""
    path = find_checkpoint(run_dir, step)
    cfg = run_config(run_dir, path)
    model = build_model(cfg.features, cfg.model)
    load_weights(model, path)
    prec = cfg.model.precision
    prepare(model, precision or prec.inference, fp16_overflow or prec.fp16_overflow)
    log.info("loaded %s (%s, %s)", path, cfg.model.kind, precision or prec.inference)
    return model, cfg


# --------------------------------------------------------------------------------------------
# Arrow rows -> Batch, for requests that do not come from files.
# --------------------------------------------------------------------------------------------


def unbounded_users(cfg: config.ExperimentConfig) -> config.ExperimentConfig:
    """The config for batching files at inference: no ``data.max_unique_users_per_batch``. The bound
    keeps the sharded user-side lookups' batch size fixed in training; unsharded, it would only close
    batches early and pad them with copies of the last request's row, which target attention then
    pads every request of the batch to."""
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, max_unique_users_per_batch=0))


class RequestBatcher:
    """The loader's contract checks and ``BatchBuilder`` for in-memory requests of one user each: one
    user slot, U = 1 per request."""

    def __init__(self, cfg: config.ExperimentConfig):
        self.cfg = cfg
        self.columns = contract_columns(cfg.features)
        self.checker = RowGroupChecker(cfg.features, cfg.data)
        self.builder = BatchBuilder(FeatureLayout.of(cfg.features), user_slots=1, broadcast=cfg.model.broadcast)

    def batch(self, request: pa.Table, where: str) -> Batch:
        f = self.cfg.features
        if request.num_rows == 0:
            raise ContractError(f"{where}: no rows to score")
        if f.columns.request_id in request.column_names:
            ids = len(pc.unique(request.column(f.columns.request_id)))
            if ids != 1:
                raise ContractError(f"{where}: score_request takes the rows of one request, got {ids} request ids")
        table = _with_label_columns(request, self.cfg)
        check_schema(where, table.schema, self.columns)
        table = table.select([c.name for c in self.columns])
        return self.builder.build(self.checker(table, where))


def _with_label_columns(table: pa.Table, cfg: config.ExperimentConfig) -> pa.Table:
    """A served request has no labels: the contract's label (and oracle) columns are filled with 0."""
    for task in cfg.features.tasks:
        for name in (task.label_column, task.true_probability_column):
            if name and table.schema.get_field_index(name) < 0:
                table = table.append_column(name, pa.array(np.zeros(table.num_rows, np.float32)))
    return table


def file_order_batches(cfg: config.ExperimentConfig, data_dir: str, batch_size: Optional[int] = None) -> ParquetBatches:
    """The loader over ``data_dir`` in file order, nothing dropped, without the unique-user bound."""
    return ParquetBatches(
        data_dir, LoaderSettings.of(unbounded_users(cfg)), shuffle=False, batch_size=batch_size, drop_last=False
    )


class _RowScorer:
    """Shared by the eager ``Predictor`` and the reloaded ``ExportedScorer``: rows -> Batch -> [N, T]."""

    cfg: config.ExperimentConfig

    @property
    def tasks(self) -> List[str]:
        return [t.name for t in self.cfg.features.tasks]

    def request_batch(self, request: pa.Table, where: str = "request") -> Batch:
        return self._batcher.batch(request, where)

    def score_request(self, request: pa.Table) -> torch.Tensor:
        """Probabilities [N, T] (tasks in config order) for one request's N candidate rows, given as an
        Arrow table in the data contract (label columns optional). The user-side work runs once."""
        return self.score_batch(self.request_batch(request))

    def score_batch(self, batch: Batch) -> torch.Tensor:
        raise NotImplementedError


class Predictor(_RowScorer):
    """A trained model on CPU, ready to score: ``Predictor.from_run("runs/demo").score_request(rows)``."""

    def __init__(self, model: nn.Module, cfg: config.ExperimentConfig):
        self.model, self.cfg = model, cfg
        self._batcher = RequestBatcher(cfg)

    @classmethod
    def from_run(
        cls,
        run_dir: Union[str, Path],
        precision: Optional[str] = None,
        step: Optional[int] = None,
        fp16_overflow: Optional[str] = None,
    ) -> "Predictor":
        model, cfg = load_model(run_dir, precision, step, fp16_overflow)
        return cls(model, cfg)

    @torch.inference_mode()
    def score_batch(self, batch: Batch) -> torch.Tensor:
        """Probabilities [B, T] of a loader batch (padding rows included: mask with ``batch.valid``)."""
        return torch.sigmoid(self.model(batch).float())


# --------------------------------------------------------------------------------------------
# Scoring a directory of requests.
# --------------------------------------------------------------------------------------------


class ScoringBatches:
    """Every row of ``data_dir`` in file order, nothing shuffled or dropped, as (rows, batch) pairs:
    ``batch`` padded to ``batch_size`` rows (padding marked invalid) and ``rows`` its valid rows, with
    each row's request id and item id as read -- before the contract's id hashing, under
    ``AS_READ_PREFIX + column`` -- so predictions join back to the input. The files are listed and
    their schemas checked here, before the first batch."""

    def __init__(self, cfg: config.ExperimentConfig, data_dir: str, batch_size: Optional[int] = None):
        names = cfg.features.columns
        self.batch_size = batch_size or cfg.data.batch_size
        self.request_column = names.request_id
        self.reader = RowGroupReader(cfg.features, cfg.data, keep_as_read=[names.request_id, names.item_id])
        self.row_groups = list_row_groups(list_files(data_dir), cfg.features)
        # No data.max_unique_users_per_batch (see unbounded_users): up to batch_size requests a batch.
        layout = FeatureLayout.of(cfg.features)
        self.builder = BatchBuilder(layout, user_slots=self.batch_size, broadcast=cfg.model.broadcast)

    def __iter__(self) -> Iterator[Tuple[pa.Table, Batch]]:
        pool = ShufflePool(self.batch_size, max_requests=self.batch_size, buffer_rows=0, rng=None)
        for rows in pool.batches(read_requests(self.reader, self.row_groups, self.request_column)):
            yield rows.table, self.builder.build(rows.table, rows.source, pad_to=self.batch_size)


def score_directory(
    predictor: _RowScorer, data_dir: str, out: Union[str, Path], batch_size: Optional[int] = None
) -> Dict[str, float]:
    """Scores every row of a Parquet directory; writes request_id, item_id, surface (name) and one
    ``p_<task>`` column per task to ``out``, streaming batch by batch. Padding rows are not written."""
    cfg = predictor.cfg
    names = cfg.features.columns
    batches = ScoringBatches(cfg, data_dir, batch_size)
    surfaces = np.array(cfg.features.surfaces, dtype=object)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer, rows, started = None, 0, time.perf_counter()
    try:
        for table, batch in batches:
            probs = predictor.score_batch(batch)
            valid = batch.valid.numpy()
            columns = {
                names.request_id: table.column(AS_READ_PREFIX + names.request_id),
                names.item_id: table.column(AS_READ_PREFIX + names.item_id),
                names.surface: pa.array(surfaces[batch.surface.numpy()[valid]], pa.string()),
            }
            for t, task in enumerate(predictor.tasks):
                columns[f"p_{task}"] = pa.array(probs[:, t].numpy()[valid], pa.float32())
            chunk = pa.table(columns)
            if writer is None:
                writer = pq.ParquetWriter(str(out), chunk.schema)
            writer.write_table(chunk)
            rows += chunk.num_rows
    finally:
        if writer is not None:
            writer.close()
    seconds = time.perf_counter() - started
    if writer is None:
        raise ContractError(f"{data_dir}: no rows to score")
    return {"rows": rows, "seconds": seconds, "rows_per_s": rows / seconds if seconds else 0.0}


# --------------------------------------------------------------------------------------------
# Export: torch.export of the whole model behind a tensors-only signature.
# --------------------------------------------------------------------------------------------

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
        request_index,
        surface,
    ) -> torch.Tensor:
        rows = dense.shape[0]
        fields = {f.name for f in dataclasses.fields(Batch)}
        extra = {"source": ""} if "source" in fields else {}
        batch = Batch(
            dense=dense,
            sparse=_kjt(self.layout.row_keys, sparse_values, sparse_lengths, rows),
            user_sparse=_kjt(self.layout.user_keys, user_values, user_lengths, rows),
            sequences=_kjt(self.layout.sequence_keys, sequence_values, sequence_lengths, rows),
            sequence_time_deltas=sequence_time_deltas,
            sequence_embeddings=sequence_embeddings,
            request_index=request_index,
            surface=surface,
            labels=dense.new_empty(0),
            valid=torch.empty(0, dtype=torch.bool),
            **extra,
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


def export_program(model: nn.Module, cfg: config.ExperimentConfig, example: Batch):
    """``torch.export`` (non-strict) of the whole prepared model on an example batch; every batch
    dimension dynamic, sizes 0 and 1 included (``backed_size_oblivious``: a single request of a single
    candidate is served by the same program)."""
    import torch.fx.experimental._config as fx_config

    if any(getattr(m, "dtype", None) == torch.float16 for m in model.modules()):
        raise ServeError(
            "fp16 cannot be exported: its overflow check (inf/NaN -> error or BF16 redo) "
            "branches on the output's values; export fp32 or bf16"
        )
    flat = FlatScorer(model, cfg.features).eval()
    args = flat_inputs(example)
    auto = torch.export.Dim.AUTO
    dynamic = tuple({k: {0: auto} for k in a} if isinstance(a, dict) else {0: auto} for a in args)
    try:
        with fx_config.patch(backed_size_oblivious=True), _quiet_torchrec_export_warnings(), torch.no_grad():
            return torch.export.export(flat, args, dynamic_shapes=dynamic, strict=False)
    except Exception as e:  # torch.export's errors run to pages: keep the cause, point at the guide
        first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise ServeError(
            f"torch.export of the {cfg.model.kind} model failed: {first} (docs/serving.md, "
            f"'Export', lists what the model code must avoid)"
        ) from e


def export_run(
    run_dir: Union[str, Path],
    out: Union[str, Path],
    data_dir: Optional[str] = None,
    precision: Optional[str] = None,
    example_rows: int = 64,
) -> Path:
    """Exports a run's model to ``out`` (.pt2), traced on the first ``example_rows`` rows of
    ``data_dir`` (default: the run's eval data)."""
    predictor = Predictor.from_run(run_dir, precision)
    cfg = predictor.cfg
    example = next(iter(file_order_batches(cfg, data_dir or cfg.data.eval_dir, example_rows)))
    program = export_program(predictor.model, cfg, example)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "config": config.to_dict(cfg),
        "inputs": list(EXPORT_INPUTS),
        "tasks": predictor.tasks,
        "precision": precision or cfg.model.precision.inference,
        "run": str(run_dir),
    }
    torch.export.save(program, str(out), extra_files={EXPORT_CONFIG: json.dumps(meta, default=str)})
    return out


class ExportedScorer(_RowScorer):
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
    return ExportedScorer(path)


# --------------------------------------------------------------------------------------------
# Two-tower: precomputed ad embeddings.
# --------------------------------------------------------------------------------------------


def export_ads(
    run_dir: Union[str, Path],
    data_dir: Optional[str],
    out: Union[str, Path],
    precision: Optional[str] = None,
    batch_size: Optional[int] = None,
) -> int:
    """Writes a two-tower run's ad vectors of every item in ``data_dir`` (models/two_tower.py)."""
    from pinads_rec.models.two_tower import export_ad_embeddings

    predictor = Predictor.from_run(run_dir, precision)
    cfg = predictor.cfg
    if cfg.model.kind != "two_tower":
        raise ServeError(f"{run_dir}: export-ads needs a two_tower run; this one is model.kind {cfg.model.kind!r}")
    return export_ad_embeddings(
        predictor.model, file_order_batches(cfg, data_dir or cfg.data.eval_dir, batch_size), out
    )


# --------------------------------------------------------------------------------------------
# Command line.
# --------------------------------------------------------------------------------------------


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pinads_rec.serve", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    def common(s: argparse.ArgumentParser, precision: bool = True) -> None:
        s.add_argument("--run", required=True, help="a train.run_dir (holds checkpoints/ and config.json)")
        s.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
        if precision:
            s.add_argument(
                "--precision",
                choices=sorted(DTYPES),
                default=None,
                help="large layers' dtype (default: the run's model.precision.inference)",
            )

    s = sub.add_parser("score", help="score a Parquet directory of requests, write predictions as Parquet")
    common(s)
    s.add_argument("--data", default=None, help="Parquet file or directory (default: the run's data.eval_dir)")
    s.add_argument("--out", default="predictions.parquet")
    s.add_argument(
        "--batch-size",
        type=int,
        default=4096,
        help="rows per batch (default 4096: BF16 pays off on large batches, docs/serving.md)",
    )
    s.add_argument(
        "--fp16-overflow",
        choices=["error", "bf16"],
        default=None,
        help="fp16 only: fail on overflow or redo the layer in bf16 (default: the run's setting)",
    )

    s = sub.add_parser("export", help="torch.export the model to a .pt2 archive")
    common(s)
    s.add_argument("--out", default="model.pt2")
    s.add_argument("--data", default=None, help="data for the example batch (default: the run's eval data)")

    s = sub.add_parser("export-ads", help="two-tower: write every item's ad-tower vectors to Parquet")
    common(s)
    s.add_argument("--data", default=None, help="Parquet file or directory of rows holding the items")
    s.add_argument("--out", default="ads.parquet")
    s.add_argument("--batch-size", type=int, default=None)
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s", force=True)
    logging.getLogger("pinads_rec").setLevel(logging.INFO)
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)  # TorchRec's is_fx_tracing notice
    try:
        if args.command == "score":
            predictor = Predictor.from_run(args.run, args.precision, args.step, args.fp16_overflow)
            data = args.data or predictor.cfg.data.eval_dir
            stats = score_directory(predictor, data, args.out, args.batch_size)
            print(
                f"scored {stats['rows']:,} rows of {data} in {stats['seconds']:.1f}s "
                f"({stats['rows_per_s']:,.0f} rows/s) -> {args.out}"
            )
        elif args.command == "export":
            started = time.perf_counter()
            out = export_run(args.run, args.out, args.data, args.precision)
            print(
                f"exported {args.run} -> {out} ({out.stat().st_size / 2**20:.1f} MiB, "
                f"{time.perf_counter() - started:.0f}s); reload with pinads_rec.serve.load_exported"
            )
        elif args.command == "export-ads":
            n = export_ads(args.run, args.data, args.out, args.precision, args.batch_size)
            print(f"wrote {n:,} ad embeddings -> {args.out}")
    except (ServeError, ContractError, ckpt_lib.IncompatibleCheckpoint) as e:
        print(f"serve error: {str(e).strip().splitlines()[-1]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
