"""The process environment of a launched rank: cores per rank and the default ``--out`` folder."""

from __future__ import annotations

import os
import time

__all__ = ["available_cpus", "default_out", "set_threads"]


def available_cpus() -> int:
    """The cores this process may run on (its affinity mask; ``os.cpu_count()`` off Linux)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def set_threads(local_world_size: int) -> int:
    """One share of the cores per local rank (respecting an explicit OMP_NUM_THREADS)."""
    import torch

    n = int(os.environ.get("OMP_NUM_THREADS") or 0) or max(1, available_cpus() // local_world_size)
    torch.set_num_threads(n)
    return n


def default_out() -> str:
    """A fresh ``outputs/run-...`` folder: a timestamp (launcher, single process) or, under a bare
    torchrun, its run id (the same on every rank)."""
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if run and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return os.path.join("outputs", f"run-torchrun-{run[:12]}")
    base = os.path.join("outputs", time.strftime("run-%Y%m%d-%H%M%S"))
    out, n = base, 1
    while os.path.exists(out):
        n += 1
        out = f"{base}-{n}"
    return out
