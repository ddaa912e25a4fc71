"""Serving (pinads_rec/serve/): a checkpoint written by a real 2-rank training run loads into the
unsharded model and reproduces the trainer's eval (loading.py); broadcasting on/off, one request vs
the command line's batch scores (scoring.py, batching.py, cli.py); an exported program reloaded in
a fresh process (export.py); BF16 vs FP32, and FP16 overflow detection.

One 2-rank training launch per module (row-wise sharded tables, so every table is split across the
ranks' shards and the load really reassembles them)."""

import copy
import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import REPO, load_tiny, read_rows, rows_of

from pinads_rec.experiments.harness import run_ranks

pytestmark = pytest.mark.slow


def _train(rank, world, result_dir, data_dir, run_dir):
    from pinads_rec import parallel
    from pinads_rec.training.run_log import RunLog
    from pinads_rec.training.trainer import Trainer

    cfg = load_tiny(
        data_dir,
        [
            f"train.run_dir={run_dir}",
            "train.max_steps=8",
            "train.lr=0.003",
            "train.warmup_steps=2",
            "train.sharding_types=[row_wise]",
        ],
    )
    summary = Trainer(cfg, parallel.init_distributed(), hooks=[RunLog()]).run()
    if rank == 0:
        with open(os.path.join(result_dir, "eval.json"), "w") as f:
            json.dump(summary["eval"], f, default=float)


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory):
    """(run_dir, the trainer's eval rows, tiny data dir)."""
    _, data_dir = tiny_data
    tmp = tmp_path_factory.mktemp("serve_run")
    run_dir = str(tmp / "run")
    result_dir = run_ranks(_train, 2, str(tmp), str(data_dir), run_dir, timeout_s=300)
    with open(os.path.join(result_dir, "eval.json")) as f:
        return run_dir, json.load(f), str(data_dir)


@pytest.fixture(scope="module")
def fp32(trained):
    from pinads_rec.serve.scoring import Predictor

    return Predictor.from_run(trained[0], precision="fp32")


@pytest.fixture(scope="module")
def bf16(trained):
    from pinads_rec.serve.scoring import Predictor

    return Predictor.from_run(trained[0], precision="bf16")


@pytest.fixture(scope="module")
def fp32_eval(trained, fp32):
    """One FP32 pass over the eval files (broadcasting on): (probs, labels, surface, batch sizes)."""
    probs, labels, surface, sizes = [], [], [], []
    for batch in _batches(fp32.cfg, os.path.join(trained[2], "eval")):
        probs.append(fp32.score_batch(batch)[batch.valid])
        labels.append(batch.labels[batch.valid])
        surface.append(batch.surface[batch.valid])
        sizes.append((batch.batch_size, batch.num_requests))
    return torch.cat(probs), torch.cat(labels), torch.cat(surface), sizes


def _metrics(cfg, probs, labels, surface):
    from pinads_rec.metrics import MetricAccumulator

    acc = MetricAccumulator([t.name for t in cfg.features.tasks], cfg.features.surfaces, has_oracle=False)
    acc.update(probs, labels, surface)
    return acc.compute()


def _batches(cfg, directory, broadcast=True, batch_size=None):
    from pinads_rec.data.loader.dataset import LoaderSettings, ParquetBatches

    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, broadcast=broadcast))
    return ParquetBatches(directory, LoaderSettings.of(cfg), shuffle=False, batch_size=batch_size, drop_last=False)


def _score_all(predictor, directory, broadcast=True):
    """Probabilities of every valid row, in loader order, plus the batches' (rows, users) sizes."""
    probs, sizes = [], []
    for batch in _batches(predictor.cfg, directory, broadcast):
        probs.append(predictor.score_batch(batch)[batch.valid])
        sizes.append((batch.batch_size, batch.num_requests))
    return torch.cat(probs), sizes


