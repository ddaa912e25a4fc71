"""Malformed raw input on the Taobao layout: each case stops the build with one line naming the file,
its row and line and the column and value where they exist, or is a repair counted in summary.json.
The raw files are dataset_fixtures' Taobao files (30 users), broken one way per test."""

import gzip
import re
import shutil
from pathlib import Path
from typing import Callable, List

import pyarrow.parquet as pq
import pytest
from dataset_fixtures import write_taobao

from pinads_rec import config
from pinads_rec.data.build import build, main
from pinads_rec.data.loader.contract import ContractError

TAOBAO = Path(__file__).resolve().parent.parent / "configs" / "datasets" / "taobao_ad.yaml"
PAST_SAMPLE = 21000  # data rows before the bad one: past DuckDB's 20480-row type-sniffing sample


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    raw = tmp_path_factory.mktemp("taobao") / "raw"
    write_taobao(raw, users=30, requests_per_user=3)
    return raw


def lines(path: Path) -> List[bytes]:
    return path.read_bytes().split(b"\n")  # the last is b"" when the file ends with a newline


def edit(path: Path, index: int, change: Callable[[List[bytes]], None]) -> None:
    """Line ``index`` (0 = the header) split at commas, changed in place, written back."""
    all_lines = lines(path)
    fields = all_lines[index].split(b",")
    change(fields)
    all_lines[index] = b",".join(fields)
    path.write_bytes(b"\n".join(all_lines))


def padded(path: Path) -> List[bytes]:
    """The header and PAST_SAMPLE data rows (the file's own, repeated)."""
    header, *body = [line for line in lines(path) if line]
    return [header] + [body[i % len(body)] for i in range(PAST_SAMPLE)]


def broken(clean: Path, tmp_path: Path, breaks: Callable[[Path], None]) -> Path:
    raw = tmp_path / "raw"
    shutil.copytree(clean, raw)
    breaks(raw)
    return raw


def build_error(raw: Path, tmp_path: Path, cfg=None) -> str:
    with pytest.raises(ContractError) as info:
        build(cfg or config.load(TAOBAO), str(raw), str(tmp_path / "out"), threads=1)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_ragged_line(clean, tmp_path):
    raw = broken(clean, tmp_path, lambda r: edit(r / "raw_sample.csv", 40, lambda f: f.append(b"7")))
    assert re.fullmatch(
        r"build\.impressions: \S+/raw_sample\.csv, row 39 \(line 41\): 7 field\(s\) where the header has 6: "
        r"an extra value '7' after column 'clk'",
        build_error(raw, tmp_path),
    )


def test_ragged_line_past_the_sample(clean, tmp_path):
    def breaks(r):
        p = r / "raw_sample.csv"
        p.write_bytes(b"\n".join(padded(p) + [b"1,1494000000,5", b""]))

    assert re.fullmatch(
        rf"build\.impressions: \S+/raw_sample\.csv, row {PAST_SAMPLE} \(line {PAST_SAMPLE + 2}\): 3 field\(s\) "
        r"where the header has 6: no value for column 'pid' \(the line ends after 'adgroup_id' = '5'\)",
        build_error(broken(clean, tmp_path, breaks), tmp_path),
    )


def test_truncated_last_line(clean, tmp_path):
    def breaks(r):
        p = r / "raw_sample.csv"
        kept = [line for line in lines(p) if line]
        p.write_bytes(b"\n".join(kept[:-1] + [kept[-1][:12]]))  # cut mid-field, no newline

    assert re.fullmatch(
        r"build\.impressions: \S+/raw_sample\.csv, row \d+ \(line \d+\): 2 field\(s\) where the header has 6: "
        r"no value for column 'adgroup_id' \(the line ends after 'time_stamp' = '\d+'\), at the end of the file "
        r"with no newline: truncated\?",
        build_error(broken(clean, tmp_path, breaks), tmp_path),
    )


