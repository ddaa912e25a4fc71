"""A seeded fuzzer of raw logs: the build reads a mutated raw CSV as the rows it holds, or refuses it
in one line naming the file and line -- never a traceback, never other rows.

    python benchmarks/raw_log_fuzz.py [--cases 1000] [--seed 0] [--users 12] [--case N] [--verbose]

Each case takes the four raw files of the Taobao layout (``pinads_rec.data.shaped_logs.taobao.write``
at a few users: raw_sample.csv, ad_feature.csv, user_profile.csv, behavior_log.csv, with the real
files' quirks; configs/datasets/taobao_ad.yaml),
mutates one of them one way (case ``i`` of seed ``s`` draws file, mutation and place from its own
generator: ``--case i`` replays it alone) and builds through the build's command line in-process
(``main([...])``, one thread): exit 0 and the output, or exit 2 and the one line on stderr, as a
user sees them. A quarter of the cases wrap the mutated bytes again in a form that keeps their rows
(CRLF, mixed or CR line endings, a byte order mark, UTF-16, gzip, zstd), so an error is also found
in a file the build reads through a copy or a decompressor.

**The logical rows** of a file are what ``logical_rows`` reads, the rule a user may hold the build to:

- compression told by the first bytes: gzip and zstd are read; bzip2 and xz are not (the refusal
  names the compression);
- a UTF-8 byte order mark skipped, a UTF-16 one naming the encoding (either byte order); otherwise
  UTF-8, the config's encoding: bytes outside it make the file malformed at their line;
- lines end at CRLF, LF or CR, in any mix; empty lines are skipped;
- fields split at ',' as RFC 4180 has them (Python's csv, strict: a field opened with '"' closes on
  its line); a line with another field count than the header is malformed there.

**The verdict** compares the mutated file's build with the build of its logical rows written as a
clean file (UTF-8, LF, the same name, the other three files untouched):

- ACCEPTED only where that clean file is accepted, and with equal output: every Parquet file of the
  splits and vocabularies, and summary.json but its timing;
- REFUSED with exit 2 and one printable line (a value quoted from the file has its control bytes
  escaped) naming the mutated file and: the line the rows are malformed at, where they are; the
  compression, for one not read; otherwise a line -- or the clean file's own message, the refusal
  then being about the rows, not their bytes (a label not 0/1, a side table's key twice);
- a mutation in ``LOSSLESS`` leaves the rows as they are and must be ACCEPTED;
- a traceback always fails the case. Any failure is a bug of the build, not of this rule.

Each mutation, and so its logical rows:

- crlf, mixed_endings, cr_only: every LF made CRLF; or those from, or up to, a random line (a chunk
  from another system); every LF made CR. The same rows.
- utf8_bom, utf16: a UTF-8 BOM; the text as UTF-16 with its BOM, little- or big-endian. The same rows.
- gzip, zstd: the file compressed, its name kept (``.csv``). The same rows.
- reorder_columns: the header and every line's fields in another order. The same rows (a column is
  read by its name).
- blank_lines: empty lines inserted. The same rows.
- bzip2, xz: the file compressed, its name kept. None: refused, naming the compression.
- truncate: the file cut at a random byte after the header. The whole lines before the cut, and
  what is left of the cut one (a value cut short, or a line malformed).
- byte_flip: one byte replaced by a digit, a delimiter, a quote, CR, LF, NUL, ESC, a space, a
  letter, '-', '.' or any byte. As read: a value changed, a line split, a line malformed.
- stray_quote: a '"' put before a field of one line (a quote no writer closed). Malformed at that
  line (the byte flips land one there too rarely to count on).
- swap_fields: two fields of one line swapped. That row's two values swapped.
- drop_column: a column removed from the header and every line. The rows without it.
- drop_field: a field removed from one line. Malformed at that line.
- duplicate_line: a data line repeated, next to it or at the end. The rows with that row twice.
- latin1: a value given an accented letter, the file in Latin-1. Malformed (not UTF-8) at its line.
- utf8_text: the same, the file in UTF-8. The rows with that value.
"""

from __future__ import annotations

import argparse
import bz2
import contextlib
import csv
import gzip
import hashlib
import io
import json
import lzma
import random
import re
import shutil
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import pyarrow as pa
import pyarrow.parquet as pq

from pinads_rec.data.build import main as build_main
from pinads_rec.data.shaped_logs import taobao

