"""One set of data rules (pinads_rec/data/loader/rules.py): each bad value through the build (raw logs),
the loader and inspect (the built files) gets the same verdict -- the same rule named."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_build import IMPRESSIONS, T0, write_raw

from pinads_rec import config
from pinads_rec.data import inspect as insp
from pinads_rec.data.build import build
from pinads_rec.data.loader import rules
from pinads_rec.data.loader.contract import ContractError
from pinads_rec.data.loader.reader import list_files
from pinads_rec.data.loader.row_group_checker import RowGroupChecker

# rule -> (the raw impression row changed: user, ts, pid, ad, clk; the built train column changed,
# and its new first value)
CASES = {
    rules.LABEL.kind: (lambda r: (*r[:4], 2), "click", lambda v: 2),
    rules.TIMESTAMP.kind: (lambda r: (r[0], r[1] * 1000, *r[2:]), "timestamp", lambda v: v * 1000),
    rules.NEGATIVE_ID.kind: (lambda r: (*r[:3], -4, r[4]), "item_id", lambda v: -4),
    "id beyond its table": (lambda r: (*r[:3], 150, r[4]), "item_id", lambda v: 150),
}


@pytest.fixture(scope="module")
def good_build(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rules")
    raw, path = write_raw(tmp)
    cfg = config.load(path)
    build(cfg, str(raw), str(tmp / "out"))
    return cfg, tmp / "out" / "train"


def _with_first_value(table: pa.Table, column: str, change) -> pa.Table:
    """The first request's first value of ``column`` changed (a list column: its first candidate's)."""
    col = table.column(column).to_pylist()
    if isinstance(col[0], list):
        col[0] = [change(col[0][0])] + col[0][1:]
    else:
        col[0] = change(col[0])
    return table.set_column(
        table.schema.get_field_index(column), column, pa.array(col, table.schema.field(column).type)
    )


@pytest.mark.parametrize("kind", list(CASES))
def test_the_build_the_loader_and_inspect_name_the_same_rule(kind, good_build, tmp_path):
    raw_edit, column, value_edit = CASES[kind]
    cfg, train = good_build

    # The build, on raw logs holding the bad value.
    raw, _ = write_raw(tmp_path, impressions=[raw_edit(IMPRESSIONS[0])] + IMPRESSIONS[1:])
    with pytest.raises(ContractError) as built:
        build(cfg, str(raw), str(tmp_path / "out"))
    assert built.value.rule is not None and built.value.rule.kind == kind, built.value

    # The loader and inspect, on the built files holding it.
    bad = tmp_path / "bad"
    bad.mkdir()
    (path,) = list_files(str(train))
    pq.write_table(_with_first_value(pq.read_table(path), column, value_edit), bad / Path(path).name)
    checker = RowGroupChecker(cfg.features, cfg.data)
    with pytest.raises(ContractError) as loaded:
        table = pq.read_table(bad / Path(path).name)
        checker.check_requests(checker.split_requests(table, "bad"), "bad")
    assert loaded.value.rule is not None and loaded.value.rule.kind == kind, loaded.value
    assert kind in {p.kind for p in insp.scan_dataset(cfg.features, cfg.data, str(bad)).problems}


def test_the_rules_agree_between_sql_and_numpy():
    import duckdb
    import numpy as np

    values = np.array([-1.0, 0.0, 0.5, 1.0, 2.0, float("nan"), T0, T0 * 1000.0, 5e8, 4.2e9])
    con = duckdb.connect()
    for rule in (rules.LABEL, rules.PROBABILITY, rules.TIMESTAMP, rules.NEGATIVE_ID, rules.id_beyond(1)):
        sql = [con.execute(f"SELECT {rule.where(repr(float(v)) + '::DOUBLE')}").fetchone()[0] for v in values[:5]]
        assert sql == rule.broken(values[:5]).tolist(), rule.kind
    assert rules.TIMESTAMP.broken(values[5:]).tolist() == [True, False, True, True, True]
