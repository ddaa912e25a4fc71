"""Raw log files as DuckDB relations: which files a source names, how they are scanned, and where a
bad row sits (file and row) when a check fails.

A source is a list of files or globs (relative to the raw directory), CSV or Parquet. Scans are
lazy SQL (``read_csv`` / ``read_parquet``): DuckDB streams them, in parallel, under the build's
memory limit. Header names are stripped of surrounding spaces. Every scan exposes DuckDB's virtual
``filename`` column, so a check can name the file; ``locate`` then finds the first offending row
of that file with a single-threaded ordered scan (only on the error path).

What DuckDB would misread is refused up front by name (``RawSource.of``): an empty file, a CSV with
only its header, a header that is one column at the configured delimiter but holds another, bytes
compressed in a way DuckDB does not read. How a CSV file's bytes are stored -- compression, byte
order mark, line endings -- is told from the bytes (raw_bytes.py): DuckDB is given each file's
compression and encoding, and reads a file mixing line endings (or in UTF-16) through a copy.
``explain`` turns DuckDB's own errors about a raw file (a ragged or truncated line, bytes not in the
encoding, a value that does not fit the type DuckDB guessed from its sample) into one line naming
the file, row, line, column and value, re-reading the line where DuckDB does not say it.
"""

from __future__ import annotations

import csv
import glob
import os
import re
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import duckdb

from pinads_rec.config import RawSourceConfig
from pinads_rec.data import raw_bytes
from pinads_rec.data.loader.contract import ContractError
from pinads_rec.data.sql_text import column_value, columns_read, first_line, printable, sql_name, sql_string

CSV_SUFFIXES = (".csv", ".csv.gz", ".csv.zst", ".tsv", ".tsv.gz", ".tsv.zst", ".txt")
PARQUET_SUFFIXES = (".parquet", ".pq")
# A header that is one field at the configured delimiter but holds one of these: the wrong delimiter.
OTHER_DELIMITERS = (";", "\t", "|", ",")
HEAD_BYTES = 1 << 16  # read to tell an empty, header-only or wrongly delimited CSV


