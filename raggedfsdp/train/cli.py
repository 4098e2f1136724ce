"""``raggedfsdp train`` (launch a training job through torchrun) and ``raggedfsdp plot``.

``raggedfsdp train [--nproc N] [flags]`` validates the configuration, then starts N worker processes
with torch's own launcher (``torch.distributed.run``, i.e. torchrun ``--standalone``) running
``raggedfsdp.train.worker`` with the same flags. It is equivalent to::

    OMP_NUM_THREADS=<cores/N> torchrun --standalone --nproc_per_node N -m raggedfsdp.train.worker [flags]

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
from pathlib import Path

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
    p.add_argument(
        "--reproduce-batch",
        metavar="ID",
        default=None,
        help="print the samples of a batch id from an error line (e.g. step3:rows4-7) and exit; "
        "use the same --config/--data/--seed/--batch-size/--seq-len as the failed run",
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
    cfg = None
    try:
        if args.nproc < 1:
            raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
        cfg = load_config(args.config, overrides)
        if not cfg.job.out:  # a fresh folder per run, chosen once for every rank
            from raggedfsdp.train.worker import default_out

            cfg.job.out = overrides["job.out"] = default_out()
        cfg.validate(world_size=args.nproc)
        cfg.check_data()  # a bad --data fails here, not after the launch on every rank
        if getattr(args, "reproduce_batch", None):
            return _reproduce(cfg, args.reproduce_batch, args.nproc)
        _check_resume(cfg)  # so does a missing or corrupt --resume path, or a taken --out
        from raggedfsdp.train.ckpt_integrity import LOCK_HELD_ENV, OutLock

        lock = OutLock(cfg.job.out).acquire()  # held by this process until the job ends
        os.environ[LOCK_HELD_ENV] = str(Path(cfg.job.out).resolve())
    except ValueError as e:
        print(f"raggedfsdp train: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # --out not writable (permission, read-only or full disk): before any launch
        what = f"cannot use --out {cfg.job.out}" if cfg is not None else "cannot read the configuration"
        print(f"raggedfsdp train: error: {what}: {e.strerror or e}: {str(e.filename)!r} (choose a path this "
              "user can write)", file=sys.stderr)  # fmt: skip
        return 2
    if "OMP_NUM_THREADS" not in os.environ:  # share the cores between the local ranks
        from raggedfsdp.train.worker import _available_cpus

        os.environ["OMP_NUM_THREADS"] = str(max(1, _available_cpus() // args.nproc))

    from torch.distributed.elastic.multiprocessing.api import SignalException
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
    except SignalException as e:  # Ctrl-C / SIGTERM / SIGHUP to the launcher: forwarded to the ranks
        name = signal.Signals(e.sigval).name
        print(f"raggedfsdp train: interrupted by {name}; resume with --resume auto --out {cfg.job.out}",
              file=sys.stderr, flush=True)  # fmt: skip
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        codes = {f.exitcode for f in e.failures.values()}
        if codes and codes <= set(_STOPPED_CODES):  # every failed rank stopped on a signal, cleanly
            print(f"raggedfsdp train: interrupted (exit code {min(codes)}); resume with --resume auto "
                  f"--out {cfg.job.out}", file=sys.stderr, flush=True)  # fmt: skip
            return min(codes)
        summary, last_line = failure_report(e, args.nproc)
        print(f"raggedfsdp train: the {args.nproc}-rank job failed\n{summary}", file=sys.stderr)
        print(last_line, file=sys.stderr, flush=True)
        return 2 if "CheckpointError: cannot load" in last_line else 1
    finally:
        lock.release()
    return 0


def _check_resume(cfg) -> None:
    """Pre-launch checks of ``--out`` and ``--resume`` (a ``ValueError`` naming the path and a fix):
    a fresh run into an ``--out`` that holds another run, a missing or corrupt ``--resume PATH``
    (verified against its manifest), an ``--out`` locked by a running job."""
    from raggedfsdp.train import ckpt_integrity as integrity

    c = cfg.checkpoint
    folder = c.resolved_folder(cfg.job.out)
    integrity.check_out_dir(cfg.job.out, folder, resume=c.resume, overwrite=cfg.job.overwrite)
    if c.resume and c.resume != "auto":
        from raggedfsdp.train.checkpoint import resolve_resume

        resolve_resume(c.resume, folder, verify=c.verify)
    if Path(cfg.job.out, integrity.LOCK_FILE).exists() and os.environ.get(integrity.LOCK_HELD_ENV) is None:
        integrity.OutLock(cfg.job.out).acquire().release()  # raises if a running job holds it


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


def _one_line(failure) -> str:
    """A failed rank's error in one line: the exception (not its traceback), exit code or signal."""
    msg = failure.message
    if isinstance(msg, dict):
        msg = msg.get("message") or "<N/A>"
    elif failure.exitcode < 0:
        msg = f"killed by signal {-failure.exitcode} ({failure.signal_name()})"
        if failure.signal_name() == "SIGKILL":
            msg += ", e.g. by the out-of-memory killer"
    elif failure.exitcode in _STOPPED_CODES and not _has_error_file(failure):
        msg = f"stopped by {_STOPPED_CODES[failure.exitcode]} (exit code {failure.exitcode})"
    elif not _has_error_file(failure):
        msg = f"exited with code {failure.exitcode} without recording an error"
    return str(msg)


