"""``raggedfsdp wrap-bench``: measure FSDP units side by side (hybrid: layer vs superblock) and
recommend one; launches :mod:`raggedfsdp.app.bench.wrap_compare` on ``--nproc`` ranks with torchrun. A failed
run ends with one line naming the root-cause rank, as ``raggedfsdp bench`` does (its ``--out``)."""

from __future__ import annotations

import os
import sys


def add_parser(subparsers):
    """``raggedfsdp wrap-bench --nproc N [--flavor F] [--wrap layer,superblock] [--backend B] [--json]``."""
    from raggedfsdp.app.bench.options import WRAP_BENCH_DESCRIPTION, wrap_bench_parser

    p = subparsers.add_parser(
        "wrap-bench",
        help="measure FSDP units side by side (hybrid: layer vs superblock) and recommend one",
        description=WRAP_BENCH_DESCRIPTION,
    )
    p.add_argument("--nproc", type=int, default=2, metavar="N", help="ranks to launch (default: 2)")
    from raggedfsdp.app.commands.bench import OUT_HELP

    p.add_argument("--out", default=None, metavar="DIR", help=OUT_HELP.replace("bench", "wrap-bench"))
    for action in wrap_bench_parser()._actions:
        if action.dest != "help":
            p._add_action(action)
    p.set_defaults(func=launch)
    return p


def launch(args) -> int:
    """Run :func:`main` on ``args.nproc`` ranks through torch's launcher; 2 for a bad argument."""
    if args.nproc < 1 or args.steps < 1 or len(args.wrap.split(",")) < 2:
        print(
            "raggedfsdp wrap-bench: error: need --nproc >= 1, --steps >= 1 and at least two units in --wrap "
            f"(got --nproc {args.nproc}, --steps {args.steps}, --wrap {args.wrap!r})",
            file=sys.stderr,
        )
        return 2
    from raggedfsdp.app.models import build_model_config

    try:  # a bad --model / --flavor: one line before the launch, not a traceback per rank
        build_model_config(args.model, args.flavor)
    except ValueError as e:
        print(
            f"raggedfsdp wrap-bench: error: --model {args.model!r} --flavor {args.flavor!r}: {e}",
            file=sys.stderr,
        )
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from raggedfsdp.app.launch.env import quiet_profiler_logs

    quiet_profiler_logs()  # the ranks' CPU peak memory runs torch.profiler: no kineto / c10 log noise
    argv = []
    for key, val in vars(args).items():
        if key in ("nproc", "out", "func", "command") or val is None or val is False:
            continue
        argv += [f"--{key.replace('_', '-')}"] + ([] if val is True else [str(val)])
    from raggedfsdp.app.launch.launcher import default_report_dir, run_reported

    torchrun = [
        "--standalone",
        f"--nproc-per-node={args.nproc}",
        "--module",
        "raggedfsdp.app.bench.wrap_compare",
    ]
    return run_reported([*torchrun, *argv], prog="raggedfsdp wrap-bench", world_size=args.nproc,
                        out_dir=args.out or default_report_dir("wrap-bench"), what="wrap-bench")  # fmt: skip