def _request_rows(data_dir, count):
    """Raw rows (as in the file, before the contract's repairs) of the first ``count`` requests of
    the first eval file, one Arrow table each, the first one cut to a single candidate."""
    first = sorted((p for p in os.scandir(os.path.join(data_dir, "eval"))), key=lambda p: p.name)[0].path
    table = rows_of(pq.read_table(first))  # one row per candidate, as a live request comes
    req = table.column("request_id").to_numpy()
    starts = np.flatnonzero(np.concatenate([[True], req[1:] != req[:-1]]))
    ends = np.append(starts[1:], len(req))
    out = [table.slice(s, e - s) for s, e in zip(starts[:count], ends[:count])]
    out[0] = out[0].slice(0, 1)
    return out


def test_checkpoint_loads_into_the_unsharded_model_with_full_trained_tables(fp32):
    from pinads_rec.models.ranker import UnifiedRanker

    model = fp32.model
    assert isinstance(model, UnifiedRanker) and not model.training
    # Full-shape plain tensors, and trained (the row-wise shards were reassembled, not left at init).
    table = model.ec.embeddings["item"].weight
    assert type(table) is torch.nn.Parameter and table.shape[0] == fp32.cfg.features.table("item").num_embeddings
    fresh = UnifiedRanker(fp32.cfg.features, fp32.cfg.model)
    assert not torch.equal(fresh.cross.module.W_kernels[0], model.cross.module.W_kernels[0])


def test_loaded_model_reproduces_the_trainers_eval(trained, fp32, fp32_eval):
    trainer_rows = trained[1]
    ours = _metrics(fp32.cfg, *fp32_eval[:3])
    assert len(ours) == len(trainer_rows) == 12
    for mine, theirs in zip(ours, trainer_rows):
        assert (mine["surface"], mine["task"], mine["examples"]) == (
            theirs["surface"],
            theirs["task"],
            theirs["examples"],
        )
        assert mine["auc"] == pytest.approx(theirs["auc"], abs=1e-4, nan_ok=True), mine
        assert mine["log_loss"] == pytest.approx(theirs["log_loss"], rel=1e-5), mine
        assert mine["calibration"] == pytest.approx(theirs["calibration"], rel=1e-5, nan_ok=True), mine


def test_broadcasting_on_and_off_give_the_same_scores(trained, fp32, fp32_eval):
    on, on_sizes = fp32_eval[0], fp32_eval[3]
    off, off_sizes = _score_all(fp32, os.path.join(trained[2], "eval"), broadcast=False)
    assert all(users < rows for rows, users in on_sizes[:-1]), "broadcasting: fewer users than rows"
    assert all(users == rows for rows, users in off_sizes), "no broadcasting: one user slot per row"
    assert on.shape == off.shape and on.shape[0] > 1000
    assert float((on - off).abs().max()) < 1e-5


@pytest.fixture(scope="module")
def cli_predictions(trained, tmp_path_factory):
    """``python -m pinads_rec.serve score`` of the eval files in FP32, read back."""
    from pinads_rec.serve.cli import main

    run_dir, _, data_dir = trained
    out = tmp_path_factory.mktemp("serve_cli") / "predictions.parquet"
    args = [
        "score",
        "--run",
        run_dir,
        "--data",
        os.path.join(data_dir, "eval"),
        "--out",
        str(out),
        "--precision",
        "fp32",
    ]
    assert main(args) == 0
    return pq.read_table(out)


def test_cli_score_writes_every_input_row_once(trained, fp32, cli_predictions):
    data_dir = trained[2]
    written = cli_predictions
    total = read_rows(os.path.join(data_dir, "eval")).num_rows
    assert written.num_rows == total, "every row once, padding rows not written"
    assert written.column_names == ["request_id", "item_id", "surface", "p_click", "p_good_click", "p_save"]
    assert set(written.column("surface").to_pylist()) <= set(fp32.cfg.features.surfaces)


