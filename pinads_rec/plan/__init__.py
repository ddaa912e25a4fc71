"""Sharding-plan inspection: TorchRec's planner run offline for a cluster you do not have
(``python -m pinads_rec.plan``; docs/planning.md).

- ``planner.py``: ``PlanSpec`` (the target cluster), the training task on the meta device, the
  per-table constraints and topology, ``plan`` -> the report (the ``--out`` JSON)
- ``pooling.py``: the lookups per batch: candidates per request (``--candidates-per-request``, the
  training files, or the generator's setting) and the ids per key measured on the first batches
- ``failure.py``: a plan that does not fit, explained
- ``report.py``: the report as text, and two reports side by side
- ``formats.py``: how the printouts show bytes (GB) and lists of ranks (ranges)
- ``cli.py``: the command line (``main``)
"""

from pinads_rec.config import SHARDING_TYPES
from pinads_rec.plan.cli import main, parse_args, parse_compare, spec_from_args
from pinads_rec.plan.planner import PlanFailed, PlanSpec, make_topology, plan, planned_task, table_constraints
from pinads_rec.plan.pooling import Candidates, NoCandidates, candidates_per_request, count_candidates, measured_pooling
from pinads_rec.plan.report import format_comparison, format_report

__all__ = [
    "SHARDING_TYPES",
    "Candidates",
    "NoCandidates",
    "PlanFailed",
    "PlanSpec",
    "candidates_per_request",
    "count_candidates",
    "format_comparison",
    "format_report",
    "main",
    "make_topology",
    "measured_pooling",
    "parse_args",
    "parse_compare",
    "plan",
    "planned_task",
    "spec_from_args",
    "table_constraints",
]
