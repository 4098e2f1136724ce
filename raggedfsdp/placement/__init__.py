"""Layer 0: the RaggedShard DTensor placement."""

from raggedfsdp.placement._ops import RaggedShardOpError
from raggedfsdp.placement.ragged_shard import RaggedShard

__all__ = ["RaggedShard", "RaggedShardOpError"]
