"""Layer 1: structure-aware planning of a unit's tensors into one balanced flat buffer."""

from raggedfsdp.planner.layout import Layout
from raggedfsdp.planner.planner import plan_layout

__all__ = ["Layout", "plan_layout"]
