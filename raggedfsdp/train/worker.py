"""Per-rank entry point of ``raggedfsdp train``.

Run it under torchrun (this is what ``raggedfsdp train --nproc N`` does)::

    torchrun --standalone --nproc_per_node 2 -m raggedfsdp.train.worker --config configs/tiny_cpu.toml

or as one process (world size 1, no torchrun needed)::

    python -m raggedfsdp.train.worker --steps 50

Rank, world size and the rendezvous come from torchrun's environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``); without them the worker is
rank 0 of 1. CPU runs use gloo, CUDA runs NCCL.

Failures: an exception on any rank is written, with its traceback, to torchrun's error file (so it
shows up, with the rank, in the launcher's failure summary), and printed here once: the traceback
(each line tagged ``[rank R/W]``), then one line ``[rank R/W] error: Type: message``. A collective
that failed because a peer went away (closed connection, timeout) prints only the one line plus a
hint; its traceback stays in the error file. The worker then exits with code 1. torchrun stops the
other ranks, so a crash on one rank never leaves the others hanging in a collective;
``job.pg_timeout_s`` bounds the wait for a rank that hangs without exiting.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from datetime import timedelta

from torch.distributed.elastic.multiprocessing.errors import get_error_handler, record

from raggedfsdp.train.config import add_config_args, load_config, overrides_from_args

# Substrings of collective errors that are consequences of a failure elsewhere.
_PEER_FAILURE_HINTS = ("closed by peer", "reset by peer", "Timed out", "Broken pipe", "Connection refused")


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog or "python -m raggedfsdp.train.worker",
        description="Train a small LLaMA-style model with FSDP (one process per rank; launch with torchrun).",
    )
    add_config_args(parser)
    return parser


def _available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _set_threads(local_world_size: int) -> int:
    """One share of the cores per local rank (respecting an explicit OMP_NUM_THREADS)."""
    import torch

    n = int(os.environ.get("OMP_NUM_THREADS") or 0) or max(1, _available_cpus() // local_world_size)
    torch.set_num_threads(n)
    return n


@record
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, overrides_from_args(args))
        cfg.check_data()
        if int(os.environ.get("RANK", "0")) == 0:
            from raggedfsdp.train.cli import _check_resume

            _check_resume(cfg)
    except ValueError as e:  # a config error, not a usage error: one line, no usage text
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2

    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    tag = f"[rank {rank}/{world_size}]"
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"{tag} %(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
    try:
        return _run(cfg, rank, world_size, local_rank, local_world_size)
    except Exception as e:  # noqa: BLE001 (recorded, reported, exit code 1)
        # The traceback goes to torchrun's error file (its summary names the rank) and, once, to
        # stderr; the one-line error comes last. A consequence of another rank's failure prints no
        # traceback. The launcher prints the root cause's line again at the very end.
        get_error_handler().record_exception(e)  # no-op without torchrun's TORCHELASTIC_ERROR_FILE
        peer = world_size > 1 and any(s in str(e) for s in _PEER_FAILURE_HINTS)
        msg = f"{tag} error: {type(e).__name__}: {e}"
        if peer:
            msg += (
                "\n"
                + f"{tag} (this usually means another rank failed or hung first; see the root cause below)"
            )
        else:
            tb = traceback.format_exc().rstrip("\n").splitlines()
            msg = "\n".join(f"{tag} {line}" for line in tb) + "\n" + msg
        print(msg, file=sys.stderr, flush=True)
        return 1


def _run(cfg, rank: int, world_size: int, local_rank: int, local_world_size: int) -> int:
    import torch
    import torch.distributed as dist

    from raggedfsdp.train.trainer import Trainer

    _set_threads(local_world_size)
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
    try:
        Trainer(cfg, device=device).train()
        dist.barrier()  # every rank is done with its collectives before any tears the group down
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
