"""The engines ``--engine`` names, and the one named started (``open_engine``): apart from the
interface (engine.py), which each engine implements, so that no engine module imports another.
"""

from __future__ import annotations

from typing import Optional

from pinads_rec.config import ConfigError
from pinads_rec.data.build.engine import DuckDBEngine, Engine

ENGINES = ("duckdb", "spark")


def open_engine(name: str, threads: int, spill_dir: str, memory_limit: Optional[str]) -> Engine:
    """The engine ``--engine`` names, started."""
    if name == "duckdb":
        return DuckDBEngine(threads, spill_dir, memory_limit)
    if name == "spark":
        from pinads_rec.data.build.spark_engine import SparkEngine  # PySpark and a JVM: only when asked

        return SparkEngine(threads, spill_dir, memory_limit)
    raise ConfigError(f"--engine {name!r}: not an engine; give one of {', '.join(ENGINES)}")
