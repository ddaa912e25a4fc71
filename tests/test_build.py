"""The raw-log builder: point in time, newest first and capped, filters, shared sequences per request,
joins and their defaults, splits, determinism, bad input named by file, column and row."""

import json
import re
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pinads_rec import config
from pinads_rec.data.build import build, main
from pinads_rec.data.loader.contract import ContractError
from pinads_rec.data.vocabulary import Vocabularies

T0 = 1_500_000_000  # 2017-07-14 02:40:00 UTC

CONFIG = """
features:
  columns: {request_id: request_id, timestamp: timestamp, surface: surface}
  surfaces: [feed, search]
  tasks: [{name: click, label_column: click}]
  tables:
    - {name: user, num_embeddings: 100, embedding_dim: 4}
    - {name: item, num_embeddings: 100, embedding_dim: 4}
    - {name: cate, num_embeddings: 20, embedding_dim: 4}
    - {name: btag, num_embeddings: 5, embedding_dim: 4}
  sparse:
    - {name: user_id, column: user_id, table: user, user_side: true}
    - {name: item_id, column: item_id, table: item}
    - {name: cate, column: cate, table: cate}
  dense:
    - {name: price, column: price}
  sequence_groups:
    - name: all
      timestamp_column: all_ts
      max_length: 3
      features:
        - {name: item, column: all_item, table: item}
        - {name: btag, column: all_btag, table: btag}
    - name: buys
      timestamp_column: buy_ts
      max_length: 5
      features:
        - {name: cate, column: buy_cate, table: cate}
data: {calibration_holdout: 0.0}
model: {calibration: none}
build:
  impressions:
    path: [impressions.csv]
    user: user
    time: ts
    request_key: [ts, user, pid]
    item: ad
  side_tables:
    - name: ads
      path: [ads.csv]
      key: {ad: ad}
      defaults: {cate: "0", price: "0.0"}
  sequences:
    - group: all
      path: [behaviour.csv]
      user: user
      time: ts
      columns: {all_item: item, all_btag: "CASE btag WHEN 'pv' THEN 1 WHEN 'cart' THEN 2 ELSE 3 END"}
    - group: buys
      path: [behaviour.csv]
      user: user
      time: ts
      filter: "btag IN ('cart', 'buy')"
      min_gap_s: 10
      columns: {buy_cate: cate}
  columns:
    user_id: user
    item_id: ad
    cate: ads.cate
    price: ads.price
    surface: "CASE pid WHEN 'p1' THEN 'feed' ELSE 'search' END"
    click: clk
  splits:
    - {name: train, end: "2017-07-14T03:00:00"}
    - {name: eval, start: "2017-07-14T03:00:00"}
  timezone: UTC
  requests_per_row_group: 2
"""

IMPRESSIONS = [  # user, ts, pid, ad, clk
    (1, T0 + 100, "p1", 10, 0),
    (1, T0 + 100, "p1", 11, 1),
    (1, T0 + 200, "p2", 12, 0),
    (2, T0 + 100, "p1", 10, 0),
    (3, T0 + 5000, "p1", 13, 1),  # eval (after 03:00)
]
BEHAVIOUR = [  # user, ts, btag, item, cate
    (1, T0 + 99, "pv", 50, 5),  # t - 1: in
    (1, T0 + 100, "cart", 51, 6),  # t: out for the first request, in for the second
    (1, T0 + 101, "buy", 52, 7),  # t + 1: out for the first request
    (1, T0 + 95, "buy", 53, 8),  # inside the buys group's 10 s gap for the first request
    (1, T0 + 50, "pv", 54, 9),
    (1, T0 + 10, "fav", 55, 9),
    (2, T0 + 1, "pv", 56, 1),
    (3, T0 + 4000, "cart", 57, 2),
]
ADS = [(10, 1, 1.5), (11, 2, 2.5), (12, 3, 3.5)]  # ad 13 has no row: defaults


