"""Layer 2: DBuffer, the flat per-unit storage behind zero-copy all-gather / reduce-scatter, and its
lifecycle."""

from raggedfsdp.buffer.dbuffer import DBuffer, alloc_storage, free_storage
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
    "all_reduce_",
    "alloc_storage",
    "debug_enabled",
    "free_storage",
    "set_debug",
]
