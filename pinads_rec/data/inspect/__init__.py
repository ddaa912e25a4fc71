"""A dataset checked against a config before training: ``python -m pinads_rec.data.inspect``
(docs/inspect.md).

- ``scan.py``: the scan (``scan_dataset`` -> ``Report``): every contract problem counted and placed,
  per-column statistics, on DuckDB over the Parquet files
- ``group_scan.py``: one group of files (same layout and schema) scanned: the checks' and the
  statistics' SQL passes (``GroupScanner``), the totals they add to (``Scan``, ``Problem``)
- ``checks.py``: the SQL of each contract check
- ``files.py``: the files, their layouts and places in them (``open_files``, ``FileInfo``, ``Place``)
- ``report.py``: a ``Report`` as text tables (``format_report``) and as JSON (``report_json``)
- ``draft.py``: a starting config guessed from the data alone (``draft_config``)
- ``verify.py``: ``--verify``: a dataset's bytes against its manifest's sha256 and its page checksums
- ``cli.py``: the command line (``main``): flags and exit codes

The names callers use are re-exported here; everything else is imported from its module.
"""

from pinads_rec.data.inspect.checks import ERROR, UNCHECKED
from pinads_rec.data.inspect.cli import main
from pinads_rec.data.inspect.draft import draft_config
from pinads_rec.data.inspect.files import Place
from pinads_rec.data.inspect.group_scan import Problem
from pinads_rec.data.inspect.report import format_report, report_json, text_table
from pinads_rec.data.inspect.scan import Report, scan_dataset

__all__ = [
    "ERROR",
    "UNCHECKED",
    "Place",
    "Problem",
    "Report",
    "draft_config",
    "format_report",
    "main",
    "report_json",
    "scan_dataset",
    "text_table",
]
