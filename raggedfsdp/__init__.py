"""raggedfsdp: fully sharded data parallel on RaggedShard DTensors (veScale-FSDP design).

Layers (imports go one way, enforced by tests/unit/test_layering.py):
placement -> planner -> buffer -> fsdp -> optim/checkpoint -> models -> train/cli.

Importing the package changes nothing in torch: the DTensor patches of ``raggedfsdp._torch_patches``
are installed by the first ``RaggedShard(...)`` of the process (every raggedfsdp ``fully_shard``
makes one), so the planner, ``raggedfsdp plan`` and torch's own ``fully_shard`` run on stock torch.
"""

from raggedfsdp.placement import RaggedShard, RaggedShardOpError
from raggedfsdp.planner import Layout, plan_layout
from raggedfsdp.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    UnshardHandle,
    fully_shard,
)
from raggedfsdp.optim.clip import clip_grad_norm_, get_total_norm

__version__ = "0.1.0"

__all__ = [
    "RaggedShard",
    "RaggedShardOpError",
    "Layout",
    "plan_layout",
    "fully_shard",
    "clip_grad_norm_",
    "get_total_norm",
    "FSDPModule",
    "UnshardHandle",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "__version__",
]
