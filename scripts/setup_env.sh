#!/usr/bin/env bash
# Create .venv (if missing) and install the pinned stack, choosing the fbgemm variant for this machine.
# Idempotent: a stamp file records what was installed; a second run returns in well under a second.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv
PY=${PYTHON:-python3}
TORCH=2.13.0
FBGEMM=1.8.0
TORCHREC=1.8.0
TORCHX=0.7.0
RUFF=0.17.6

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  VARIANT=cuda
else
  VARIANT=cpu
fi

STAMP="$VENV/.pinads_rec-installed"
WANT="$VARIANT torch=$TORCH fbgemm=$FBGEMM torchrec=$TORCHREC torchx=$TORCHX ruff=$RUFF $(sha1sum pyproject.toml | cut -c1-12)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip install --disable-pip-version-check -q"

$PIP "torch==$TORCH"
if [ "$VARIANT" = cuda ]; then
  $PIP "fbgemm-gpu==$FBGEMM" "torchrec==$TORCHREC"
else
  # torchrec's metadata names the CUDA fbgemm-gpu; on CPU install it without deps and add the rest.
  $PIP "fbgemm-gpu-cpu==$FBGEMM"
  $PIP --no-deps "torchrec==$TORCHREC"
  $PIP tensordict "torchmetrics==1.0.3" tqdm pyre-extensions iopath
fi
$PIP "torchx==$TORCHX"
$PIP --no-deps -e .
$PIP pyarrow pyyaml numpy matplotlib pytest "ruff==$RUFF"
echo "$WANT" > "$STAMP"
echo "environment ready ($VARIANT) in $VENV"
