"""How a raw CSV file's bytes are stored -- compression, byte order mark, line endings -- told from
the bytes rather than the name, and the file DuckDB reads for it (``form``).

DuckDB's CSV reader takes the compression from the file name: gzip bytes named ``.csv`` are read
as text and blamed on the encoding. It refuses a file whose lines end in CRLF in one part and in LF
in another (a chunk appended from another system: "Error when sniffing file", "The CSV Parser state
machine reached an invalid state"); its ``strict_mode = false`` reads one, but then also drops a
line's extra fields without a word. And it reads UTF-16 little-endian only. So each local CSV file
is looked at once, cached by path, size and modification time:

- its first bytes name the compression: gzip (1f 8b) and zstd (28 b5 2f fd) are read, DuckDB given
  ``compression``; bzip2, xz, zip, lz4 and 7z are refused, named (DuckDB reads none of them);
- a UTF-16 byte order mark names the encoding, whatever the config says (a UTF-8 one DuckDB skips);
- one pass over the (decompressed) bytes counts CR, LF and CRLF with ``bytes.count`` (about 1 GB/s
  on one core; DuckDB's own ``count(*)`` over the same file takes twice as long). A file mixing
  line endings, and any UTF-16 file, is copied once, streamed, into a temporary directory (removed
  at exit): every line ending LF, UTF-16 as UTF-8. DuckDB reads the copy. Its lines are the
  original's -- CRLF, LF and CR each end one -- so the line an error names is the same in both.

``lines`` gives a file's lines back the way DuckDB counted them (the error path re-reads one).
"""

from __future__ import annotations

import atexit
import codecs
import gzip
import os
import re
import shutil
import tempfile
import zlib
from dataclasses import dataclass
from typing import BinaryIO, Dict, Iterator, Optional, Tuple

import pyarrow as pa

from pinads_rec.data.loader.contract import ContractError

CHUNK = 1 << 22
# Compressions told by their first bytes: those DuckDB reads (the name its ``compression`` takes)...
READ = {b"\x1f\x8b": "gzip", b"\x28\xb5\x2f\xfd": "zstd"}
# ... and those it does not.
UNREAD = {
    b"BZh": "bzip2",
    b"\xfd7zXZ\x00": "xz",
    b"PK\x03\x04": "zip",
    b"\x04\x22\x4d\x18": "lz4",
    b"7z\xbc\xaf\x27\x1c": "7z",
}
BOMS = {b"\xef\xbb\xbf": "utf-8", b"\xff\xfe": "utf-16-le", b"\xfe\xff": "utf-16-be"}
# A line's end, as DuckDB and the copy count them.
_LINE = re.compile(rb"[^\r\n]*(?:\r\n|\r|\n)")


@dataclass(frozen=True)
class Form:
    """What DuckDB reads for the configured file ``path``: ``read`` (``path`` itself, or its
    copy) with ``compression`` (none, gzip, zstd) and ``encoding`` (DuckDB's name), and what the
    original's lines end in (``endings``: "LF", "CRLF", "CR", "CRLF and LF"..., "" for no line end)."""

    path: str
    read: str
    compression: str
    encoding: str
    endings: str

    @property
    def copied(self) -> bool:
        return self.read != self.path


_forms: Dict[Tuple[str, str], Tuple[Tuple[int, int], Form]] = {}
_copies: Optional[str] = None


def form(path: str, encoding: str) -> Form:
    """The form DuckDB reads local CSV file ``path`` in, configured as ``encoding``: looked at once
    per version of the file. ContractError (naming the file, no config key) for bytes the build
    cannot read: a compression DuckDB does not read, a compressed stream cut short."""
    stat = os.stat(path)
    version = (stat.st_size, stat.st_mtime_ns)
    known = _forms.pop((path, encoding), None)
    if known and known[0] == version:
        _forms[(path, encoding)] = known
        return known[1]
    if known and known[1].copied:  # the copy of an earlier version
        shutil.rmtree(os.path.dirname(known[1].read), ignore_errors=True)
    found = _look(path, encoding)
    _forms[(path, encoding)] = (version, found)
    return found


def _look(path: str, encoding: str) -> Form:
    with open(path, "rb") as f:
        magic = f.read(8)
    compression = next((name for m, name in READ.items() if magic.startswith(m)), "none")
    unread = next((name for m, name in UNREAD.items() if magic.startswith(m)), None)
    if unread:
        raise ContractError(
            f"{path} holds {unread}-compressed bytes (it starts with {magic[:4]!r}), which DuckDB does not read: "
            f"decompress it, or compress it with gzip or zstd"
        )
    head = next(_chunks(path, compression, 4), b"")
    bom = next((name for m, name in BOMS.items() if head.startswith(m)), "")
    if bom.startswith("utf-16") or encoding.lower().replace("-", "").replace("_", "") == "utf16":
        # The BOM says UTF-16 whatever the config does. DuckDB reads it little-endian only, and its
        # errors name no line: read as UTF-8.
        return _copy(path, compression, encoding, bom if bom.startswith("utf-16") else "utf-16-le")
    endings = _named(*_count_endings(path, compression))
    if " and " in endings:
        return _copy(path, compression, encoding, None)
    return Form(path, path, compression, encoding, endings)


