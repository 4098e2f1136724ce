"""raggedfsdp: fully sharded data parallel on RaggedShard DTensors (veScale-FSDP design).

Rooms (imports go one way, enforced by tests/unit/test_layering.py; docs/architecture.md maps them):
placement -> planner -> buffer -> fsdp -> optim / checkpoint -> models -> train / launch ->
sizing / bench -> commands / cli.

Importing the package imports nothing else and changes nothing in torch: the public names below
are loaded on first use (PEP 562), the DTensor patches of ``raggedfsdp.placement._patches`` are
installed by the first ``RaggedShard(...)`` of the process (every raggedfsdp ``fully_shard`` makes
one), so the planner, ``raggedfsdp plan`` and torch's own ``fully_shard`` run on stock torch, and
``raggedfsdp --help`` does not import torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_PUBLIC = {
    "RaggedShard": "raggedfsdp.placement",
    "RaggedShardOpError": "raggedfsdp.placement",
    "strict_ops": "raggedfsdp.placement",
    "implicit_redistribution_count": "raggedfsdp.placement",
    "Layout": "raggedfsdp.planner",
    "plan_layout": "raggedfsdp.planner",
    "fully_shard": "raggedfsdp.fsdp",
    "FSDPModule": "raggedfsdp.fsdp",
    "UnshardHandle": "raggedfsdp.fsdp",
    "MixedPrecisionPolicy": "raggedfsdp.fsdp",
    "OffloadPolicy": "raggedfsdp.fsdp",
    "CPUOffloadPolicy": "raggedfsdp.fsdp",
    "clip_grad_norm_": "raggedfsdp.optim.clip",
    "get_total_norm": "raggedfsdp.optim.clip",
}

__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'raggedfsdp' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
