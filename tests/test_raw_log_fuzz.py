"""benchmarks/raw_log_fuzz.py at make test's size: seeded mutations of the Taobao layout's raw logs,
each built through the build's command line, none breaking the fuzzer's rule (its docstring: accepted
as the clean file of the same rows, or refused in one line naming the file and line; no traceback)."""

import os

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow


@pytest.fixture()
def fuzzer_module(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))
    import raw_log_fuzz

    return raw_log_fuzz


def test_lossless_mutations_keep_the_logical_rows(fuzzer_module, tmp_path):
    """The rule itself: each lossless mutation of each file reads back as the clean rows (else a verdict
    against it would blame the build for the fuzzer's own misreading)."""
    import random

    from pinads_rec.data.shaped_logs import taobao

    taobao.write(tmp_path, users=12, seed=0)
    for name in fuzzer_module.FILES:
        data = (tmp_path / name).read_bytes()
        clean = fuzzer_module.logical_rows(data)
        assert clean.rows and not clean.fault
        for mutation in sorted(fuzzer_module.LOSSLESS):
            for seed in range(3):
                mutated, detail = fuzzer_module.MUTATIONS[mutation][1](random.Random(seed), data)
                assert mutated != data and fuzzer_module.logical_rows(mutated).as_dicts() == clean.as_dicts(), detail


def test_a_hundred_mutated_raw_logs(fuzzer_module):
    counts = fuzzer_module.fuzz(cases=100, seed=0)
    assert not counts.failures, "\n" + "\n".join(counts.failures)
    v = counts.verdicts
    assert counts.cases == 100 and v["TRACEBACK"] == 0 and v["ACCEPTED"] + v["REFUSED"] == 100
    assert v["ACCEPTED"] >= 20 and v["REFUSED"] >= 20  # both outcomes exercised