REPO = Path(__file__).resolve().parents[1]
TAOBAO = REPO / "configs" / "datasets" / "taobao_ad.yaml"

# Which file a case mutates, by weight: the impression log most, the side tables and the behaviour log too.
FILES = {"raw_sample.csv": 4, "behavior_log.csv": 2, "ad_feature.csv": 2, "user_profile.csv": 2}
LOSSLESS = {
    "crlf",
    "mixed_endings",
    "cr_only",
    "utf8_bom",
    "utf16",
    "gzip",
    "zstd",
    "reorder_columns",
    "blank_lines",
}
# What the compression a refusal must name is called, by mutation.
UNREAD_COMPRESSION = {"bzip2": "bzip2", "xz": "xz"}
WRAPPED_SHARE = 0.25  # of the cases whose mutation changes the rows: wrapped again in a lossless form
LINE_ENDING = re.compile(r"\r\n|\r|\n")


# --- the logical rows --------------------------------------------------------------------------


@dataclass
class Reading:
    """A file's logical rows, or where they are malformed: ``line`` (1-based, counting every line,
    empty ones too) or the whole file (``line`` None: a compression not read, no rows)."""

    header: List[str] = field(default_factory=list)
    rows: List[List[str]] = field(default_factory=list)
    fault: Optional[str] = None
    line: Optional[int] = None

    def as_dicts(self) -> List[Dict[str, str]]:
        return [dict(zip(self.header, r)) for r in self.rows]


def decompress(data: bytes) -> Tuple[Optional[bytes], Optional[str]]:
    """(the bytes decompressed, None), or (None, the compression) for one the build does not read."""
    if data.startswith(b"\x1f\x8b"):
        return gzip.decompress(data), None
    if data.startswith(b"\x28\xb5\x2f\xfd"):
        return pa.input_stream(pa.BufferReader(data), compression="zstd").read(), None
    if data.startswith(b"BZh"):
        return None, "bzip2"
    if data.startswith(b"\xfd7zXZ\x00"):
        return None, "xz"
    return data, None


def logical_rows(data: bytes) -> Reading:
    """The rows ``data`` holds by the rule of the module docstring."""
    plain, unread = decompress(data)
    if plain is None:
        return Reading(fault=f"{unread}-compressed")
    encoding = "utf-8"
    if plain.startswith(b"\xef\xbb\xbf"):
        plain = plain[3:]
    elif plain.startswith((b"\xff\xfe", b"\xfe\xff")):
        encoding = "utf-16-le" if plain.startswith(b"\xff\xfe") else "utf-16-be"
        plain = plain[2:]
    try:
        text = plain.decode(encoding)
    except UnicodeDecodeError as e:
        before = plain[: e.start].decode(encoding, "replace")
        return Reading(fault=f"not {encoding}", line=len(LINE_ENDING.findall(before)) + 1)
    lines = LINE_ENDING.split(text)
    if lines and lines[-1] == "":
        lines.pop()  # the last line's ending
    reading = Reading()
    for n, line in enumerate(lines, 1):
        if line == "":
            continue
        try:
            fields = next(csv.reader([line], strict=True))
        except csv.Error as e:
            return Reading(fault=f"quoting: {e}", line=n)
        if not reading.header:
            reading.header = fields
        elif len(fields) != len(reading.header):
            return Reading(fault=f"{len(fields)} fields where the header has {len(reading.header)}", line=n)
        else:
            reading.rows.append(fields)
    if not reading.rows:
        return Reading(fault="no rows")
    return reading


def render(reading: Reading) -> bytes:
    """The rows as a clean CSV: UTF-8, LF, fields quoted only where they must be."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(reading.header)
    writer.writerows(reading.rows)
    return out.getvalue().encode("utf-8")


# --- mutations ---------------------------------------------------------------------------------


def _split(data: bytes) -> List[bytes]:
    """The file's lines without their LF (the fixture writes LF, and ends with one)."""
    return data[:-1].split(b"\n") if data.endswith(b"\n") else data.split(b"\n")


def _join(lines: List[bytes]) -> bytes:
    return b"\n".join(lines) + b"\n"


def crlf(rng: random.Random, data: bytes) -> Tuple[bytes, str]:
    return data.replace(b"\n", b"\r\n"), "every line CRLF"


