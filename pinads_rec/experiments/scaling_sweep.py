"""The scaling sweep's points: which runs a ``--sweep`` asks for, and each run's config, step counts
and data settings.

Dimensions (``--sweep NAME=v1,v2,...``):

- ``ranks``: gloo processes, one torch thread each (so 1 vs 2 ranks compares like for like); the
  per-rank batch stays ``batch_size`` (weak scaling: the global batch grows with the ranks).
- ``batch_size``: rows per rank per step (``data.batch_size``).
- ``sequence_length``: ``synth.sequence_length``; every sequence group's ``max_length`` is scaled by
  the same factor (the demo's pins/ads/queries 100/50/50 at length 100 become 25/12/12 at 25).
- ``table_rows``: rows of the big tables (``--scale-tables``, default: the tables the generator's
  ``num_users`` / ``num_items`` index, user and item); the data is generated with as many users and
  items, so the ids really spread over the whole table.

By default one dimension varies at a time around a base point (each dimension's base is the
config's own value when it is among the listed values, else the first listed); ``grid`` gives the
full product. ``Point`` -> ``point_config`` -> the ``ExperimentConfig`` of that run.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from pinads_rec import config

DIMENSIONS = ("ranks", "batch_size", "sequence_length", "table_rows")


@dataclasses.dataclass(frozen=True)
class Point:
    ranks: int
    batch_size: int
    sequence_length: int
    table_rows: Optional[int]  # None: the config's own table sizes

    @property
    def name(self) -> str:
        rows = "cfg" if self.table_rows is None else str(self.table_rows)
        return f"r{self.ranks}-b{self.batch_size}-L{self.sequence_length}-T{rows}"


def parse_sweeps(items: Sequence[str]) -> Dict[str, List[int]]:
    """``["ranks=1,2", "batch_size=256,512"]`` -> {"ranks": [1, 2], ...}; names checked, values > 0."""
    out: Dict[str, List[int]] = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--sweep {item!r}: expected NAME=v1,v2,... with NAME one of {list(DIMENSIONS)}")
        name, text = item.split("=", 1)
        name = name.strip()
        if name not in DIMENSIONS:
            raise ValueError(f"--sweep {item!r}: unknown dimension {name!r} (one of {list(DIMENSIONS)})")
        try:
            values = [int(v.replace("_", "")) for v in text.split(",") if v.strip()]
        except ValueError:
            raise ValueError(f"--sweep {item!r}: values must be integers") from None
        if not values or any(v <= 0 for v in values):
            raise ValueError(f"--sweep {item!r}: need one or more values > 0")
        out.setdefault(name, [])
        out[name] += [v for v in values if v not in out[name]]
    return out


def scaled_table_names(cfg: config.ExperimentConfig, names: Optional[Sequence[str]]) -> List[str]:
    """The tables ``table_rows`` resizes. Default: those the generator's user/item ids index."""
    if names is None:
        f = cfg.features
        columns = {f.columns.user_id, f.columns.item_id}
        used = [s.table for s in f.sparse if s.column in columns]
        names = sorted(set(used), key=[t.name for t in f.tables].index)
    known = {t.name for t in cfg.features.tables}
    missing = [n for n in names if n not in known]
    if missing:
        raise ValueError(f"--scale-tables: no table named {missing} in the config (tables: {sorted(known)})")
    return list(names)


def config_values(cfg: config.ExperimentConfig, tables: Sequence[str]) -> Dict[str, Optional[int]]:
    """Each dimension's value in the config itself."""
    rows = {cfg.features.table(t).num_embeddings for t in tables}
    return {
        "ranks": None,
        "batch_size": cfg.data.batch_size,
        "sequence_length": cfg.synth.sequence_length,
        "table_rows": rows.pop() if len(rows) == 1 else None,
    }


def base_point(
    cfg: config.ExperimentConfig,
    sweeps: Dict[str, List[int]],
    tables: Sequence[str],
    base: Optional[Dict[str, int]] = None,
) -> Point:
    """Per dimension: --base, else the config's value if the sweep lists it, else the first listed
    value; a dimension not swept keeps the config's value (1 rank, the config's table sizes)."""
    own = config_values(cfg, tables)
    values = {}
    for dim in DIMENSIONS:
        listed = sweeps.get(dim)
        if base and dim in base:
            values[dim] = base[dim]
        elif listed:
            values[dim] = own[dim] if own[dim] in listed else listed[0]
        else:
            values[dim] = own[dim] if own[dim] is not None or dim == "table_rows" else 1
    if "table_rows" not in sweeps and not (base and "table_rows" in base):
        values["table_rows"] = None
    return Point(**values)


