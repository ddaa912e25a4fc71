"""python -m pinads_rec.data.inspect: every planted problem found with its count and first place, in
both storage layouts; clean data and the synthetic demo data pass; a drafted config loads and
passes on its own data."""

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import read_rows

from pinads_rec import config
from pinads_rec.data import inspect as insp
from pinads_rec.data.loader.reader import list_files

R, C, RG = 40, 4, 16  # requests, candidates each, rows per row group (4 whole requests)
T0 = 1_700_000_000  # the first request's time (epoch seconds)

FEATURES = {
    "columns": {"request_id": "request_id", "user_id": "user_id", "item_id": "item_id"},
    "surfaces": ["a", "b"],
    "tasks": [{"name": "click", "label_column": "click", "true_probability_column": "true_p_click"}],
    "tables": [
        {"name": "user", "num_embeddings": 100, "embedding_dim": 8, "hash": True},
        {"name": "item", "num_embeddings": 50, "embedding_dim": 8},
        {"name": "cat", "num_embeddings": 10, "embedding_dim": 8},
        {"name": "tag", "num_embeddings": 10, "embedding_dim": 8},
        {"name": "hist_item", "num_embeddings": 50, "embedding_dim": 8},
        {"name": "hist_cat", "num_embeddings": 10, "embedding_dim": 8},
    ],
    "sparse": [
        {"name": "user_id", "column": "user_id", "table": "user", "user_side": True},
        {"name": "item_id", "column": "item_id", "table": "item"},
        {"name": "cat", "column": "cat", "table": "cat"},
        {"name": "tags", "column": "tags", "table": "tag"},
    ],
    "dense": [{"name": "price", "column": "price"}, {"name": "emb", "column": "emb", "dim": 4}],
    "sequence_groups": [
        {
            "name": "hist",
            "timestamp_column": "hist_ts",
            "max_length": 5,
            "features": [
                {"name": "item", "column": "hist_item", "table": "hist_item"},
                {"name": "cat", "column": "hist_cat", "table": "hist_cat"},
            ],
        }
    ],
}

SCHEMA = pa.schema(
    [
        ("request_id", pa.int64()),
        ("timestamp", pa.int64()),
        ("user_id", pa.int64()),
        ("hist_ts", pa.list_(pa.int64())),
        ("hist_item", pa.list_(pa.int64())),
        ("hist_cat", pa.list_(pa.int64())),
        ("surface", pa.string()),
        ("item_id", pa.int64()),
        ("cat", pa.int64()),
        ("tags", pa.list_(pa.int64())),
        ("price", pa.float64()),
        ("emb", pa.list_(pa.float32())),
        ("click", pa.int8()),
        ("true_p_click", pa.float64()),
    ]
)
REQUEST_LEVEL = ["request_id", "timestamp", "user_id", "hist_ts", "hist_item", "hist_cat"]


def cfg_of(**data):
    return config.from_dict(
        {"features": FEATURES, "data": {"calibration_holdout": 0.0, **data}, "model": {"calibration": "none"}}
    )


def scan(cfg, path):
    return insp.scan_dataset(cfg.features, cfg.data, path)


def clean_rows(first_request=0, requests=R):
    """Per-row dicts: C candidates per request, sequences newest first and strictly before the request."""
    rows = []
    for r in range(first_request, first_request + requests):
        t, n = T0 + 10 * r, r % 6
        for k in range(C):
            rows.append(
                {
                    "request_id": r,
                    "timestamp": t,
                    "user_id": 7 * r,  # beyond the hashed user table (100) from r = 15: hashed, no problem
                    "hist_ts": [t - 1 - j for j in range(n)],
                    "hist_item": [(r + j) % 50 for j in range(n)],
                    "hist_cat": [(r + j) % 10 for j in range(n)],
                    "surface": "ab"[r % 2],
                    "item_id": (3 * r + k) % 50,
                    "cat": (r + k) % 10,
                    "tags": [k, k + 1],
                    "price": k + 0.5,
                    "emb": [0.25] * 4,
                    "click": (r + k) % 2,
                    "true_p_click": 0.5,
                }
            )
    return rows