def write_raw(tmp_path, impressions=IMPRESSIONS, behaviour=BEHAVIOUR, ads=ADS, config_text=CONFIG):
    raw = tmp_path / "raw"
    raw.mkdir(exist_ok=True)
    (raw / "impressions.csv").write_text(
        "user,ts,pid,ad,clk\n" + "".join(",".join(map(str, r)) + "\n" for r in impressions)
    )
    (raw / "behaviour.csv").write_text(
        "user,ts,btag,item,cate\n" + "".join(",".join(map(str, r)) + "\n" for r in behaviour)
    )
    (raw / "ads.csv").write_text("ad,cate,price\n" + "".join(",".join(map(str, r)) + "\n" for r in ads))
    path = tmp_path / "config.yaml"
    path.write_text(textwrap.dedent(config_text))
    return raw, path


def requests_of(out, split):
    rows = []
    for f in sorted((out / split).glob("*.parquet")):
        rows += pq.read_table(f).to_pylist()
    return {(r["user_id"], r["timestamp"]): r for r in rows}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("build")
    raw, path = write_raw(tmp)
    summary = build(config.load(path), str(raw), str(tmp / "out"))
    return tmp / "out", summary


def test_point_in_time_newest_first_and_capped(built):
    out, _ = built
    train = requests_of(out, "train")
    first = train[(1, T0 + 100)]
    # Only events strictly before the impression, newest first, at most max_length (3).
    assert first["all_ts"] == [T0 + 99, T0 + 95, T0 + 50]
    assert first["all_item"] == [50, 53, 54]
    assert first["all_btag"] == [1, 3, 1]
    second = train[(1, T0 + 200)]
    assert second["all_ts"] == [T0 + 101, T0 + 100, T0 + 99]
    assert second["all_item"] == [52, 51, 50]


def test_filter_and_min_gap(built):
    out, _ = built
    train = requests_of(out, "train")
    # buys: cart/buy only, and at least 10 s before: the buy at t-5 is left out, the one at t+1 too.
    assert train[(1, T0 + 100)]["buy_cate"] == []
    assert train[(1, T0 + 200)]["buy_cate"] == [7, 6, 8]
    assert train[(1, T0 + 200)]["buy_ts"] == [T0 + 101, T0 + 100, T0 + 95]


def test_candidates_of_a_request_share_its_sequences(built):
    out, summary = built
    first = requests_of(out, "train")[(1, T0 + 100)]
    assert first["item_id"] == [10, 11] and first["click"] == [0, 1]
    assert first["surface"] == ["feed", "feed"]
    assert first["cate"] == [1, 2] and first["price"] == [1.5, 2.5]
    assert summary["splits"]["train"] == {**summary["splits"]["train"], "requests": 3, "rows": 4}


def test_split_by_time_and_join_defaults(built):
    out, summary = built
    ev = requests_of(out, "eval")
    assert list(ev) == [(3, T0 + 5000)]
    only = ev[(3, T0 + 5000)]
    assert only["cate"] == [0] and only["price"] == [0.0]  # ad 13 has no row: the declared defaults
    assert only["all_item"] == [57]
    assert summary["join_misses"] == {"ads": 1}
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["outputs"]["train"]["requests"] == 3
    assert manifest["inputs"]["impressions"][0]["bytes"] > 0


def test_requests_in_time_order_and_row_groups(built):
    out, _ = built
    f = pq.ParquetFile(next((out / "train").glob("*.parquet")))
    assert f.metadata.num_row_groups == 2  # 3 requests, 2 per row group
    assert f.schema_arrow.metadata[b"pinads_rec.layout"] == b"per_request"
    t = f.read()
    assert t.column("timestamp").to_pylist() == sorted(t.column("timestamp").to_pylist())


def test_deterministic(tmp_path, built):
    out, _ = built
    raw, path = write_raw(tmp_path)
    build(config.load(path), str(raw), str(tmp_path / "again"), threads=1)
    for split in ("train", "eval"):
        a = pq.read_table(next((out / split).glob("*.parquet")))
        b = pq.read_table(next((tmp_path / "again" / split).glob("*.parquet")))
        assert a.equals(b)


def test_cli_prints_the_summary(tmp_path, capsys):
    raw, path = write_raw(tmp_path)
    assert (
        main(["--config", str(path), "--raw", str(raw), "--out", str(tmp_path / "out"), "--memory-limit", "1GB"]) == 0
    )
    assert "train: 3 requests, 4 rows" in capsys.readouterr().out


