#!/usr/bin/env bash
# One command for a machine with NVIDIA GPUs: GPU tests (NCCL), then `raggedfsdp bench` on CUDA
# (dense and MoE, bf16 params / fp32 reduce) at the largest world size the machine allows, one JSON
# line per case on stdout (step time, CUDA allocator peak, copy bytes, loss of both systems).
# Runs from the source tree, installs nothing (PYTHONPATH=<repo>); needs torch >= 2.11 with CUDA.
#
#   bash benchmarks/gpu/bench.sh             # on the GPU machine (~3-6 min on one GPU)
#   bash benchmarks/gpu/bench.sh --dry-run   # anywhere: print the commands, run each case tiny on CPU
#
# Env: PYTHON (default python3), NPROC (default: all visible GPUs), STEPS (default 10).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PYTHON:-python3}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT"
DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1

CASES=(
  "--model dense --flavor small"
  "--model moe --flavor moe-small --experts separate"
  "--model moe --flavor moe-small --experts fused"
)
COMMON="--param-dtype bf16 --reduce-dtype fp32 --batch 8 --seq 512 --json --quiet"

if [[ $DRY == 1 ]]; then
  NPROC=2
  echo "# dry run: on a GPU machine these would run (NPROC = number of GPUs):" >&2
  echo "$PY -m pytest -q tests/gpu" >&2
  for c in "${CASES[@]}"; do
    echo "$PY -m raggedfsdp.app.cli bench $c --device cuda --nproc \$NPROC --steps ${STEPS:-10} $COMMON" >&2
  done
  echo "# now each case tiny on CPU (gloo, 2 ranks) to check the pipeline:" >&2
  for c in "${CASES[@]}"; do
    c="${c/--flavor small/--flavor debug}"
    c="${c/--flavor moe-small/--flavor moe-debug}"
    OMP_NUM_THREADS=1 "$PY" -m raggedfsdp.app.cli bench $c --device cpu --nproc $NPROC --steps 1 --warmup 1 \
      --param-dtype bf16 --batch 1 --seq 16 --json --quiet
  done
  exit 0
fi

NGPU="$("$PY" -c 'import torch; print(torch.cuda.device_count())')"
if [[ "$NGPU" -lt 1 ]]; then
  echo "run.sh: no CUDA device visible (torch.cuda.device_count() == 0); use --dry-run on CPU" >&2
  exit 2
fi
NPROC="${NPROC:-$NGPU}"
"$PY" -c 'import torch; print(f"# torch {torch.__version__} cuda {torch.version.cuda} {torch.cuda.get_device_name(0)} x'"$NGPU"'")' >&2
if [[ -d tests/gpu ]]; then
  "$PY" -m pytest -q -p no:cacheprovider tests/gpu >&2 || echo "# GPU tests FAILED (continuing with the bench)" >&2
fi
for c in "${CASES[@]}"; do
  "$PY" -m raggedfsdp.app.cli bench $c --device cuda --nproc "$NPROC" --steps "${STEPS:-10}" $COMMON
done
