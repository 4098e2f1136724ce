"""Layer 2: DBuffer, the flat per-unit storage behind zero-copy all-gather / reduce-scatter, and its
lifecycle."""

from raggedfsdp.buffer.dbuffer import DBuffer, alloc_storage, free_storage
from raggedfsdp.buffer.dbuffer import _all_gather_single as all_gather_single
from raggedfsdp.buffer.dbuffer import _reduce_scatter_single as reduce_scatter_single
from raggedfsdp.buffer.lifecycle import UnitBuffers, all_reduce_
from raggedfsdp.buffer.streams import (
    BufferLifetimeError,
    CollectiveError,
    CommHandle,
    debug_enabled,
    set_debug,
)

__all__ = [
    "BufferLifetimeError",
    "CollectiveError",
    "CommHandle",
    "DBuffer",
    "UnitBuffers",
    "all_gather_single",
    "all_reduce_",
    "alloc_storage",
    "debug_enabled",
    "free_storage",
    "reduce_scatter_single",
    "set_debug",
]
