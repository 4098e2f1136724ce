"""Layer 1: structure-aware planning of a unit's tensors into one balanced flat buffer.

Public API (all sizes in elements):

- :func:`plan_layout` -- exact minimum shard size for a fixed (or the best named) tensor order;
- :class:`Layout`, :func:`validate_layout` -- the plan and an independent invariant check;
- :class:`GradLayout`, :func:`plan_grad_layout` -- the compacted gradient shards of a unit with frozen
tensors;
- :func:`plan_segments`, :func:`segment_share` -- a unit planned in segments, each sharded evenly on
  its own (the trainable tensors of a unit that mixes frozen and trainable ones);
- :class:`BlockSpec`, :func:`granularity_for`, :func:`make_policy`, :func:`plan_params` -- the
  per-parameter granularity policy (``orig_param_policy``) and the ``RaggedShard`` dims it implies.

Pure Python + stdlib (``torch`` only to recognise tensors); no process group anywhere.
"""

from raggedfsdp.planner.grad_layout import GradLayout, plan_grad_layout
from raggedfsdp.planner.layout import Layout, dim0_shard_padding, padding_vs_fsdp2, validate_layout
from raggedfsdp.planner.planner import plan_layout
from raggedfsdp.planner.segments import plan_segments, segment_share
from raggedfsdp.planner.policy import (
    DEFAULT_BLOCK,
    BlockSpec,
    ParamBlock,
    Policy,
    granularity_for,
    granularity_for_local,
    make_policy,
    plan_params,
    ragged_dims,
    resolve_blocks,
)

__all__ = [
    "DEFAULT_BLOCK",
    "BlockSpec",
    "GradLayout",
    "Layout",
    "ParamBlock",
    "Policy",
    "dim0_shard_padding",
    "granularity_for",
    "granularity_for_local",
    "make_policy",
    "padding_vs_fsdp2",
    "plan_grad_layout",
    "plan_layout",
    "plan_params",
    "plan_segments",
    "ragged_dims",
    "resolve_blocks",
    "segment_share",
    "validate_layout",
]