def test_bytes_not_utf8(clean, tmp_path):
    raw = broken(clean, tmp_path, lambda r: edit(r / "raw_sample.csv", 30, lambda f: f.__setitem__(3, b"4305\xff8")))
    assert re.fullmatch(
        r"build\.impressions: \S+/raw_sample\.csv, row 29 \(line 31\): column 'pid': value '4305\\xff8' is not "
        r"valid utf-8; set build\.impressions\.encoding: latin-1 if it is Latin-1",
        build_error(raw, tmp_path),
    )


@pytest.mark.parametrize(
    "column, value, hint",
    [(5, b"x", ""), (0, str(2**63).encode(), r" \(an integer beyond 2\^63 - 1, the largest BIGINT\)")],
    ids=["unparsable", "2^63"],
)
def test_value_past_the_sample(clean, tmp_path, column, value, hint):
    """DuckDB types a CSV column from its first rows; a later value that does not fit."""

    def breaks(r):
        p = r / "raw_sample.csv"
        rows = padded(p)
        fields = rows[-1].split(b",")
        fields[column] = value
        p.write_bytes(b"\n".join(rows + [b",".join(fields), b""]))

    name = ["user", "time_stamp", "adgroup_id", "pid", "nonclk", "clk"][column]
    assert re.fullmatch(
        rf"build\.impressions: \S+/raw_sample\.csv, row {PAST_SAMPLE} \(line {PAST_SAMPLE + 2}\), column '{name}': "
        rf"value '{value.decode()}' is not a BIGINT, the type DuckDB guessed for the column from the first 20480 "
        rf"rows{hint}",
        build_error(broken(clean, tmp_path, breaks), tmp_path),
    )


def test_text_price(clean, tmp_path):
    raw = broken(clean, tmp_path, lambda r: edit(r / "ad_feature.csv", 20, lambda f: f.__setitem__(5, b"cheap")))
    assert re.fullmatch(
        r"build\.side_tables\[0\]\.defaults\.price: \S+/ad_feature\.csv, row 19 \(line 21\), column 'price': "
        r"value 'cheap' makes the column text, and its default 0\.0 is a number; fix the value, or quote the default",
        build_error(raw, tmp_path),
    )


def test_text_value_an_expression_casts(clean, tmp_path):
    """No default involved: the cast of an impression column fails at run time."""
    raw = broken(clean, tmp_path, lambda r: edit(r / "raw_sample.csv", 12, lambda f: f.__setitem__(4, b"one")))
    cfg = config.load(TAOBAO)
    cfg.build.columns["clk"] = "CAST(nonclk AS INTEGER) * 0 + clk"
    assert re.fullmatch(
        r"build\.impressions: \S+/raw_sample\.csv, row 11 \(line 13\), column 'nonclk': value 'one' does not "
        r"convert to INT32 \(an expression casts it\)",
        build_error(raw, tmp_path, cfg),
    )


def test_missing_label_column(clean, tmp_path):
    def breaks(r):
        p = r / "raw_sample.csv"
        p.write_bytes(b"\n".join(b",".join(line.split(b",")[:5]) for line in lines(p)))

    assert re.fullmatch(
        r"build\.columns\.clk: 'clk' reads column 'clk', which \S+/raw_sample\.csv does not have \(its columns: "
        r"user, time_stamp, adgroup_id, pid, nonclk, ad\.<column>, profile\.<column>\)",
        build_error(broken(clean, tmp_path, breaks), tmp_path),
    )


@pytest.mark.parametrize(
    "name, where",
    [("behavior_log.csv", r"build\.sequences\[0\]"), ("ad_feature.csv", r"build\.side_tables\[0\]")],
    ids=["behaviour log", "ad table"],
)
def test_header_only(clean, tmp_path, name, where):
    raw = broken(clean, tmp_path, lambda r: (r / name).write_bytes(lines(r / name)[0] + b"\n"))
    assert re.fullmatch(rf"{where}\.path: \S+/{name} has only its header line, no rows", build_error(raw, tmp_path))