def mixed_endings(rng: random.Random, data: bytes) -> Tuple[bytes, str]:
    lines = data.split(b"\n")
    k = rng.randrange(1, max(2, len(lines) - 1))
    if rng.random() < 0.5:
        return b"\n".join(lines[:k]) + b"\n" + b"\r\n".join(lines[k:]), f"CRLF from line {k + 1} on"
    return b"\r\n".join(lines[:k]) + b"\r\n" + b"\n".join(lines[k:]), f"CRLF up to line {k}"


def cr_only(rng: random.Random, data: bytes) -> Tuple[bytes, str]:
    return data.replace(b"\n", b"\r"), "every line CR"


def utf8_bom(rng: random.Random, data: bytes) -> Tuple[bytes, str]:
    return b"\xef\xbb\xbf" + data, "a UTF-8 BOM"


def utf16(rng: random.Random, data: bytes) -> Tuple[bytes, str]:
    text = data.decode("utf-8")
    if rng.random() < 0.7:
        return b"\xff\xfe" + text.encode("utf-16-le"), "UTF-16 little-endian with its BOM"
    return b"\xfe\xff" + text.encode("utf-16-be"), "UTF-16 big-endian with its BOM"


def gzipped(rng: random.Random, data: bytes) -> Tuple[bytes, str]:
    return gzip.compress(data, mtime=0), "gzip bytes under the plain name"


def zstd(rng: random.Random, data: bytes) -> Tuple[bytes, str]:
    return pa.compress(data, codec="zstd", asbytes=True), "zstd bytes under the plain name"


def bzip2(rng: random.Random, data: bytes) -> Tuple[bytes, str]:
    return bz2.compress(data), "bzip2 bytes under the plain name"


def xz(rng: random.Random, data: bytes) -> Tuple[bytes, str]:
    return lzma.compress(data), "xz bytes under the plain name"


def reorder_columns(rng: random.Random, data: bytes) -> Tuple[bytes, str]:
    rows = [next(csv.reader([line.decode()])) for line in _split(data)]
    order = list(range(len(rows[0])))
    while order == sorted(order):
        rng.shuffle(order)
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows([[r[i] for i in order] for r in rows])
    return out.getvalue().encode(), f"columns in the order {order}"


def blank_lines(rng: random.Random, data: bytes) -> Tuple[bytes, str]:
    lines = _split(data)
    at = sorted(rng.sample(range(1, len(lines) + 1), min(3, len(lines))), reverse=True)
    for k in at:
        lines.insert(k, b"")
    return _join(lines), f"empty lines before lines {sorted(a + 1 for a in at)}"


def truncate(rng: random.Random, data: bytes) -> Tuple[bytes, str]:
    start = data.index(b"\n") + 1
    cut = rng.randrange(start, len(data))
    return data[:cut], f"cut after byte {cut} of {len(data)}"


FLIPS = [b"0", b"1", b"9", b",", b'"', b"\r", b"\n", b"\x00", b"\x1b", b" ", b"x", b"-", b"."]


def byte_flip(rng: random.Random, data: bytes) -> Tuple[bytes, str]:
    at = rng.randrange(len(data))
    new = bytes([rng.randrange(256)]) if rng.random() < 0.3 else rng.choice(FLIPS)
    return data[:at] + new + data[at + 1 :], f"byte {at} ({data[at : at + 1]!r}) -> {new!r}"


def _fields(line: bytes) -> List[bytes]:
    return line.split(b",")  # the fixture quotes no field


def stray_quote(rng: random.Random, data: bytes) -> Tuple[bytes, str]:
    lines = _split(data)
    k = rng.randrange(1, len(lines))
    fields = _fields(lines[k])
    j = rng.randrange(len(fields))
    fields[j] = b'"' + fields[j]
    lines[k] = b",".join(fields)
    return _join(lines), f"a quote before field {j} of line {k + 1}"


def swap_fields(rng: random.Random, data: bytes) -> Tuple[bytes, str]:
    lines = _split(data)
    k = rng.randrange(1, len(lines))
    fields = _fields(lines[k])
    i, j = rng.sample(range(len(fields)), 2)
    fields[i], fields[j] = fields[j], fields[i]
    lines[k] = b",".join(fields)
    return _join(lines), f"fields {i} and {j} of line {k + 1} swapped"


