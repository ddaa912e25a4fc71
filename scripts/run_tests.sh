#!/usr/bin/env bash
# The project's test command (make test; extra arguments go to pytest, e.g. make test ARGS="-k loader";
# make test-quick passes -m "not slow").
# pytest exits 5 when a selection collects no tests; say so loudly, but do not fail the run on it.
set -uo pipefail
cd "$(dirname "$0")/.."
# Style first (seconds): the whole tree is ruff-formatted and lint-clean (pyproject.toml [tool.ruff]).
.venv/bin/ruff format --check --quiet . || { echo "ruff format: run .venv/bin/ruff format ." >&2; exit 1; }
.venv/bin/ruff check --quiet . || exit 1
# Two pytest workers (pytest-xdist), a test file each at a time (its module fixtures, e.g. one
# 2-rank launch, run once): a worker waiting on spawned ranks or imports leaves the core to the other.
.venv/bin/python -m pytest -q -n 2 --dist loadfile --durations=20 "$@"
rc=$?
if [ $rc -eq 5 ]; then
  echo "pytest: no tests were collected for this selection" >&2
  exit 0
fi
exit $rc
