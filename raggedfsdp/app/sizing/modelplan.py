"""Plan every FSDP unit of a whole model from shapes alone, and compare with FSDP1/FSDP2 padding.

Units with identical ``(shape, granularity)`` lists get identical plans, so each distinct unit
signature is planned once (a 95-layer MoE has four distinct units). Sizes are in elements.

Baselines (same units, same world size ``m``):

- **FSDP2** (``fully_shard``): every parameter padded on dim 0 to ``ceil(d0/m)*m`` rows, no
  collective alignment (``fsdp2-internals.md``). Block-unaware: it ignores the granularity.
- **FSDP2 with blocks**: what even ``Shard(0)`` chunks need to keep the same blocks whole: dim 0
  padded to a multiple of ``m * k0`` rows, ``k0 = lcm(g, slice) / slice`` dim-0 slices per block.
- **FSDP1 / DeepSpeed ZeRO-3**: one flat element-wise buffer padded to ``m * ceil(E/m)`` rounded
  up to ``align`` -- also the planner's lower bound (:attr:`Layout.lower_bound`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from raggedfsdp.app.sizing.archs import Unit
from raggedfsdp.planner.layout import Layout
from raggedfsdp.planner.planner import plan_layout, shard_size_lower_bound
from raggedfsdp.planner.policy import (
    DEFAULT_BLOCK,
    BlockSpec,
    Policy,
    granularity_for,
    granularity_for_local,
    make_policy,
)


def fsdp2_padding(shapes: Sequence[Sequence[int]], world_size: int) -> int:
    """Padding elements of FSDP2 per-parameter ``Shard(0)``: ``sum (ceil(d0/m)*m - d0) * row``. O(n)."""
    m = world_size
    pad = 0
    for s in shapes:
        s = tuple(s) or (1,)
        pad += (-(-s[0] // m) * m - s[0]) * math.prod(s[1:])
    return pad


def fsdp2_block_padding(
    shapes: Sequence[Sequence[int]], granularities: Sequence[int], world_size: int
) -> int:
    """Padding of even ``Shard(0)`` chunks that never cut a block: dim 0 to a multiple of ``m*k0``."""
    pad = 0
    for s, g in zip(shapes, granularities):
        s = tuple(s) or (1,)
        sl = math.prod(s[1:])
        if s[0] == 0 or sl == 0:
            continue
        step = world_size * (math.lcm(g, sl) // sl)
        pad += (-(-s[0] // step) * step - s[0]) * sl
    return pad


def fsdp1_padding(numel: int, world_size: int, align: int = 1) -> int:
    """Padding elements of a flat element-wise buffer with shards of ``ceil(E/m)`` rounded up to ``align``."""
    per = -(-max(-(-numel // world_size), 1) // align) * align
    return world_size * per - numel


def gcd_fallback(spec: BlockSpec | str) -> Policy:
    """Policy: ``spec`` for matrices, shrunk to the largest row count that tiles the tensor.

    ``rows:K`` / ``tile:KxC`` on a tensor whose row count is not a multiple of ``K`` uses
    ``gcd(K, rows)`` rows instead of raising (e.g. 128-row blocks on GPT-OSS's 2,880-row ``o_proj``
    become 64-row blocks). Vectors get element granularity. For sweeps only; the library default
    raises.
    """
    spec = BlockSpec.parse(spec)

    def policy(shape: Any) -> BlockSpec:
        shape = tuple(getattr(shape, "shape", shape))
        if len(shape) < 2:
            return BlockSpec("element")
        if spec.kind == "rows":
            k = math.gcd(spec.rows, math.prod(shape[:-1]))
            return BlockSpec("rows", k) if k != spec.rows else spec
        if spec.kind == "tile":
            k = math.gcd(spec.rows, shape[-2])
            return BlockSpec("tile", k, spec.cols) if k != spec.rows else spec
        return spec

    return policy


class BlockError(ValueError):
    """A tensor's block (granularity) does not fit it, e.g. ``rows:K`` with ``K`` not dividing its rows.

    ``block`` is the :class:`BlockSpec` that failed (the CLI suggests ``--on-indivisible gcd`` for
    ``rows``/``tile`` blocks).
    """

    def __init__(self, message: str, *, block: BlockSpec) -> None:
        super().__init__(message)
        self.block = block


@dataclass(frozen=True)
class UnitPlan:
    """One unit's plan plus the FSDP2 baseline for it."""

    name: str
    layout: Layout
    dims: tuple[tuple[int, ...], ...]
    blocks: tuple[str, ...]
    fsdp2_padding: int
    fsdp1_padding: int
    fsdp2_block_padding: int
    bound_shard_size: int


