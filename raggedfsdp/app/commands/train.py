"""``raggedfsdp train``: validate, prepare the run once, launch the ranks through torchrun.

``raggedfsdp train [--nproc N] [flags]`` validates the configuration, then starts N worker processes
with torch's own launcher (``torch.distributed.run``, i.e. torchrun ``--standalone``) running
``raggedfsdp.app.launch.worker`` with the same flags. It is equivalent to::

    OMP_NUM_THREADS=<cores/N> torchrun --standalone --nproc_per_node N -m raggedfsdp.app.launch.worker [flags]

Several nodes: one ``raggedfsdp train --nnodes N --node-rank R --rdzv-endpoint HOST:PORT`` per node
(torchrun's static rendezvous: ``--nnodes N --node-rank R --rdzv-backend static``), ``--out`` on a
file system all nodes share: node 0's launcher checks and locks it, every rank writes its own
checkpoint shards, rank 0 the manifest. Under SLURM the node flags come from its environment.
Use torchrun directly for other launcher options.

Before launching, the config is validated, including the data source (missing, empty, too small for
``seq_len``) and the batch split over ``--nproc``: such errors are one line and exit code 2. When a
rank fails, the job ends with one line naming the root-cause rank and its error (exit code 1),
``raggedfsdp train: [rank R/W] error: Type: message (every rank's report: OUT/failure.log)``; above it
only the traceback of an unexpected error (once, lines tagged ``[rank R/W]``) or a hung rank's stack.
``OUT/failure.log`` holds torchrun's rank-tagged failure table and every rank's traceback,
``OUT/launcher.log`` torchrun's own log lines.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from raggedfsdp.app.train.config import add_config_args, load_config, override_argv, overrides_from_args

_TRAIN_EPILOG = """\
examples:
  raggedfsdp train                                  # default: 2 CPU ranks, stdlib corpus, tiny model
  raggedfsdp train --steps 50 --model debug --out outputs/debug
  raggedfsdp train --config configs/tiny_cpu.toml --backend torch --lr 2e-3
  raggedfsdp train --data raggedfsdp                # any text file or folder (here: this repo's sources)
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

several nodes (one launcher per node, the same flags, --out on a shared file system):
  raggedfsdp train --nnodes 2 --node-rank 0 --rdzv-endpoint node0:29500 --out /shared/run   # on node0
  raggedfsdp train --nnodes 2 --node-rank 1 --rdzv-endpoint node0:29500 --out /shared/run   # on node1
  srun --nodes 2 --ntasks-per-node 1 raggedfsdp train --nproc 8 --out /shared/run   # SLURM fills them in

