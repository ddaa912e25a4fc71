"""The demo's raw logs, built by pinads_rec.data.build with configs/demo.yaml's build: section,
equal the generator's own contract output row by row, split by split, every contract column."""

from __future__ import annotations

import time

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from conftest import DEMO, load_tiny

from pinads_rec.config import ConfigError, SplitConfig, load
from pinads_rec.data import build as B
from pinads_rec.data import synth as S
from pinads_rec.data.loader.contract import contract_columns
from pinads_rec.data.loader.storage_layout import to_per_row

# Tiny sizes, but users with several requests (timelines) and the demo's sequence caps.
OVERRIDES = ["synth.num_users=150", "synth.sequence_length=100"]


def _iso(t: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))


def _read(directory) -> pa.Table:
    return pa.concat_tables(pq.read_table(p) for p in sorted(directory.glob("part-*.parquet")))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("build_demo")
    cfg = load_tiny(root / "synth", OVERRIDES)
    summary = S.generate(cfg, root / "synth", raw=True)
    # The build section's split boundaries are those of the demo's sizes; these sizes cut elsewhere.
    bounds = S.split_boundaries(cfg.synth)
    cfg.build.splits = [
        SplitConfig("train", end=_iso(bounds["train"][1])),
        SplitConfig("calibration", start=_iso(bounds["calibration"][0]), end=_iso(bounds["calibration"][1])),
        SplitConfig("eval", start=_iso(bounds["eval"][0])),
    ]
    build_summary = B.build(cfg, str(root / "synth" / "raw"), str(root / "built"))
    return cfg, root, summary, build_summary


@pytest.mark.parametrize("split", ["train", "calibration", "eval"])
def test_built_equals_generated_row_by_row(built, split):
    cfg, root, summary, build_summary = built
    f = cfg.features
    # Both per request, each storing what it chose once per request (its schema metadata says what).
    generated = to_per_row(_read(root / "synth" / split), f)
    made = to_per_row(_read(root / "built" / split), f)
    assert made.num_rows == generated.num_rows == summary["splits"][split]["rows"]
    assert build_summary["splits"][split]["requests"] == summary["splits"][split]["requests"]
    # Both sorted by request id; a request's candidates stay in their order (position).
    rid = f.columns.request_id
    generated = generated.take(pc.sort_indices(generated.column(rid)))  # stable: candidate order kept
    made = made.take(pc.sort_indices(made.column(rid)))
    columns = [c.name for c in contract_columns(f)]
    assert set(columns) <= set(made.column_names)
    for name in columns:
        want = generated.column(name).combine_chunks()
        got = made.column(name).combine_chunks().cast(want.type)
        if not got.equals(want):
            bad = next(i for i in range(len(want)) if got[i] != want[i])
            pytest.fail(f"{split}.{name}: row {bad} (request {generated.column(rid)[bad]}): {got[bad]} != {want[bad]}")


def test_raw_logs_have_no_request_id_to_match_on(built):
    _, root, summary, build_summary = built
    raw = root / "synth" / "raw"
    for name in S.RAW_LOGS.values():
        cols = pq.read_schema(raw / f"{name}.parquet").names
        assert cols[:2] == ["user_id", "timestamp"] and "request_id" not in cols, (name, cols)
        assert summary["raw"][name]["rows"] > 0
    assert build_summary["repairs"]["duplicated impressions (dropped)"] == 0
    assert all(n == 0 for n in build_summary["join_misses"].values())


def test_raw_refuses_faults_and_mismatched_caps(tmp_path):
    with pytest.raises(ConfigError, match="synth.faults"):
        S.generate(load_tiny(tmp_path, OVERRIDES + ["synth.faults.stale_fraction=0.1"]), tmp_path, raw=True)
    with pytest.raises(ConfigError, match=r"max_length: 100, but the generator caps"):
        S.generate(load_tiny(tmp_path), tmp_path, raw=True)  # TINY_SYNTH: sequence_length 20


def test_demo_build_splits_are_the_generators_windows():
    """configs/demo.yaml's build.splits cut where the generator cuts the demo's sizes."""
    cfg = load(DEMO)
    bounds = S.split_boundaries(cfg.synth)
    got = {s.name: (s.start, s.end) for s in cfg.build.splits}
    assert got == {
        "train": (None, _iso(bounds["train"][1])),
        "calibration": (_iso(bounds["calibration"][0]), _iso(bounds["calibration"][1])),
        "eval": (_iso(bounds["eval"][0]), None),
    }
