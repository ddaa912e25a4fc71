"""A sharding plan as JSON (``train.plan_file``, what ``pinads_rec.plan --out`` writes and a
checkpoint keeps): read (``load_plan``) and made from TorchRec's plan (``plan_tables``)."""

from __future__ import annotations

import json

from torchrec.distributed.types import ShardingPlan

from pinads_rec.config import ConfigError


def load_plan(path: str) -> dict:
    """A plan JSON written by pinads_rec.plan: {"tables": {name: {"sharding_type", "compute_kernel",
    "ranks", ...}}, "topology": {...}}. A ConfigError names the key when it cannot be read."""
    try:
        with open(path) as f:
            plan = json.load(f)
    except OSError as e:
        raise ConfigError(f"train.plan_file: cannot read {path}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"train.plan_file: cannot read {path}: not JSON ({e})") from None
    if not isinstance(plan, dict) or not isinstance(plan.get("tables"), dict):
        raise ConfigError(f"train.plan_file: {path} is not a plan written by pinads_rec.plan (no 'tables')")
    return plan


def plan_tables(plan: ShardingPlan) -> dict:
    """The per-table part of a plan in load_plan's format (table -> type, kernel, ranks)."""
    tables = {}
    for module in plan.plan.values():
        for param, sharding in module.items():
            tables[param] = {
                "sharding_type": sharding.sharding_type,
                "compute_kernel": sharding.compute_kernel,
                "ranks": list(sharding.ranks or []),
            }
    return {"tables": tables}
