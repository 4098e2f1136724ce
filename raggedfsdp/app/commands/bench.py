"""``raggedfsdp bench``: raggedfsdp.fully_shard vs torch's fully_shard, same model, data and seed, one run.

``raggedfsdp bench --model dense|moe [--experts separate|fused] --nproc N --steps K
[--param-dtype fp32|bf16] [--json]`` launches N ranks with torchrun (``--standalone``) running
``raggedfsdp.app.bench.worker`` (see its docstring for the phases and what is measured). Rank 0 prints a
table of both systems with ratios, or with ``--json`` one JSON object::

    {"throughput_ratio": torch step time / raggedfsdp step time (> 1: raggedfsdp faster),
     "cpu_time_ratio": the same for the CPU seconds a rank spends per step (robust on a loaded machine),
     "peak_memory_ratio": raggedfsdp peak / torch peak (max over ranks; < 1: raggedfsdp smaller),
     "raggedfsdp": {"step_seconds_median", "copy_bytes", "padding_bytes", "collectives",
                    "collective_bytes", "host_syncs", "peak_memory_bytes", "final_loss", ...},
     "torch": {... the same keys ...}, "model", "nproc", "torch_version", ...,
     with --floor (default): "local_floor": {"step_seconds_median", ...} (no FSDP, no communication),
     "throughput_ceiling": torch step / floor step (the best ratio any FSDP could reach here),
     "overhead_seconds": {"raggedfsdp", "torch"} (step - floor), "overhead_ratio": torch's / ours}

Progress lines go to stderr. Exit code 2 for a bad argument (checked before the launch). A failed run
ends, like ``raggedfsdp train``, with one line naming the root-cause rank and its error (exit code 1),
``raggedfsdp bench: [rank R/W] error: Type: message (every rank's report: OUT/failure.log)``; above it
only the traceback of an unexpected error (once, lines tagged ``[rank R/W]``). ``--out DIR`` chooses
that folder (default: a fresh one in the system's temporary folder, created only on a failure).
"""

from __future__ import annotations

import argparse
import os
import sys

_EPILOG = """\
examples:
  raggedfsdp bench --model moe --nproc 4 --json                 # 16 separate experts per block
  raggedfsdp bench --model moe --experts fused --param-dtype bf16
  raggedfsdp bench --model dense --nproc 4 --steps 10
  raggedfsdp bench --model moe --nproc 4 --profile outputs/prof  # + cProfile of rank 0 per system
  raggedfsdp bench --model moe --device cuda --nproc 1           # GPU: NCCL, CUDA allocator peak
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``bench`` subcommand."""
    p = sub.add_parser(
        "bench",
        help="benchmark raggedfsdp.fully_shard against torch's fully_shard (same run, alternated steps)",
        description=__doc__.split("\n\n")[0],
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nproc", type=int, default=4, metavar="N", help="ranks to launch (default: 4)")
    p.add_argument("--out", default=None, metavar="DIR", help=OUT_HELP)
    from raggedfsdp.app.bench.options import build_arg_parser

    build_arg_parser(p)
    p.set_defaults(func=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    from raggedfsdp.app.bench.options import validate, worker_argv

    try:
        validate(args)
    except ValueError as e:
        print(f"raggedfsdp bench: error: {e}", file=sys.stderr)
        return 2
    if "OMP_NUM_THREADS" not in os.environ:
        from raggedfsdp.app.launch.env import available_cpus

        os.environ["OMP_NUM_THREADS"] = str(max(1, available_cpus() // args.nproc))
    from raggedfsdp.app.launch.env import quiet_profiler_logs

    quiet_profiler_logs()  # the ranks' CPU peak memory runs torch.profiler: no kineto / c10 log noise
    if not args.quiet:
        print(
            f"raggedfsdp bench: launching {args.nproc} rank(s) "
            f"(OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}): "
            f"model {args.model}/{args.flavor}, {args.steps} alternated steps per system",
            file=sys.stderr,
            flush=True,
        )
    from raggedfsdp.app.launch.launcher import default_report_dir, run_reported

    argv = ["--standalone", f"--nproc-per-node={args.nproc}", "--module", "raggedfsdp.app.bench.worker"]
    return run_reported([*argv, *worker_argv(args)], prog="raggedfsdp bench", world_size=args.nproc,
                        out_dir=args.out or default_report_dir("bench"), what="bench")  # fmt: skip


OUT_HELP = (
    "folder for the report of a failed run: failure.log (torchrun's failure table, every rank's "
    "traceback) and launcher.log (torchrun's log lines); created only when there is something to "
    "write (default: a fresh raggedfsdp-bench-<time>-<pid>/ in the system's temporary folder)"
)
