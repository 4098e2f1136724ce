"""Layer 2: DBuffer, the flat per-unit storage behind zero-copy all-gather / reduce-scatter."""

from raggedfsdp.buffer.dbuffer import DBuffer, alloc_storage, free_storage

__all__ = ["DBuffer", "alloc_storage", "free_storage"]
