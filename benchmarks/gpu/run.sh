#!/usr/bin/env bash
# One prepared GPU check (issue 21): stages env, smoke (no pytest), ~1B dense and ~1B MoE vs torch's
# fully_shard and a no-FSDP floor, a simulated world size 8 on the GPU, the 128-expert bench, the fp8
# all-gather's quantize cost beside the step time; one JSON summary.
# Installs nothing; needs only torch (the GPU image: torch 2.11 + CUDA 13, Python 3.12) and this tree.
#   bash benchmarks/gpu/run.sh            # on the GPU machine: internal deadline 460 s (run.py docstring)
#   bash benchmarks/gpu/run.sh --dry-run  # on CPU: every stage on tiny shapes, same code paths
# Files (summary.json after every stage, per-stage JSON and logs) go to $OUT if set, else /tmp/raggedfsdp-gpu.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
PY="${PYTHON:-python}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
# outer guard: the driver's own deadline is 460 s; this kills it (and its stage groups get SIGHUP) at 520 s
if command -v timeout >/dev/null 2>&1; then
  exec timeout --kill-after=10 520 "$PY" benchmarks/gpu/run.py "$@"
fi
exec "$PY" benchmarks/gpu/run.py "$@"