@dataclass(frozen=True)
class RawSource:
    """One configured raw table: ``where`` names it in errors (``build.impressions``)."""

    where: str
    files: Tuple[str, ...]
    format: str  # csv | parquet
    delimiter: str
    null_values: Tuple[str, ...]
    names: Tuple[str, ...] = ()  # a CSV without a header: its column names
    encoding: str = "utf-8"

    @classmethod
    def of(cls, cfg: RawSourceConfig, raw_dir: str, where: str) -> "RawSource":
        if not cfg.path:
            raise ContractError(f"{where}.path: no file given")
        files: List[str] = []
        for pattern in cfg.path:
            full = pattern if os.path.isabs(pattern) or is_remote(pattern) else _join(raw_dir, pattern)
            if is_remote(full):  # object storage: the engine lists it (Spark expands the globs)
                files.append(full)
                continue
            found = sorted(glob.glob(full)) if glob.has_magic(full) else ([full] if os.path.isfile(full) else [])
            if not found:
                raise ContractError(f"{where}.path: no file matches {pattern!r} (looked for {full})")
            files += found
        fmt = cfg.format
        if fmt == "auto":
            kinds = {_kind(f) for f in files}
            if None in kinds or len(kinds) != 1:
                raise ContractError(
                    f"{where}.format: cannot tell CSV from Parquet for {files[:3]} by their names; "
                    f"set format: csv or parquet"
                )
            fmt = kinds.pop()
        source = cls(where, tuple(files), fmt, cfg.delimiter, tuple(cfg.null_values), tuple(cfg.names), cfg.encoding)
        source.check_files()
        return source

    def check_files(self) -> None:
        """Refuses what DuckDB would misread rather than name: an empty file (read as one column
        ``column0``), a CSV with only its header (every column typed text, no rows), a header that is
        one column at the configured delimiter (every expression's column 'not found')."""
        for path in self.files:
            if is_remote(path):  # not on this machine: the engine's reader says what is wrong
                continue
            if os.path.getsize(path) == 0:
                raise ContractError(f"{self.where}.path: {path} is empty (0 bytes)")
            if self.format != "csv":
                continue
            self.form(path)  # bytes DuckDB cannot read are refused here, naming how they are stored
            head, whole = self._head(path)
            lines = [line for line in head.splitlines() if line.strip()]
            if not lines:
                raise ContractError(f"{self.where}.path: {path} holds no line (blank)")
            first = lines[0]
            if len(self._fields(first)) == 1 and len(self.names) != 1:
                found = [d for d in OTHER_DELIMITERS if d != self.delimiter and d in first]
                if found:
                    d = max(found, key=first.count)
                    raise ContractError(
                        f"{self.where}.delimiter: {path} looks {d!r}-delimited (its first line "
                        f"'{printable(first[:80])}' is one column at delimiter {self.delimiter!r}): set "
                        f"{self.where}.delimiter: {d!r}"
                    )
            if len(lines) == 1 and whole and not self.names:
                raise ContractError(f"{self.where}.path: {path} has only its header line, no rows")

    def form(self, path: str) -> raw_bytes.Form:
        """How DuckDB reads CSV file ``path`` (raw_bytes.py); a remote one as DuckDB finds it."""
        if is_remote(path):
            return raw_bytes.Form(path, path, "auto", self.encoding, "")
        try:
            return raw_bytes.form(path, self.encoding)
        except ContractError as e:
            raise ContractError(f"{self.where}.path: {e}") from None

    def scan(self, files: Optional[Tuple[str, ...]] = None) -> str:
        """The SQL table expression reading the files (all of them by default), each row's
        ``filename`` the file as configured."""
        files = files or self.files
        if self.format == "parquet":
            return f"read_parquet([{', '.join(sql_string(f) for f in files)}], union_by_name = true)"
        groups, copied = self._groups(files)
        reads = [self._read_csv(paths, compression, encoding) for (compression, encoding), paths in groups.items()]
        if len(reads) == 1 and not copied:
            return reads[0]
        # Files read apart (another compression or encoding) or through a copy: one relation again,
        # ``filename`` now a column of it, naming the configured file.
        name = "filename"
        if copied:
            name = f"CASE filename {' '.join(f'WHEN {sql_string(f.read)} THEN {sql_string(f.path)}' for f in copied)}"
            name += " ELSE filename END"
        return "(" + " UNION ALL BY NAME ".join(f"SELECT *, {name} AS filename FROM {r}" for r in reads) + ")"

    def read_apart(self) -> bool:
        """Whether ``scan`` reads the files apart, ``filename`` then a column of the relation."""
        if self.format != "csv":
            return False
        groups, copied = self._groups(self.files)
        return len(groups) > 1 or bool(copied)

    def _groups(self, files: Sequence[str]) -> Tuple[Dict[Tuple[str, str], List[str]], List[raw_bytes.Form]]:
        """The files DuckDB reads, by (compression, encoding); the forms of those read through a copy."""
        forms = [self.form(f) for f in files]
        groups: Dict[Tuple[str, str], List[str]] = {}
        for f in forms:
            groups.setdefault((f.compression, f.encoding), []).append(f.read)
        return groups, [f for f in forms if f.copied]

    def _read_csv(self, paths: List[str], compression: str, encoding: str) -> str:
        # skip = 0: the first line is the header (or, with names, a row). DuckDB's sniffer would
        # otherwise skip lines it finds out of step with the rest: a header one field short, dropped,
        # the first row taken for it. Quotes as RFC 4180 has them: sniffed, a file with no quoted
        # field reads a stray '"' as part of a value ('"pv'), the line's end inside a quote unnoticed.
        nulls = "[" + ", ".join(sql_string(v) for v in self.null_values) + "]"
        header = "header = true"
        if self.names:
            header = "header = false, names = [" + ", ".join(sql_string(n) for n in self.names) + "]"
        return (
            f"read_csv([{', '.join(sql_string(p) for p in paths)}], {header}, delim = {sql_string(self.delimiter)}, "
            f"nullstr = {nulls}, encoding = {sql_string(encoding)}, compression = {sql_string(compression)}, "
            f"skip = 0, quote = '\"', escape = '\"', union_by_name = true)"
        )

    def find(self, path: str, condition: str, values: str = "", row_as: Optional[str] = None) -> Optional[tuple]:
        """(0-based data row, *values) of the first row of ``path`` where ``condition`` holds,
        scanning in file order on one thread; None if it never does. ``condition`` and ``values`` are
        SQL over the file's columns, or with ``row_as`` over a struct of that name holding them (a
        side table's ``name.column``)."""
        found = self.find_all(path, condition, values, row_as, 1)
        return found[0] if found else None

    def find_all(
        self, path: str, condition: str, values: str = "", row_as: Optional[str] = None, limit: int = 2
    ) -> List[tuple]:
        """``find``'s rows: the first ``limit`` of them, in file order (none if the SQL fails)."""
        con = duckdb.connect()
        con.execute("SET threads = 1")
        con.execute("SET preserve_insertion_order = true")
        columns = (
            f"{sql_name(row_as)} FROM {self.scan((path,))} AS {sql_name(row_as)}"
            if row_as
            else f"* FROM {self.scan((path,))}"
        )
        try:
            rows = con.execute(
                f"SELECT __row{', ' + values if values else ''} FROM (SELECT row_number() OVER () - 1 AS __row, "
                f"{columns}) WHERE {condition} ORDER BY __row LIMIT {int(limit)}"
            ).fetchall()
        except duckdb.Error:
            return []
        finally:
            con.close()
        return [(int(row[0]), *row[1:]) for row in rows]

    def columns_of(self, path: str) -> List[str]:
        """The columns DuckDB reads from ``path`` (none if it cannot)."""
        con = duckdb.connect()
        try:
            return [r[0] for r in con.execute(f"DESCRIBE SELECT * FROM {self.scan((path,))}").fetchall()]
        except duckdb.Error:
            return []
        finally:
            con.close()

    def locate(self, path: str, condition: str, row_as: Optional[str] = None) -> Optional[int]:
        """The 0-based data row (header excluded) of ``path`` where ``condition`` (SQL over the
        file's columns) first holds; None if it never does (``find``)."""
        found = self.find(path, condition, row_as=row_as)
        return None if found is None else found[0]

    def place(self, path: str, condition: str, row_as: Optional[str] = None, reads: str = "") -> str:
        """``file, row N`` (CSV: also its line) of the first row where condition holds; with
        ``reads`` (SQL over the file's columns, e.g. the expression that failed), also the value
        there of each column it reads (``, column 'time_stamp': value 1494000000000``)."""
        have = {c.lower(): c for c in self.columns_of(path)} if reads and not row_as else {}
        columns = [have[c.lower()] for c in columns_read(reads) if c.lower() in have] if have else []
        found = self.find(path, condition, ", ".join(sql_name(c) for c in columns), row_as)
        if found is None:
            return path
        return self.at(path, found[0]) + "".join(f", {column_value(c, v)}" for c, v in zip(columns, found[1:]))

    def places(self, condition: str, limit: int = 2) -> List[str]:
        """``file, row N (line M)`` of the first ``limit`` rows of the files, in order, where
        ``condition`` (SQL over the file's columns) holds."""
        found: List[str] = []
        for path in self.files:
            found += [self.at(path, row[0]) for row in self.find_all(path, condition, limit=limit - len(found))]
            if len(found) >= limit:
                break
        return found

    def at(self, path: str, row: int) -> str:
        """``file, row N`` of a 0-based data row (CSV: also its 1-based line; -1: the header)."""
        if row < 0 and self.format == "csv" and not self.names:
            return f"{path}, line 1 (the header)"
        line = f" (line {row + 1 + (not self.names)})" if self.format == "csv" else ""
        return f"{path}, row {row}{line}"

    def explain_csv(self, path: str, text: str) -> str:
        """DuckDB's CSV error ``text`` about ``path`` as one line naming row, line, column and value."""
        line = re.search(r"CSV Error on Line: (\d+)", text)
        number = int(line.group(1)) if line else None
        cast = re.search(r'Error when converting column "(.+?)"\. Could not convert string "(.*)" to \'(\w+)\'', text)
        if cast and number:
            column, value, kind = cast.groups()
            sample = re.search(r"sample_size = (\d+)", text)
            guessed = f" from the first {sample.group(1)} rows" if sample else ""
            beyond = ""
            if re.fullmatch(r"[+-]?\d+", value) and not -(2**63) <= int(value) < 2**63:
                beyond = " (an integer beyond 2^63 - 1, the largest BIGINT)"
            return (
                f"{self.where}: {self.at(path, number - 1 - (not self.names))}, column {column!r}: value {value!r} "
                f"is not a {kind}, the type DuckDB guessed for the column{guessed}{beyond}"
            )
        problem = self.line_problem(path, number) if number else None
        found = (number, problem) if problem else self.first_bad_line(path)
        if found:
            return f"{self.where}: {self.at(path, found[0] - 1 - (not self.names))}: {found[1]}"
        return f"{self.where}: cannot read {path}: {first_line(text)}"

    def original(self, path: str) -> Optional[str]:
        """The configured file DuckDB read as ``path`` (itself, or the file it copies); None if none."""
        if path in self.files:
            return path
        if self.format != "csv":
            return None
        return next((f for f in self.files if not is_remote(f) and self.form(f).read == path), None)

    def find_value(self, path: str, value: str) -> Optional[Tuple[int, str]]:
        """(0-based row, column) of the first text field of ``path`` equal to ``value``."""
        con = duckdb.connect()
        try:
            kinds = con.execute(f"DESCRIBE SELECT * FROM {self.scan((path,))}").fetchall()
        except duckdb.Error:
            return None
        finally:
            con.close()
        text = [k[0] for k in kinds if k[1] == "VARCHAR"]
        if not text:
            return None
        equal = [f"{sql_name(c)} = {sql_string(value)}" for c in text]
        found = self.find(path, " OR ".join(equal), "[" + ", ".join(equal) + "]")
        return None if found is None else (found[0], text[found[1].index(True)])

    # --- a line DuckDB refused, read again --------------------------------------------------

    def header(self, path: str) -> List[str]:
        """The column names, in file order."""
        if self.names:
            return list(self.names)
        first = next((line for line in self._head(path)[0].splitlines() if line.strip()), "")
        return [f.strip() for f in self._fields(first)]

    def line_problem(self, path: str, number: int) -> Optional[str]:
        """What is wrong with 1-based line ``number`` of ``path`` as a row of this source (bytes not
        in its encoding, a field too many or too few), naming the column and value; None if nothing."""
        header, encoding = self.header(path), self.form(path).encoding
        for n, raw, last in self._lines(path):
            if n == number:
                return self._problem(header, raw, last, encoding)
        return None

    def first_bad_line(self, path: str) -> Optional[Tuple[int, str]]:
        """(1-based line, what is wrong) of the first line of ``path`` that ``line_problem`` faults."""
        header, encoding = self.header(path), self.form(path).encoding
        for n, raw, last in self._lines(path):
            if n == 1 and not self.names:
                continue
            problem = self._problem(header, raw, last, encoding)
            if problem:
                return n, problem
        return None

    def _problem(self, header: List[str], raw: bytes, last: bool, encoding: str) -> Optional[str]:
        ended = raw.endswith((b"\n", b"\r"))
        raw = raw.rstrip(b"\r\n")
        try:
            text = raw.decode(encoding)
        except UnicodeDecodeError as e:
            column = raw[: e.start].decode(encoding, "replace").count(self.delimiter)
            field = raw.split(self.delimiter.encode(encoding))[column]
            name = header[column] if column < len(header) else f"#{column + 1}"
            hint = f"; set {self.where}.encoding: latin-1 if it is Latin-1" if encoding != "latin-1" else ""
            return (
                f"column {name!r}: value '{printable(field.decode(encoding, 'backslashreplace'))}' is not valid "
                f"{encoding}{hint}"
            )
        if not text:  # an empty line: DuckDB skips it
            return None
        fields = self._fields(text)
        try:
            next(csv.reader([text], delimiter=self.delimiter, strict=True), [])
        except csv.Error:  # a quote opened and never closed on the line (or closed mid-field)
            opened = next((i for i, f in enumerate(fields) if '"' in f or self.delimiter in f), len(fields) - 1)
            name = header[opened] if opened < len(header) else f"#{opened + 1}"
            return (
                f"column {name!r}: a quote opens its value and does not close it as RFC 4180 has it (the line reads "
                f"'{printable(text[:120])}')"
            )
        if len(fields) == len(header):
            return None
        counted = f"{len(fields)} field(s) where the header has {len(header)}"
        if len(fields) > len(header):
            return f"{counted}: an extra value {fields[len(header)]!r} after column {header[-1]!r}"
        cut = ", at the end of the file with no newline: truncated?" if last and not ended else ""
        after = f" (the line ends after {header[len(fields) - 1]!r} = {fields[-1]!r})" if fields else ""
        return f"{counted}: no value for column {header[len(fields)]!r}{after}{cut}"

    def _fields(self, line: str) -> List[str]:
        return next(csv.reader([line], delimiter=self.delimiter), [])

    def _head(self, path: str) -> Tuple[str, bool]:
        """The first HEAD_BYTES of what DuckDB reads for the file as text (decoded leniently: only
        to look at), and whether that is the whole file."""
        form = self.form(path)
        with raw_bytes.opened(form) as f:
            head = f.read(HEAD_BYTES + 1)
        encoding = "utf-8-sig" if form.encoding == "utf-8" else form.encoding
        return head[:HEAD_BYTES].decode(encoding, "replace"), len(head) <= HEAD_BYTES

    def _lines(self, path: str) -> Iterator[Tuple[int, bytes, bool]]:
        """(1-based line, its bytes, whether it is the last) of each line DuckDB reads for the file."""
        lines = raw_bytes.lines(self.form(path))
        previous = next(lines, None)
        n = 1
        for line in lines:
            yield n, previous, False
            previous, n = line, n + 1
        if previous is not None:
            yield n, previous, True


