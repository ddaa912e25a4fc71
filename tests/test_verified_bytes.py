"""Verified bytes (docs/data_build.md, "Verified bytes"): a Parquet file whose bytes changed after it
was written, its size unchanged, is refused with one line naming it -- by training's loader, by
``serve score`` and by ``inspect --verify`` -- never read as data. Generated files carry page checksums
(data/page_checksums.py); a build's files are also hashed against its manifest (data/build_output.py).
And ``serve score`` removes the temporary file a killed score to the same --out left.

Data: the golden config's generated files (about a second) and its committed run (tests/golden/run);
the Taobao-shaped fixture's build (tests/dataset_fixtures.py, under a second)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from dataset_fixtures import write_taobao
from test_golden import CONFIG, RESUME_STEP, SAVED_RUN, data_overrides, make_data

from pinads_rec import config, serve
from pinads_rec.data import inspect as insp
from pinads_rec.data.build import build
from pinads_rec.data.loader.contract import ContractError
from pinads_rec.data.loader.dataset import LoaderSettings, ParquetBatches
from pinads_rec.data.page_checksums import CheckedParquetFile
from pinads_rec.data.vocabulary import Vocabularies
from pinads_rec.serve.scoring import remove_stale_temporaries

REPO = Path(__file__).resolve().parent.parent
TAOBAO = REPO / "configs" / "datasets" / "taobao_ad.yaml"
PAGE = r"{}: row group {} fails its page checksum \(the file's bytes changed after it was written"


def corrupt_page(path: Path, row_group: int, column: str = None) -> None:
    """Inverts 8 bytes in the middle of the row group's largest column chunk, or ``column``'s (a data
    page's values, past its header), keeping the file's size."""
    md = pq.ParquetFile(path).metadata.row_group(row_group)
    chunks = [md.column(j) for j in range(md.num_columns)]
    chunks = [c for c in chunks if column is None or c.path_in_schema.split(".")[0] == column]
    chunk = max(chunks, key=lambda c: c.total_compressed_size)
    at = chunk.data_page_offset + chunk.total_compressed_size // 2
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(at)
        data = f.read(8)
        f.seek(at)
        f.write(bytes(b ^ 0xFF for b in data))
    assert path.stat().st_size == size


def zero_page_header(path: Path, row_group: int) -> None:
    """Zeroes 4 KiB from the start of the row group's largest column chunk: its first page header,
    which no checksum covers, and the page after it (as a disk's zeroed block would), keeping the size."""
    md = pq.ParquetFile(path).metadata.row_group(row_group)
    chunk = max((md.column(j) for j in range(md.num_columns)), key=lambda c: c.total_compressed_size)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(chunk.data_page_offset)
        f.write(bytes(min(4096, chunk.total_compressed_size)))
    assert path.stat().st_size == size


DAMAGES = {"page": corrupt_page, "header": zero_page_header}
# What each damage gives: a page's checksum fails, or a page header no longer decodes.
SAID = {
    "page": PAGE,
    "header": r"{}, row group {}: cannot be read \(.*\): the file is damaged or was not written as Parquet; restore",
}


def one_line(text: str) -> str:
    assert text.count("\n") <= 1, text
    return text.strip()


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("generated")
    make_data(out)
    return out


def damaged_copy(generated: Path, tmp_path: Path, split: str = "eval", damage: str = "page") -> Path:
    """A copy of the generated data whose ``split``/part-00001.parquet has row group 1 damaged."""
    data = tmp_path / "data"
    shutil.copytree(generated, data)
    DAMAGES[damage](data / split / "part-00001.parquet", 1)
    return data


@pytest.fixture
def damaged(generated, tmp_path) -> Path:
    """A copy of the generated data whose eval/part-00001.parquet has row group 1 corrupted."""
    return damaged_copy(generated, tmp_path)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("verified_build")
    write_taobao(root / "raw", users=40, requests_per_user=3)
    build(config.load(TAOBAO, ["build.requests_per_row_group=16"]), str(root / "raw"), str(root / "out"), threads=1)
    return root / "out"


@pytest.fixture
def build_copy(built, tmp_path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(built, out)
    return out


def test_the_writers_checksums_turn_a_silent_change_into_an_error(damaged, generated):
    bad = damaged / "eval" / "part-00001.parquet"
    # Read as the readers did before: the row group's values come back changed, and nothing says so.
    assert pq.ParquetFile(bad).read_row_group(1) != pq.ParquetFile(
        generated / "eval" / "part-00001.parquet"
    ).read_row_group(1)
    with pytest.raises(ContractError, match=PAGE.format(re.escape(str(bad)), 1)):
        CheckedParquetFile(str(bad)).read()  # a whole-file read still names the row group
    assert CheckedParquetFile(str(bad)).read_row_group(0).num_rows > 0  # the other row groups read


def test_the_loader_refuses_a_changed_page_naming_file_and_row_group(damaged):
    cfg = config.load(str(CONFIG), data_overrides(damaged))
    bad = damaged / "eval" / "part-00001.parquet"
    with pytest.raises(ContractError, match=PAGE.format(re.escape(str(bad)), 1)) as info:
        for _ in ParquetBatches(str(damaged / "eval"), LoaderSettings.of(cfg), shuffle=False):
            pass
    one_line(str(info.value))


@pytest.mark.slow  # starts a process
@pytest.mark.parametrize("split, damage", [("eval", "page"), ("train", "header")])
def test_training_exits_2_with_one_data_error_line(generated, tmp_path, split, damage):
    """train.py's main (one rank, its loader's workers) on a damaged split: the data error path,
    exit 2, the error whole on one line; a damaged training split stops it before any checkpoint."""
    damaged = damaged_copy(generated, tmp_path, split, damage)
    run = tmp_path / "run"
    overrides = data_overrides(damaged) + [f"train.run_dir={run}", "data.num_workers=1"]
    # Eval: one step, then the damaged eval split. Train: the whole epoch (it reaches the damaged row
    # group somewhere in it) with no checkpoint but the final one, which must never be written.
    overrides.append("train.max_steps=1" if split == "eval" else "train.checkpoint_every=1000")
    cmd = [sys.executable, "-m", "pinads_rec.train", "--config", str(CONFIG)]
    cmd += [a for o in overrides for a in ("--set", o)]
    env = {**os.environ, "PINADS_RDZV_FILE": str(tmp_path / "rdzv")}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [x for x in proc.stderr.splitlines() if "data error" in x]
    bad = damaged / split / "part-00001.parquet"
    said = SAID[damage].format(re.escape(str(bad)), 1)
    assert re.fullmatch(r"\[rank 0\] data error: " + said + r".*", line), line
    if split == "train":
        assert not list(run.glob("checkpoints/step-*")), sorted(run.rglob("*"))


@pytest.mark.parametrize("damage", ["page", "header"])
def test_serve_score_refuses_a_changed_page_and_writes_nothing(generated, tmp_path, capsys, damage):
    damaged = damaged_copy(generated, tmp_path, "eval", damage)
    out = tmp_path / "scores.parquet"
    argv = ["score", "--run", str(SAVED_RUN), "--step", str(RESUME_STEP), "--precision", "fp32"]
    assert serve.main(argv + ["--data", str(damaged / "eval"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if not re.match(r"\d{4}-\d\d-\d\d .* INFO ", x)]  # its log aside
    bad = damaged / "eval" / "part-00001.parquet"
    assert re.fullmatch(r"serve error: " + SAID[damage].format(re.escape(str(bad)), 1) + r".*", line), err
    assert sorted(os.listdir(tmp_path)) == ["data"]  # no output, no temporary file


@pytest.mark.parametrize("damage", ["page", "header"])
def test_the_loader_names_a_page_header_that_does_not_decode(generated, tmp_path, damage):
    """A zeroed page header fails no checksum (none covers it), yet the read names file and row group."""
    damaged = damaged_copy(generated, tmp_path, "eval", damage)
    settings = LoaderSettings.of(config.load(str(CONFIG), data_overrides(damaged)))
    bad = damaged / "eval" / "part-00001.parquet"
    with pytest.raises(ContractError, match=SAID[damage].format(re.escape(str(bad)), 1)) as info:
        for _ in ParquetBatches(str(damaged / "eval"), settings, shuffle=False):
            pass
    one_line(str(info.value))


def test_the_reference_is_not_fitted_on_a_changed_page_and_says_where(generated, tmp_path):
    from pinads_rec.reference.fit import reference_summary

    damaged = damaged_copy(generated, tmp_path, "train", "header")
    cfg = config.load(str(CONFIG), data_overrides(damaged))
    bad = damaged / "train" / "part-00001.parquet"
    corrupt_page(bad, 0, cfg.features.tasks[0].label_column)  # a column the reference reads
    summary = reference_summary(cfg)
    assert re.fullmatch(PAGE.format(re.escape(str(bad)), 0) + r".*", one_line(summary["error"])), summary


@pytest.mark.slow  # starts a process
def test_serve_score_removes_the_temporary_file_a_killed_score_left(generated, tmp_path):
    out = tmp_path / "scores.parquet"
    dead = subprocess.Popen(["true"])
    dead.wait()  # reaped: its pid runs nothing now
    stale = f".scores.parquet.{dead.pid}-0123abcd.tmp"
    kept = [
        f".scores.parquet.{os.getppid()}-0123abcd.tmp",  # a score still running (pytest's parent)
        f".other.parquet.{dead.pid}-0123abcd.tmp",  # another output's
        f".scores.parquet.{dead.pid}-0123abcd.tmp.keep",  # not the pattern
        "notes.txt",
    ]
    for name in kept + [stale]:
        (tmp_path / name).write_bytes(b"partial")
    argv = ["score", "--run", str(SAVED_RUN), "--step", str(RESUME_STEP), "--precision", "fp32"]
    assert serve.main(argv + ["--data", str(generated / "eval"), "--out", str(out)]) == 0
    assert sorted(os.listdir(tmp_path)) == sorted(kept + ["scores.parquet"])
    assert CheckedParquetFile(str(out)).read().num_rows > 0  # its own output: page checksums, verified
    assert remove_stale_temporaries(out) == []


def test_a_build_file_changed_in_place_fails_its_sha256_at_listing(build_copy):
    part = build_copy / "train" / "part-00000.parquet"
    corrupt_page(part, 0)
    settings = LoaderSettings.of(config.load(TAOBAO))
    with pytest.raises(ContractError) as info:
        ParquetBatches(str(build_copy / "train"), settings, shuffle=False)
    assert one_line(str(info.value)) == (
        f"{part}: its sha256 differs from manifest.json's (the file changed after the build wrote it: disk, copy "
        f"or edit); rebuild with python -m pinads_rec.data.build ... --out {build_copy}, or restore the file from "
        f"a copy of that build"
    )
    # Each rank of a job hashes its share of the files: rank 1 of 2 has none of this one-file split's.
    assert ParquetBatches(str(build_copy / "train"), settings, rank=1, world_size=2, shuffle=False).files


def test_a_changed_vocabulary_fails_its_sha256(build_copy):
    vocab = build_copy / "vocabularies" / "user.parquet"
    data = bytearray(vocab.read_bytes())
    data[len(data) // 3] ^= 0xFF
    vocab.write_bytes(bytes(data))
    with pytest.raises(ContractError, match=r"vocabularies/user.parquet: its sha256 differs from manifest.json's"):
        Vocabularies.load(str(build_copy), config.load(TAOBAO).features)


def test_inspect_verify_passes_a_clean_build(built, capsys):
    assert insp.main(["--verify", str(built)]) == 0
    out = capsys.readouterr()
    assert out.err == ""
    assert re.fullmatch(
        rf"{re.escape(str(built))}: 10 file\(s\), .* MiB; 10 hashed against manifest.json's sha256, every page of 9 "
        r"Parquet file\(s\) read with its checksum verified: all intact\n",
        out.out,
    )


def test_inspect_verify_names_each_bad_file_once(build_copy, capsys):
    part = build_copy / "train" / "part-00000.parquet"
    corrupt_page(part, 1)
    vocab = build_copy / "vocabularies" / "cate.parquet"
    data = bytearray(vocab.read_bytes())
    data[len(data) // 3] ^= 0xFF
    vocab.write_bytes(bytes(data))
    assert insp.main(["--verify", str(build_copy)]) == 2
    out = capsys.readouterr()
    lines = out.err.splitlines()
    assert len(lines) == 2, out.err
    assert re.fullmatch(PAGE.format(re.escape(str(part)), 1) + r".*; restore the file from a good copy, .*", lines[0])
    assert lines[1].startswith(f"{vocab}: its sha256 differs from manifest.json's")
    assert out.out.endswith(": 2 problem(s)\n")


def test_inspect_verify_checks_the_pages_of_data_no_build_made(damaged, capsys):
    assert insp.main(["--verify", str(damaged / "eval")]) == 2
    out = capsys.readouterr()
    bad = damaged / "eval" / "part-00001.parquet"
    assert re.fullmatch(PAGE.format(re.escape(str(bad)), 1) + r".*\n", out.err)
    assert "0 hashed against manifest.json's sha256, every page of 2 Parquet file(s)" in out.out


def test_a_file_written_without_checksums_still_reads(generated, tmp_path):
    """Files from before this change, or another tool's: verification applies where checksums exist."""
    src = generated / "eval" / "part-00000.parquet"
    plain = tmp_path / "plain.parquet"
    pq.write_table(pq.read_table(src), plain)  # pyarrow's default: no page checksums
    assert CheckedParquetFile(str(plain)).read() == pq.read_table(src)
    assert insp.main(["--verify", str(plain)]) == 0
