"""A user's mistake in a count or an output path is refused before any work (pinads_rec/arguments.py):
one line naming the flag, exit 2, no traceback -- through the commands' own command lines (their
``main``, in this process: the argument check is the first thing each does)."""

import pytest
from conftest import DEMO

from pinads_rec.data.build.cli import main as build_main
from pinads_rec.serve.cli import main as serve_main


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "a_file"
    path.write_text("not a directory")
    return path


def cases(tmp_path, a_file):
    build = [build_main, "--config", DEMO, "--raw", str(tmp_path)]
    score = [serve_main, "score", "--run", str(tmp_path / "no_run")]
    return [
        (build + ["--out", str(a_file / "out")], "--out", "is a file, not a directory"),
        (build + ["--out", str(a_file)], "--out", "is a file, not a directory"),
        (build + ["--out", str(tmp_path / "o"), "--threads", "-1"], "--threads", "give 1 or more"),
        (build + ["--out", str(tmp_path / "o"), "--threads", "two"], "--threads", "not a whole number"),
        (score + ["--out", str(tmp_path)], "--out", "is a directory: give a file name"),
        (score + ["--out", str(a_file / "p.parquet")], "--out", "is a file, not a directory"),
    ]


def test_bad_counts_and_output_paths_are_refused_before_the_work(tmp_path, a_file, capsys):
    for (main, *argv), flag, words in cases(tmp_path, a_file):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        err = capsys.readouterr().err
        assert exited.value.code == 2 and f"argument {flag}: " in err and words in err, (argv, err)
    assert a_file.read_text() == "not a directory"  # nothing lost