@pytest.mark.parametrize("terminal", [False, True])
def test_duckdb_draws_its_progress_bar_only_on_a_terminal(tmp_path, monkeypatch, terminal):
    """DuckDB draws its bar on stdout: a build redirected into a log gets none."""
    from pinads_rec.data.build.engine import DuckDBEngine

    monkeypatch.setattr("sys.stdout.isatty", lambda: terminal)
    engine = DuckDBEngine(1, str(tmp_path / "spill"), None)
    assert engine.rows("SELECT current_setting('enable_progress_bar')") == [(terminal,)]
    engine.close()


def test_a_cases_own_else_is_counted_apart_from_the_repairs(built, tmp_path, capsys):
    """all_btag's ELSE 3 stands for fav and buy on purpose: the three such events are reported as
    the rows no WHEN matched, never among the repairs (the build's own defaults and drops)."""
    out, summary = built
    assert summary["case_else"] == {"build.sequences[0].columns.all_btag: events given the CASE's ELSE value 3": 3}
    assert not [what for what in summary["repairs"] if "ELSE" in what]
    assert json.loads((out / "summary.json").read_text())["case_else"] == summary["case_else"]
    # A CASE whose ELSE a THEN gives too, or a non-id column's (the surface), is not counted at all.
    raw, path = write_raw(tmp_path)
    cfg = config.load(path, ["build.sequences.0.columns.all_btag=CASE btag WHEN 'pv' THEN 1 ELSE 1 END"])
    assert build(cfg, str(raw), str(tmp_path / "out"), threads=1)["case_else"] == {}
    assert main(["--config", str(path), "--raw", str(raw), "--out", str(tmp_path / "again"), "--threads", "1"]) == 0
    text = capsys.readouterr().out
    assert "rows no WHEN of the config's CASE matched (given its own ELSE; not repairs):\n" in text
    assert "\n  build.sequences[0].columns.all_btag: events given the CASE's ELSE value 3: 3" in text


TYPED_BUILD = """
build:
  impressions:
    path: [impressions.inter]
    format: csv
    delimiter: "\\t"
    user: '"user_id:token"'
    time: '"timestamp:float"'
    request_key: ['"timestamp:float"', '"user_id:token"', '"pid:token"']
    item: '"item_id:token"'
    filter: '"item_id:token" <> 99'
  side_tables:
    - name: ads
      path: [ads.csv]
      key: {"item_id:token": '"item_id:token"'}
      defaults: {"cate:token": "0", "price:float": "0.0"}
  sequences:
    - group: all
      path: [behaviour.csv]
      user: '"user_id:token"'
      time: '"timestamp:float"'
      columns:
        all_item: '"item_id:token"'
        all_btag: "CASE \\"btag:token\\" WHEN 'pv' THEN 1 WHEN 'cart' THEN 2 ELSE 3 END"
    - group: buys
      path: [behaviour.csv]
      user: '"user_id:token"'
      time: '"timestamp:float"'
      filter: "\\"btag:token\\" IN ('cart', 'buy')"
      min_gap_s: 10
      columns: {buy_cate: '"cate:token"'}
  columns:
    user_id: '"user_id:token"'
    item_id: '"item_id:token"'
    cate: 'ads."cate:token"'
    price: 'ads."price:float"'
    surface: "CASE \\"pid:token\\" WHEN 'p1' THEN 'feed' ELSE 'search' END"
    click: '"clk:token"'
  splits:
    - {name: train, end: "2017-07-14T03:00:00"}
    - {name: eval, start: "2017-07-14T03:00:00"}
  timezone: UTC
  requests_per_row_group: 2
"""