def configured(build, raw_dir: str) -> List[RawSource]:
    """The raw sources of a ``build:`` section (``BuildConfig``), each named by its config key;
    those that cannot be opened are left out (this is for explaining an error)."""
    named = [("build.impressions", build.impressions)]
    named += [(f"build.side_tables[{i}]", s) for i, s in enumerate(build.side_tables)]
    named += [(f"build.sequences[{i}]", s) for i, s in enumerate(build.sequences) if s.path]
    sources = []
    for where, cfg in named:
        try:
            sources.append(RawSource.of(cfg, raw_dir, where))
        except ContractError:
            pass
    return sources


def explain(error: Exception, sources: Sequence[RawSource]) -> Optional[str]:
    """One line for a DuckDB error about a raw file of ``sources`` -- its config key, file, row and
    line, column and value -- instead of DuckDB's first line (``CSV Error on Line: 26447``); None
    when the error is not about a raw file."""
    text = str(error)
    named = re.search(r"^\s*file = (.+?)\s*$", text, re.M) or re.search(r'Error when sniffing file "(.+?)"', text)
    if named:
        path = named.group(1)
        for source in sources:
            original = source.original(path)
            if original:
                return source.explain_csv(original, text)
        return RawSource("build", (path,), "csv", ",", ("", "NULL")).explain_csv(path, text)
    cast = re.search(r"Could not convert string '(.*?)' to (\w+)", text)
    if cast:  # an expression's cast of a text value: the first raw field holding it
        value, kind = cast.groups()
        # DuckDB names the column cast, and writes some bytes escaped (NUL as \0): then the first value
        # of that column that does not convert is the one.
        named = re.search(r"when casting from source column (\S+)", text)
        # The value as written, or with DuckDB's escaped NUL (\0) as the file holds it.
        values = list(dict.fromkeys([value, value.replace("\\0", "\x00")]))
        for source in sources:
            for path in source.files:
                found = next((hit + (v,) for v in values if (hit := source.find_value(path, v))), None)
                if found:
                    row, column, value = found
                elif named and kind.isalnum():
                    column = named.group(1)
                    c = sql_name(column)
                    found = source.find(path, f"{c} IS NOT NULL AND TRY_CAST({c} AS {kind}) IS NULL", c)
                    if not found:
                        continue
                    row, value = found
                else:
                    continue
                return (
                    f"{source.where}: {source.at(path, row)}, column {column!r}: value '{printable(value)}' does not "
                    f"convert to {kind} (an expression casts it)"
                )
    return None


def is_remote(path: str) -> bool:
    """A URI of object storage or a cluster file system (``s3a://``, ``gs://``, ``hdfs://``)."""
    return re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", path) is not None and not path.startswith("file://")


def _join(raw_dir: str, pattern: str) -> str:
    return raw_dir.rstrip("/") + "/" + pattern if is_remote(raw_dir) else os.path.join(raw_dir, pattern)


def _kind(path: str) -> Optional[str]:
    low = path.lower()
    if low.endswith(CSV_SUFFIXES):
        return "csv"
    if low.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return None
