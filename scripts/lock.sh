#!/usr/bin/env bash
# Regenerate the lock files locks/cpu.txt and locks/cuda.txt (what scripts/setup_env.sh installs)
# from the top-level requirements below. Run it after changing one of them; commit the locks.
#
#   bash scripts/lock.sh            # both locks (needs the package index; ~3 minutes)
#
# CPU: a fresh venv built the way the project was always installed (torch+cpu and fbgemm-gpu-cpu,
# torchrec without its dependencies because its metadata names the CUDA fbgemm-gpu, then the rest),
# frozen with `pip freeze --all` less pip itself (setuptools stays: torch requires it at run time).
# CUDA: cannot be installed here (no GPU, and a 0.5 GB fbgemm-gpu); resolved instead with
# `pip install --dry-run --report` against the index's default torch build (the CUDA one), with
# every package the two variants share constrained to the CPU lock's version, so the two locks
# differ only in torch, fbgemm and the CUDA runtime packages torch's metadata requires.
# Both are for CPython 3.11 on Linux x86_64.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
TORCH=2.13.0
FBGEMM=1.8.0
TORCHREC=1.8.0
# Everything else the project imports or runs, each pinned where the project needs that version.
# kubernetes: TorchX's Kubernetes scheduler (the `kubernetes` extra); 37.x needs urllib3 >= 2,
# which torchx 0.7.0 refuses (urllib3 < 1.27), so 36.0.3 is the newest that fits.
# duckdb: the raw-log builder's engine (data/build/); polars and pandas: the engines
# benchmarks/build.py measures it against (docs/data_build.md says why DuckDB).
# scikit-learn and lightgbm: the reference models benchmarks/datasets.py fits beside every dataset
# run (a logistic regression and gradient-boosted trees on hand-computed features).
# pyspark and sqlglot: the builder's Spark engine (--engine spark; sqlglot translates its DuckDB SQL);
# pyspark 4.3 needs a Java 17+ runtime, which the engine checks for at start.
# ray[serve]: the online ranking service's engine (serve/online/: HTTP proxy, dynamic batching,
# replicas, autoscaling; KubeRay's RayService on Kubernetes).
# aiohttp (already here through fsspec): benchmarks/serving.py's open-loop load generator.
REST=(
  torchx==0.7.0 torchmetrics==1.0.3 tensordict tqdm pyre-extensions iopath
  pyarrow pyyaml numpy matplotlib tensorboard==2.21.0 kubernetes==36.0.3 pytest pytest-xdist ruff==0.17.6
  duckdb==2.0.1 polars==2.1.0 pandas==3.1.1 scikit-learn==1.9.1 lightgbm==4.7.0 pyspark==4.3.0 sqlglot==30.31.0
  "ray[serve]==2.60.0"
)

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p locks

header() {  # $1: variant, $2: how it was produced
  cat <<EOF
# Lock file ($1): the exact version of every package scripts/setup_env.sh installs, transitive
# ones included; installed with \`pip install --no-deps -r\` (every package is here, so no resolver).
# $2
# CPython 3.11, Linux x86_64. Regenerate with: bash scripts/lock.sh (never edit by hand).
EOF
}

# --- CPU: build it and freeze it ---
"$PY" -m venv "$WORK/cpu"
PIP="$WORK/cpu/bin/python -m pip install --disable-pip-version-check -q"
# The +cpu build: from the machine's wheel folder (pip's find-links) or PyTorch's CPU index.
$PIP "torch==$TORCH+cpu" "fbgemm-gpu-cpu==$FBGEMM"
$PIP --no-deps "torchrec==$TORCHREC"
# torchrec's own dependencies less fbgemm-gpu, then the rest (pip then reports torchrec's unmet
# fbgemm-gpu requirement as an ERROR line: expected, fbgemm-gpu-cpu stands for it).
$PIP "${REST[@]}"
{
  header cpu "Produced by building a fresh venv here and freezing it (pip freeze --all, less pip)."
  "$WORK/cpu/bin/python" -m pip freeze --all --exclude pip --exclude-editable \
    | "$PY" -c 'import sys; print("".join(sorted(sys.stdin, key=str.lower)), end="")'
} > locks/cpu.txt

# --- CUDA: resolve it (dry run against the index's CUDA torch; this machine's pip config is left
# out, since its wheel folder offers torch+cpu for torch==2.13.0) ---
grep -v -i -E '^(#|torch==|fbgemm)' locks/cpu.txt > "$WORK/shared.txt"
env -u PIP_FIND_LINKS -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null \
  "$WORK/cpu/bin/python" -m pip install --disable-pip-version-check -q --dry-run --ignore-installed \
  --report "$WORK/cuda.json" -c "$WORK/shared.txt" \
  "torch==$TORCH" "fbgemm-gpu==$FBGEMM" "torchrec==$TORCHREC" "${REST[@]}"
{
  header cuda "Produced by resolving it (pip install --dry-run --report; torch's CUDA build from the index)."
  "$WORK/cpu/bin/python" - "$WORK/cuda.json" <<'EOF'
import json
import sys

report = json.load(open(sys.argv[1]))
pins = [f"{i['metadata']['name']}=={i['metadata']['version']}" for i in report["install"]]
print("\n".join(sorted((p for p in pins if not p.lower().startswith("pip==")), key=str.lower)))
EOF
} > locks/cuda.txt
wc -l locks/cpu.txt locks/cuda.txt