# Exit codes of a rank that stopped on a signal (train/watchdog.py: 128 + signum).
_STOPPED_CODES = {129: "SIGHUP", 130: "SIGINT", 143: "SIGTERM"}


def _has_error_file(failure) -> bool:
    return bool(failure.error_file) and failure.error_file != "<N/A>"


def _is_consequence(failure) -> bool:
    """A rank stopped by torchrun, or one whose collective failed because a peer went away."""
    from raggedfsdp.train.worker import _PEER_FAILURE_HINTS

    if isinstance(failure.message, dict):  # the rank recorded an exception: judge by its message
        return any(h in _one_line(failure) for h in _PEER_FAILURE_HINTS)
    if failure.exitcode in _STOPPED_CODES:
        return True
    return failure.exitcode < 0 and failure.signal_name() in ("SIGTERM", "SIGINT")


def failure_report(err, world_size: int) -> tuple[str, str]:
    """``(summary, last_line)`` for a failed job (a torchrun ``ChildFailedError``).

    ``summary`` is torchrun's rank-tagged failure table with each traceback replaced by its one-line
    error (the root-cause rank printed its traceback to stderr once; every traceback is also in the
    ``error_file`` listed). The root cause is the first failure that is not a consequence of another
    (a rank torchrun stopped, or a collective that lost its peer), so a rank that timed out in the
    same second as the real failure is not blamed. ``last_line`` names that rank and its error and is
    meant to be printed last.
    """
    import copy

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    failures = sorted(err.failures.items(), key=lambda rf: rf[1].timestamp)  # stable: rank order on ties
    root_rank, root = next(((r, f) for r, f in failures if not _is_consequence(f)), failures[0])
    short = {}
    for rank, failure in [(root_rank, root)] + [(r, f) for r, f in failures if r != root_rank]:
        f = copy.copy(failure)
        f.message = _one_line(failure)
        short[rank] = f
    short[root_rank].timestamp = min(f.timestamp for f in short.values())  # shown as the root cause
    summary = ChildFailedError(err.name, short).format_msg()
    consequence = _is_consequence(root)
    if isinstance(root.message, dict) and _has_error_file(root):
        from raggedfsdp.train.worker import _ONE_LINE

        above = "" if consequence or _one_line(root).split(":")[0] in _ONE_LINE else "above and "
        where = f"traceback {above}in {root.error_file}"
    else:
        where = "see its output above"
    last_line = f"raggedfsdp train: [rank {root_rank}/{world_size}] error: {_one_line(root)} ({where})"
    if consequence:
        last_line += "; this usually means another rank failed or hung first"
    return summary, last_line


def run_plot(args: argparse.Namespace) -> int:
    from raggedfsdp.train.plot import plot_metrics

    try:
        out = plot_metrics(args.metrics, args.output, title=args.title)
    except (ImportError, ValueError, FileNotFoundError) as e:
        print(f"raggedfsdp plot: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0
