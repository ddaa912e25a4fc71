#!/usr/bin/env bash
# The GPU check (issue 18): on a CUDA machine, within 10 minutes, measure what the project can run
# there and write a report (report.md, and each step's log and JSON beside it).
#
#   bash scripts/gpu_check.sh [OUT_DIR]            # default $OUT/gpu_check where $OUT is set, else out/gpu_check
#   bash scripts/gpu_check.sh --dry-run [OUT_DIR]  # every step at tiny sizes on the CPU (tests/test_gpu_check.py)
#
# Always (torch alone is enough): benchmarks/arch_precision.py --torch-only -- the dense and sequence
# arch (Transformer + target attention, DIN, DCNv2, MMoE) forward and forward+backward, BF16 vs FP32,
# at the demo's and at configs/prod_8gpu.yaml's widths, with the torch fallbacks for fbgemm's jagged
# ops and TorchRec's layers (a machine without them: the lent GPU machine, docs/performance.md).
# Where TorchRec and fbgemm import as well: a 1-GPU NCCL train.py on the demo config (small data, a
# step cap; examples/s, AUC) in FP32, in BF16, with fused Adam instead of row-wise Adagrad and with the
# item table under managed collision (TorchRec's CUDA eviction reset); the
# arch benchmark once more on TorchRec's and fbgemm's own kernels; serve score (CPU) in each
# precision; the online service (Ray Serve) with its replicas on the GPU; the planner with this GPU's memory (pinads_rec.plan --compute-device cuda --hbm-gb).
# A step that fails or runs out of time is reported as such; the others still run.
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
DIR=${1:-${OUT:+$OUT/gpu_check}}
DIR=${DIR:-out/gpu_check}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
PY=$(command -v "$PY")
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
BUDGET=${GPU_CHECK_BUDGET_S:-570} # stop starting steps past this (the whole check: 10 minutes)
START=$SECONDS
REPORT=$DIR/report.md
SUMMARY=$DIR/steps.tsv
: >"$SUMMARY"

# The dry run makes each kind of step once (the other runs and precisions are the same commands
# with another --set), so that it takes about a minute and a half (most of it the serving step).
if [ $DRY = 1 ]; then
  DEVICE=cpu ROWS=48 REPEATS=1 WARMUP=0 STEPS=4 REQUESTS=300 CONFIGS="configs/demo.yaml"
  # Its serving step is also benchmarks/serving.py's smoke test (tests/test_gpu_check.py): a batched
  # variant at auto precision beside the unbatched one, as on the GPU.
  RUNS="fp32" PRECISIONS="auto" SERVING=(--smoke --variants batched/auto/1 unbatched/fp32/1)
else
  DEVICE=cuda ROWS=4096 REPEATS=20 WARMUP=3 STEPS=300 REQUESTS=40000 CONFIGS="configs/demo.yaml configs/prod_8gpu.yaml"
  RUNS="fp32 bf16 adam managed" PRECISIONS="auto fp32 bf16"
  SERVING=(--variants batched/fp32/1 batched/auto/1 unbatched/fp32/1 --seconds-per-point 5 --max-rate 1024)
fi

# step NAME TIMEOUT_S CMD...: runs CMD (output to NAME.log) unless the budget is spent; one line in steps.tsv.
step() {
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  local left=$((BUDGET - (SECONDS - START)))
  if [ $left -le 10 ]; then
    printf '%s\tskipped (the 10-minute budget is spent)\t0\n' "$name" >>"$SUMMARY"
    return 1
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" >"$DIR/$name.log" 2>&1
  rc=$?
  local status=ok
  if [ $rc = 124 ]; then status="timed out after ${limit}s"; elif [ $rc != 0 ]; then status="failed (exit $rc)"; fi
  printf '%s\t%s\t%s\n' "$name" "$status" $((SECONDS - t0)) >>"$SUMMARY"
  tail -n 3 "$DIR/$name.log"
  return $rc
}

