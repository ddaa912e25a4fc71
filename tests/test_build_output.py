"""A build is all or nothing (data/build_output.py): it replaces --out whole once complete; a
failed or SIGKILLed build leaves the previous output byte for byte, or nothing; the next build
cleans up or restores what a killed one left; readers refuse an incomplete build, naming what is
missing, and read data no build made as before. On the Taobao-shaped fixture (tests/dataset_fixtures.py)
with the real config."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest
from dataset_fixtures import write_taobao

from pinads_rec import config
from pinads_rec.config import ConfigError
from pinads_rec.data import build_output
from pinads_rec.data import inspect as insp
from pinads_rec.data.build import build
from pinads_rec.data.loader.contract import ContractError
from pinads_rec.data.loader.dataset import LoaderSettings, ParquetBatches
from pinads_rec.data.vocabulary import Vocabularies
from pinads_rec.serve.batching import ScoringBatches

REPO = Path(__file__).resolve().parent.parent
TAOBAO = REPO / "configs" / "datasets" / "taobao_ad.yaml"
SMALL = ["build.requests_per_row_group=16"]
# The config's splits without calibration.
TWO_SPLITS = (
    'build.splits=[{name: train, start: "2017-05-06", end: "2017-05-12"}, '
    '{name: eval, start: "2017-05-13", end: "2017-05-14"}]'
)
# Another build of the same logs: every split's files differ (other row groups).
OTHER = "build.requests_per_row_group=4"


def load(*overrides: str) -> config.ExperimentConfig:
    return config.load(TAOBAO, SMALL + list(overrides))


def run_build(raw: Path, out: Path, *overrides: str) -> dict:
    return build(load(*overrides), str(raw), str(out), threads=1)


def contents(out: Path) -> Dict[str, str]:
    """Every file under ``out`` (the manifest too) -> the sha256 of its bytes."""
    return {
        p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*"))
        if p.is_file()
    }


def leftovers(out: Path) -> List[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def loader(path: Path) -> ParquetBatches:
    return ParquetBatches(str(path), LoaderSettings.of(load()), shuffle=False)


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> Path:
    raw = tmp_path_factory.mktemp("atomic") / "raw"
    write_taobao(raw, users=40, requests_per_user=3)
    return raw


@pytest.fixture(scope="module")
def built(raw, tmp_path_factory) -> Path:
    """One complete build (train, calibration, eval, vocabularies); copy it before changing it."""
    out = tmp_path_factory.mktemp("built") / "out"
    run_build(raw, out)
    return out


@pytest.fixture
def previous(built, tmp_path) -> Path:
    """A copy of the complete build at ``tmp_path/out``, to rebuild over."""
    out = tmp_path / "out"
    shutil.copytree(built, out)
    return out


# --- (a) a rebuild replaces the whole output --------------------------------------------------


def test_a_rebuild_with_fewer_splits_leaves_no_old_split(raw, previous):
    assert (previous / "calibration").is_dir()
    run_build(raw, previous, TWO_SPLITS)
    assert sorted(p.name for p in previous.iterdir()) == [
        "eval",
        "manifest.json",
        "summary.json",
        "train",
        "vocabularies",
    ]
    assert leftovers(previous) == []
    build_output.verify(str(previous))
    with pytest.raises(ContractError, match=r"no split 'calibration', only train, eval\)"):
        loader(previous / "calibration")


# --- (b) a failed build changes nothing -------------------------------------------------------


def corrupt_raw(raw: Path, tmp: Path) -> Path:
    """A copy of the raw files whose impression log has an unparsable timestamp on its last line."""
    bad = tmp / "bad_raw"
    shutil.copytree(raw, bad)
    with open(bad / "raw_sample.csv", "a") as f:
        f.write("1141729,yesterday,1,430548_1007,1,0\n")
    return bad


@pytest.mark.parametrize(
    "failure",
    [
        "build.columns.clk=clk_typo",  # refused by DuckDB in the first step
        "build.columns.cms_segid=profile.cms_segid + 1000",  # refused after the vocabularies are written
        "corrupt raw file",
    ],
)
def test_a_failed_build_leaves_the_previous_one_byte_identical_and_a_fresh_out_absent(raw, previous, tmp_path, failure):
    source, overrides = (corrupt_raw(raw, tmp_path), []) if failure == "corrupt raw file" else (raw, [failure])
    before = contents(previous)
    fingerprint = build_output.verify(str(previous))
    with pytest.raises(ContractError):
        run_build(source, previous, *overrides)
    assert contents(previous) == before and build_output.verify(str(previous)) == fingerprint
    fresh = tmp_path / "fresh"
    with pytest.raises(ContractError):
        run_build(source, fresh, *overrides)
    assert not fresh.exists()
    assert leftovers(previous) == leftovers(fresh) == []


def test_an_out_that_is_not_a_build_is_left_alone(raw, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"--out .*out: exists and is not a build's output \(no manifest.json\)"):
        run_build(raw, out)
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and leftovers(out) == []


# --- (c) SIGKILL at every step ----------------------------------------------------------------


def killed_build(raw: Path, out: Path, step: str) -> None:
    """``python -m pinads_rec.data.build`` (another build than ``previous``: OTHER) killed at ``step``."""
    cmd = [sys.executable, "-m", "pinads_rec.data.build", "--config", str(TAOBAO), "--raw", str(raw)]
    cmd += ["--out", str(out), "--threads", "1", "--set", OTHER]
    env = {**os.environ, build_output.KILL_AT: step}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("step", ["split:train", "split:calibration", "publish", "swap", "cleanup"])
def test_a_killed_rebuild_leaves_one_complete_build_and_the_next_build_cleans_up(raw, previous, step):
    fingerprint = build_output.verify(str(previous))
    killed_build(raw, previous, step)
    assert leftovers(previous)  # what the kill left beside --out
    if step == "swap":
        # Killed between the two renames: --out is gone for now, the previous build set aside.
        assert not previous.exists()
        with pytest.raises(
            ContractError, match=r"out/train: not a complete build \(.*out is missing and \.out\.previous-"
        ):
            loader(previous / "train")
        build_output.recover(previous)  # what the next build does first
    if step == "cleanup":
        # Killed after the swap: the new build is in, complete; only the old one is left to remove.
        assert build_output.verify(str(previous)) != fingerprint
    else:
        assert build_output.verify(str(previous)) == fingerprint
    assert loader(previous / "train").num_rows > 0  # a complete build reads, whatever lies beside it
    run_build(raw, previous)
    assert leftovers(previous) == []
    build_output.verify(str(previous))


@pytest.mark.slow
def test_a_fresh_out_killed_midway_leaves_nothing(raw, tmp_path):
    out = tmp_path / "out"
    killed_build(raw, out, "split:train")
    assert not out.exists()
    (temporary,) = leftovers(out)
    assert temporary.startswith(".out.building-")
    with pytest.raises(ContractError, match=r"manifest.json missing: a build of .*out is running or was killed"):
        loader(out / "train")
    with pytest.raises(ContractError, match=r"is the temporary directory of a build of .*out"):
        loader(tmp_path / temporary / "train")
    run_build(raw, out)
    assert leftovers(out) == []
    build_output.verify(str(out))


def dead_pid() -> int:
    dead = subprocess.Popen(["true"])
    dead.wait()  # reaped: its pid runs nothing now
    return dead.pid


@pytest.mark.slow
def test_only_leftovers_of_dead_builds_of_this_out_are_removed(raw, tmp_path):
    out = tmp_path / "out"
    pid = dead_pid()
    keep = [f".out.building-x{pid}", f".other.building-{pid}", "notes.txt", f".out.building-{os.getppid()}"]
    for name in keep + [f".out.building-{pid}"]:
        (tmp_path / name).mkdir()
    run_build(raw, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(keep + ["out"])


# --- (d) readers --------------------------------------------------------------------------------


def one_line_refusal(path: Path, why: str) -> None:
    """The loader, serving's batches and inspect refuse ``path`` with one line saying ``why``."""
    pattern = (
        rf"{re.escape(str(path))}: not a complete build \({why}.*\); rebuild it with python -m pinads_rec.data.build"
    )
    with pytest.raises(ContractError, match=pattern) as info:
        loader(path)
    assert "\n" not in str(info.value)
    with pytest.raises(ContractError, match=pattern):
        ScoringBatches(load(), str(path))