def drop_column(rng: random.Random, data: bytes) -> Tuple[bytes, str]:
    lines = _split(data)
    j = rng.randrange(len(_fields(lines[0])))
    kept = [b",".join(f for i, f in enumerate(_fields(line)) if i != j) for line in lines]
    return _join(kept), f"column {j} ({_fields(lines[0])[j].decode()!r}) dropped"


def drop_field(rng: random.Random, data: bytes) -> Tuple[bytes, str]:
    lines = _split(data)
    k = rng.randrange(1, len(lines))
    fields = _fields(lines[k])
    j = rng.randrange(len(fields))
    lines[k] = b",".join(fields[:j] + fields[j + 1 :])
    return _join(lines), f"field {j} of line {k + 1} dropped"


def duplicate_line(rng: random.Random, data: bytes) -> Tuple[bytes, str]:
    lines = _split(data)
    k = rng.randrange(1, len(lines))
    if rng.random() < 0.5:
        lines.insert(k + 1, lines[k])
        return _join(lines), f"line {k + 1} repeated after itself"
    return _join(lines + [lines[k]]), f"line {k + 1} repeated at the end"


def _accented(rng: random.Random, data: bytes) -> Tuple[List[bytes], int, int]:
    lines = _split(data)
    k = rng.randrange(1, len(lines))
    fields = _fields(lines[k])
    j = rng.randrange(len(fields))
    fields[j] = fields[j] + "é".encode()
    lines[k] = b",".join(fields)
    return lines, k, j


def latin1(rng: random.Random, data: bytes) -> Tuple[bytes, str]:
    lines, k, j = _accented(rng, data)
    return _join(lines).decode().encode("latin-1"), f"field {j} of line {k + 1} given an 'é', the file in Latin-1"


def utf8_text(rng: random.Random, data: bytes) -> Tuple[bytes, str]:
    lines, k, j = _accented(rng, data)
    return _join(lines), f"field {j} of line {k + 1} given an 'é'"


MUTATIONS: Dict[str, Tuple[int, Callable[[random.Random, bytes], Tuple[bytes, str]]]] = {
    # name: (weight, mutation)
    "crlf": (1, crlf),
    "mixed_endings": (2, mixed_endings),
    "cr_only": (1, cr_only),
    "utf8_bom": (1, utf8_bom),
    "utf16": (1, utf16),
    "gzip": (1, gzipped),
    "zstd": (1, zstd),
    "bzip2": (1, bzip2),
    "xz": (1, xz),
    "reorder_columns": (1, reorder_columns),
    "blank_lines": (1, blank_lines),
    "truncate": (3, truncate),
    "byte_flip": (6, byte_flip),
    "stray_quote": (1, stray_quote),
    "swap_fields": (2, swap_fields),
    "drop_column": (2, drop_column),
    "drop_field": (2, drop_field),
    "duplicate_line": (2, duplicate_line),
    "latin1": (1, latin1),
    "utf8_text": (1, utf8_text),
}
# The lossless forms a changed file may be wrapped in again (UTF-16 only around text that decodes).
WRAPPERS = ["crlf", "mixed_endings", "cr_only", "utf8_bom", "utf16", "gzip", "zstd"]


@dataclass
class Case:
    index: int
    file: str
    mutation: str
    data: bytes
    detail: str


def make_case(seed: int, index: int, clean: Dict[str, bytes]) -> Case:
    """Case ``index`` of ``seed``: a file of ``clean`` (name -> bytes) mutated, drawn from its own generator."""
    rng = random.Random(f"{seed}:{index}")
    name = rng.choices(list(FILES), weights=list(FILES.values()))[0]
    mutation = rng.choices(list(MUTATIONS), weights=[w for w, _ in MUTATIONS.values()])[0]
    data, detail = MUTATIONS[mutation][1](rng, clean[name])
    if mutation not in LOSSLESS and mutation not in UNREAD_COMPRESSION and rng.random() < WRAPPED_SHARE:
        wrapper = rng.choice(WRAPPERS)
        try:
            data, how = MUTATIONS[wrapper][1](rng, data)
        except UnicodeDecodeError:  # UTF-16 around bytes that are no text: left as they are
            wrapper, how = "", ""
        if wrapper:
            mutation, detail = f"{mutation}+{wrapper}", f"{detail}; then {how}"
    return Case(index, name, mutation, data, detail)


# --- the verdict -------------------------------------------------------------------------------