def test_score_request_equals_the_cli_batch_scores(trained, fp32, cli_predictions):
    written = cli_predictions
    by_key = {
        (r, i): row
        for r, i, row in zip(
            written.column("request_id").to_pylist(),
            written.column("item_id").to_pylist(),
            np.stack([written.column(f"p_{t}").to_numpy() for t in fp32.tasks], 1),
        )
    }
    for request in _request_rows(trained[2], 4):
        labels = [t.label_column for t in fp32.cfg.features.tasks] + [
            t.true_probability_column for t in fp32.cfg.features.tasks
        ]
        served = request.drop_columns(labels)  # a live request has no labels
        probs = fp32.score_request(served)
        assert probs.shape == (request.num_rows, 3)
        batch = fp32.request_batch(served)
        assert batch.num_requests == 1, "U = 1: the user-side work runs once for the request"
        expected = np.stack(
            [
                by_key[(r, i)]
                for r, i in zip(request.column("request_id").to_pylist(), request.column("item_id").to_pylist())
            ]
        )
        assert np.abs(probs.numpy() - expected).max() < 1e-5


def test_score_request_refuses_the_rows_of_two_requests(trained, fp32):
    with pytest.raises(ValueError, match="one request"):
        fp32.score_request(pa.concat_tables(_request_rows(trained[2], 2)))


@pytest.fixture(scope="module")
def exported(trained, bf16, tmp_path_factory):
    """A BF16 export reloaded in a fresh process: (its scores of a 200-row batch and of single
    requests, the batch, the requests -- the first one a single candidate)."""
    from pinads_rec.serve.export import export_run

    run_dir, _, data_dir = trained
    tmp = tmp_path_factory.mktemp("serve_export")
    path = export_run(run_dir, tmp / "model.pt2", os.path.join(data_dir, "eval"), precision="bf16")
    requests = _request_rows(data_dir, 3)
    for i, r in enumerate(requests):
        pq.write_table(r, tmp / f"request-{i}.parquet")
    batch = next(iter(_batches(bf16.cfg, os.path.join(data_dir, "eval"), batch_size=200)))
    torch.save(batch, tmp / "batch.pt")
    # cwd=REPO: ``python -c`` puts the working directory first on sys.path, so this checkout is imported.
    script = f"""
import json, torch, pyarrow.parquet as pq
from pinads_rec.serve import load_exported
scorer = load_exported({str(path)!r})
out = {{"batch": scorer.score_batch(torch.load({str(tmp / "batch.pt")!r}, weights_only=False)).tolist(),
        "requests": [scorer.score_request(pq.read_table({str(tmp)!r} + f"/request-{{i}}.parquet")).tolist()
                     for i in range({len(requests)})]}}
json.dump(out, open({str(tmp / "out.json")!r}, "w"))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(tmp / "out.json") as f:
        got = json.load(f)
    return got, batch, requests


def test_exported_program_scores_a_batch_like_the_eager_model(bf16, exported):
    got, batch, _ = exported
    expected = bf16.score_batch(batch)
    assert torch.tensor(got["batch"]).shape == expected.shape
    assert float((torch.tensor(got["batch"]) - expected).abs().max()) < 1e-5


def test_exported_program_scores_single_requests_like_the_eager_model(bf16, exported):
    got, _, requests = exported
    assert [len(r) for r in got["requests"]] == [r.num_rows for r in requests] and requests[0].num_rows == 1
    for rows, r in zip(got["requests"], requests):
        assert float((torch.tensor(rows) - bf16.score_request(r)).abs().max()) < 1e-5


def test_bf16_casts_the_large_layers_only(bf16):
    assert bf16.model.cross.module.W_kernels[0].dtype == torch.bfloat16  # a large layer, cast once
    assert bf16.model.calibration.scale.dtype == torch.float32  # small layers stay FP32


def test_default_inference_precision_is_auto_resolved_for_this_cpu(trained, caplog):
    """model.precision.inference defaults to auto: BF16 on a CPU with BF16 units, FP32 elsewhere,
    logged; the config as served names what it chose."""
    from pinads_rec.modules.precision import DTYPES, fast_bf16
    from pinads_rec.serve.scoring import Predictor

    fast, why = fast_bf16(torch.device("cpu"))
    want = "bf16" if fast else "fp32"
    with caplog.at_level("INFO"):
        default = Predictor.from_run(trained[0])
    assert default.cfg.model.precision.inference == want
    assert default.model.cross.module.W_kernels[0].dtype == DTYPES[want]
    assert f"inference precision auto -> {want}: {why}" in caplog.text


def test_bf16_inference_is_close_to_fp32(trained, fp32, fp32_eval, bf16):
    a, labels, surface, _ = fp32_eval
    b, _ = _score_all(bf16, os.path.join(trained[2], "eval"))
    assert torch.isfinite(b).all()
    assert float((a - b).abs().max()) < 0.02 and float((a - b).abs().mean()) < 2e-3
    ours, theirs = _metrics(fp32.cfg, a, labels, surface), _metrics(bf16.cfg, b, labels, surface)
    for x, y in zip(ours, theirs):
        if x["positives"] >= 20:
            assert abs(x["auc"] - y["auc"]) < 0.01, (x, y)


@pytest.fixture(scope="module")
def first_batch(trained, fp32):
    return next(iter(_batches(fp32.cfg, os.path.join(trained[2], "eval"))))


def _fp16(fp32, overflow):
    """A copy of the FP32 predictor's model in FP16, overflow handled by ``overflow`` (error | bf16)."""
    from pinads_rec.serve.loading import prepare
    from pinads_rec.serve.scoring import Predictor

    fp16 = Predictor(copy.deepcopy(fp32.model), fp32.cfg)
    prepare(fp16.model, "fp16", fp16_overflow=overflow)
    return fp16


