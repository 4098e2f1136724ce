#!/usr/bin/env bash
# One prepared GPU check (issue 8 item 6): runs tests/gpu from the source tree, then a short
# memory / speed comparison against torch's fully_shard, and prints one JSON summary (last line).
# Installs nothing; needs torch + pytest (the GPU image: torch 2.11 + CUDA 13, Python 3.12).
#   benchmarks/gpu/run.sh            # on the GPU machine (< 8 min on one GPU)
#   benchmarks/gpu/run.sh --dry-run  # on CPU: everything imports, tests/gpu collects, drivers run tiny
# Files (junit XML, per-test JSON, logs, summary.json) go to $OUT if set, else /tmp/raggedfsdp-gpu.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
PY="${PYTHON:-python}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
exec "$PY" benchmarks/gpu/run.py "$@"
