"""Per-rank entry point of ``raggedfsdp train``.

Run it under torchrun (this is what ``raggedfsdp train --nproc N`` does)::

    torchrun --standalone --nproc_per_node 2 -m raggedfsdp.app.launch.worker --config configs/tiny_cpu.toml

or as one process (world size 1, no torchrun needed)::

    python -m raggedfsdp.app.launch.worker --steps 50

Rank, world size and the rendezvous come from torchrun's environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``); without them the worker is
rank 0 of 1. CPU runs use gloo, CUDA runs NCCL.

Failures: an exception on any rank is written, with its traceback and the ranks it blames, to
torchrun's error file (``launch.failures.record_failure``; the launcher names the root-cause rank
from them), and an unexpected one's traceback is printed here once (each line tagged ``[rank R/W]``).
Under ``raggedfsdp train`` the launcher prints the one-line error (``[rank R/W] error: Type: message``)
of the root cause only, last; under a bare torchrun each failing rank prints its own. A collective
that failed because a peer went away (closed connection, timeout) prints no traceback (it stays in
the error file). The worker then exits with code 1. torchrun stops the
other ranks, so a crash on one rank never leaves the others hanging in a collective;
``job.pg_timeout_s`` bounds the wait for a rank that hangs without exiting.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from datetime import timedelta

from torch.distributed.elastic.multiprocessing.errors import record

from raggedfsdp.app.launch.env import set_threads
from raggedfsdp.app.launch.failures import REPORTED_ENV, record_failure, report_rank_failure
from raggedfsdp.app.train import run_dir
from raggedfsdp.app.train.config import add_config_args, load_config, overrides_from_args


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog or "python -m raggedfsdp.app.launch.worker",
        description="Train a small LLaMA-style model with FSDP (one process per rank; launch with torchrun).",
    )
    add_config_args(parser)
    return parser


@record
def main(argv: list[str] | None = None) -> int:
    from raggedfsdp.app.train.watchdog import set_parent_death_signal

    set_parent_death_signal()  # die with the launcher (no orphans); see train/watchdog.py
    parser = build_parser()
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    tag = f"[rank {rank}/{world_size}]"
    from raggedfsdp.app.train.trainer import Interrupted
    from raggedfsdp.app.train.watchdog import Interrupts

    # first thing: a signal during the start-up (checks, rendezvous, model build) stops every rank at
    # step 1's boundary, naming this rank, instead of killing it mid-setup
    interrupts = Interrupts(tag, announce=rank == 0).install()
    try:
        cfg = load_config(args.config, overrides_from_args(args), validate=False)
        run = run_dir.prepare(cfg, world_size, rank=rank, check_model=True)  # validated once per process
        for note in run.notes:  # e.g. a run.json recovered from the checkpoints' manifests
            print(f"{parser.prog}: note: {note}", file=sys.stderr, flush=True)
    except (ValueError, OSError) as e:  # a config error (or an unwritable --out): one line, no usage text
        # Under `raggedfsdp train` the launcher checked all this before the launch, so it changed since
        # (e.g. a data file truncated): recorded, for the launcher's last line.
        reported = os.environ.get(REPORTED_ENV) == "1"
        if reported and type(e).__name__ == "DataError":
            e = type(e)(f"{e} (found by rank {rank} after the launch: changed after the pre-launch check?)")
        record_failure(e, (rank,))  # no-op without torchrun
        if not reported:
            print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"{tag} %(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
    try:
        return _run(cfg, run, rank, world_size, local_rank, local_world_size, interrupts)
    except Interrupted as e:  # every rank, at the same step boundary: one line (rank 0), 128 + signum
        record_failure(e, e.culprits)  # the signalled ranks, for the launcher's last line (no-op alone)
        if rank == 0:
            print(f"{tag} {e}", file=sys.stderr, flush=True)
        return 128 + e.signum
    except Exception as e:  # noqa: BLE001 (recorded, reported, exit code 1)
        return report_rank_failure(e, rank, world_size, tag)


def _run(
    cfg, run, rank: int, world_size: int, local_rank: int, local_world_size: int, interrupts=None
) -> int:
    import torch
    import torch.distributed as dist

    from raggedfsdp.app.train.trainer import Trainer

    set_threads(local_world_size)
    use_cuda = cfg.job.device == "cuda" or (cfg.job.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    timeout = timedelta(seconds=cfg.job.pg_timeout_s)
    if "RANK" in os.environ:  # torchrun (env:// rendezvous)
        dist.init_process_group(backend, timeout=timeout)
    else:  # plain `python -m`: a 1-rank group, same code path as N ranks
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    from raggedfsdp.app.train.watchdog import Watchdog, heartbeat_store

    watchdog = Watchdog(
        rank=rank,
        world_size=world_size,
        tag=f"[rank {rank}/{world_size}]",
        timeout_s=cfg.job.hang_timeout_s,
        pg_timeout_s=cfg.job.pg_timeout_s,
        interrupts=interrupts,
        store=heartbeat_store() if world_size > 1 else None,
    ).start()
    from raggedfsdp.teardown import shutdown_process_group
    from raggedfsdp.app.train.trainer import Interrupted

    ok = False
    try:
        try:
            Trainer(cfg, device=device, watchdog=watchdog, interrupts=interrupts, run=run).train()
        except Interrupted:  # raised on every rank at the same step: still tear down together
            ok = True
            raise
        except BaseException:
            if interrupts is not None:  # a failed rank: torchrun's SIGTERM may end it at once now
                interrupts.uninstall()
            raise
        ok = True
    finally:
        watchdog.stop()
        # barrier + store check-in: no rank closes its sockets while a peer is still in a collective.
        # Not when the launcher is gone (kill -9): the store lived in it, and each store call would
        # print a 13-frame C++ stack ("recvValue failed ... Connection was likely closed").
        shutdown_process_group(synchronize=ok and not watchdog.launcher_gone())
    return 0


if __name__ == "__main__":
    sys.exit(main())