def write_rows(path, rows, row_group_rows=RG):
    table = pa.Table.from_pylist(rows, SCHEMA)
    pq.write_table(table, path, row_group_size=row_group_rows)


def to_per_request(rows):
    """Group the rows of each request: request-level columns once, candidate columns as lists."""
    out = []
    for row in rows:
        if not out or out[-1]["request_id"] != row["request_id"]:
            out.append(
                {**{c: row[c] for c in REQUEST_LEVEL}, **{c: [] for c in SCHEMA.names if c not in REQUEST_LEVEL}}
            )
        for c in SCHEMA.names:
            if c not in REQUEST_LEVEL:
                out[-1][c].append(row[c])
    fields = [f if f.name in REQUEST_LEVEL else pa.field(f.name, pa.list_(f.type)) for f in SCHEMA]
    return out, pa.schema(fields, metadata={b"pinads_rec.layout": b"per_request"})


def write_requests(path, requests, schema, row_group_requests=4):
    pq.write_table(pa.Table.from_pylist(requests, schema), path, row_group_size=row_group_requests)


def found(report):
    """{(kind, column): (count, (file name, row group, row, candidate))}."""
    out = {}
    for p in report.problems:
        place = p.place and (Path(p.place.file).name, p.place.row_group, p.place.row, p.place.candidate)
        out[(p.kind, p.column)] = (p.count, place)
    return out