def test_empty_impression_log(clean, tmp_path, capsys):
    raw = broken(clean, tmp_path, lambda r: (r / "raw_sample.csv").write_bytes(b""))
    assert re.fullmatch(
        r"build\.impressions\.path: \S+/raw_sample\.csv is empty \(0 bytes\)", build_error(raw, tmp_path)
    )
    assert main(["--config", str(TAOBAO), "--raw", str(raw), "--out", str(tmp_path / "cli")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "raw_sample.csv is empty (0 bytes)" in err


def test_semicolon_delimited_impression_log(clean, tmp_path):
    def breaks(r):
        p = r / "raw_sample.csv"
        p.write_bytes(p.read_bytes().replace(b",", b";"))

    assert re.fullmatch(
        r"build\.impressions\.delimiter: \S+/raw_sample\.csv looks ';'-delimited \(its first line "
        r"'user;time_stamp;adgroup_id;pid;nonclk;clk' is one column at delimiter ','\): "
        r"set build\.impressions\.delimiter: ';'",
        build_error(broken(clean, tmp_path, breaks), tmp_path),
    )


def test_profile_value_outside_its_table_names_the_profile_file(clean, tmp_path):
    raw = broken(clean, tmp_path, lambda r: edit(r / "user_profile.csv", 5, lambda f: f.__setitem__(1, b"500")))
    assert re.fullmatch(
        r"build\.columns\.cms_segid: id 501 at \S+/user_profile\.csv, row 4 \(line 6\), column 'cms_segid' "
        r"\(side table profile\) is outside \[0, 98\), the table of sparse feature 'cms_segid'; .*",
        build_error(raw, tmp_path),
    )


def unknown_surface(raw: Path) -> None:
    edit(raw / "raw_sample.csv", 10, lambda f: f.__setitem__(3, b"430539_2000"))


def test_unknown_surface_is_an_error(clean, tmp_path):
    assert re.fullmatch(
        r"build\.columns\.pid: 1 impression\(s\) on a surface not in features\.surfaces \['430548_1007', "
        r"'430539_1007'\] \(e\.g\. '430539_2000'\), first at \S+/raw_sample\.csv, row 9 \(line 11\), column 'pid': "
        r"value '430539_2000'; add it to "
        r"features\.surfaces, or set build\.impressions\.unknown_surface: drop",
        build_error(broken(clean, tmp_path, unknown_surface), tmp_path),
    )


def test_unknown_surface_dropped_and_counted(clean, tmp_path):
    raw = broken(clean, tmp_path, unknown_surface)
    cfg = config.load(TAOBAO, ["build.impressions.unknown_surface=drop"])
    summary = build(cfg, str(raw), str(tmp_path / "out"), threads=1)
    assert summary["repairs"]["impressions on a surface not in features.surfaces (dropped)"] == 1
    shown = len([line for line in lines(raw / "raw_sample.csv") if line]) - 1
    rows = sum(s["rows"] for s in summary["splits"].values())
    assert rows == shown - 1 - summary["repairs"]["duplicated impressions (dropped)"]


def test_unmapped_behaviour_type_and_other_defaults_counted(clean, tmp_path):
    def breaks(r):
        for index in (3, 7, 9):
            edit(r / "behavior_log.csv", index, lambda f: f.__setitem__(2, b"click"))  # no WHEN for it

    out = tmp_path / "out"
    summary = build(config.load(TAOBAO), str(broken(clean, tmp_path, breaks)), str(out), threads=1)
    repairs, chosen = summary["repairs"], summary["case_else"]
    # The CASE's ELSE is the config's own value: counted apart, not as a repair.
    assert chosen["build.sequences[0].columns.behaviour_btag: events given the CASE's ELSE value 0"] == 3
    assert chosen["build.sequences[1].columns.intent_btag: events given the CASE's ELSE value 0"] == 0  # filtered
    assert not [what for what in repairs if "ELSE" in what]
    # A side table's default for a blank value is counted too (a missing key is: join_misses).
    profile = [line.split(b",") for line in lines(clean / "user_profile.csv")[1:] if line]
    blank = sum(1 for f in profile if f[5] == b"")
    assert blank and repairs["side table profile: rows with a blank pvalue_level (its default 0 used)"] == blank
    # Ads never shown in the training days are out of vocabulary: 0, and counted.
    zeros = sum(
        ids.count(0)
        for split in ("train", "calibration", "eval")
        for ids in pq.read_table(out / split).column("adgroup_id").to_pylist()
    )
    assert zeros > 0 and repairs["vocabulary adgroup: ids out of vocabulary (mapped to 0)"] == zeros


# --- bytes stored another way, and the value behind each error ----------------------------------


def outputs(out: Path) -> dict:
    return {str(p.relative_to(out)): pq.read_table(p) for p in sorted(out.rglob("*.parquet"))}


def test_mixed_line_endings_and_gzip_under_csv_build_as_the_clean_files(clean, tmp_path):
    """A chunk with CRLF line endings appended to an LF log, and gzip bytes under a .csv name: the build's
    output is the clean files' (DuckDB alone refuses the first while sniffing, and reads the second as text)."""
    build(config.load(TAOBAO), str(clean), str(tmp_path / "clean"), threads=1)
    expected = outputs(tmp_path / "clean")

    def stored_otherwise(r):
        log = r / "raw_sample.csv"
        *head, tail = log.read_bytes().split(b"\n", 60)
        log.write_bytes(b"\n".join(head) + b"\n" + tail.replace(b"\n", b"\r\n"))
        events = r / "behavior_log.csv"
        events.write_bytes(gzip.compress(events.read_bytes()))

    raw = broken(clean, tmp_path, stored_otherwise)
    assert b"\r\n" in (raw / "raw_sample.csv").read_bytes()[:-2]
    build(config.load(TAOBAO), str(raw), str(tmp_path / "out"), threads=1)
    got = outputs(tmp_path / "out")
    assert got.keys() == expected.keys() and all(got[k].equals(expected[k]) for k in got)


def test_timestamp_out_of_range_names_its_value(clean, tmp_path):
    raw = broken(
        clean, tmp_path, lambda r: edit(r / "raw_sample.csv", 20, lambda f: f.__setitem__(1, b"1494000000000"))
    )
    assert re.fullmatch(
        r"build\.impressions\.time: 1 timestamp\(s\) outside 1990\.\.2100, first at \S+/raw_sample\.csv, row 19 "
        r"\(line 21\), column 'time_stamp': value 1494000000000 \(milliseconds\? divide by 1000 in the expression\)",
        build_error(raw, tmp_path),
    )


def test_unparsable_timestamp_names_its_value(clean, tmp_path):
    raw = broken(clean, tmp_path, lambda r: edit(r / "behavior_log.csv", 9, lambda f: f.__setitem__(1, b"soon")))
    assert re.fullmatch(
        r"build\.sequences\[0\]\.time: 1 timestamp\(s\) missing or unparsable, first at \S+/behavior_log\.csv, "
        r"row 8 \(line 10\), column 'time_stamp': value 'soon'",
        build_error(raw, tmp_path),
    )


def test_side_table_key_twice_names_both_lines(clean, tmp_path):
    def breaks(r):
        p = r / "ad_feature.csv"
        p.write_bytes(p.read_bytes() + lines(p)[7] + b"\n")

    key = lines(clean / "ad_feature.csv")[7].split(b",")[0].decode()
    total = len([line for line in lines(clean / "ad_feature.csv") if line])
    assert re.fullmatch(
        rf"build\.side_tables\[0\]: key \{{'adgroup_id': {key}\}} has 2 rows, at \S+/ad_feature\.csv, row 6 \(line 8\) "
        rf"and \S+/ad_feature\.csv, row {total - 1} \(line {total + 1}\); a side table needs one row per key",
        build_error(broken(clean, tmp_path, breaks), tmp_path),
    )


def test_duplicated_impression_error_names_both_lines(clean, tmp_path):
    def breaks(r):
        p = r / "raw_sample.csv"
        kept = [line for line in lines(p) if line]
        seen, unique = set(), []
        for line in kept[1:]:  # the fixture's own duplicate left out: one pair, the one added here
            if line not in seen:
                seen.add(line)
                unique.append(line)
        p.write_bytes(b"\n".join([kept[0]] + unique + [unique[4], b""]))

    cfg = config.load(TAOBAO, ["build.impressions.duplicates=error"])
    message = build_error(broken(clean, tmp_path, breaks), tmp_path, cfg)
    assert re.fullmatch(
        r"build\.impressions: 1 duplicated impression\(s\); request \d+ shows item \d+ 2 times \(column "
        r"'adgroup_id'\), at \S+/raw_sample\.csv, row 4 \(line 6\) and \S+/raw_sample\.csv, row \d+ \(line \d+\); "
        r"set build\.impressions\.duplicates: drop to keep the first",
        message,
    )


def test_a_text_value_where_an_expression_needs_a_number(clean, tmp_path):
    """coalesce(brand, 0) over a brand column one value made text: DuckDB says only "Cannot mix values of type VARCHAR
    and INTEGER_LITERAL"; the message names that value."""
    raw = broken(clean, tmp_path, lambda r: edit(r / "behavior_log.csv", 30, lambda f: f.__setitem__(4, b"12-7")))
    assert re.fullmatch(
        r"build\.sequences\[0\]\.columns\.behaviour_brand: \S+/behavior_log\.csv, row 29 \(line 31\), column 'brand': "
        r"value '12-7' makes the column text, and 'coalesce\(brand, 0\)' reads it as a number; fix the value, or cast "
        r"it in the expression \(Binder Error: .*\)",
        build_error(raw, tmp_path),
    )


def test_a_dropped_user_column_is_missing_not_the_session_user(clean, tmp_path):
    """Bare ``user`` over a log without that column is DuckDB's session user ('duckdb') on every row, not a binder
    error: the build names it as the missing column it is."""

    def breaks(r):
        p = r / "raw_sample.csv"
        p.write_bytes(b"\n".join(b",".join(line.split(b",")[1:]) for line in lines(p)))

    assert re.fullmatch(
        r"build\.columns\.user_id: 'user' reads column 'user', which \S+/raw_sample\.csv does not have \(its columns: "
        r"time_stamp, adgroup_id, pid, nonclk, clk, ad\.<column>, profile\.<column>\)",
        build_error(broken(clean, tmp_path, breaks), tmp_path),
    )


def test_a_request_of_two_users_names_a_line_of_each(clean, tmp_path):
    """A request key that is too coarse (the surface alone): the request's first row and its first row of another
    user, each with its value."""
    cfg = config.load(TAOBAO, ["build.impressions.request_key=[pid]"])
    assert re.fullmatch(
        r"build\.impressions: request 1 has impressions of \d+ users \('user' is \d+ at \S+/raw_sample\.csv, row \d+ "
        r"\(line \d+\) and \d+ at \S+/raw_sample\.csv, row \d+ \(line \d+\)\); a request is one user's \(check "
        r"build\.impressions\.request / request_key\)",
        build_error(clean, tmp_path, cfg),
    )


def test_a_nul_byte_in_a_gzipped_side_table_key_names_its_line(clean, tmp_path):
    """A NUL byte inside an ad id of gzip bytes under ad_feature.csv (the fuzzer's case 973 of seed 0): DuckDB
    says only "Could not convert string '66\\01' ... from source column __k0" (NUL written escaped, the column its
    own alias); the message names the file, line, column and value."""

    def breaks(r):
        path = r / "ad_feature.csv"
        edit(path, 7, lambda f: f.__setitem__(0, f[0][:1] + b"\x00" + f[0][1:]))
        path.write_bytes(gzip.compress(path.read_bytes()))

    assert re.fullmatch(
        r"build\.side_tables\[0\]: \S+/ad_feature\.csv, row 6 \(line 8\), column 'adgroup_id': value '\d\\x00\d*' "
        r"does not convert to INT64 \(an expression casts it\)",
        build_error(broken(clean, tmp_path, breaks), tmp_path),
    )