@dataclass
class Outcome:
    """A build's exit status and what it left: the output (``snapshot``) or stderr's text."""

    code: int
    output: Optional[dict] = None
    stderr: str = ""
    traceback: str = ""

    @property
    def message(self) -> str:
        return self.stderr[len("error: ") :].rstrip("\n") if self.stderr.startswith("error: ") else self.stderr


def snapshot(out: Path) -> dict:
    """What a build wrote that its rows decide: every Parquet file's table and summary.json but its timing."""
    tables = {str(p.relative_to(out)): pq.read_table(p) for p in sorted(out.rglob("*.parquet"))}
    summary = json.loads((out / "summary.json").read_text())
    summary.pop("seconds", None)
    return {"tables": tables, "summary": summary}


def same_output(a: dict, b: dict) -> bool:
    return (
        a["summary"] == b["summary"]
        and a["tables"].keys() == b["tables"].keys()
        and all(a["tables"][k].equals(b["tables"][k]) for k in a["tables"])
    )


def run_build(raw: Path, out: Path) -> Outcome:
    """The build's command line, in-process, on one thread: its exit status and output or message."""
    stdout, stderr = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = build_main(["--config", str(TAOBAO), "--raw", str(raw), "--out", str(out), "--threads", "1"])
    except BaseException as e:  # noqa: BLE001 - a traceback is what the fuzzer counts
        return Outcome(-1, stderr=stderr.getvalue(), traceback="".join(traceback.format_exception(e)))
    outcome = Outcome(code, stderr=stderr.getvalue())
    if code == 0:
        outcome.output = snapshot(out)
    shutil.rmtree(out, ignore_errors=True)
    return outcome


class Fuzzer:
    """The clean raw files under ``work``, their build, and a cache of the clean builds of logical rows."""

    def __init__(self, work: Path, users: int):
        self.work = work
        self.clean_dir = work / "clean"
        taobao.write(self.clean_dir, users=users, seed=0)
        self.clean = {name: (self.clean_dir / name).read_bytes() for name in FILES}
        self.clean_rows = {name: logical_rows(data) for name, data in self.clean.items()}
        self.oracles: Dict[Tuple[str, str], Outcome] = {}
        self.clean_outcome = run_build(self.clean_dir, work / "out")
        assert self.clean_outcome.code == 0, self.clean_outcome.stderr + self.clean_outcome.traceback

    def raw_with(self, name: str, data: bytes, where: str) -> Path:
        """The clean raw directory with file ``name`` replaced by ``data``, at ``work/where``."""
        raw = self.work / where
        shutil.rmtree(raw, ignore_errors=True)
        shutil.copytree(self.clean_dir, raw)
        (raw / name).write_bytes(data)
        return raw

    def oracle(self, name: str, reading: Reading) -> Tuple[Outcome, Path]:
        """The build of ``reading``'s rows as a clean file ``name`` (cached), and its raw directory."""
        data = render(reading)
        key = (name, hashlib.sha256(data).hexdigest())
        raw = self.work / f"oracle-{key[1][:16]}"
        if key not in self.oracles:
            self.oracles[key] = run_build(self.raw_with(name, data, raw.name), self.work / "out")
        return self.oracles[key], raw

    def judge(self, case: Case) -> Tuple[str, str]:
        """(verdict, why): ACCEPTED / REFUSED when the case keeps the rule, else FAILED or TRACEBACK."""
        raw = self.raw_with(case.file, case.data, "case")
        got = run_build(raw, self.work / "out")
        if got.traceback:
            return "TRACEBACK", got.traceback
        reading = logical_rows(case.data)
        base = case.mutation.split("+")[0]
        if base in LOSSLESS and reading.as_dicts() != self.clean_rows[case.file].as_dicts():
            return "FAILED", "the fuzzer's own rule reads this lossless mutation as other rows"
        path = str(raw / case.file)
        if got.code == 0:
            if base in LOSSLESS:
                expected = self.clean_outcome
            elif reading.fault:
                return "FAILED", f"accepted, but the rows are malformed ({reading.fault}, line {reading.line})"
            else:
                expected = self.oracle(case.file, reading)[0]
            if expected.code != 0:
                return "FAILED", f"accepted, but the clean file of its rows is refused: {expected.message}"
            if not same_output(got.output, expected.output):
                return "FAILED", "accepted with an output other than the clean file's of the same rows"
            return "ACCEPTED", ""
        message = got.message
        if got.code != 2 or got.stderr.count("\n") != 1 or not got.stderr.startswith("error: "):
            return "FAILED", f"exit {got.code}, stderr not one error line: {got.stderr!r}"
        if not message.isprintable():
            return "FAILED", f"the message holds unprintable characters: {message!r}"
        if base in LOSSLESS:
            return "FAILED", f"refused a file whose rows are the clean ones: {message}"
        if path not in message:
            return "FAILED", f"the message does not name {path}: {message}"
        if base in UNREAD_COMPRESSION:
            named = UNREAD_COMPRESSION[base] in message
            return ("REFUSED", message) if named else ("FAILED", f"the compression is not named: {message}")
        lines = {int(n) for n in re.findall(r"\bline (\d+)\b", message)}
        if reading.fault and reading.line is not None:
            if reading.line in lines:
                return "REFUSED", message
            return "FAILED", f"malformed at line {reading.line} ({reading.fault}), but the message says: {message}"
        if lines:
            return "REFUSED", message
        if not reading.fault:
            clean, clean_raw = self.oracle(case.file, reading)
            if clean.code == 2 and clean.message.replace(str(clean_raw), str(raw)) == message:
                return "REFUSED", message
        return "FAILED", f"the message names no line: {message}"


