"""Per-rank entry point of ``raggedfsdp train``.

Run it under torchrun (this is what ``raggedfsdp train --nproc N`` does)::

    torchrun --standalone --nproc_per_node 2 -m raggedfsdp.train.worker --config configs/tiny_cpu.toml

or as one process (world size 1, no torchrun needed)::

    python -m raggedfsdp.train.worker --steps 50

Rank, world size and the rendezvous come from torchrun's environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``); without them the worker is
rank 0 of 1. CPU runs use gloo, CUDA runs NCCL.

Failures: ``main`` is wrapped in torchelastic's ``@record``, so an exception on any rank is written
to torchrun's error file and shows up, with the rank, in the launcher's failure summary; the
exception is also printed here with a ``[rank R/W]`` tag. torchrun then stops the other ranks, so a
crash on one rank never leaves the others hanging in a collective; ``job.pg_timeout_s`` bounds the
wait for a rank that hangs without exiting.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from datetime import timedelta

from torch.distributed.elastic.multiprocessing.errors import record

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
    except ValueError as e:
        parser.error(str(e))

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
    except Exception as e:
        # One tagged line per failing rank; the traceback follows (torch prefixes it with the rank
        # once the process group exists) and torchrun's summary names the first failing rank.
        msg = f"{tag} error: {type(e).__name__}: {e}"
        if world_size > 1 and any(s in str(e) for s in _PEER_FAILURE_HINTS):
            msg += (
                "\n"
                + f"{tag} (this usually means another rank failed or hung first; see the root cause below)"
            )
        print(msg, file=sys.stderr, flush=True)
        raise


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