def test_typed_headers_are_read_through_quoted_names(built, tmp_path):
    """Column names that are no plain SQL identifiers (RecBole's atomic files: ``user_id:token``, a
    tab-separated ``.inter`` file) are read as double-quoted identifiers in every expression: the
    build equals the plain-header one row for row."""
    raw, path = write_raw(tmp_path, config_text=CONFIG.split("build:")[0] + TYPED_BUILD)
    plain = (raw / "impressions.csv").read_text().splitlines()[1:]
    (raw / "impressions.csv").unlink()
    (raw / "impressions.inter").write_text(
        "\t".join(["user_id:token", "timestamp:float", "pid:token", "item_id:token", "clk:token"])
        + "\n"
        + "".join(line.replace(",", "\t") + "\n" for line in plain)
    )
    for name, header in {
        "behaviour.csv": "user_id:token,timestamp:float,btag:token,item_id:token,cate:token",
        "ads.csv": "item_id:token,cate:token,price:float",
    }.items():
        lines = (raw / name).read_text().splitlines()
        (raw / name).write_text("\n".join([header] + lines[1:]) + "\n")
    summary = build(config.load(path), str(raw), str(tmp_path / "out"), threads=1)
    out, expected = built
    for split in ("train", "eval"):
        assert pq.read_table(tmp_path / "out" / split).equals(pq.read_table(out / split))
    assert summary["join_misses"] == expected["join_misses"] and summary["case_else"] == expected["case_else"]
    # A misspelt quoted name is named as any other column is; a bare one is a syntax error that says how to quote.
    with pytest.raises(ContractError, match=r"""build.columns.click: '"clk:tokn"' reads column 'clk:tokn', which """):
        build(config.load(path, ["""build.columns.click='"clk:tokn"'"""]), str(raw), str(tmp_path / "typo"))
    with pytest.raises(
        ContractError,
        match=r"""^build.columns.click: 'clk:token': Parser Error: .*; column 'clk:token' is no plain SQL name: """
        r"""write it double-quoted, "clk:token" \(in YAML, inside single quotes: '"clk:token"'\)$""",
    ):
        build(config.load(path, ["build.columns.click=clk:token"]), str(raw), str(tmp_path / "bare"))


# --- bad input: a clear error naming file, column and row -----------------------------------------


def build_error(tmp_path, **raw) -> str:
    """The one-line message the build stops with on these raw files."""
    raw_dir, path = write_raw(tmp_path, **raw)
    with pytest.raises(ContractError) as info:
        build(config.load(path), str(raw_dir), str(tmp_path / "out"))
    return str(info.value)


def test_label_not_01_names_file_and_row(tmp_path):
    bad = IMPRESSIONS[:2] + [(1, T0 + 200, "p2", 12, 2)] + IMPRESSIONS[3:]
    message = build_error(tmp_path, impressions=bad)
    assert re.search(r"build.columns.click: 1 label\(s\) not 0/1.*impressions.csv, row 2 \(line 4\)", message)


def test_unparsable_timestamp(tmp_path):
    bad = IMPRESSIONS[:3] + [(2, "yesterday", "p1", 10, 0)] + IMPRESSIONS[4:]
    message = build_error(tmp_path, impressions=bad)
    assert re.search(r"build.impressions.time: 1 timestamp\(s\) missing or unparsable.*row 3", message)


def test_milliseconds_timestamp(tmp_path):
    bad = IMPRESSIONS[:4] + [(3, (T0 + 5000) * 1000, "p1", 13, 1)]
    assert re.search(r"outside 1990..2100.*row 4.*milliseconds", build_error(tmp_path, impressions=bad))


def test_event_without_user(tmp_path):
    bad = BEHAVIOUR + [("", T0, "pv", 1, 1)]
    message = build_error(tmp_path, behaviour=bad)
    assert re.search(r"build.sequences\[0\].user: 1 event\(s\) without a user.*behaviour.csv, row 8", message)


def test_duplicated_impressions_dropped_and_counted(tmp_path):
    raw, path = write_raw(tmp_path, impressions=IMPRESSIONS + [IMPRESSIONS[1]])
    summary = build(config.load(path), str(raw), str(tmp_path / "out"))
    assert summary["repairs"]["duplicated impressions (dropped)"] == 1
    assert summary["splits"]["train"]["rows"] == 4


def test_duplicated_impressions_error(tmp_path):
    raw, path = write_raw(tmp_path, impressions=IMPRESSIONS + [IMPRESSIONS[1]])
    cfg = config.load(path, ["build.impressions.duplicates=error"])
    with pytest.raises(ContractError, match=r"1 duplicated impression\(s\).*item 11 2 times"):
        build(cfg, str(raw), str(tmp_path / "out"))


def test_missing_file_and_column(tmp_path):
    raw, path = write_raw(tmp_path)
    (raw / "ads.csv").unlink()
    with pytest.raises(ContractError, match=r"build.side_tables\[0\].path: no file matches 'ads.csv'"):
        build(config.load(path), str(raw), str(tmp_path / "out"))
    raw, path = write_raw(tmp_path)
    with pytest.raises(ContractError, match=r"clk_typo"):
        build(config.load(path, ["build.columns.click=clk_typo"]), str(raw), str(tmp_path / "out"))


