"""Layer 0: the RaggedShard DTensor placement."""

from raggedfsdp.placement._implicit import (
    implicit_redistribution_count,
    implicit_redistributions_by_op,
    strict_ops,
)
from raggedfsdp.placement._ops import RaggedPartial, RaggedShardOpError
from raggedfsdp.placement._slices import slice_placements, stack_ragged, unbind_ragged
from raggedfsdp.placement.ragged_shard import RaggedShard

__all__ = [
    "RaggedPartial",
    "RaggedShard",
    "RaggedShardOpError",
    "implicit_redistribution_count",
    "implicit_redistributions_by_op",
    "slice_placements",
    "stack_ragged",
    "strict_ops",
    "unbind_ragged",
]