# --- what this machine has ---
"$PY" - "$DEVICE" >"$DIR/environment.txt" 2>&1 <<'EOF'
import importlib.util, platform, sys
import torch
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda})")
if sys.argv[1] == "cuda" and torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device: {p.name}, {p.total_memory / 2**30:.1f} GiB, {torch.cuda.device_count()} visible, "
          f"bf16 {torch.cuda.is_bf16_supported(including_emulation=False)}")
    print(f"hbm_gib={p.total_memory / 2**30:.1f}")
else:
    print(f"device: cpu ({platform.processor() or platform.machine()}), {torch.get_num_threads()} threads")
for name in ("yaml", "numpy", "pyarrow", "torchrec", "fbgemm_gpu", "torchx"):
    print(f"{name}: {'present' if importlib.util.find_spec(name) else 'absent'}")
EOF
cat "$DIR/environment.txt"
if [ $DRY = 0 ] && ! "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
  echo "gpu_check.sh: torch sees no CUDA device (run with --dry-run for the CPU smoke test)" >&2
  exit 2
fi
if ! "$PY" -c 'import yaml' 2>/dev/null; then
  echo "gpu_check.sh: pyyaml is missing (the configs are YAML): install it, e.g. from a carried wheel" \
    "(pip download pyyaml --only-binary=:all: --python-version 3.X -d wheels/)" >&2
  exit 2
fi
FULL=0
if "$PY" -c 'import torchrec, fbgemm_gpu' >/dev/null 2>&1; then FULL=1; fi
HBM=$(sed -n 's/^hbm_gib=//p' "$DIR/environment.txt")

# --- 1. torch alone: the dense and sequence arch, BF16 vs FP32 ---
for cfg in $CONFIGS; do
  name=arch_torch_only_$(basename "$cfg" .yaml)
  step "$name" 200 "$PY" benchmarks/arch_precision.py --device $DEVICE --config "$cfg" --rows $ROWS \
    --repeats $REPEATS --warmup $WARMUP --torch-only --json "$DIR/$name.json"
done

# --- 2. with TorchRec and fbgemm ---
if [ $FULL = 1 ]; then
  step arch_torchrec_demo 200 "$PY" benchmarks/arch_precision.py --device $DEVICE --config configs/demo.yaml \
    --rows $ROWS --repeats $REPEATS --warmup $WARMUP --json "$DIR/arch_torchrec_demo.json"
  step data 120 "$PY" -m pinads_rec.data.synth --config configs/demo.yaml --out "$DIR/data" --raw \
    --set synth.train_requests=$REQUESTS --set synth.eval_requests=$((REQUESTS / 10)) \
    --set synth.calibration_requests=$((REQUESTS / 10))
  DATA=(--set "data.train_dir=$DIR/data/train" --set "data.eval_dir=$DIR/data/eval"
    --set "data.calibration_dir=$DIR/data/calibration" --set train.max_steps=$STEPS --set train.log_every=50)
  for run in $RUNS; do
    case $run in
      fp32) extra=() ;;
      bf16) extra=(--set model.precision.train=bf16) ;;
      adam) extra=(--set train.embedding_optimizer=adam) ;; # fused Adam: CUDA-only in fbgemm
      # The item table under managed collision: TorchRec's own eviction reset (reset_weight_momentum,
      # CUDA-only in fbgemm) and its UVM kernels, which the CPU never runs.
      managed) extra=(--set features.tables.item.managed_collision.eviction=lru
        --set features.tables.item.num_embeddings=20000) ;;
    esac
    step "train_$run" 150 "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 pinads_rec/train.py \
      --config configs/demo.yaml "${DATA[@]}" --set "train.run_dir=$DIR/runs/$run" "${extra[@]}"
  done
  for precision in $PRECISIONS; do
    step "serve_$precision" 90 "$PY" -m pinads_rec.serve score --run "$DIR/runs/fp32" --precision $precision \
      --out "$DIR/predictions_$precision.parquet"
  done
  # The online service with its replicas on this device (serve.device auto: CUDA where torch sees
  # it), driven open loop over loopback beside the model alone (benchmarks/serving.py).
  step serve_online 200 "$PY" benchmarks/serving.py --run "$DIR/runs/fp32" --raw "$DIR/data/raw" "${SERVING[@]}" \
    --out-csv "$DIR/serve_online.csv" --chart "$DIR/serve_online.png"
  for cfg in $CONFIGS; do
    step "plan_$(basename "$cfg" .yaml)" 90 "$PY" -m pinads_rec.plan --config "$cfg" --compute-device cuda \
      --hbm-gb "${HBM:-80}" --world-size 8
  done
