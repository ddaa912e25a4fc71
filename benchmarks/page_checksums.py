"""Page checksums' cost, side by side (docs/data_build.md, "Verified bytes"):

    python benchmarks/page_checksums.py [--data data/demo/train] [--config configs/demo.yaml]
                                        [--max-bytes 1073741824] [--repeats 3]

Rewrites up to ``--max-bytes`` of ``--data``'s Parquet files with page checksums into a temporary directory (same
compression, row groups and schema), then, ``--repeats`` times on one thread: every row group read by pyarrow (a)
unverified and (b) verified, (c) the loader's ``RowGroupReader.read_requests`` (always verified), and sha256 of every
file (``build_output.sha256``). Prints CPU and wall seconds of each, the median ratio (b)/(a) and sha256's GB/s.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Tuple

import pyarrow as pa
import pyarrow.parquet as pq

from pinads_rec import config
from pinads_rec.arguments import existing_path, positive_int
from pinads_rec.data import page_checksums
from pinads_rec.data.build_output import sha256
from pinads_rec.data.loader.contract import ContractError
from pinads_rec.data.loader.reader import RowGroup, RowGroupReader, list_files, list_row_groups

GB = 1e9
MODES = ("unverified", "verified", "RowGroupReader", "sha256")


def _options(md: pq.FileMetaData) -> dict:
    """The writer options that reproduce ``md``'s column chunks, plus the page checksums."""
    chunks = [md.row_group(i).column(j) for i in range(md.num_row_groups) for j in range(md.num_columns)]
    codecs = {c.compression for c in chunks}
    if len(codecs) != 1:
        raise ContractError(f"the columns use several codecs ({sorted(codecs)}): give files written with one")
    codec = codecs.pop()
    return dict(
        compression="none" if codec == "UNCOMPRESSED" else codec.lower(),
        use_dictionary=any(c.has_dictionary_page for c in chunks),
        write_statistics=any(c.is_stats_set for c in chunks),
        **page_checksums.WRITE,
    )


def rewrite(files: Sequence[str], max_bytes: int, out: Path) -> Tuple[List[str], str]:
    """The files' row groups, in order, until ``max_bytes`` of their compressed bytes (one at least),
    written under ``out`` with page checksums, one row group per source row group, and checked to
    keep the source's options; the copies and those options."""
    copies, total, options = [], 0, {}
    for n, path in enumerate(files):
        src = pq.ParquetFile(path)
        md = src.metadata
        sizes = [
            sum(rg.column(j).total_compressed_size for j in range(rg.num_columns))
            for rg in map(md.row_group, range(md.num_row_groups))
        ]
        keep = 0
        while keep < len(sizes) and (total == 0 or total + sizes[keep] <= max_bytes):
            total += sizes[keep]
            keep += 1
        if keep == 0:
            break
        options = _options(md)
        dst = out / f"part-{n:05d}.parquet"
        with pq.ParquetWriter(dst, src.schema_arrow, **options) as writer:
            for i in range(keep):
                table = src.read_row_group(i)
                writer.write_table(table, row_group_size=max(table.num_rows, 1))
        copy = pq.ParquetFile(dst).metadata
        if _options(copy) != options or [copy.row_group(i).num_rows for i in range(copy.num_row_groups)] != [
            md.row_group(i).num_rows for i in range(keep)
        ]:
            raise ContractError(
                f"{dst}: the copy of {path} does not keep its codec, dictionary, statistics or row groups"
            )
        copies.append(str(dst))
        if keep < len(sizes):
            break
    return copies, ", ".join(f"{k} {v}" for k, v in options.items())


def read_requests(reader: RowGroupReader, groups: Sequence[RowGroup]) -> None:
    for group in groups:
        reader.read_requests(group)


def hash_all(files: Sequence[str]) -> None:
    for path in files:
        sha256(Path(path))


def read_all(files: Sequence[str], verify: bool) -> None:
    for path in files:
        f = pq.ParquetFile(path, page_checksum_verification=verify)
        for i in range(f.num_row_groups):
            f.read_row_group(i, use_threads=False)


def timed(work: Callable[[], None]) -> Tuple[float, float]:
    """CPU seconds (the whole process: Arrow's pool threads included) and wall seconds."""
    cpu, wall = time.process_time(), time.perf_counter()
    work()
    return time.process_time() - cpu, time.perf_counter() - wall


