"""Stage F of benchmarks/gpu/run.sh: the quantized parameter all-gather's cost on CUDA (issue 40 item 3).

Runs ``raggedfsdp bench --model dense --device cuda --nproc 1`` with ``--all-gather-dtype fp8_e4m3``
and with ``none``: raggedfsdp vs torch's ``fully_shard`` in one run, bf16 params / fp32 reduce. At
world size 1 no collective runs, but each quantized unit still quantizes its shard into the 8-bit
payload and dequantizes it into the unsharded params, so the run shows what that local work costs
beside the step: ``quantize_seconds`` / ``dequantize_seconds`` per step (one accounted step, CUDA
events, synced after it; the timed steps stay unsynced), ``quantize_dequantize_step_fraction`` (their
sum over raggedfsdp's median step), and the step times, throughput ratio and peak memory of both
systems; the ``none`` case is the same model unquantized (its quantize seconds are 0).

Cases (each a ``raggedfsdp bench`` subprocess with its own time limit, result written after each):

* ``base_fp8`` / ``base_none``: ``--flavor base`` (dim 512, 8 blocks), batch 4 x 512;
* ``l8b2_fp8``: LLaMA-3 8B shapes cut to 2 blocks (``--flavor llama3-8b --n-layers 2``, ~1.5B
  parameters, most of them the 128K-vocabulary embedding and output), batch 1 x 1024: matrices of a real
  model size, where the quantize pass is a memory-bound sweep of the sharded master.

``--dry-run``: ``base_fp8`` and ``base_none`` on CPU (gloo) with ``--flavor debug``, 1 warm-up + 2
timed steps.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Result, run_bench_json, write_stdout_json

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

_BASE = ["--flavor", "base", "--batch", "4", "--seq", "512", "--steps", "10", "--warmup", "3"]
CASES = [
    ("base_fp8", [*_BASE, "--all-gather-dtype", "fp8_e4m3"], 40),
    ("base_none", [*_BASE, "--all-gather-dtype", "none"], 40),
    (
        "l8b2_fp8",
        [
            "--flavor", "llama3-8b", "--n-layers", "2", "--batch", "1", "--seq", "1024", "--steps", "5",
            "--warmup", "2", "--all-gather-dtype", "fp8_e4m3",
        ],
        150,  # builds two ~1.5B-parameter models on the host first
    ),
]  # fmt: skip

TOP = (
    "all_gather_dtype",
    "quantize_dequantize_step_fraction",
    "throughput_ratio",
    "peak_memory_ratio",
    "all_gather_wire_bytes_ratio",
    "final_loss_abs_diff",
    "num_params",
    "torch_version",
    "device",
)
PER_SYSTEM = (
    "step_seconds_median",
    "quantize_seconds",
    "dequantize_seconds",
    "quantize_calls",
    "dequantize_calls",
    "peak_memory_bytes",
    "all_gather_wire_bytes",
    "host_syncs",
    "final_loss",
)


def summarize(d: dict) -> dict:
    """The bench JSON's quantize / dequantize seconds beside both systems' step time and memory."""
    out = {k: d[k] for k in TOP if k in d}
    for s in ("raggedfsdp", "torch"):
        r = d.get(s, {})
        out[s] = {k: r[k] for k in PER_SYSTEM if k in r}
    a = out["raggedfsdp"]
    if a.get("step_seconds_median"):
        out["quantize_ms"] = round(a.get("quantize_seconds", 0) * 1e3, 3)
        out["dequantize_ms"] = round(a.get("dequantize_seconds", 0) * 1e3, 3)
    return out


def run_case(name: str, argv: list[str], limit: float, dry_run: bool) -> dict:
    cmd = [sys.executable, "-m", "raggedfsdp.app.cli", "bench", "--model", "dense", "--nproc", "1"]
    cmd += ["--param-dtype", "bf16", "--reduce-dtype", "fp32", "--no-floor", "--json", "--quiet"]
    if dry_run:
        argv = list(argv)
        argv[argv.index("--flavor") + 1] = "debug"
        argv[argv.index("--steps") + 1] = "2"
        argv[argv.index("--warmup") + 1] = "1"
        argv[argv.index("--seq") + 1] = "32"
        cmd += [*argv, "--device", "cpu"]
    else:
        cmd += [*argv, "--device", "cuda"]
    return run_bench_json(cmd, limit, summarize, ROOT)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", nargs="*", default=None, choices=[c for c, _, _ in CASES])
    args = ap.parse_args()
    res = Result(args.out, stage="quant", what="quantize / dequantize seconds per step vs the step time")
    cases = [c for c in CASES if args.only is None or c[0] in args.only]
    if args.dry_run:
        cases = [c for c in cases if c[0].startswith("base_")]
    for name, argv, limit in cases:
        res.set(name, run_case(name, argv, limit * (4 if args.dry_run else 1), args.dry_run))
    ok = all("error" not in res.data[c] for c, _, _ in cases)
    fp8 = [res.data[c] for c, _, _ in cases if c.endswith("_fp8") and "error" not in res.data[c]]
    # the accounting saw the quantized units: every fp8 case has quantize seconds > 0, none has 0
    ok = ok and all(r["raggedfsdp"].get("quantize_calls", 0) > 0 for r in fp8)
    ok = ok and all(
        res.data[c]["raggedfsdp"].get("quantize_seconds") == 0
        for c, _, _ in cases
        if c.endswith("_none") and "error" not in res.data[c]
    )
    res.set("ok", ok)
    write_stdout_json(res.data)


if __name__ == "__main__":
    main()