@dataclass
class Counts:
    cases: int = 0
    verdicts: Counter = field(default_factory=Counter)
    by_mutation: Dict[str, Counter] = field(default_factory=dict)
    failures: List[str] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, case: Case, verdict: str, why: str) -> None:
        self.cases += 1
        self.verdicts[verdict] += 1
        self.by_mutation.setdefault(case.mutation.split("+")[0], Counter())[verdict] += 1
        if verdict in ("FAILED", "TRACEBACK"):
            self.failures.append(f"case {case.index} ({case.file}, {case.mutation}: {case.detail}): {why}")

    def table(self) -> str:
        lines = [f"{'mutation':<16} {'cases':>6} {'accepted':>9} {'refused':>8} {'failed':>7} {'tracebacks':>11}"]
        for name in MUTATIONS:
            c = self.by_mutation.get(name)
            if c:
                lines.append(
                    f"{name:<16} {sum(c.values()):>6} {c['ACCEPTED']:>9} {c['REFUSED']:>8} {c['FAILED']:>7} "
                    f"{c['TRACEBACK']:>11}"
                )
        v = self.verdicts
        lines.append(
            f"{'all':<16} {self.cases:>6} {v['ACCEPTED']:>9} {v['REFUSED']:>8} {v['FAILED']:>7} {v['TRACEBACK']:>11}"
        )
        return "\n".join(lines)


def fuzz(cases: int, seed: int, users: int = 12, only: Optional[int] = None, verbose: bool = False) -> Counts:
    """Runs cases 0..cases-1 of ``seed`` (or case ``only``); the counts, and every failure described."""
    counts = Counts()
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="raw_log_fuzz_") as tmp:
        fuzzer = Fuzzer(Path(tmp), users)
        for index in [only] if only is not None else range(cases):
            case = make_case(seed, index, fuzzer.clean)
            verdict, why = fuzzer.judge(case)
            counts.add(case, verdict, why)
            if verdict in ("FAILED", "TRACEBACK"):
                print(counts.failures[-1], file=sys.stderr, flush=True)
            elif verbose:
                print(f"case {index} ({case.file}, {case.mutation}: {case.detail}): {verdict} {why}", flush=True)
    counts.seconds = time.time() - start
    return counts


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--users", type=int, default=12, help="users of the Taobao-shaped logs (their size)")
    ap.add_argument("--case", type=int, default=None, help="replay this case of --seed alone")
    ap.add_argument("--verbose", action="store_true", help="one line per case")
    args = ap.parse_args(argv)
    counts = fuzz(args.cases, args.seed, args.users, args.case, args.verbose)
    print(counts.table())
    v = counts.verdicts
    print(
        f"cases {counts.cases}, accepted {v['ACCEPTED']}, refused {v['REFUSED']}, failed {v['FAILED']}, "
        f"tracebacks {v['TRACEBACK']} ({counts.seconds:.0f} s, seed {args.seed})"
    )
    return 1 if counts.failures else 0


if __name__ == "__main__":
    sys.exit(main())
