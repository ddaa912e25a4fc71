#!/usr/bin/env bash
# Create the venv (if missing) and install the locked stack of this machine's variant:
# locks/cuda.txt where nvidia-smi sees a GPU, locks/cpu.txt elsewhere (scripts/lock.sh makes them).
# Idempotent: a stamp records the variant and the hashes of the lock and pyproject.toml; a second
# run returns at once, a changed lock or pyproject installs again.
#   VENV=/tmp/env bash scripts/setup_env.sh     # another venv than .venv
#   PYTHON=python3.11 bash scripts/setup_env.sh # the interpreter that makes the venv
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PY=${PYTHON:-python3}

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  VARIANT=cuda
else
  VARIANT=cpu
fi
LOCK=locks/$VARIANT.txt

STAMP="$VENV/.pinads_rec-installed"
WANT="$VARIANT $(sha1sum "$LOCK" pyproject.toml | cut -c1-12 | tr '\n' ' ')"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  # The locks pin cp311 wheels (and the CPU torch wheel exists for 3.11 only).
  if ! "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
    echo "setup_env.sh: $PY is Python $("$PY" -c 'import platform; print(platform.python_version())'); the" \
      "locks are for Python 3.11: run with PYTHON=python3.11" >&2
    exit 1
  fi
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip install --disable-pip-version-check -q"
# Every package is pinned in the lock, transitive ones included: no resolving, no dependency
# metadata consulted (torchrec's names the CUDA fbgemm-gpu even on CPU, where fbgemm-gpu-cpu
# provides it; `pip check` reports that one and only that one: expected).
$PIP --no-deps -r "$LOCK"
$PIP --no-deps -e .
if [ "$VARIANT" = cuda ] && ! "$VENV/bin/python" -c 'import sys, torch; sys.exit(torch.version.cuda is None)'; then
  echo "setup_env.sh: locks/cuda.txt installed a torch without CUDA (a CPU wheel offered by pip's" \
    "find-links?): remove $VENV and install with that wheel folder out of pip's configuration" >&2
  exit 1
fi
# Packages the lock does not name (installed by hand, or dropped from a newer lock) stay: say so.
EXTRA=$("$VENV/bin/python" -m pip freeze --all --exclude pip --exclude-editable | sed 's/[=@ ].*//' |
  tr 'A-Z_.' 'a-z--' | sort | comm -23 - <(grep -v '^#' "$LOCK" | sed 's/=.*//' | tr 'A-Z_.' 'a-z--' | sort))
if [ -n "$EXTRA" ]; then
  echo "setup_env.sh: $VENV has packages locks/$VARIANT.txt does not name:" $EXTRA \
    "(tests/test_lock.py fails on them; pip uninstall them or remove $VENV)" >&2
fi
echo "$WANT" > "$STAMP"
echo "environment ready ($VARIANT, $LOCK) in $VENV"
