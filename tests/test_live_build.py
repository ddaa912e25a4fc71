"""The online feature path (data/build/live.py): raw requests built by the build's own steps equal the
offline build of the same impressions, column for column, on the demo's raw logs and the Taobao
layout (vocabularies, side tables with defaults, request keys without an id, a filtered second
sequence group); bad requests are refused naming the field and the value."""

from __future__ import annotations

import copy
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO, demo_raw
from dataset_fixtures import write_taobao

from pinads_rec import config
from pinads_rec.data import build as B
from pinads_rec.data.build.live import LiveFeatures, RequestError
from pinads_rec.data.loader.contract import ContractError
from pinads_rec.data.loader.storage_layout import stored_request_level, to_per_row
from pinads_rec.serve.batching import _with_label_columns

pytestmark = pytest.mark.slow  # raw logs generated and built (seconds each)

TAOBAO = Path(REPO) / "configs" / "datasets" / "taobao_ad.yaml"


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    cfg, raw, built = demo_raw(tmp_path_factory.mktemp("live_demo"))
    return cfg, raw, built, LiveFeatures(cfg, str(raw))


@pytest.fixture(scope="module")
def taobao(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("live_taobao")
    write_taobao(tmp / "raw")
    cfg = config.load(TAOBAO, ["build.requests_per_row_group=64"])
    B.build(cfg, str(tmp / "raw"), str(tmp / "out"))
    return cfg, tmp / "raw", tmp / "out", LiveFeatures(cfg, str(tmp / "raw"), str(tmp / "out"))


def per_row(table: pa.Table, cfg) -> list:
    """Rows (dicts) of every contract column but the request id and the labels, requests in time
    order (user breaking ties), candidates in their order."""
    f = cfg.features
    labels = {t.label_column for t in f.tasks} | {t.true_probability_column for t in f.tasks}
    table = to_per_row(_with_label_columns(table, cfg, stored_request_level(table.schema, f)), f)
    rows = [{k: v for k, v in r.items() if k not in labels and k != f.columns.request_id} for r in table.to_pylist()]
    return sorted(rows, key=lambda r: (r[f.columns.timestamp], r[f.columns.user_id], r[f.columns.item_id]))


def offline(built, split) -> pa.Table:
    return pa.concat_tables(pq.read_table(p) for p in sorted((built / split).glob("part-*.parquet")))


@pytest.mark.parametrize("which", ["demo", "taobao"])
def test_live_requests_build_as_the_offline_build(which, request):
    cfg, _, built, live = request.getfixturevalue(which)
    expected = offline(built, "eval")
    requests = live.requests_from_logs("eval", limit=expected.num_rows)
    assert len(requests) == expected.num_rows
    made = live.build(requests)
    assert made.num_rows == len(requests)
    assert made.column(cfg.features.columns.request_id).to_pylist() == list(range(len(requests)))
    got, want = per_row(made, cfg), per_row(expected, cfg)
    assert len(got) == len(want)
    for column in want[0]:
        assert [r[column] for r in got] == [r[column] for r in want], column


def test_one_request_alone_builds_as_in_a_batch(demo):
    cfg, _, _, live = demo
    requests = live.requests_from_logs("eval", limit=6)
    together = live.build(requests)
    for i, r in enumerate(requests):
        alone = live.build([r])
        assert per_row(alone, cfg) == per_row(together.slice(i, 1), cfg)


def test_a_user_twice_in_a_batch_keeps_each_requests_own_events(demo):
    cfg, _, _, live = demo
    request = live.requests_from_logs("eval", limit=1)[0]
    fewer = copy.deepcopy(request)
    for log in fewer["events"]:
        fewer["events"][log] = fewer["events"][log][3:]
    rows = live.build([request, fewer]).to_pylist()
    group = cfg.features.sequence_groups[0]
    assert len(rows[0][group.timestamp_column]) == len(rows[1][group.timestamp_column]) + 3


def refusal(live, request) -> str:
    with pytest.raises(RequestError) as e:
        live.build([request])
    return str(e.value)


def test_bad_requests_are_refused_naming_the_field_and_value(demo):
    cfg, _, _, live = demo
    good = live.requests_from_logs("eval", limit=1)[0]

    def changed(edit):
        r = copy.deepcopy(good)
        edit(r)
        return r

    assert "request.candidates[2].item_id: 'x7' is not an integer" in refusal(
        live, changed(lambda r: r["candidates"][2].update(item_id="x7"))
    )
    assert "request.request.surface" in refusal(live, changed(lambda r: r["request"].update(surface=3)))
    assert "request.candidates[0].item_id: missing" in refusal(
        live, changed(lambda r: [c.pop("item_id") for c in r["candidates"]])
    )
    assert "request.candidates[1].colour: not a column of the impression log" in refusal(
        live, changed(lambda r: r["candidates"][1].update(colour=1))
    )
    assert "request.candidates: missing or empty" in refusal(live, changed(lambda r: r.update(candidates=[])))
    assert "request.events.clicks: not a behaviour log" in refusal(
        live, changed(lambda r: r["events"].update(clicks=[]))
    )
    # The log stores a plain list; the group's width is the build's cast, which names the column.
    with pytest.raises(ContractError, match="group 'pins'.*length 3 to array with length 8.*embedding"):
        live.build([changed(lambda r: r["events"]["pin_events"][0].update(embedding=[0.1, 0.2, 0.3]))])
    assert "request.user: not a field of a request" in refusal(live, changed(lambda r: r.update(user=5)))
    assert "is not a finite number" in refusal(live, changed(lambda r: r["request"].update(user_activity="high")))
    bounded = LiveFeatures(cfg, str(demo[1]), max_candidates=3, max_events=2)
    assert "more than the configured 3" in refusal(bounded, good)
    assert "events, more than the configured 2" in refusal(bounded, {**good, "candidates": good["candidates"][:3]})


def test_an_id_a_plain_table_cannot_hold_is_refused_by_the_builds_check(demo):
    cfg, _, _, live = demo
    request = copy.deepcopy(live.requests_from_logs("eval", limit=1)[0])
    request["request"]["context_topic"] = 10**6  # the topic table holds 33 rows and does not hash
    with pytest.raises(ContractError, match=r"context_topic: id 1000000 .* outside \[0, 33\)"):
        live.build([request])


def test_a_changed_page_of_a_side_table_stops_the_service_naming_file_and_row_group(demo, tmp_path):
    """DuckDB verifies no page checksum: the live features read a Parquet side table's pages with
    theirs first, so a changed page is refused at start, never served as attributes."""
    import re
    import shutil

    from test_verified_bytes import PAGE, corrupt_page

    cfg, raw, _, _ = demo
    copy = tmp_path / "raw"
    shutil.copytree(raw, copy)
    items = copy / "items.parquet"
    corrupt_page(items, 0)
    with pytest.raises(ContractError) as info:
        LiveFeatures(cfg, str(copy))
    assert re.fullmatch(r"build\.side_tables\[0\]: " + PAGE.format(re.escape(str(items)), 0) + ".*", str(info.value))