@dataclass(frozen=True)
class ModelPlan:
    """All unit plans of a model; ratios are padding / (padded buffer elements), summed over units."""

    world_size: int
    align: int
    order: str
    units: tuple[UnitPlan, ...]
    distinct_units: int
    plan_seconds: float

    @property
    def numel(self) -> int:
        return sum(u.layout.total_numel for u in self.units)

    @property
    def padding(self) -> int:
        return sum(u.layout.padding for u in self.units)

    def _ratio(self, pad: int) -> float:
        return pad / (self.numel + pad) if self.numel + pad else 0.0

    @property
    def padding_ratio(self) -> float:
        return self._ratio(self.padding)

    @property
    def fsdp2_padding_ratio(self) -> float:
        return self._ratio(sum(u.fsdp2_padding for u in self.units))

    @property
    def fsdp1_padding_ratio(self) -> float:
        return self._ratio(sum(u.fsdp1_padding for u in self.units))

    @property
    def fsdp2_block_padding_ratio(self) -> float:
        return self._ratio(sum(u.fsdp2_block_padding for u in self.units))

    @property
    def bound_padding_ratio(self) -> float:
        """Padding at :func:`shard_size_lower_bound` per unit: no order can do better."""
        m = self.world_size
        return self._ratio(sum(m * u.bound_shard_size - u.layout.total_numel for u in self.units))

    @property
    def max_unit_padding_ratio(self) -> float:
        return max((u.layout.padding_ratio for u in self.units), default=0.0)

    def to_dict(self, *, tensors: bool = True) -> dict[str, Any]:
        """One JSON-ready object; per unit ``name``, ``shard_size`` and ``tensors`` (name, shape,
        granularity, offset, dims) -- enough to re-check every invariant from the output alone."""
        units = []
        for u in self.units:
            lay = u.layout
            d: dict[str, Any] = {
                "name": u.name,
                "shard_size": lay.shard_size,
                "numel": lay.total_numel,
                "padding": lay.padding,
                "padding_ratio": lay.padding_ratio,
                "fsdp2_padding": u.fsdp2_padding,
                "fsdp1_padding": u.fsdp1_padding,
                "fsdp2_block_padding": u.fsdp2_block_padding,
                "bound_shard_size": u.bound_shard_size,
                "order": list(lay.order),
            }
            if tensors:
                d["tensors"] = [
                    {
                        "name": lay.names[i],
                        "shape": list(lay.shapes[i]),
                        "granularity": lay.granularities[i],
                        "offset": lay.offsets[i],
                        "dims": list(u.dims[i]),
                        "block": u.blocks[i],
                    }
                    for i in range(len(lay.numels))
                ]
            units.append(d)
        return {
            "world_size": self.world_size,
            "align": self.align,
            "order": self.order,
            "num_params": self.numel,
            "num_units": len(self.units),
            "distinct_units": self.distinct_units,
            "padding": self.padding,
            "padding_ratio": self.padding_ratio,
            "fsdp2_padding_ratio": self.fsdp2_padding_ratio,
            "fsdp1_padding_ratio": self.fsdp1_padding_ratio,
            "fsdp2_block_padding_ratio": self.fsdp2_block_padding_ratio,
            "bound_padding_ratio": self.bound_padding_ratio,
            "max_unit_padding_ratio": self.max_unit_padding_ratio,
            "plan_seconds": self.plan_seconds,
            "units": units,
        }


