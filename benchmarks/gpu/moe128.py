"""Stage E of benchmarks/gpu/run.sh: issue 22 item 4 on the GPU, 128 separate experts per MoE layer.

Runs ``raggedfsdp bench`` (the same command and the same floor split as the CPU rows of
benchmarks/README.md, "128 experts") with ``--device cuda --nproc 1``: one NCCL rank, raggedfsdp vs
torch's ``fully_shard`` vs the same model without FSDP (the floor), interleaved. At world size 1 neither
FSDP issues a collective, so "the rest" (step - floor - collectives) is exactly the FSDP runtime's own
cost: hooks, copies, the ``.grad`` DTensors, and the host time to launch them. On a GPU the copies
are kernels, so the host-side cost is the training thread's CPU time above the floor's
(``non_comm_overhead_main_thread_cpu_seconds``, paired per repetition); the issue's bar is
ours / torch <= 0.25 on that split. ``non_comm_overhead_main_thread_split`` cuts it at
``optimizer.step()``: the same ``torch.optim.AdamW`` on DTensor params in both systems vs the rest of
the training thread's work (``non_comm_overhead_main_thread_fwd_bwd_ratio``; on CUDA that is the
forward and pre-backward part: autograd runs the backward and its hooks on its own device thread).

Cases (each a ``raggedfsdp bench`` subprocess with its own time limit, result written after each):

* ``tiny128``: ``--flavor moe-tiny --n-experts 128 --n-layers 2`` fp32, batch 2 x 128: the CPU
  rows' exact shape (launch-bound on an H200: measures host-side overhead);
* ``small128_bf16``: ``--flavor moe-small --n-experts 128 --n-layers 4``, bf16 params / fp32 reduce,
  batch 4 x 512 (785 -> ~1550 parameters, more GPU work per step).

``--dry-run``: the first case on CPU (gloo) with 8 experts, 1 warm-up + 2 timed steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Result, run_bench_json, write_stdout_json

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

CASES = [
    (
        "tiny128",
        ["--flavor", "moe-tiny", "--n-experts", "128", "--n-layers", "2", "--steps", "30", "--warmup", "3"],
        70,
    ),
    (
        "small128_bf16",
        [
            "--flavor", "moe-small", "--n-experts", "128", "--n-layers", "4", "--param-dtype", "bf16",
            "--batch", "4", "--seq", "512", "--steps", "15", "--warmup", "3",
        ],
        60,
    ),
]  # fmt: skip

KEYS = (
    "non_comm_overhead_main_thread_cpu_seconds",
    "non_comm_overhead_main_thread_cpu_ratio",
    "non_comm_overhead_main_thread_split",
    "non_comm_overhead_main_thread_fwd_bwd_ratio",
    "non_comm_overhead_seconds",
    "non_comm_overhead_cpu_seconds",
    "non_comm_overhead_cpu_ratio",
    "throughput_ratio",
    "throughput_ceiling",
    "overhead_ratio",
    "cpu_time_ratio",
    "peak_memory_ratio",
    "copy_bytes_ratio",
    "final_loss_abs_diff",
    "num_params",
    "torch_version",
    "device",
)


def summarize(d: dict) -> dict:
    """The bench JSON's split and ratios, plus each system's median step and main-thread CPU."""
    out = {k: d[k] for k in KEYS if k in d}
    floor = d.get("local_floor", {})
    out["floor_step_seconds_median"] = floor.get("step_seconds_median")
    mt = floor.get("main_thread_cpu_seconds") or []
    out["floor_main_thread_cpu_seconds_median"] = statistics.median(mt) if mt else None
    for s in ("raggedfsdp", "torch"):
        r = d.get(s, {})
        out[s] = {
            k: r[k]
            for k in (
                "step_seconds_median",
                "cpu_seconds_median",
                "main_thread_cpu_seconds_median",
                "tokens_per_second",
                "peak_memory_bytes",
                "copy_bytes",
                "host_syncs",
                "host_sync_ops",
                "host_sync_sites",
                "final_loss",
            )
            if k in r
        }
    return out


def run_case(name: str, argv: list[str], limit: float, dry_run: bool, profile: str | None = None) -> dict:
    cmd = [sys.executable, "-m", "raggedfsdp.app.cli", "bench", "--model", "moe", "--nproc", "1", "--json"]
    if profile:  # cProfile (process CPU time) of 5 more steps per system after the timed ones
        cmd += ["--profile", os.path.join(profile, name), "--profile-steps", "5"]
    if dry_run:
        argv = list(argv)
        argv[argv.index("--steps") + 1] = "2"
        argv[argv.index("--warmup") + 1] = "1"
        argv[argv.index("--n-experts") + 1] = "8"  # the code paths, not the 128-expert cost
        cmd += [*argv, "--device", "cpu"]
    else:
        cmd += [*argv, "--device", "cuda"]
    return run_bench_json(cmd, limit, summarize, ROOT)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", nargs="*", default=None, choices=[c for c, _, _ in CASES])
    ap.add_argument(
        "--profile", default=None, metavar="DIR", help="also write DIR/<case>/<system>.pstats and .ops.txt"
    )
    args = ap.parse_args()
    res = Result(args.out, stage="moe128", bar="non_comm_overhead_main_thread_cpu_ratio <= 0.25")
    cases = [c for c in CASES if args.only is None or c[0] in args.only]
    if args.dry_run:
        cases = cases[:1]
    for name, argv, limit in cases:
        res.set(name, run_case(name, argv, limit * (4 if args.dry_run else 1), args.dry_run, args.profile))
    res.set("ok", all("error" not in res.data[c] for c, _, _ in cases))
    write_stdout_json(res.data)


if __name__ == "__main__":
    main()