def sweep_points(sweeps: Dict[str, List[int]], base: Point, grid: bool = False) -> List[Point]:
    """One dimension at a time around ``base`` (the base run once), or the full product."""
    if grid:
        axes = [sweeps.get(d, [getattr(base, d)]) for d in DIMENSIONS]
        return [Point(*values) for values in itertools.product(*axes)]
    points = [base]
    for dim in DIMENSIONS:
        for v in sweeps.get(dim, []):
            p = dataclasses.replace(base, **{dim: v})
            if p not in points:
                points.append(p)
    return points


def point_config(
    cfg: config.ExperimentConfig, p: Point, tables: Sequence[str], data_dir: Optional[Path] = None
) -> config.ExperimentConfig:
    """The config of one run: batch, sequence lengths, table sizes (and the data they index)."""
    cfg = copy.deepcopy(cfg)
    scale = p.sequence_length / cfg.synth.sequence_length
    groups = [
        dataclasses.replace(g, max_length=max(1, round(g.max_length * scale))) for g in cfg.features.sequence_groups
    ]
    synth = dataclasses.replace(cfg.synth, sequence_length=p.sequence_length)
    features_tables = cfg.features.tables
    if p.table_rows is not None:
        features_tables = [
            dataclasses.replace(t, num_embeddings=p.table_rows) if t.name in tables else t for t in cfg.features.tables
        ]
        synth = dataclasses.replace(synth, num_users=p.table_rows, num_items=p.table_rows)
    features = dataclasses.replace(cfg.features, tables=features_tables, sequence_groups=groups)
    data = dataclasses.replace(cfg.data, batch_size=p.batch_size)
    if data_dir is not None:
        # calibration/: the trainer checks every split it will read before training (the generator
        # writes it when synth.calibration_requests > 0, as for the config's own data)
        calibration = str(data_dir / "calibration") if cfg.data.calibration_dir else None
        data = dataclasses.replace(
            data, train_dir=str(data_dir / "train"), eval_dir=str(data_dir / "eval"), calibration_dir=calibration
        )
    out = dataclasses.replace(cfg, features=features, synth=synth, data=data)
    config.from_dict(config.to_dict(out))  # the same checks a YAML config gets
    return out


def loader_period_rows(cfg: config.ExperimentConfig) -> int:
    """Rows between two of the loader's expensive moments (read + check a row group, reshuffle and
    compact the buffer): its data wait comes in bursts this far apart, not evenly per batch."""
    return max(cfg.data.shuffle_buffer_rows, cfg.synth.row_group_size)


def point_steps(
    cfg: config.ExperimentConfig,
    p: Point,
    warmup: Optional[int],
    steps: Optional[int],
    comms_steps: Optional[int] = None,
) -> Tuple[int, int, int]:
    """(warmup, timed, profiled) steps of a run. Given counts are used as they are. By default the
    warmup covers the loader's first buffer fill and the timed window 4 loader periods (at least 20
    steps), so the bursty data wait is sampled in proportion, not by luck; the profiled steps (the
    collectives, after the timed ones) are as many as the timed ones, for the same reason."""
    period = loader_period_rows(cfg)
    w = warmup if warmup is not None else max(5, math.ceil(period / p.batch_size) + 2)
    n = steps if steps is not None else max(20, math.ceil(4 * period / p.batch_size))
    return w, n, n if comms_steps is None else comms_steps


def data_key(p: Point) -> Tuple[int, Optional[int]]:
    return p.sequence_length, p.table_rows


def data_synth(cfg: config.ExperimentConfig, rows_needed: int, max_ranks: int, max_batch: int) -> config.SynthConfig:
    """Generator settings holding ``rows_needed`` training rows in enough row groups that every rank
    gets its share (row groups are dealt to ranks round-robin)."""
    s = cfg.synth
    # The config's row groups (the loader's cost per batch depends on them: it reads, shuffles and
    # compacts its buffer once per row group), unless a rank would get fewer than about 3.
    rg = int(min(s.row_group_size, max(256, math.ceil(rows_needed / max_ranks / 3))))
    rows = rows_needed + 2 * max_ranks * rg  # uneven row-group split, partial batches dropped
    requests = math.ceil(rows / s.candidates_per_request)
    return dataclasses.replace(
        s, train_requests=requests, eval_requests=64, row_group_size=rg, num_files=max(2, 2 * max_ranks)
    )
