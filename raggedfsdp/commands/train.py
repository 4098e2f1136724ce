"""``raggedfsdp train``: validate, prepare the run once, launch the ranks through torchrun.

``raggedfsdp train [--nproc N] [flags]`` validates the configuration, then starts N worker processes
with torch's own launcher (``torch.distributed.run``, i.e. torchrun ``--standalone``) running
``raggedfsdp.launch.worker`` with the same flags. It is equivalent to::

    OMP_NUM_THREADS=<cores/N> torchrun --standalone --nproc_per_node N -m raggedfsdp.launch.worker [flags]

Use torchrun directly for multi-node jobs or other launcher options.

Before launching, the config is validated, including the data source (missing, empty, too small for
``seq_len``) and the batch split over ``--nproc``: such errors are one line and exit code 2. When a
rank fails, the failing rank prints its traceback once (lines tagged ``[rank R/W]``), torchrun's
rank-tagged failure table follows with one-line errors, and the last line names the root-cause rank
and its error (exit code 1).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from raggedfsdp.launch.failures import STOPPED_CODES, failure_report
from raggedfsdp.train.config import add_config_args, load_config, override_argv, overrides_from_args

_TRAIN_EPILOG = """\
examples:
  raggedfsdp train                                  # default: 2 CPU ranks, stdlib corpus, tiny model
  raggedfsdp train --steps 50 --model debug --out outputs/debug
  raggedfsdp train --config configs/tiny_cpu.toml --backend torch --lr 2e-3
  raggedfsdp train --data ../shared/data/tinyshakespeare.txt
  raggedfsdp plot outputs/run-*/metrics.jsonl -o loss.png

checkpoints (torch.distributed.checkpoint; resume exactly, at any --nproc):
  raggedfsdp train --steps 600 --checkpoint-interval 100 --out outputs/run   # -> outputs/run/checkpoints/step-N/
  raggedfsdp train --steps 600 --checkpoint-interval 100 --out outputs/run --resume auto --nproc 1
  raggedfsdp train ... --resume outputs/run/checkpoints/step-300              # a given step (or a folder of them)
  --checkpoint-interval N saves every N steps and at the last step (0: off, the default);
  --checkpoint.folder DIR (default OUT/checkpoints); --checkpoint.keep_latest K (default 2, 0: all).
  --resume auto takes the newest step-N/ under the checkpoint folder, or starts fresh when there is
  none. A step folder holds the sharded model + AdamW state and the step (the LR schedule and data
  order are functions of the step and seed), plus meta.json (step, world size, config hash). A
  resumed run with the same OUT keeps metrics.jsonl up to the checkpoint's step and appends.
  A missing or corrupt --resume path is an error before the launch (exit code 2).
  Each step-N/ has a manifest.json (size + SHA-256 per file, run id): loads verify it and are strict
  (--checkpoint.allow_partial true loads only the matching keys); --resume auto takes the newest
  checkpoint of the run in OUT/run.json that verifies and names those it skipped.

faults (see README; test-only injection: RAGGEDFSDP_FAULT=nan@step3:rank1, raggedfsdp/train/faults.py):
  --training.on_nonfinite stop|skip   NaN/Inf loss or gradient on any rank (default: stop, save nothing)
  --job.hang_timeout_s S              name a rank stuck outside a collective after S s (default 60)
  Ctrl-C / SIGTERM: every rank stops at the next step, saves (if checkpointing), exits 130 / 143.
  --reproduce-batch step3:rows4-7     print the samples of a batch id from an error line
  Without --out each run gets a fresh outputs/run-YYYYmmdd-HHMMSS/; a fresh run into an --out that
  holds a run is refused (--resume auto continues it, --job.overwrite true starts anew).