def test_string_ids_need_a_vocabulary(tmp_path):
    raw, path = write_raw(tmp_path)
    with pytest.raises(ContractError, match=r"build.columns.item_id: gives VARCHAR values"):
        build(config.load(path, ["build.columns.item_id=concat('a', ad)"]), str(raw), str(tmp_path / "out"))


def test_vocabulary_fitted_on_train(tmp_path):
    raw, path = write_raw(tmp_path)
    cfg = config.load(path, ["build.vocabularies=[{table: item}]"])
    build(cfg, str(raw), str(tmp_path / "out"))
    vocab = pq.read_table(tmp_path / "out" / "vocabularies" / "item.parquet").to_pylist()
    assert vocab[0]["idx"] == 1 and all(v["count"] >= 1 for v in vocab)
    index = {v["raw"]: v["idx"] for v in vocab}
    ev = requests_of(tmp_path / "out", "eval")[(3, T0 + 5000)]
    assert ev["item_id"] == [0]  # ad 13 only shows in eval: out of vocabulary
    assert ev["all_item"] == [0]  # item 57 is only seen after the training split: out of vocabulary too
    first = requests_of(tmp_path / "out", "train")[(1, T0 + 100)]
    assert first["all_item"] == [index["50"], index["53"], index["54"]]
    # Serving maps raw ids the same way, from the saved vocabulary.
    raw_rows = pa.table({"item_id": [10, 13], "all_item": [[50, 53], [57]], "cate": [1, 2]})
    mapped = Vocabularies.load(str(tmp_path / "out"), cfg.features).apply(raw_rows)
    assert mapped.column("item_id").to_pylist() == [index["10"], 0]
    assert mapped.column("all_item").to_pylist() == [[index["50"], index["53"]], [0]]
    assert mapped.column("cate").to_pylist() == [1, 2]  # no vocabulary for its table


def test_unknown_ids_per_split_and_table_in_the_summary(tmp_path):
    """summary.json's unknown_ids: per split and vocabulary table, the ids mapped to 0 of the
    impressions (a user-side id counts each of its request's rows) and of the events of the
    split's sequences, as the written files hold them."""
    raw, path = write_raw(tmp_path)
    cfg = config.load(path, ["build.vocabularies=[{table: item}, {table: user}]"])
    summary = build(cfg, str(raw), str(tmp_path / "out"))
    expected = {}
    for split in ("train", "eval"):
        rows = requests_of(tmp_path / "out", split).values()

        def counted(ids):
            return {"ids": len(ids), "unknown": ids.count(0), "share": round(ids.count(0) / len(ids), 6)}

        expected[split] = {
            "item": {
                "impressions": counted([i for r in rows for i in r["item_id"]]),
                "events": counted([i for r in rows for i in r["all_item"]]),
            },
            "user": {"impressions": counted([r["user_id"] for r in rows for _ in r["click"]])},
        }
    assert summary["unknown_ids"] == expected
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["unknown_ids"] == expected
    # User 3 and its ad 13 first show in eval, and its one event (item 57) after the training split.
    assert expected["eval"]["user"]["impressions"] == {"ids": 1, "unknown": 1, "share": 1.0}
    assert expected["eval"]["item"]["events"]["unknown"] == 1
    assert expected["train"]["user"]["impressions"]["unknown"] == 0


def test_vocabulary_counts_an_event_once_whatever_the_groups_reading_it(tmp_path):
    # Item 51 shows once, in a cart event: the "all" group and the "buys" group (carts and buys)
    # both read it, and it must not pass min_count 2 by being counted twice. Item 52 (a buy) and
    # item 50 (a page view) likewise show once; an item shown twice in impressions passes.
    both = CONFIG.replace("columns: {buy_cate: cate}", "columns: {buy_cate: cate, buy_item: item}").replace(
        "        - {name: cate, column: buy_cate, table: cate}",
        "        - {name: cate, column: buy_cate, table: cate}\n        - {name: item, column: buy_item, table: item}",
    )
    raw, path = write_raw(tmp_path, config_text=both)
    cfg = config.load(path, ["build.vocabularies=[{table: item, min_count: 2}]"])
    build(cfg, str(raw), str(tmp_path / "out"))
    kept = {v["raw"]: v["count"] for v in pq.read_table(tmp_path / "out" / "vocabularies" / "item.parquet").to_pylist()}
    assert "51" not in kept and "52" not in kept and "50" not in kept, kept
    assert kept["10"] == 2  # ad 10 shown twice in the training split


