"""Layer 3: ``fully_shard`` (torch 2.13 FSDP2 API) on RaggedShard + planner + DBuffer."""

from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from raggedfsdp.buffer.quant_gather import QuantizedAllGatherPolicy
from raggedfsdp.fsdp._common import RuntimeOptions
from raggedfsdp.fsdp._fully_shard import FSDPModule, UnshardHandle, fully_shard
from raggedfsdp.fsdp._module import set_runtime_options
from raggedfsdp.fsdp._report import FSDPUnit, fsdp_units

__all__ = [
    "CPUOffloadPolicy",
    "FSDPModule",
    "FSDPUnit",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "QuantizedAllGatherPolicy",
    "RuntimeOptions",
    "UnshardHandle",
    "fsdp_units",
    "fully_shard",
    "set_runtime_options",
]
