"""Embedding tables at serving size (serve/quantize.py, serve/guard.py): the served run's tables at
FP16 / INT8 / INT4 through TorchRec's quantized collections -- their bytes as fbgemm lays the rows
out, scores close to FP32's, the same through ``serve score --set``, a quantized export reloaded in a
fresh process scoring as the eager model, the AUC guard's per-table choice written and taken back,
and a table or dtype the config does not have refused in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import torch
import yaml
from conftest import REPO

from pinads_rec import config
from pinads_rec.serve import guard
from pinads_rec.serve.batching import ScoringBatches
from pinads_rec.serve.quantize import embedding_bytes, table_bytes, table_dtypes
from pinads_rec.serve.scoring import Predictor

pytestmark = pytest.mark.slow


def _predictor(run, **tables):
    return Predictor.from_run(run, "fp32", serve=tables or None)


@pytest.fixture(scope="module")
def eval_batch(served_run):
    run, _, _ = served_run
    cfg = _predictor(run).cfg
    return next(iter(ScoringBatches(cfg, cfg.data.eval_dir, 256)))[1]


@pytest.mark.parametrize("dtype, bound", [("fp16", 1e-3), ("int8", 5e-3), ("int4", 5e-2)])
def test_each_dtype_holds_the_rows_fbgemm_lays_out_and_scores_close_to_fp32(served_run, eval_batch, dtype, bound):
    run, _, _ = served_run
    fp32, small = _predictor(run), _predictor(run, embedding_dtype=dtype)
    assert set(table_dtypes(small.cfg).values()) == {dtype} and small.cfg.serve.embedding_dtype == dtype
    assert type(small.model.ec).__module__ == "torchrec.quant.embedding_modules"
    # measured storage = rows x fbgemm's row size (D + 4 bytes at INT8, D/2 + 4 at INT4), within a few small buffers
    expected = sum(table_bytes(small.cfg, dtype).values())
    assert expected <= embedding_bytes(small.model) <= expected + 16384
    assert embedding_bytes(fp32.model) == sum(table_bytes(fp32.cfg, "fp32").values())
    gap = float((small.score_batch(eval_batch) - fp32.score_batch(eval_batch))[eval_batch.valid].abs().max())
    assert 0.0 < gap <= bound  # quantized for real, and close


def test_a_table_kept_in_fp32_is_left_float(served_run, eval_batch):
    run, _, _ = served_run
    mixed = _predictor(run, embedding_dtype="int8", table_dtypes={"item": "fp32"})
    dtypes = table_dtypes(mixed.cfg)
    assert dtypes["item"] == "fp32" and dtypes["user"] == "int8"
    every = _predictor(run, embedding_dtype="int8")
    assert embedding_bytes(mixed.model) > embedding_bytes(every.model)


def test_serve_score_takes_the_dtypes_and_refuses_a_table_it_does_not_have(served_run, tmp_path):
    run, _, _ = served_run
    out = tmp_path / "int8.parquet"
    cmd = [sys.executable, "-m", "pinads_rec.serve", "score", "--run", str(run), "--precision", "fp32"]
    args = ["--out", str(out), "--set", "embedding_dtype=int8"]
    done = subprocess.run(cmd + args, capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    from pinads_rec.serve.scoring import score_directory

    eager = tmp_path / "eager.parquet"
    int8 = _predictor(run, embedding_dtype="int8")
    score_directory(int8, int8.cfg.data.eval_dir, eager)
    a, b = pq.read_table(out).to_pandas(), pq.read_table(eager).to_pandas()
    assert len(a) == len(b) and (a.filter(like="p_") - b.filter(like="p_")).abs().max().max() <= 1e-6
    bad = subprocess.run(cmd + ["--set", "table_dtypes.nope=int8"], capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 2 and "serve.table_dtypes.nope: no such table" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr


def test_a_quantized_export_reloaded_in_a_fresh_process_scores_as_the_eager_model(served_run, eval_batch, tmp_path):
    from pinads_rec.serve.export import export_run

    run, _, _ = served_run
    path = export_run(run, tmp_path / "int8.pt2", precision="fp32", serve={"embedding_dtype": "int8"})
    torch.save(eval_batch, tmp_path / "batch.pt")
    script = f"""
import json, torch
from pinads_rec.serve import load_exported
scorer = load_exported({str(path)!r})
batch = torch.load({str(tmp_path / "batch.pt")!r}, weights_only=False)
json.dump({{"scores": scorer.score_batch(batch).tolist(), "dtype": scorer.cfg.serve.embedding_dtype}},
          open({str(tmp_path / "out.json")!r}, "w"))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads((tmp_path / "out.json").read_text())
    expected = _predictor(run, embedding_dtype="int8").score_batch(eval_batch)
    assert got["dtype"] == "int8"
    assert float((torch.tensor(got["scores"]) - expected).abs().max()) <= 1e-6


def test_the_guard_measures_every_table_and_writes_a_choice_within_its_tolerance(served_run, tmp_path):
    run, _, _ = served_run
    result = guard.guard(run, dtypes=["int8", "int4"], tolerance=0.001, precision="fp32", echo=lambda *_: None)
    cfg = _predictor(run).cfg
    assert set(result["tables"]) == {t.name for t in cfg.features.tables}
    for t in result["tables"].values():
        assert t["bytes"]["int4"] < t["bytes"]["int8"] < t["bytes"]["fp32"]
        assert set(t["deltas"]) == {"int8", "int4"}
    assert result["all"]["int4"]["bytes"] < result["all"]["int8"]["bytes"] < result["fp32_bytes"]
    assert (
        guard.worst_auc(result["choice_deltas"]) <= 0.001 and guard.worst_calibration(result["choice_deltas"]) <= 0.005
    )
    for name, d in result["choice"].items():  # each table's choice is within the tolerances on its own
        own = result["tables"][name]["deltas"].get(d)
        assert d == "fp32" or (guard.worst_auc(own) <= 0.001 and guard.worst_calibration(own) <= 0.005)
    text = guard.report(result)
    assert "every table" in text and "the choice" in text
    written = guard.write_choice(result["choice"], tmp_path / "tables.yaml")
    section = yaml.safe_load(written.read_text())["serve"]
    raw = config.to_dict(cfg)
    raw["serve"].update(section)
    taken = table_dtypes(config.from_dict(raw))
    assert taken == result["choice"]
    json.dumps(guard.as_json(result))  # every key a string


def test_a_dtype_or_table_the_config_lacks_is_refused():
    demo = os.path.join(REPO, "configs", "demo.yaml")
    with pytest.raises(config.ConfigError, match="serve.embedding_dtype"):
        config.load(demo, ["serve.embedding_dtype=int2"])
    with pytest.raises(config.ConfigError, match="serve.table_dtypes.item: 'int3'"):
        config.load(demo, ["serve.table_dtypes={item: int3}"])
