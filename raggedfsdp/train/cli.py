"""``raggedfsdp train`` (launch a training job through torchrun) and ``raggedfsdp plot``.

``raggedfsdp train [--nproc N] [flags]`` validates the configuration, then starts N worker processes
with torch's own launcher (``torch.distributed.run``, i.e. torchrun ``--standalone``) running
``raggedfsdp.train.worker`` with the same flags. It is equivalent to::

    OMP_NUM_THREADS=<cores/N> torchrun --standalone --nproc_per_node N -m raggedfsdp.train.worker [flags]

Use torchrun directly for multi-node jobs or other launcher options.
"""

from __future__ import annotations

import argparse
import os
import sys

from raggedfsdp.train.config import add_config_args, load_config, override_argv, overrides_from_args

_TRAIN_EPILOG = """\
examples:
  raggedfsdp train                                  # default: 2 CPU ranks, stdlib corpus, tiny model
  raggedfsdp train --steps 50 --model debug --out outputs/debug
  raggedfsdp train --config configs/tiny_cpu.toml --backend torch --lr 2e-3
  raggedfsdp train --data ../shared/data/tinyshakespeare.txt
  raggedfsdp plot outputs/run/metrics.jsonl -o loss.png

Every option is also a TOML key: --section.key in [section] (CLI > TOML > defaults).
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``train`` and ``plot`` subcommands."""
    p = sub.add_parser(
        "train",
        help="train a small LLaMA-style model with FSDP on N local ranks (torchrun)",
        description=(
            "Validate the config, then launch N ranks of raggedfsdp.train.worker with torchrun\n"
            "(torch.distributed.run --standalone). Same as:\n"
            "  OMP_NUM_THREADS=<cores/N> torchrun --standalone --nproc_per_node N \\\n"
            "      -m raggedfsdp.train.worker [flags]"
        ),
        epilog=_TRAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--nproc", type=int, default=2, metavar="N", help="ranks (processes) to launch (default: 2)"
    )
    add_config_args(p)
    p.set_defaults(func=run_train)

    q = sub.add_parser("plot", help="plot loss and grad norm from metrics.jsonl files (needs matplotlib)")
    q.add_argument("metrics", nargs="+", help="metrics.jsonl file(s); several are overlaid")
    q.add_argument("-o", "--output", default="loss.png", help="image file to write (default: loss.png)")
    q.add_argument("--title", default=None, help="figure title")
    q.set_defaults(func=run_plot)


def run_train(args: argparse.Namespace) -> int:
    overrides = overrides_from_args(args)
    try:
        if args.nproc < 1:
            raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
        cfg = load_config(args.config, overrides)
        cfg.validate(world_size=args.nproc)
    except ValueError as e:
        print(f"raggedfsdp train: error: {e}", file=sys.stderr)
        return 2
    if "OMP_NUM_THREADS" not in os.environ:  # share the cores between the local ranks
        from raggedfsdp.train.worker import _available_cpus

        os.environ["OMP_NUM_THREADS"] = str(max(1, _available_cpus() // args.nproc))

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    torchrun_argv = [
        "--standalone",
        f"--nproc-per-node={args.nproc}",
        "--module",
        "raggedfsdp.train.worker",
        *override_argv(args.config, overrides),
    ]
    print(
        f"raggedfsdp train: launching {args.nproc} rank(s) with torchrun --standalone "
        f"(OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, backend {cfg.fsdp.backend}) -> {cfg.job.out}",
        file=sys.stderr,
        flush=True,
    )
    try:
        run(parse_args(torchrun_argv))
    except ChildFailedError as e:
        print(f"raggedfsdp train: the {args.nproc}-rank job failed\n{e}", file=sys.stderr, flush=True)
        return 1
    return 0


def run_plot(args: argparse.Namespace) -> int:
    from raggedfsdp.train.plot import plot_metrics

    try:
        out = plot_metrics(args.metrics, args.output, title=args.title)
    except (ImportError, ValueError, FileNotFoundError) as e:
        print(f"raggedfsdp plot: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0
