"""Layer 1: structure-aware planning of a unit's tensors into one balanced flat buffer.

Public API: :func:`plan_layout` (exact minimum shard size for a fixed order), :class:`Layout` and
:func:`validate_layout` (pure data + invariant check). All sizes are in elements.
"""

from raggedfsdp.planner.layout import Layout, validate_layout
from raggedfsdp.planner.planner import plan_layout

__all__ = ["Layout", "plan_layout", "validate_layout"]
