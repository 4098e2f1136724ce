"""The process environment of a launched rank: cores per rank."""

from __future__ import annotations

import os

__all__ = ["available_cpus", "set_threads"]


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