def _opened(path: str, compression: str) -> BinaryIO:
    """``path``'s bytes, decompressed."""
    if compression == "gzip":
        return gzip.open(path, "rb")
    if compression == "zstd":
        return pa.input_stream(path, compression="zstd")
    return open(path, "rb")


def _chunks(path: str, compression: str, size: int = CHUNK) -> Iterator[bytes]:
    """``path``'s bytes decompressed, in chunks; a stream cut short or corrupt is a ContractError."""
    read = 0
    try:
        with _opened(path, compression) as f:
            while True:
                chunk = f.read(size)
                if not chunk:
                    return
                read += len(chunk)
                yield chunk
    except (OSError, EOFError, zlib.error, pa.ArrowException) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        if compression == "none":
            raise ContractError(f"{path}: cannot read it: {why}") from None
        raise ContractError(
            f"{path}: its {compression} stream breaks off after {read} bytes decompressed (cut short in a copy or "
            f"download?): {why}"
        ) from None


def _endings(chunk: bytes) -> Tuple[int, int, int]:
    """(CRLF, lone LF, lone CR) in ``chunk``."""
    lf, cr = chunk.count(b"\n"), chunk.count(b"\r")
    crlf = chunk.count(b"\r\n") if cr and lf else 0
    return crlf, lf - crlf, cr - crlf


def _held(carried: bytes, chunk: bytes) -> Tuple[bytes, bytes]:
    """(the chunk to count, the byte held back): a CR ending a chunk waits, its LF may open the next."""
    if carried:
        chunk = carried + chunk
    return (chunk[:-1], b"\r") if chunk.endswith(b"\r") else (chunk, b"")


def _named(crlf: int, lf: int, cr: int) -> str:
    return " and ".join(kind for kind, n in (("CRLF", crlf), ("LF", lf), ("CR", cr)) if n)


def _count_endings(path: str, compression: str) -> Tuple[int, int, int]:
    """(CRLF, lone LF, lone CR) line endings of ``path``."""
    total = [0, 0, 0]
    carried = b""
    for chunk in _chunks(path, compression):
        chunk, carried = _held(carried, chunk)
        for i, n in enumerate(_endings(chunk)):
            total[i] += n
    total[2] += len(carried)
    return total[0], total[1], total[2]


def _copy(path: str, compression: str, encoding: str, utf16: Optional[str]) -> Form:
    """``path`` copied, decompressed, with every line ending LF; from UTF-16 (``utf16``: its codec,
    the byte order mark's or little-endian) to UTF-8 where given, else in ``encoding`` as it is."""
    global _copies
    if _copies is None:
        _copies = tempfile.mkdtemp(prefix="pinads_raw_")
        atexit.register(shutil.rmtree, _copies, True)
    read = os.path.join(tempfile.mkdtemp(dir=_copies), os.path.basename(path))
    decoder = codecs.getincrementaldecoder(utf16)() if utf16 else None
    total = [0, 0, 0]
    carried = b""
    with open(read, "wb") as out:
        for i, chunk in enumerate(_chunks(path, compression)):
            if decoder:
                try:
                    text = decoder.decode(chunk)
                except UnicodeDecodeError as e:
                    before = chunk[: e.start].decode(utf16, "replace")
                    line = sum(total) + len(re.findall("\r\n|\r|\n", before)) + 1
                    raise ContractError(f"{path}, line {line}: bytes that are not {utf16.upper()}") from None
                chunk = (text[1:] if i == 0 and text.startswith("\ufeff") else text).encode("utf-8")
            chunk, carried = _held(carried, chunk)
            for k, n in enumerate(_endings(chunk)):
                total[k] += n
            out.write(chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n"))
        if decoder and decoder.getstate()[0]:  # an odd byte left at the end: no UTF-16
            raise ContractError(f"{path}, line {sum(total) + 1}: ends in half a {utf16.upper()} character")
        if carried:
            total[2] += 1
            out.write(b"\n")
    return Form(path, read, "none", "utf-8" if utf16 else encoding, _named(*total))


def opened(f: Form) -> BinaryIO:
    """The bytes DuckDB reads for ``f``, decompressed."""
    return _opened(f.read, f.compression)


def lines(f: Form) -> Iterator[bytes]:
    """Each line DuckDB reads for ``f``, with its ending (CRLF, LF or CR); the last may have none."""
    rest = b""
    with opened(f) as stream:
        while True:
            chunk = stream.read(CHUNK)
            if not chunk:
                break
            data = rest + chunk
            end = 0
            for m in _LINE.finditer(data):
                if m.end() == len(data) and data.endswith(b"\r"):
                    break  # its LF may open the next chunk
                yield m.group()
                end = m.end()
            rest = data[end:]
    end = 0
    for m in _LINE.finditer(rest):
        yield m.group()
        end = m.end()
    if rest[end:]:
        yield rest[end:]