fi

# --- the report ---
"$PY" - "$DIR" "$FULL" "$DRY" >"$REPORT" <<'EOF'
import json, subprocess, sys
from pathlib import Path

out, full, dry = Path(sys.argv[1]), sys.argv[2] == "1", sys.argv[3] == "1"
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
print(f"# GPU check{' (dry run on the CPU: tiny sizes, figures meaningless)' if dry else ''}\n")
print(f"commit {commit or 'unknown'}\n\n```\n{(out / 'environment.txt').read_text().strip()}\n```\n")
if not full:
    print("TorchRec / fbgemm cannot be imported here: only the torch-only arch benchmark ran.\n")
print("| step | status | seconds |\n|---|---|---|")
for line in (out / "steps.tsv").read_text().splitlines():
    print("| " + " | ".join(line.split("\t")) + " |")
for bench in sorted(out.glob("arch_*.json")):
    r = json.loads(bench.read_text())
    print(f"\n## {bench.stem}: {r['device']}, torch {r['torch']}, torchrec {r['torchrec']}, fbgemm {r['fbgemm']}, "
          f"{r['config']}, {r['rows']} rows a batch\n")
    print("| part | mode | fp32 ms | bf16 ms | fp32/bf16 | bf16 rows/s |\n|---|---|---|---|---|---|")
    for f in r["figures"]:
        print(f"| {f['part']} | {f['mode']} | {f['fp32_ms']:.2f} | {f['bf16_ms']:.2f} | "
              f"{f['fp32_over_bf16']:.2f}x | {f['bf16_rows_per_s']:,.0f} |")
    print(f"\nmax |bf16 - fp32| of the whole arch's logits: {r['max_logit_diff']:.3g}")
runs = sorted((out / "runs").glob("*/metrics.jsonl")) if (out / "runs").exists() else []
if runs:
    print("\n## train.py, one process (1 GPU, NCCL; gloo in the dry run), demo config on small synthetic data\n")
    print("| run | steps | examples/s | eval AUC (all surfaces: click, good_click, save) |\n|---|---|---|---|")
    for m in runs:
        records = [json.loads(x) for x in m.read_text().splitlines() if x.strip()]
        summary = next((r for r in reversed(records) if "eval" in r), {})
        aucs = [f"{r['auc']:.4f}" for r in summary.get("eval", []) if r.get("surface") == "all"]
        print(f"| {m.parent.name} | {summary.get('step', '?')} | {summary.get('train_examples_per_s', 0):,.0f} | "
              f"{', '.join(aucs)} |")
serve = sorted(p for p in out.glob("serve_*.log") if p.stem != "serve_online")
if serve:
    print("\n## serve score (CPU), the fp32 run's checkpoint\n")
    for log in serve:
        line = next((x for x in log.read_text().splitlines() if x.startswith("scored")), "no result (see the log)")
        print(f"- {log.stem.removeprefix('serve_')}: {line}")
online = out / "serve_online.log"
if online.exists():
    keep = ("model alone", "precision ", "fp32 ", "auto -> ", "max requests/s", "batched/", "best variant")
    lines = [x for x in online.read_text().splitlines() if x.startswith(keep) and "INFO" not in x]
    print("\n## the online service (Ray Serve, replicas on this device), open-loop load over loopback\n")
    print("```\n" + ("\n".join(lines[-40:]) or "no result (see serve_online.log)") + "\n```")
for plan in sorted(out.glob("plan_*.log")):
    print(f"\n## {plan.stem} (this GPU's memory)\n\n```\n{plan.read_text().strip()[-3000:]}\n```")
EOF
echo "report: $REPORT ($((SECONDS - START))s)"
awk -F'\t' '$2 ~ /^(failed|timed out)/ { bad = 1 } END { exit bad }' "$SUMMARY"