def as_policy(policy: Policy | BlockSpec | str | None) -> Policy:
    """A policy callable: ``None`` means ``DEFAULT_BLOCK`` (element, fully_shard's default); a block spec
    applies to every matrix (vectors: element)."""
    if policy is None or isinstance(policy, (str, BlockSpec)):
        return make_policy(policy or DEFAULT_BLOCK)
    return policy


def resolve_unit_blocks(
    unit: Unit, pol: Policy, cache: dict | None = None
) -> tuple[list[int], list[tuple[int, ...]], list[str]]:
    """Per tensor of ``unit``: granularity (elements), ``RaggedShard`` dims and the block spec text.

    ``cache`` (shape -> result) may be shared between calls with the same policy.

    Raises:
        BlockError: a block that does not fit a tensor (message names the unit and the tensor).
    """
    cache = {} if cache is None else cache
    grans, dims, blocks = [], [], []
    globals_ = unit.global_shapes or tuple(s for _, s in unit.params)
    for (name, s), gs in zip(unit.params, globals_, strict=True):
        key = s if gs == s else (s, gs)
        r = cache.get(key)
        if r is None:
            got = pol(gs)  # a block spec is defined on the global tensor (TP: Note [FSDP x TP])
            blk = DEFAULT_BLOCK if got is None else BlockSpec.parse(got)
            try:
                if gs == s:
                    g, d = granularity_for(s, blk, name=name)
                elif blk.kind == "row":  # fully_shard's Shard(0) under TP: one row of the TP-local tensor
                    g, d = granularity_for(s, blk, name=name)
                else:  # no TP boundary may cut the block either
                    g, d = granularity_for_local(gs, s, blk, name=name)
            except ValueError as exc:
                raise BlockError(f"unit {unit.name!r}: {exc}", block=blk) from None
            r = cache[key] = (g, d, str(blk))
        grans.append(r[0])
        dims.append(r[1])
        blocks.append(r[2])
    return grans, dims, blocks


def plan_model(
    units: Sequence[Unit],
    world_size: int,
    *,
    policy: Policy | BlockSpec | str | None = None,
    align: int = 1,
    order: str = "default",
) -> ModelPlan:
    """Plan every unit; identical units are planned once. ``plan_seconds`` covers the policy, the
    per-signature planning and the baselines (not building the shape tables).

    ``policy``: an ``orig_param_policy`` called with each *shape* tuple, or a block spec applied
    to every matrix (vectors: element). Cost: one :func:`plan_layout` per distinct unit.
    """
    pol = as_policy(policy)
    t0 = time.perf_counter()
    gran_cache: dict[tuple, tuple[int, tuple[int, ...], str]] = {}
    plan_cache: dict[tuple, tuple] = {}
    out = []
    for unit in units:
        shapes = tuple(s for _, s in unit.params)
        hit = plan_cache.get((shapes, unit.global_shapes))
        names = tuple(n for n, _ in unit.params)
        if hit is None:
            grans, dims, blocks = resolve_unit_blocks(unit, pol, gran_cache)
            numels = [math.prod(s) for s in shapes]
            lay = plan_layout(numels, grans, world_size, align=align, order=order, shapes=shapes, names=names)
            f2 = fsdp2_padding(shapes, world_size)
            f1 = fsdp1_padding(sum(numels), world_size, align)
            f2b = fsdp2_block_padding(shapes, grans, world_size)
            bound = shard_size_lower_bound(numels, grans, world_size, align)
            hit = plan_cache[shapes, unit.global_shapes] = (
                lay,
                f2,
                f1,
                tuple(dims),
                tuple(blocks),
                f2b,
                bound,
            )
            lay_u = lay
        else:
            lay_u = replace(hit[0], names=names)
        out.append(UnitPlan(unit.name, lay_u, hit[3], hit[4], hit[1], hit[2], hit[5], hit[6]))
    secs = time.perf_counter() - t0
    order_name = order if isinstance(order, str) else "explicit"
    return ModelPlan(world_size, align, order_name, tuple(out), len(plan_cache), secs)