def at(file, i, candidate=None, rows_per_group=RG):
    return (file, i // rows_per_group, i % rows_per_group, candidate)


# --------------------------------------------------------------------------------------------


def test_clean_data_has_no_problem_and_exact_stats(tmp_path):
    write_rows(tmp_path / "part-0.parquet", clean_rows())
    r = scan(cfg_of(), str(tmp_path))
    assert r.problems == []
    assert (r.rows, r.requests, r.files) == (R * C, R, 1)
    assert r.candidates_per_request["mean"] == C and r.candidates_per_request["max"] == C
    assert r.columns["item_id"]["min"] == 0 and r.columns["item_id"]["max"] == 49
    assert r.columns["cat"]["distinct"] == 10 and r.columns["cat"]["table_size"] == 10
    hist = r.sequence_lengths["hist"]  # lengths r % 6 over 40 requests, 4 rows each
    lengths = np.repeat([r_ % 6 for r_ in range(R)], C)
    assert hist["max"] == 5 and math.isclose(hist["mean"], lengths.mean())
    assert hist["p50"] == int(np.quantile(lengths, 0.5, method="inverted_cdf"))
    assert r.label_rates == {"a": {"rows": 80, "click": 0.5}, "b": {"rows": 80, "click": 0.5}}
    assert any("user_id" in n and "hashed" in n for n in r.notes)  # ids beyond a hash: true table


def planted_rows():
    rows = clean_rows()
    rows[3]["cat"], rows[50]["cat"] = -1, -2  # negative ids: 2
    rows[17]["item_id"], rows[18]["item_id"], rows[100]["item_id"] = 50, 77, 51  # beyond item (50): 3
    rows[40]["click"] = 2  # label not 0/1: 1
    rows[41]["true_p_click"], rows[42]["true_p_click"] = 1.5, -0.1  # outside [0, 1]: 2
    for i in range(60, 64):
        rows[i]["surface"] = "zzz"  # unknown surface: 4
    rows[70]["price"], rows[71]["price"] = float("nan"), float("inf")  # non-finite: 2
    rows[72]["emb"] = [0.25, float("nan"), 0.25, 0.25]  # non-finite: 1
    rows[84]["emb"] = [0.25] * 3  # wrong width: 1
    rows[90]["cat"] = None  # null: 1
    rows[91]["tags"] = [1, None]  # null inside a list: 1
    rows[97]["hist_cat"] = rows[97]["hist_cat"] + [1]  # ragged: 1
    for i in range(100, 104):  # request 25: sequences of 7 > max_length 5: 4 rows
        for c in ("hist_ts", "hist_item", "hist_cat"):
            rows[i][c] = [rows[i]["timestamp"] - 1 - j if c == "hist_ts" else 1 for j in range(7)]
    for i in range(116, 120):  # request 29: an event at the impression's time: 4 rows
        rows[i]["hist_ts"] = [rows[i]["timestamp"]] + rows[i]["hist_ts"][1:]
    for i in range(140, 144):  # request 35: oldest first: 4 rows
        rows[i]["hist_ts"] = rows[i]["hist_ts"][::-1]
    rows[29]["item_id"] = rows[28]["item_id"]  # duplicated (request, item): 2
    rows[82]["item_id"] = rows[81]["item_id"]
    rows.insert(127, rows.pop(123))  # request 30's last row after request 31's (one row group): not contiguous
    return rows


def test_every_planted_problem_is_reported_with_its_count_and_first_place(tmp_path):
    write_rows(tmp_path / "bad.parquet", planted_rows())
    # Requests cut by row-group boundaries (3-row groups, 4-row requests: both requests cut).
    write_rows(tmp_path / "cut.parquet", clean_rows(1000, 2), row_group_rows=3)
    # Another schema: a column missing, another of the wrong type.
    other = [{k: v for k, v in row.items() if k != "true_p_click"} for row in clean_rows(2000, 2)]
    schema = SCHEMA.remove(SCHEMA.get_field_index("true_p_click"))
    schema = schema.set(schema.get_field_index("price"), pa.field("price", pa.string()))
    for row in other:
        row["price"] = str(row["price"])
    pq.write_table(pa.Table.from_pylist(other, schema), tmp_path / "other.parquet")

    r = scan(cfg_of(), str(tmp_path))
    assert found(r) == {
        ("negative id", "cat"): (2, at("bad.parquet", 3)),
        ("id beyond its table", "item_id"): (3, at("bad.parquet", 17)),
        ("label not 0/1", "click"): (1, at("bad.parquet", 40)),
        ("probability outside [0, 1]", "true_p_click"): (2, at("bad.parquet", 41)),
        ("unknown surface", "surface"): (4, at("bad.parquet", 60)),
        ("non-finite dense value", "price"): (2, at("bad.parquet", 70)),
        ("non-finite dense value", "emb"): (1, at("bad.parquet", 72)),
        ("wrong dense width", "emb"): (1, at("bad.parquet", 84)),
        ("null", "cat"): (1, at("bad.parquet", 90)),
        ("null inside a list", "tags"): (1, at("bad.parquet", 91)),
        ("ragged sequence group", "hist_cat"): (1, at("bad.parquet", 97)),
        ("sequence longer than max_length", "hist_ts"): (4, at("bad.parquet", 100)),
        ("sequence event at or after the impression", "hist_ts"): (4, at("bad.parquet", 116)),
        ("sequence not newest first", "hist_ts"): (4, at("bad.parquet", 140)),
        ("duplicated (request, item) row", "item_id"): (2, at("bad.parquet", 29)),
        ("request rows not contiguous", "request_id"): (1, at("bad.parquet", 120)),
        ("request split across row groups", "request_id"): (2, ("cut.parquet", 0, 0, None)),
        ("missing column", "true_p_click"): (1, ("other.parquet", None, None, None)),
        ("wrong type", "price"): (1, ("other.parquet", None, None, None)),
    }
    loader = {(p.kind, p.column): p.loader for p in r.problems}
    assert loader[("non-finite dense value", "price")] == "error"
    assert loader[("sequence longer than max_length", "hist_ts")].startswith("repaired: truncated")
    assert loader[("duplicated (request, item) row", "item_id")] == insp.UNCHECKED
    assert r.rows == R * C + 2 * C + 2 * C and r.requests == R + 4

    # The policies change what the loader does, not what is found.
    r2 = scan(cfg_of(nonfinite_dense="replace", overlong_sequence="error"), str(tmp_path / "bad.parquet"))
    loader = {(p.kind, p.column): p.loader for p in r2.problems}
    assert loader[("non-finite dense value", "price")] == "repaired: replaced by 0"
    assert loader[("sequence longer than max_length", "hist_ts")] == "error"


def test_per_request_layout_clean_and_planted(tmp_path):
    requests, schema = to_per_request(clean_rows())
    (tmp_path / "clean").mkdir()
    write_requests(tmp_path / "clean" / "part-0.parquet", requests, schema)
    clean = scan(cfg_of(), str(tmp_path / "clean"))
    assert clean.problems == [] and clean.layouts == {"per_request": 1}
    assert (clean.rows, clean.requests) == (R * C, R)
    assert clean.label_rates == {"a": {"rows": 80, "click": 0.5}, "b": {"rows": 80, "click": 0.5}}
    assert clean.sequence_unit == "requests" and clean.sequence_lengths["hist"]["max"] == 5
    assert clean.columns["item_id"]["max"] == 49 and clean.columns["cat"]["distinct"] == 10

    requests[3]["item_id"][2] = 60  # beyond: candidate 2 of request 3
    requests[9]["surface"][1:3] = ["zzz", "zzz"]
    requests[12]["price"] = requests[12]["price"][:3]  # 3 prices for 4 candidates
    requests[14].update(
        {
            c: list(range(T0 + 90, T0 + 83, -1)) if c == "hist_ts" else [1] * 7
            for c in ("hist_ts", "hist_item", "hist_cat")
        }
    )
    requests[15]["user_id"] = None
    requests[20]["item_id"][1] = requests[20]["item_id"][0]
    write_requests(tmp_path / "bad.parquet", requests, schema)
    r = scan(cfg_of(), str(tmp_path / "bad.parquet"))
    assert found(r) == {
        ("id beyond its table", "item_id"): (1, ("bad.parquet", 0, 3, 2)),
        ("unknown surface", "surface"): (2, ("bad.parquet", 2, 1, 1)),
        ("candidate lists of unequal lengths", "price"): (1, ("bad.parquet", 3, 0, None)),
        ("sequence longer than max_length", "hist_ts"): (1, ("bad.parquet", 3, 2, None)),
        ("null", "user_id"): (1, ("bad.parquet", 3, 3, None)),
        ("duplicated (request, item) row", "item_id"): (1, ("bad.parquet", 5, 0, 1)),
    }


def test_synthetic_demo_data(tiny_data):
    cfg, out = tiny_data
    r = scan(cfg, str(out / "train"))
    requests = pa.concat_tables([pq.read_table(f) for f in list_files(str(out / "train"))])  # per request
    table = read_rows(out / "train", cfg.features)
    assert r.problems == []
    assert r.rows == table.num_rows and r.requests == len(set(table.column("request_id").to_pylist()))
    assert r.requests == requests.num_rows
    for g in cfg.features.sequence_groups:  # per request: each request's sequences counted once
        lengths = np.array([len(x) for x in requests.column(g.timestamp_column).to_pylist()])
        assert r.sequence_lengths[g.name]["max"] == lengths.max() <= g.max_length
        assert math.isclose(r.sequence_lengths[g.name]["mean"], lengths.mean())
    surface = np.array(table.column("surface").to_pylist())
    click = table.column("click").to_numpy()
    for s, e in r.label_rates.items():
        assert e["rows"] == (surface == s).sum() and math.isclose(e["click"], click[surface == s].mean())


@pytest.mark.parametrize("layout", ["per_row", "per_request"])
def test_draft_config_loads_and_passes_on_its_data(tmp_path, layout):
    data = tmp_path / "data"
    data.mkdir()
    if layout == "per_row":
        write_rows(data / "part-0.parquet", clean_rows())
    else:
        write_requests(data / "part-0.parquet", *to_per_request(clean_rows()))
    draft = tmp_path / "draft.yaml"
    assert insp.main(["--data", str(data), "--draft-config", str(draft), "--json", str(tmp_path / "r.json")]) == 0
    assert draft.read_text().splitlines()[0].endswith(f"({layout} layout), by python -m pinads_rec.data.inspect.")
    cfg = config.load(draft)
    f = cfg.features
    assert [(t.label_column, t.true_probability_column) for t in f.tasks] == [("click", "true_p_click")]
    assert (f.columns.request_id, f.columns.timestamp, f.columns.surface) == ("request_id", "timestamp", "surface")
    assert sorted(f.surfaces) == ["a", "b"]
    [g] = f.sequence_groups
    assert (g.timestamp_column, g.max_length, sorted(x.column for x in g.features)) == (
        "hist_ts",
        5,
        ["hist_cat", "hist_item"],
    )
    assert {(d.column, d.dim) for d in f.dense} == {("price", 1), ("emb", 4)}
    sparse = {s.column: s for s in f.sparse}
    assert set(sparse) == {"user_id", "item_id", "cat", "tags"}
    assert sparse["user_id"].user_side == (layout == "per_request")
    assert f.table(sparse["item_id"].table).num_embeddings == 50
    assert "# Guess" in draft.read_text() or "guess" in draft.read_text()
    assert scan(cfg, cfg.data.train_dir).problems == []  # data.train_dir is the drafted data
    assert json.loads((tmp_path / "r.json").read_text())["problems"] == []


def test_draft_proposes_a_history_of_every_event_with_its_action(tmp_path):
    """Labels with negatives and no group carrying an action: the draft proposes a group of every
    event with its action, commented out, pointing at the docs, and the proposal loads once pasted.
    A group that carries an action is said to, with no proposal."""
    data = tmp_path / "data"
    data.mkdir()
    write_rows(data / "part-0.parquet", clean_rows())
    text = insp.draft_config(str(data))
    assert 'docs/datasets.md, "Designing history groups"' in text
    proposal = yaml.safe_load("\n".join(x[len("  #   ") :] for x in text.splitlines() if x.startswith("  #   ")))
    raw = yaml.safe_load(text)
    raw["features"]["tables"] += proposal["features.tables"]
    raw["features"]["sequence_groups"] += proposal["features.sequence_groups"]
    raw["build"] = {"impressions": {"path": ["log.parquet"]}, "sequences": proposal["build.sequences"]}
    cfg = config.from_dict(raw)
    assert [f.name for f in cfg.features.sequence_groups[-1].features] == ["item", "action"]
    assert cfg.build.sequences[0].columns["events_action"] == "CASE WHEN click = 1 THEN 1 ELSE 2 END"
    assert cfg.build.sequences[0].filter is None  # every event: the negatives too

    acting = pq.read_table(data / "part-0.parquet").rename_columns(
        ["hist_action" if n == "hist_cat" else n for n in SCHEMA.names]
    )
    pq.write_table(acting, data / "part-0.parquet")
    text = insp.draft_config(str(data))
    assert "History: 'hist' (hist_action) carries each event's action" in text and "build.sequences" not in text

    # A ratings log as is: the rating is the outcome (never a feature); its earlier values the action.
    ratings = tmp_path / "ratings"
    ratings.mkdir()
    log = {"request_id": list(range(8)), "user_id": [1, 2] * 4, "item_id": list(range(8)), "rating": [1, 5] * 4}
    pq.write_table(pa.table({**log, "timestamp": [T0 + i for i in range(8)]}), ratings / "u.parquet")
    text = insp.draft_config(str(ratings))
    assert "rating" not in {s["column"] for s in yaml.safe_load(text)["features"]["sparse"]}
    assert "events_action: CASE WHEN rating >= 4 THEN 1 ELSE 2 END" in text


def test_command_line_exit_codes_and_json(tmp_path, capsys):
    write_rows(tmp_path / "bad.parquet", planted_rows())
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump({"features": FEATURES, "data": {"train_dir": str(tmp_path)}}))
    assert insp.main(["--config", str(cfg_path), "--json", str(tmp_path / "r.json")]) == 1
    text = capsys.readouterr().out
    assert "PROBLEMS: 16" in text and "bad.parquet, row group 1, row 1" in text
    report = json.loads((tmp_path / "r.json").read_text())
    beyond = next(p for p in report["problems"] if p["kind"] == "id beyond its table")
    assert beyond["count"] == 3 and beyond["place"]["where"].endswith("bad.parquet, row group 1, row 1")
    with pytest.raises(SystemExit) as e:  # checked by argparse, before the config is read
        insp.main(["--config", str(cfg_path), "--data", str(tmp_path / "nowhere")])
    assert e.value.code == 2 and "argument --data: " in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        insp.main([])
    assert e.value.code == 2


