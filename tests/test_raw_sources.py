"""data/raw_sources.py: which files a source names -- local globs listed here, object storage left
to the engine that reads it (Spark's readers list s3a:// and gs:// themselves)."""

from __future__ import annotations

import pytest

from pinads_rec.config import RawSourceConfig
from pinads_rec.data.contract import ContractError
from pinads_rec.data.raw_sources import RawSource, is_remote


def test_local_globs_are_listed_and_a_missing_file_is_named(tmp_path):
    for name in ("b.csv", "a.csv"):
        (tmp_path / name).write_text("x,y\n1,2\n")
    source = RawSource.of(RawSourceConfig(path=["*.csv"]), str(tmp_path), "build.impressions")
    assert source.files == (str(tmp_path / "a.csv"), str(tmp_path / "b.csv")) and source.format == "csv"
    with pytest.raises(ContractError, match=r"build.impressions.path: no file matches 'c.csv'"):
        RawSource.of(RawSourceConfig(path=["c.csv"]), str(tmp_path), "build.impressions")


def test_object_storage_paths_go_to_the_engine_as_given():
    source = RawSource.of(RawSourceConfig(path=["part-*.parquet"]), "s3a://bucket/raw/", "build.impressions")
    assert source.files == ("s3a://bucket/raw/part-*.parquet",) and source.format == "parquet"
    absolute = RawSource.of(RawSourceConfig(path=["gs://b/log.csv"]), "/data", "build.sequences[0]")
    assert absolute.files == ("gs://b/log.csv",)
    assert is_remote("hdfs://nn/x") and not is_remote("/tmp/x") and not is_remote("file:///tmp/x")