def _crafted(batch):
    """Pretrained event embeddings far beyond FP16's range (max 65504)."""
    return dataclasses.replace(batch, sequence_embeddings={k: v * 1e6 for k, v in batch.sequence_embeddings.items()})


def _cross_overflowing_input(model):
    """The articles' case: the DCNv2 cross layer overflows inside (inputs of a few hundred are in range)."""
    return 300.0 * torch.ones(8, model.cross.module.W_kernels[0].shape[0])


def test_fp16_scores_an_ordinary_batch(fp32, first_batch):
    assert torch.isfinite(_fp16(fp32, "error").score_batch(first_batch)).all()


def test_fp16_overflow_in_the_transformer_is_an_error_never_a_silent_nan(fp32, first_batch):
    from pinads_rec.modules.precision import PrecisionOverflow

    with pytest.raises(PrecisionOverflow, match="transformer.stack: FP16 overflow"):
        _fp16(fp32, "error").score_batch(_crafted(first_batch))


def test_fp16_overflow_in_the_cross_network_is_an_error_never_a_silent_nan(fp32):
    from pinads_rec.modules.precision import PrecisionOverflow

    model = _fp16(fp32, "error").model
    with pytest.raises(PrecisionOverflow, match="cross: FP16 overflow"):
        model.cross(_cross_overflowing_input(model))


def test_fp16_fallback_redoes_an_overflowing_layer_in_bf16_and_counts_it(fp32):
    from pinads_rec.modules.precision import fallback_count
    from pinads_rec.serve.loading import prepare

    model = _fp16(fp32, "bf16").model
    x = _cross_overflowing_input(model)
    before = fallback_count(model)
    y = model.cross(x)
    assert fallback_count(model) == before + 1, "the layer was redone in BF16, and counted"
    assert torch.isfinite(y).all()
    bf16 = copy.deepcopy(fp32.model)
    prepare(bf16, "bf16")
    reference = bf16.cross(x)
    assert float((y - reference).norm() / reference.norm()) < 0.05  # what BF16 inference gives


def test_fp16_fallback_scores_a_crafted_request(fp32, first_batch):
    from pinads_rec.modules.precision import fallback_count

    fp16 = _fp16(fp32, "bf16")
    probs = fp16.score_batch(_crafted(first_batch))
    assert fallback_count(fp16.model) >= 1, "the overflowing Transformer was redone in BF16, and counted"
    assert torch.isfinite(probs).all()