def test_unknown_items_of_a_built_vocabulary_are_not_duplicates(tmp_path):
    """A build maps ids its vocabulary left out to 0: two such candidates of one request are two
    items. Without a vocabulary beside the data, 0 is an id like any other."""
    rows = clean_rows(requests=4)
    for row in rows[:2]:  # request 0: two candidates of item 0
        row["item_id"] = 0
    split = tmp_path / "build" / "eval"
    split.mkdir(parents=True)
    write_rows(split / "part-00000.parquet", rows)
    assert ("duplicated (request, item) row", "item_id") in found(scan(cfg_of(), str(split)))
    (tmp_path / "build" / "vocabularies").mkdir()
    pq.write_table(
        pa.table({"raw": ["a"], "idx": [1], "count": [3]}), tmp_path / "build" / "vocabularies" / "item.parquet"
    )
    assert ("duplicated (request, item) row", "item_id") not in found(scan(cfg_of(), str(split)))


def test_a_split_dominated_by_unknown_ids_is_shown_and_warned(tmp_path):
    """A build's summary.json beside the data gives each split's unknown-id shares: shown as a
    table, and a split at or above UNKNOWN_DOMINATES of a table's ids warned about in one line
    naming split, table and share -- a warning, not a problem (the exit code stays 0)."""

    def shares(calibration_share):
        def entry(ids, share):
            return {"ids": ids, "unknown": round(ids * share), "share": share}

        return {
            "train": {"user": {"impressions": entry(1000, 0.0)}, "item": {"impressions": entry(4000, 0.0)}},
            "calibration": {
                "user": {"impressions": entry(200, calibration_share)},
                "item": {"impressions": entry(800, 0.0)},
            },
            "eval": {"user": {"impressions": entry(400, 0.16)}, "item": {"impressions": entry(1600, 0.0)}},
        }

    build_dir = tmp_path / "build"
    (build_dir / "train").mkdir(parents=True)
    write_rows(build_dir / "train" / "part-00000.parquet", clean_rows())
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump({"features": FEATURES, "data": {"train_dir": str(build_dir / "train")}}))
    for share, warned in ((0.74, True), (0.4, False)):
        (build_dir / "summary.json").write_text(json.dumps({"unknown_ids": shares(share)}))
        report = scan(cfg_of(), str(build_dir / "train"))
        assert report.unknown_ids == shares(share) and report.problems == []
        warnings = [w for w in report.warnings if "'calibration'" in w]
        assert len(warnings) == (1 if warned else 0) and len(report.warnings) == len(warnings)
        if warned:
            assert "74.0% of the impressions' user ids" in warnings[0], warnings
        text = insp.format_report(report, cfg_of().features)
        assert ("WARNING: split 'calibration'" in text) == warned
        # The table lists the tables with an unknown id somewhere, in every split.
        assert "eval         user   impressions    400       64  16.0%" in text, text
        assert "item" not in text.split("Unknown ids per split")[1]
    assert insp.main(["--config", str(cfg_path)]) == 0  # the last summary: no warning, no problem
    # One file of the split finds its build too; data no build wrote has no shares.
    assert scan(cfg_of(), str(build_dir / "train" / "part-00000.parquet")).unknown_ids == shares(0.4)
    (build_dir / "summary.json").unlink()
    assert scan(cfg_of(), str(build_dir / "train")).unknown_ids == {}