@pytest.mark.parametrize(
    "damage, why",
    [
        pytest.param(
            "no manifest",
            r"manifest.json missing: a build of .*out is running or was killed \(\.out\.building-",
            marks=pytest.mark.slow,  # dead_pid() starts a process
        ),
        ("partial manifest", r"manifest.json unreadable"),
        ("no marker", r"manifest.json has no completion marker"),
        ("truncated file", r"train/part-00000.parquet holds 100 bytes, the manifest says"),
        ("extra file", r"train/part-00009.parquet is not in the manifest"),
    ],
)
def test_readers_refuse_an_incomplete_build_naming_what_is_missing(previous, capsys, damage, why):
    manifest = previous / "manifest.json"
    text = manifest.read_text()
    if damage == "no manifest":
        # Without a manifest a directory is a build's only if a build left something beside it
        # (alone it reads as hand-made data).
        manifest.unlink()
        (previous.parent / f".out.building-{dead_pid()}").mkdir()
    elif damage == "partial manifest":
        manifest.write_text(text[: len(text) // 2])
    elif damage == "no marker":
        manifest.write_text(text.replace('"complete": true', '"complete": false'))
    elif damage == "truncated file":
        part = previous / "train" / "part-00000.parquet"
        part.write_bytes(part.read_bytes()[:100])
    else:
        shutil.copy(previous / "train" / "part-00000.parquet", previous / "train" / "part-00009.parquet")
    one_line_refusal(previous / "train", why)
    assert insp.main(["--config", str(TAOBAO), "--data", str(previous / "train")]) == 2
    err = capsys.readouterr().err
    assert "not a complete build" in err and err.count("\n") == 1
    with pytest.raises(ContractError, match="not a complete build"):  # the build's root: checked whole
        Vocabularies.load(str(previous), load().features)


def test_readers_read_a_complete_build_and_hand_made_data(built, tmp_path):
    assert loader(built / "train").num_rows > 0
    assert Vocabularies.load(str(built), load().features).tables
    hand = tmp_path / "hand" / "train"  # no manifest anywhere, no build beside: read as before
    hand.mkdir(parents=True)
    shutil.copy(built / "train" / "part-00000.parquet", hand)
    assert loader(hand).num_rows == loader(built / "train").num_rows


def test_verify_finds_same_size_changes_by_sha256(previous):
    vocab = previous / "vocabularies" / "user.parquet"
    data = bytearray(vocab.read_bytes())
    data[10] ^= 0xFF  # same size, other bytes
    vocab.write_bytes(bytes(data))
    assert loader(previous / "train").num_rows > 0
    with pytest.raises(ContractError, match=r"vocabularies/user.parquet: its sha256 differs"):
        build_output.verify(str(previous))
