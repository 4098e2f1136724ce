"""Layer 3: ``fully_shard`` (torch 2.13 FSDP2 API) on RaggedShard + planner + DBuffer.

Every name of torch 2.13's FSDP2 API (``torch.distributed.fsdp.__all__``'s FSDP2 part and
``torch.distributed.fsdp._fully_shard._fully_shard.__all__``) is here; the policies,
``DataParallelMeshDims``, ``register_fsdp_forward_method`` and ``disable_fsdp_module_new_init`` are
torch's own (they work on raggedfsdp's modules), the rest raggedfsdp's (tests/unit/test_fsdp_api_surface.py).
"""

import torch.distributed.fsdp as _torch_fsdp
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    register_fsdp_forward_method,
)
from torch.distributed.fsdp._fully_shard._fully_shard import disable_fsdp_module_new_init

from raggedfsdp.buffer.quant_gather import QuantizedAllGatherPolicy
from raggedfsdp.fsdp._common import RuntimeOptions
from raggedfsdp.fsdp._compile import eager_hook
from raggedfsdp.fsdp._fully_shard import FSDPModule, UnshardHandle, fully_shard, get_cls_to_fsdp_cls
from raggedfsdp.fsdp._module import set_runtime_options, share_comm_ctx
from raggedfsdp.fsdp._report import FSDPUnit, fsdp_units
from raggedfsdp.fsdp._switch import TorchPatch, patch_torch, torch_is_patched, unpatch_torch

# torch >= 2.13 (``dp_mesh_dims``); torch 2.11 / 2.12 have no DataParallelMeshDims (and no dp_mesh_dims)
_SINCE_2_13 = ["DataParallelMeshDims"] if hasattr(_torch_fsdp, "DataParallelMeshDims") else []
if _SINCE_2_13:
    DataParallelMeshDims = _torch_fsdp.DataParallelMeshDims

__all__ = [
    *_SINCE_2_13,
    "CPUOffloadPolicy",
    "FSDPModule",
    "FSDPUnit",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "QuantizedAllGatherPolicy",
    "RuntimeOptions",
    "TorchPatch",
    "UnshardHandle",
    "disable_fsdp_module_new_init",
    "eager_hook",
    "fsdp_units",
    "fully_shard",
    "get_cls_to_fsdp_cls",
    "patch_torch",
    "register_fsdp_forward_method",
    "set_runtime_options",
    "share_comm_ctx",
    "torch_is_patched",
    "unpatch_torch",
]
