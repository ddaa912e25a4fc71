"""Raw impression and behaviour logs -> the training contract, point in time, beyond memory.

    python -m pinads_rec.data.build --config X.yaml --raw RAW_DIR --out DIR [--memory-limit 2GB] [--threads N]
    python -m pinads_rec.data.build ... --day 2024-01-03[:2024-01-09] [--vocabularies FULL_BUILD_DIR]

The ``build:`` section of the config (``BuildConfig``; docs/data_build.md) says which raw file is what.
The build runs as SQL on DuckDB, which streams the files, uses every core and spills to disk under
``--memory-limit``; the same statements are plain SQL a distributed engine runs too. Steps:

1. **Impressions**: the impression log, filtered, joined with the side tables by key (a missing key
   gets the declared default and is counted; a table with ``as_of`` joins the row of the
   impression's date), each contract column computed from its ``build.columns`` expression, each row
   given its split by time window. Timestamps, labels, users and duplicated impressions are checked;
   an error names the file, column and row.
2. **Sequences**, per group: the group's events (a behaviour log, or the impression log itself),
   numbered per user in time order; requests and events sorted together per user, requests first at
   equal times, so each request counts the events strictly before (its time - ``min_gap_s``); the
   newest ``max_length`` of them, newest first.
3. **Vocabularies** (optional): raw ids -> 1..V by frequency on the fitting split, 0 out of vocabulary.
4. **Output**: one row per request (the per-request layout, data/loader/storage_layout.py): the request-level columns
   once, the candidates' columns as lists, requests in time order, in ``<out>/<split>/part-*.parquet``;
   ``summary.json`` (rows per split and surface, label rates, sequence lengths, join misses, every
   repair counted) and, last, ``manifest.json`` (inputs, config, outputs, every file's sha256, the
   completion marker). All of it goes to a temporary directory beside ``<out>`` that replaces
   ``<out>`` in one step once complete (data/build_output.py): a failed or killed build leaves the
   previous output as it was.

One job a module:

- ``full_build.py``: ``build`` and ``Build``, the build's state (engine, config sections, what each
  step found) and its steps in order; the candidates grouped and each split written
- ``impressions.py``, ``sequences.py``, ``vocabularies.py``: steps 1-3 above, functions over the
  ``Build``, every SQL statement of the build; ``time_sql.py``: times and dates as SQL
- ``checks.py``: the raw data's checks on the way (times, nulls, labels, id types and ranges,
  surfaces, defaults), functions over the ``Build``
- ``writer.py``: the split's Parquet files (``SplitWriter``), ``summary.json`` and the manifest
- ``queries.py``: the small queries all of them ask of the engine, the base of ``Build``
- ``engine.py``: the engine interface and DuckDB; ``spark_engine.py`` and ``spark_sql.py``: Spark;
  ``engines.py``: the one ``--engine`` names, started
- ``config_checks.py``: what a build needs of the config (``check_build``)
- ``days.py``: builds by day (``--day``): ``build_days``, each day's requests as a partition
  ``<out>/days/<day>/`` of its own, the vocabularies of an existing build applied (``DayBuild``)
- ``live.py``: live requests built by the same steps (the online feature path); ``request_values.py``:
  a request's values against the raw logs' types
- ``cli.py``: the command line (``main``) and the summary as text
- ``data/build_output.py`` (beside the package): what a complete build directory is, the temporary
  directory and its one-step swap into ``--out``

The names callers use are re-exported here; everything else is imported from its module.
"""

from pinads_rec.data.build.cli import format_summary, main
from pinads_rec.data.build.config_checks import check_build
from pinads_rec.data.build.days import DayBuild, build_days, day_dir, parse_days
from pinads_rec.data.build.full_build import Build, build

__all__ = ["Build", "DayBuild", "build", "build_days", "check_build", "day_dir", "format_summary", "main", "parse_days"]
