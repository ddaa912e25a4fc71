"""``--verify``: are a dataset's bytes the ones its writer wrote? Each file a build's manifest lists is
hashed again against its sha256 (data/build_output.py), and every page of every Parquet file is read
with its checksum verified (data/page_checksums.py): one line per bad file, and a summary.

A build, a split of one, or any directory or file of Parquet (without a manifest only the pages are
checked; a page written without a checksum is checked only in that it still decodes).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import List

from pinads_rec.data.build_output import MANIFEST, require_complete, require_unchanged
from pinads_rec.data.loader.contract import ContractError
from pinads_rec.data.page_checksums import check_pages


@dataclass
class Verdict:
    problems: List[str] = field(default_factory=list)  # one line each: the build incomplete, a bad file
    files: int = 0
    bytes: int = 0
    hashed: int = 0  # files checked against their manifest's sha256
    parquet: int = 0  # Parquet files whose every page was read

    def summary(self, path: str) -> str:
        bad = f"{len(self.problems)} problem(s)" if self.problems else "all intact"
        return (
            f"{path}: {self.files} file(s), {self.bytes / 2**20:.1f} MiB; {self.hashed} hashed against "
            f"{MANIFEST}'s sha256, every page of {self.parquet} Parquet file(s) read with its checksum verified: {bad}"
        )


def _files(path: str) -> List[str]:
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise ContractError(f"{path} does not exist")
    found = [os.path.join(top, n) for top, _, names in os.walk(path) for n in names]
    return sorted(f for f in found if os.path.basename(f) != MANIFEST)


def verify_bytes(path: str) -> Verdict:
    """Every file under ``path`` checked; a file with several problems is named once, by the one
    that says most: a row group failing its page checksum, else the file's sha256, else a page that
    no longer decodes."""
    verdict = Verdict()
    try:
        require_complete(path)
    except ContractError as e:
        verdict.problems.append(str(e))
    for f in _files(path):
        verdict.files += 1
        verdict.bytes += os.path.getsize(f)
        page = hashed = unreadable = None
        if f.endswith(".parquet"):
            verdict.parquet += 1
            try:
                page = check_pages(f)
            except ContractError as e:
                unreadable = str(e)
        try:
            verdict.hashed += require_unchanged([f])
        except ContractError as e:
            verdict.hashed += 1
            hashed = str(e)
        if page or hashed or unreadable:
            verdict.problems.append(page or hashed or unreadable)
    return verdict