faults (see README; test-only injection: RAGGEDFSDP_FAULT=nan@step3:rank1, raggedfsdp/app/train/faults.py):
  --training.on_nonfinite stop|skip   NaN/Inf loss or gradient on any rank (default: stop, save nothing)
  --job.hang_timeout_s S              name a rank stuck outside a collective after S s (default 60; adapts)
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
            "Validate the config, then launch N ranks of raggedfsdp.app.launch.worker with "
            "torchrun\n(torch.distributed.run --standalone). Same as:\n  OMP_NUM_THREADS=<cores/N> torchrun "
            "--standalone --nproc_per_node N \\\n      -m raggedfsdp.app.launch.worker [flags]"
        ),
        epilog=_TRAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--nproc", type=int, default=2, metavar="N", help="ranks (processes) to launch (default: 2)"
    )
    nodes = p.add_argument_group(
        "several nodes",
        "run one `raggedfsdp train` per node with the same flags and --out on a shared file system; "
        "rank = node_rank x nproc + local rank (torchrun's static rendezvous). Under SLURM "
        "(srun, one task per node) --nnodes/--node-rank/--rdzv-id come from SLURM_NNODES/SLURM_NODEID/"
        "SLURM_JOB_ID and the endpoint from MASTER_ADDR:MASTER_PORT or the first host of the node list",
    )
    nodes.add_argument("--nnodes", type=int, default=None, metavar="N", help="nodes in the job (default: 1)")
    nodes.add_argument(
        "--node-rank", type=int, default=None, metavar="R", help="this node, 0..N-1 (default: 0)"
    )
    nodes.add_argument(
        "--rdzv-endpoint",
        default=None,
        metavar="HOST:PORT",
        help="node 0's address, the same on every node (required with --nnodes > 1)",
    )
    nodes.add_argument("--rdzv-id", default=None, metavar="ID", help="job id shared by the nodes")
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
    cfg = prepared = None
    try:
        if args.nproc < 1:
            raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
        from raggedfsdp.app.launch.env import node_options

        node = node_options(getattr(args, "nnodes", None), getattr(args, "node_rank", None),
                            getattr(args, "rdzv_endpoint", None), getattr(args, "rdzv_id", None))  # fmt: skip
        node.check_endpoint()  # a host that does not resolve, node 0's port in use: one line, now
        cfg = load_config(args.config, overrides, validate=False)
        from raggedfsdp.app.train import run_dir

        if node.nnodes > 1 and not cfg.job.out:
            raise ValueError(
                f"--nnodes {node.nnodes} needs --out: one folder on a file system every node shares"
            )
        # A bad config or --data fails here, not after the launch on every rank; so does a missing or
        # corrupt --resume path (verified here, once for the whole job), or a taken --out. With several
        # nodes, node 0's launcher checks and locks --out; the others only validate.
        reproduce = getattr(args, "reproduce_batch", None)
        world = args.nproc * node.nnodes
        prepared = run_dir.prepare(cfg, world, rank=node.node_rank, check_out=not reproduce, check_model=True)
        for note in prepared.notes:  # e.g. a run.json recovered from the checkpoints' manifests
            print(f"raggedfsdp train: note: {note}", file=sys.stderr, flush=True)
        overrides["job.out"] = cfg.job.out  # the default --out (a fresh folder) is chosen once, here
        if reproduce:
            return _reproduce(cfg, reproduce, args.nproc)
        run_dir.hand_to_workers(cfg, prepared)  # the ranks neither re-lock OUT nor re-hash --resume
        from raggedfsdp.app.train.data_identity import REFERENCE_ENV, write_reference

        node_tag = "" if node.nnodes == 1 else f".node{node.node_rank}"
        # the corpus the ranks must read (each compares its own with it at the start)
        write_reference(cfg, Path(cfg.job.out) / f"data_fingerprint{node_tag}.json")
    except ValueError as e:
        print(f"raggedfsdp train: error: {e}", file=sys.stderr)
        return _refused(prepared)
    except OSError as e:  # --out not writable (permission, read-only or full disk): before any launch
        what = f"cannot use --out {cfg.job.out}" if cfg is not None else "cannot read the configuration"
        print(f"raggedfsdp train: error: {what}: {e.strerror or e}: {str(e.filename)!r} (choose a path this "
              "user can write)", file=sys.stderr)  # fmt: skip
        return _refused(prepared)
    if "OMP_NUM_THREADS" not in os.environ:  # share the (idle) cores between the local ranks
        from raggedfsdp.app.launch.env import threads_per_rank

        os.environ["OMP_NUM_THREADS"] = str(threads_per_rank(args.nproc))

    from raggedfsdp.app.launch.env import rdzv_timeout_s

    torchrun_argv = [
        *node.torchrun_argv(args.nproc),
        "--module",
        "raggedfsdp.app.launch.worker",
        *override_argv(args.config, overrides),
    ]
    where = (
        "--standalone"
        if node.nnodes == 1
        else (
            f"node {node.node_rank}/{node.nnodes}, ranks {node.node_rank * args.nproc}-"
            f"{(node.node_rank + 1) * args.nproc - 1} of {world}, rendezvous {node.endpoint}; waiting up to "
            f"{rdzv_timeout_s()} s for the other nodes"
        )
    )
    print(
        f"raggedfsdp train: launching {args.nproc} rank(s) with torchrun {where} "
        f"(OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, backend {cfg.fsdp.backend}) -> {cfg.job.out}",
        file=sys.stderr,
        flush=True,
    )
    # One last line per failed job (launch/launcher.py): the ranks print no one-line error of their own
    # (the root cause's is printed there, last), torchrun's log lines go to OUT/launcher.log, its failure
    # table and every rank's traceback to OUT/failure.log.
    from raggedfsdp.app.launch.launcher import run_reported

    try:
        return run_reported(
            torchrun_argv,
            prog="raggedfsdp train",
            world_size=world,
            out_dir=cfg.job.out,
            tag=node_tag,
            on="" if node.nnodes == 1 else f" (node {node.node_rank} of {node.nnodes})",
            resume_hint=f"; resume with --resume auto --out {cfg.job.out}",
            rendezvous=None if node.nnodes == 1 else (node.endpoint, rdzv_timeout_s()),
        )
    finally:
        os.environ.pop(REFERENCE_ENV, None)  # a launcher called in-process leaves nothing behind
        if prepared.lock is not None:
            prepared.lock.release()


def _refused(prepared) -> int:
    """Exit code 2 before the launch, releasing ``OUT/.lock`` if this process took it."""
    if prepared is not None and prepared.lock is not None:
        prepared.lock.release()
    return 2


def _reproduce(cfg, text: str, nproc: int) -> int:
    """``--reproduce-batch ID``: print the samples of a batch id from an error line (no launch)."""
    from raggedfsdp.app.train.data import BatchSampler, load_corpus, reproduce_batch

    t = cfg.training
    corpus = load_corpus(cfg.data.path, max_bytes=cfg.data.max_bytes, val_fraction=cfg.data.val_fraction)
    sampler = BatchSampler(
        corpus.train, seq_len=t.seq_len, global_batch_size=t.global_batch_size, seed=cfg.job.seed
    )
    print(reproduce_batch(sampler, text))
    return 0
