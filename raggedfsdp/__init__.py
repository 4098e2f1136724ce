"""raggedfsdp: fully sharded data parallel on RaggedShard DTensors (veScale-FSDP design).

Two layers in one package (docs/architecture.md; imports go one way, enforced by
tests/unit/test_layering.py):

* the library, ``raggedfsdp.*``: placement -> planner -> buffer -> fsdp -> optim, plus
  ``teardown`` (``shutdown_process_group``). It needs torch alone and never imports the application;
* the application, ``raggedfsdp.app.*``: models -> checkpoint -> train / launch -> sizing / bench ->
  commands / cli (the ``raggedfsdp`` command). It uses the library's public names only.

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
    "DataParallelMeshDims": "raggedfsdp.fsdp",
    "register_fsdp_forward_method": "raggedfsdp.fsdp",
    "share_comm_ctx": "raggedfsdp.fsdp",
    "patch_torch": "raggedfsdp.fsdp",
    "unpatch_torch": "raggedfsdp.fsdp",
    "QuantizedAllGatherPolicy": "raggedfsdp.fsdp",
    "clip_grad_norm_": "raggedfsdp.optim.clip",
    "get_total_norm": "raggedfsdp.optim.clip",
    "shutdown_process_group": "raggedfsdp.teardown",
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