def test_the_impressions_filter_reaches_the_event_logs_only_with_event_users_built(tmp_path):
    """build.impressions.filter drops user 2's only impression. Their behaviour (item 56, before the
    training split's end) still counts in the item vocabulary by default; event_users: built keeps
    only the events of users with a request built, so the vocabulary is the filtered build's."""
    raw, path = write_raw(tmp_path)
    sample = ["build.impressions.filter=user <> 2", "build.vocabularies=[{table: item}]"]

    def vocabulary(out):
        return {v["raw"] for v in pq.read_table(out / "vocabularies" / "item.parquet").to_pylist()}

    summary = build(config.load(path, sample), str(raw), str(tmp_path / "all"), threads=1)
    assert 2 not in {user for user, _ in requests_of(tmp_path / "all", "train")}
    assert "56" in vocabulary(tmp_path / "all")
    assert not [what for what in summary["repairs"] if "no request built" in what]

    summary = build(config.load(path, sample + ["build.impressions.event_users=built"]), str(raw), str(tmp_path / "b"))
    assert "56" not in vocabulary(tmp_path / "b") and "50" in vocabulary(tmp_path / "b")
    assert summary["repairs"]["sequence group all: events of users with no request built (dropped)"] == 1
    assert summary["repairs"]["sequence group buys: events of users with no request built (dropped)"] == 0
    # The users built keep every event: their sequences are the unfiltered build's.
    for split in ("train", "eval"):
        assert requests_of(tmp_path / "b", split).keys() == requests_of(tmp_path / "all", split).keys()
    first = requests_of(tmp_path / "b", "train")[(1, T0 + 200)]
    assert first["all_ts"] == [T0 + 101, T0 + 100, T0 + 99] and first["buy_ts"] == [T0 + 101, T0 + 100, T0 + 95]


def test_the_impressions_filter_reaches_a_history_read_from_the_impression_log(tmp_path):
    """A sequence source without a path reads the impression log as filtered: user 1's click on ad
    11 is in their later request's history, unless the filter drops that impression."""
    clicks = [
        "build.sequences.1.path=[]",
        "build.sequences.1.filter=clk = 1",
        "build.sequences.1.columns={buy_cate: ads.cate}",
    ]
    raw, path = write_raw(tmp_path)
    build(config.load(path, clicks), str(raw), str(tmp_path / "all"), threads=1)
    assert requests_of(tmp_path / "all", "train")[(1, T0 + 200)]["buy_cate"] == [2]  # ad 11's category
    build(config.load(path, clicks + ["build.impressions.filter=ad <> 11"]), str(raw), str(tmp_path / "f"), threads=1)
    assert requests_of(tmp_path / "f", "train")[(1, T0 + 200)]["buy_cate"] == []


def test_negative_downsampling_counts_and_records(tmp_path):
    raw, path = write_raw(tmp_path)
    cfg = config.load(path, ["build.negative_downsampling={task: click, rates: {feed: 0.000001}}"])
    summary = build(cfg, str(raw), str(tmp_path / "out"))
    assert summary["repairs"]["negatives of click downsampled away"] == 2  # every train feed negative
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["negative_downsampling"]["rates"] == {"feed": 0.000001}
    assert requests_of(tmp_path / "out", "eval")  # eval untouched


def test_null_in_a_contract_column(tmp_path):
    no_default = CONFIG.replace('defaults: {cate: "0", price: "0.0"}', 'defaults: {price: "0.0"}')
    raw, path = write_raw(tmp_path, config_text=no_default)
    with pytest.raises(ContractError, match=r"build.columns.cate: 1 null value\(s\).*coalesce"):
        build(config.load(path), str(raw), str(tmp_path / "out"))
    bad = BEHAVIOUR + [(2, T0, "cart", "", 1)]
    raw, path = write_raw(tmp_path, behaviour=bad)
    with pytest.raises(ContractError, match=r"build.sequences\[0\].columns.all_item: 1 null.*behaviour.csv, row 8"):
        build(config.load(path), str(raw), str(tmp_path / "out"))