def run(args: argparse.Namespace) -> int:
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    cfg = config.load(args.config)
    with tempfile.TemporaryDirectory(prefix="page_checksums-") as tmp:
        start = time.perf_counter()
        files, options = rewrite(list_files(args.data), args.max_bytes, Path(tmp))
        nbytes = sum(Path(p).stat().st_size for p in files)
        groups = list_row_groups(list_files(tmp), cfg.features)
        reader = RowGroupReader(cfg.features, cfg.data)
        print(
            f"{args.data}: {len(files)} file(s), {len(groups)} row group(s) rewritten with page checksums "
            f"({nbytes / GB:.3f} GB; {options}) in {time.perf_counter() - start:.0f} s"
        )
        work: Dict[str, Callable[[], None]] = {
            "unverified": lambda: read_all(files, verify=False),
            "verified": lambda: read_all(files, verify=True),
            "RowGroupReader": lambda: read_requests(reader, groups),
            "sha256": lambda: hash_all(files),
        }
        reader.read_requests(groups[0])  # imports and first allocations, outside the timings
        if "torch" in sys.modules:  # one thread everywhere, were anything on the path to use it
            sys.modules["torch"].set_num_threads(1)
        times: Dict[str, List[Tuple[float, float]]] = {m: [] for m in MODES}
        for r in range(args.repeats):  # alternating; (a) and (b) swap places each repeat
            order = MODES if r % 2 == 0 else (MODES[1], MODES[0]) + MODES[2:]
            for mode in order:
                times[mode].append(timed(work[mode]))
    print(report(times, nbytes))
    return 0


def report(times: Dict[str, List[Tuple[float, float]]], nbytes: int) -> str:
    gb = nbytes / GB
    lines = [
        "one thread (pyarrow cpu_count 1, io_thread_count 1); CPU s: time.process_time, wall s: time.perf_counter",
        "",
        f"{'repeat':8}{'(a) unverified':>18}{'(b) verified':>18}{'(c) RowGroupReader':>20}{'sha256':>27}",
        f"{'':8}" + f"{'cpu s':>9}{'wall s':>9}" * 2 + f"{'cpu s':>11}{'wall s':>9}" * 2 + f"{'GB/s':>7}",
    ]

    def row(label: str, t: Dict[str, Tuple[float, float]]) -> str:
        a, b, c, h = (t[m] for m in MODES)
        cells = f"{a[0]:9.2f}{a[1]:9.2f}{b[0]:9.2f}{b[1]:9.2f}{c[0]:11.2f}{c[1]:9.2f}{h[0]:11.2f}{h[1]:9.2f}"
        return f"{label:8}{cells}{gb / h[1]:7.2f}"

    for r in range(len(times["unverified"])):
        lines.append(row(str(r + 1), {m: times[m][r] for m in MODES}))
    median = {m: tuple(statistics.median(x[k] for x in times[m]) for k in (0, 1)) for m in MODES}
    lines.append(row("median", median))

    def ratios(k: int) -> List[float]:
        return [b[k] / a[k] for a, b in zip(times["unverified"], times["verified"])]

    added = statistics.median(b[0] - a[0] for a, b in zip(times["unverified"], times["verified"]))
    loader = median["RowGroupReader"][0]
    rates = [gb / h[1] for h in times["sha256"]]
    lines += [
        "",
        f"(b)/(a) verified/unverified, median: CPU {statistics.median(ratios(0)):.3f}x "
        f"(per repeat {', '.join(f'{x:.3f}' for x in ratios(0))}), "
        f"wall {statistics.median(ratios(1)):.3f}x (per repeat {', '.join(f'{x:.3f}' for x in ratios(1))})",
        f"verification adds {added / gb:.3f} CPU s per GB (median of (b)-(a)); "
        f"pyarrow unverified: {median['unverified'][0] / gb:.3f} CPU s per GB",
        f"(c) RowGroupReader: {loader / gb:.3f} CPU s per GB, verified: (b)-(a) is {added / loader:.1%} of it. Not "
        f"measured unverified: RowGroupReader opens each file itself (reader.open_parquet, always verified) and "
        f"takes no ParquetFile",
        f"sha256: {gb / median['sha256'][1]:.2f} GB/s median ({min(rates):.2f}-{max(rates):.2f}) of wall time, "
        f"{gb / median['sha256'][0]:.2f} GB per CPU second",
    ]
    return "\n".join(lines)


def main(argv: List[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=existing_path, default="data/demo/train")
    p.add_argument("--config", type=existing_path, default="configs/demo.yaml")
    p.add_argument("--max-bytes", type=positive_int, default=2**30, help="compressed bytes copied (default 1 GiB)")
    p.add_argument("--repeats", type=positive_int, default=3)
    args = p.parse_args(argv)
    try:
        return run(args)
    except ContractError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
