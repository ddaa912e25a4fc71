"""data/raw_sources.py: which files a source names -- local globs listed here, object storage left
to the engine that reads it (Spark's readers list s3a:// and gs:// themselves) -- and how their bytes
are read (data/raw_bytes.py): mixed line endings, compression under a plain name, UTF-16, an error's
line in a file read through a copy, control bytes escaped in a message."""

from __future__ import annotations

import bz2
import gzip

import duckdb
import pyarrow as pa
import pytest

from pinads_rec.config import RawSourceConfig
from pinads_rec.data.loader.contract import ContractError
from pinads_rec.data.raw_sources import RawSource, explain, is_remote


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


CLEAN = "user,time,item,surface\n" + "".join(f"{u},{1494000000 + u},{u * 7},home\n" for u in range(1, 41))


def rows(tmp_path, name: str, data: bytes, **config):
    """(source, its rows as DuckDB reads them through the build's scan, each row's filename)."""
    (tmp_path / name).write_bytes(data)
    source = RawSource.of(RawSourceConfig(path=[name], **config), str(tmp_path), "build.impressions")
    con = duckdb.connect()
    try:
        query = f"SELECT user, time, item, surface, filename FROM {source.scan()} ORDER BY user"
        return source, con.execute(query).fetchall()
    finally:
        con.close()


def refusal(tmp_path, name: str = "log.csv", **config) -> str:
    """The one-line message ``explain`` gives for DuckDB's refusal to scan ``tmp_path/name``."""
    source = RawSource.of(RawSourceConfig(path=[name], **config), str(tmp_path), "build.impressions")
    with pytest.raises(duckdb.Error) as info:
        duckdb.connect().execute(f"SELECT count(*) FROM {source.scan()}").fetchall()
    return explain(info.value, [source])


def mixed(text: str, from_line: int) -> bytes:
    """``text`` with its lines from ``from_line`` (1-based) on ending in CRLF: a chunk appended from another system."""
    lines = text.split("\n")
    return ("\n".join(lines[: from_line - 1]) + "\n" + "\r\n".join(lines[from_line - 1 :])).encode()


@pytest.mark.parametrize(
    "data",
    [
        mixed(CLEAN, 30),
        mixed(CLEAN, 2),
        CLEAN.replace("\n", "\r\n", 5).encode(),  # CRLF first, LF after
        CLEAN.replace("\n", "\r").encode(),
        gzip.compress(mixed(CLEAN, 12)),
        pa.compress(CLEAN.encode(), codec="zstd", asbytes=True),
        b"\xff\xfe" + CLEAN.replace("\n", "\r\n").encode("utf-16-le"),
        b"\xfe\xff" + CLEAN.encode("utf-16-be"),
    ],
    ids=["crlf-tail", "crlf-after-header", "crlf-head", "cr", "gzip-mixed", "zstd", "utf16-le", "utf16-be"],
)
def test_stored_another_way_the_rows_are_the_clean_files(tmp_path, data):
    """Mixed line endings (DuckDB alone: "Error when sniffing file"), gzip and zstd bytes named .csv
    (DuckDB alone: read as text, blamed on the encoding), UTF-16 of either byte order: the rows of
    the clean file, each row's filename the configured file."""
    _, expected = rows(tmp_path, "clean.csv", CLEAN.encode())
    _, got = rows(tmp_path, "log.csv", data)
    assert [r[:-1] for r in got] == [r[:-1] for r in expected] and len(got) == 40
    assert {r[-1] for r in got} == {str(tmp_path / "log.csv")}


def test_a_bad_line_in_a_mixed_file_is_named_in_the_original(tmp_path):
    """A file with mixed line endings is read through a copy: DuckDB's error names the copy, the
    message the configured file and the line, counted as in the original."""
    lines = CLEAN.split("\n")
    lines[24] += ",extra"  # line 25
    (tmp_path / "log.csv").write_bytes(mixed("\n".join(lines), 10))
    assert refusal(tmp_path) == (
        f"build.impressions: {tmp_path / 'log.csv'}, row 23 (line 25): 5 field(s) where the header has 4: an extra "
        f"value 'extra' after column 'surface'"
    )


def test_compressions_duckdb_does_not_read_are_named(tmp_path):
    (tmp_path / "log.csv").write_bytes(bz2.compress(CLEAN.encode()))
    with pytest.raises(ContractError) as info:
        RawSource.of(RawSourceConfig(path=["log.csv"]), str(tmp_path), "build.impressions")
    assert str(info.value) == (
        f"build.impressions.path: {tmp_path / 'log.csv'} holds bzip2-compressed bytes (it starts with b'BZh9'), "
        f"which DuckDB does not read: decompress it, or compress it with gzip or zstd"
    )
    (tmp_path / "cut.csv").write_bytes(gzip.compress(CLEAN.encode())[:60])  # a download cut short
    with pytest.raises(ContractError, match=r"^build.impressions.path: \S+/cut.csv: its gzip stream breaks off after"):
        RawSource.of(RawSourceConfig(path=["cut.csv"]), str(tmp_path), "build.impressions")


def test_control_bytes_quoted_from_a_file_are_escaped(tmp_path):
    """A value quoted in a message has its control bytes escaped: a terminal shows them, never acts on them."""
    data = CLEAN.encode().replace(b"\n7,", b"\n7\x1b[2J\xff,", 1)  # a screen-clearing escape, a byte not UTF-8
    (tmp_path / "log.csv").write_bytes(data)
    message = refusal(tmp_path)
    assert message.isprintable() and "value '7\\x1b[2J\\xff' is not valid utf-8" in message
    assert "row 6 (line 8)" in message


@pytest.mark.parametrize("names", [[], ["user", "time", "item", "surface"]], ids=["header", "names"])
def test_a_first_line_out_of_step_is_named_not_skipped(tmp_path, names):
    """DuckDB's sniffer skips leading lines out of step with the rest: a header one field short was dropped and
    the first row taken for the header; a headerless file (names) silently lost its first row. Read with skip = 0,
    the line is named."""
    lines = CLEAN.split("\n")
    lines[0 if not names else 1] = lines[0 if not names else 1].rsplit(",", 1)[0]  # one field short
    (tmp_path / "log.csv").write_text("\n".join(lines[0 if not names else 1 :]))
    message = refusal(tmp_path, names=names)
    expected = (
        "row 0 (line 2): 4 field(s) where the header has 3: an extra value 'home' after column 'item'"
        if not names
        else "row 0 (line 1): 3 field(s) where the header has 4: no value for column 'surface' (the line ends after "
        "'item' = '7')"
    )
    assert message == f"build.impressions: {tmp_path / 'log.csv'}, {expected}"


def test_a_quote_never_closed_is_named_not_read_into_the_value(tmp_path):
    """In a file with no quoted field DuckDB's sniffer reads a stray '"' as part of the value ('"home'); read with
    RFC 4180's quote, the line is refused where the quote opens. A quoted field, and a '"' inside a field, still
    read."""
    data = CLEAN.replace("\n9,", '\n9,"', 1)
    (tmp_path / "log.csv").write_text(data)
    assert refusal(tmp_path) == (
        f"build.impressions: {tmp_path / 'log.csv'}, row 8 (line 10): column 'time': a quote opens its value and does "
        f"not close it as RFC 4180 has it (the line reads '9,\"1494000009,63,home')"
    )
    quoted = CLEAN.replace(",home\n", ',"ho,me"\n', 1).replace(",home\n", ',ho"me\n', 1)
    _, got = rows(tmp_path, "quoted.csv", quoted.encode())
    assert [r[3] for r in got[:3]] == ["ho,me", 'ho"me', "home"]