Every option is also a TOML key: --section.key in [section] (CLI > TOML > defaults).
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``train`` subcommand."""
    p = sub.add_parser(
        "train",
        help="train a small LLaMA-style model with FSDP on N local ranks (torchrun)",
        description=(
            "Validate the config, then launch N ranks of raggedfsdp.launch.worker with torchrun\n"
            "(torch.distributed.run --standalone). Same as:\n"
            "  OMP_NUM_THREADS=<cores/N> torchrun --standalone --nproc_per_node N \\\n"
            "      -m raggedfsdp.launch.worker [flags]"
        ),
        epilog=_TRAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--nproc", type=int, default=2, metavar="N", help="ranks (processes) to launch (default: 2)"
    )
    p.add_argument(
        "--reproduce-batch",
        metavar="ID",
        default=None,
        help="print the samples of a batch id from an error line (e.g. step3:rows4-7) and exit; "
        "use the same --config/--data/--seed/--batch-size/--seq-len as the failed run",
    )
    add_config_args(p)
    p.set_defaults(func=run_train)


def run_train(args: argparse.Namespace) -> int:
    overrides = overrides_from_args(args)
    cfg = None
    try:
        if args.nproc < 1:
            raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
        cfg = load_config(args.config, overrides, validate=False)
        from raggedfsdp.train import run_dir

        # A bad config or --data fails here, not after the launch on every rank; so does a missing or
        # corrupt --resume path (verified here, once for the whole job), or a taken --out.
        reproduce = getattr(args, "reproduce_batch", None)
        prepared = run_dir.prepare(cfg, args.nproc, check_out=not reproduce)
        overrides["job.out"] = cfg.job.out  # the default --out (a fresh folder) is chosen once, here
        if reproduce:
            return _reproduce(cfg, reproduce, args.nproc)
        run_dir.hand_to_workers(cfg, prepared)  # the ranks neither re-lock OUT nor re-hash --resume
    except ValueError as e:
        print(f"raggedfsdp train: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # --out not writable (permission, read-only or full disk): before any launch
        what = f"cannot use --out {cfg.job.out}" if cfg is not None else "cannot read the configuration"
        print(f"raggedfsdp train: error: {what}: {e.strerror or e}: {str(e.filename)!r} (choose a path this "
              "user can write)", file=sys.stderr)  # fmt: skip
        return 2
    if "OMP_NUM_THREADS" not in os.environ:  # share the cores between the local ranks
        from raggedfsdp.launch.env import available_cpus

        os.environ["OMP_NUM_THREADS"] = str(max(1, available_cpus() // args.nproc))

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    torchrun_argv = [
        "--standalone",
        f"--nproc-per-node={args.nproc}",
        "--module",
        "raggedfsdp.launch.worker",
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
    except SignalException as e:  # Ctrl-C / SIGTERM / SIGHUP to the launcher: forwarded to the ranks
        name = signal.Signals(e.sigval).name
        print(f"raggedfsdp train: interrupted by {name}; resume with --resume auto --out {cfg.job.out}",
              file=sys.stderr, flush=True)  # fmt: skip
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        codes = {f.exitcode for f in e.failures.values()}
        if codes and codes <= set(STOPPED_CODES):  # every failed rank stopped on a signal, cleanly
            print(f"raggedfsdp train: interrupted (exit code {min(codes)}); resume with --resume auto "
                  f"--out {cfg.job.out}", file=sys.stderr, flush=True)  # fmt: skip
            return min(codes)
        summary, last_line = failure_report(e, args.nproc)
        print(f"raggedfsdp train: the {args.nproc}-rank job failed\n{summary}", file=sys.stderr)
        print(last_line, file=sys.stderr, flush=True)
        return 2 if "CheckpointError: cannot load" in last_line else 1
    finally:
        if prepared.lock is not None:
            prepared.lock.release()
    return 0


def _reproduce(cfg, text: str, nproc: int) -> int:
    """``--reproduce-batch ID``: print the samples of a batch id from an error line (no launch)."""
    from raggedfsdp.train.data import BatchSampler, load_corpus, reproduce_batch

    t = cfg.training
    corpus = load_corpus(cfg.data.path, max_bytes=cfg.data.max_bytes, val_fraction=cfg.data.val_fraction)
    sampler = BatchSampler(
        corpus.train, seq_len=t.seq_len, global_batch_size=t.global_batch_size, seed=cfg.job.seed
    )
    print(reproduce_batch(sampler, text))
    return 0