def test_as_of_side_table_and_timezone(tmp_path):
    """A daily side table joins the row of the impression's own date, in build.timezone: T0 + 14 h
    is 2017-07-15 00:40 in Beijing but still 2017-07-14 in UTC."""
    daily = CONFIG.replace(
        '      defaults: {cate: "0", price: "0.0"}\n',
        '      defaults: {cate: "0", price: "0.0"}\n'
        "    - name: daily\n      path: [daily.csv]\n      key: {ad: ad}\n      as_of: day\n"
        '      defaults: {price: "-1.0"}\n',
    ).replace("price: ads.price", "price: daily.price")
    daily = daily.replace("timezone: UTC", "timezone: Asia/Shanghai").replace("03:00:00", "11:00:00")
    impressions = IMPRESSIONS[:4] + [(3, T0 + 14 * 3600, "p1", 10, 1)]
    raw, path = write_raw(tmp_path, impressions=impressions, config_text=daily)
    (raw / "daily.csv").write_text("ad,day,price\n10,20170714,1.0\n10,20170715,2.0\n11,20170714,3.0\n")
    summary = build(config.load(path), str(raw), str(tmp_path / "out"))
    assert requests_of(tmp_path / "out", "train")[(1, T0 + 100)]["price"] == [1.0, 3.0]
    assert requests_of(tmp_path / "out", "eval")[(3, T0 + 14 * 3600)]["price"] == [2.0]
    assert summary["join_misses"]["daily"] == 1  # ad 12 has no row
    raw, path = write_raw(tmp_path, impressions=impressions, config_text=daily.replace("Asia/Shanghai", "UTC"))
    build(config.load(path), str(raw), str(tmp_path / "utc"))
    assert requests_of(tmp_path / "utc", "eval")[(3, T0 + 14 * 3600)]["price"] == [1.0]


def test_events_read_a_dated_side_table_by_their_own_key_and_date(tmp_path):
    """A history with a path of its own reads a side table joined by the event's item, on the
    event's own date (build.sequences[].side_tables): the buys' categories from a daily catalog."""
    dated = CONFIG.replace(
        '      defaults: {cate: "0", price: "0.0"}\n',
        '      defaults: {cate: "0", price: "0.0"}\n'
        "    - name: catalog\n      path: [catalog.csv]\n      key: {item: ad}\n      as_of: day\n"
        '      defaults: {cate: "0"}\n',
    ).replace(
        "      columns: {buy_cate: cate}",
        "      side_tables: {catalog: {item: item}}\n      columns: {buy_cate: catalog.cate}",
    )
    raw, path = write_raw(tmp_path, config_text=dated)
    (raw / "catalog.csv").write_text("item,day,cate\n51,20170714,16\n52,20170714,17\n53,20170714,18\n51,20170713,9\n")
    build(config.load(path), str(raw), str(tmp_path / "out"))
    train = requests_of(tmp_path / "out", "train")
    assert train[(1, T0 + 200)]["buy_cate"] == [17, 16, 18]  # items 52, 51, 53 on 2017-07-14 (51's 07-13 row unused)
    assert requests_of(tmp_path / "out", "eval")[(3, T0 + 5000)]["buy_cate"] == [0]  # item 57: no row, its default
    with pytest.raises(config.ConfigError, match=r"build.sequences\[1\].side_tables.catalog: give an event expression"):
        build(config.load(path, ["build.sequences.1.side_tables={catalog: {day: ts}}"]), str(raw), str(tmp_path / "x"))


def test_id_beyond_its_table_is_found_at_build_time(tmp_path):
    bad = BEHAVIOUR + [(2, T0, "pv", 150, 1)]  # item table: 100 rows, no hash
    raw, path = write_raw(tmp_path, behaviour=bad)
    with pytest.raises(ContractError, match=r"build.sequences\[0\].columns.all_item: id 150 at .*behaviour.csv, row 8"):
        build(config.load(path), str(raw), str(tmp_path / "out"))
    raw, path = write_raw(
        tmp_path,
        behaviour=bad,
        config_text=CONFIG.replace(
            "{name: item, num_embeddings: 100, embedding_dim: 4}",
            "{name: item, num_embeddings: 100, embedding_dim: 4, hash: true}",
        ),
    )
    build(config.load(path), str(raw), str(tmp_path / "out"))  # the loader hashes it into range
