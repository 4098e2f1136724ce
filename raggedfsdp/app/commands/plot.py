"""``raggedfsdp plot METRICS.jsonl... -o loss.png``: loss and grad norm curves (needs matplotlib)."""

from __future__ import annotations

import argparse
import os
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``plot`` subcommand."""
    q = sub.add_parser("plot", help="plot loss and grad norm from metrics.jsonl files (needs matplotlib)")
    q.add_argument("metrics", nargs="+", help="metrics.jsonl file(s); several are overlaid")
    q.add_argument("-o", "--output", default="loss.png", help="image file to write (default: loss.png)")
    q.add_argument("--title", default=None, help="figure title")
    q.set_defaults(func=run_plot)


def run_plot(args: argparse.Namespace) -> int:
    """Exit 0: the image was written; 2: a bad input (a missing path, a folder or file without
    metrics), as the other commands; 1: matplotlib is not installed."""
    missing = [p for p in args.metrics if not os.path.exists(p)]
    if missing:
        print(
            f"raggedfsdp plot: error: metrics file {missing[0]!r} does not exist (give a metrics.jsonl or "
            "a run folder --out)",
            file=sys.stderr,
        )
        return 2
    from raggedfsdp.app.train.plot import plot_metrics

    try:
        out = plot_metrics(args.metrics, args.output, title=args.title)
    except (ValueError, FileNotFoundError) as e:
        print(f"raggedfsdp plot: error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:
        print(f"raggedfsdp plot: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0
