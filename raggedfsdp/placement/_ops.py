"""Sharding propagation for RaggedShard DTensors: what runs locally, what reduces, what raises.

A RaggedShard local tensor is a flat 1-D range of rows, so only ops whose result at an element
depends on that element alone (pointwise / foreach / like / copy ops on tensors of the SAME global
shape), plus full reductions (sum, p-norms), can run on the local pieces. Everything else (view,
reshape, t/transpose, permute, mm/matmul/linear, indexing/slicing, reductions over some dims,
random ops, ...) would be silently wrong and raises :class:`RaggedShardOpError` naming the op.

Mechanism (installed by ``raggedfsdp/_torch_patches.py``):

* :func:`guard_propagation` wraps ``ShardingPropagator.propagate_op_sharding(_non_cached)``: any op
  whose args carry a RaggedShard is classified and checked here BEFORE torch's strategies run.
* patch A, :func:`make_fill_placeholders`: torch's single-dim strategies (pointwise, foreach)
  are written with ``_ShardingPlaceholder(dim)`` and expanded only for ``Shard``/``_StridedShard``
  (torch/distributed/tensor/_ops/single_dim_strategy.py ``_fill_single_dim_strategy_placeholders``).
  The patch also expands all-dim-0 placeholder rules to each RaggedShard of the inputs, so such
  ops keep the placement and run locally (no collective, in-place allowed: optimizers work).
* patch B, :func:`make_map_after_reduction`: torch maps placements through a reduction with
  ``map_placements_after_reduction`` (``_ops/_math_ops.py``), which rejects unknown placements.
  The patch maps a RaggedShard to the reduction's Partial (``Partial("sum")``, ``_NormPartial(p)``):
  a local partial reduction followed by one all-reduce when the result is read.

Source: fsdp2-internals.md section 3.4 (patches A and B, verified on torch 2.13).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from raggedfsdp.placement.ragged_shard import RaggedShard

aten = torch.ops.aten


class RaggedShardOpError(RuntimeError):
    """An op that cannot be computed on flat RaggedShard pieces was called on a RaggedShard DTensor."""


_LIKE_OPS = {
    aten.clone.default,
    aten.copy_.default,
    aten.detach.default,
    aten.alias.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.empty_like.default,
    aten.full_like.default,
    aten.fill_.Scalar,
    aten.fill_.Tensor,
    aten.zero_.default,
    aten._to_copy.default,
    aten.to.dtype,
    aten.lerp_.Scalar,
    aten.lerp_.Tensor,
}
for _name in ("_fused_adamw_", "_fused_adam_", "_fused_sgd_"):
    if hasattr(aten, _name):
        _LIKE_OPS.update(getattr(getattr(aten, _name), o) for o in getattr(aten, _name).overloads())

# full reductions that are linear over the flat pieces: (op, index of the `dim` arg or None)
_REDUCTIONS: dict[Any, int | None] = {
    aten.sum.default: None,
    aten.sum.dim_IntList: 1,
    aten.nansum.default: None,
    aten.linalg_vector_norm.default: 2,
    aten.norm.Scalar: None,
    aten._foreach_norm.Scalar: None,
}
for _name, _idx in (("linalg__powsum", 2), ("_foreach_powsum", None)):
    if hasattr(aten, _name):
        for _o in getattr(aten, _name).overloads():
            _REDUCTIONS[getattr(getattr(aten, _name), _o)] = _idx


def _iter_specs(obj):
    if isinstance(obj, DTensorSpec):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _iter_specs(o)


def schema_has_ragged(op_schema) -> bool:
    for obj in (*op_schema.args_schema, *op_schema.kwargs_schema.values()):
        for spec in _iter_specs(obj):
            if any(isinstance(p, RaggedShard) for p in spec.placements):
                return True
    return False


def _torch_pointwise_ops() -> frozenset:
    """The ops torch registers with its pointwise strategy (torch/distributed/tensor/_ops/_pointwise_ops.py)."""
    try:
        from torch.distributed.tensor._ops import _pointwise_ops as pw

        return frozenset(pw.pointwise_ops) | frozenset(getattr(pw, "_specially_registered_ops", ()))
    except (ImportError, AttributeError):  # pragma: no cover - fall back to the op tag
        return frozenset()


_POINTWISE = _torch_pointwise_ops()


def classify(op) -> str | None:
    """``'pointwise'``, ``'reduction'`` or None (unsupported on RaggedShard)."""
    tags = set(op.tags)
    if torch.Tag.nondeterministic_seeded in tags:
        return None  # random ops are handled by random_op_handler, never propagated
    if op in _REDUCTIONS:
        return "reduction"
    if op in _LIKE_OPS or op in _POINTWISE or torch.Tag.pointwise in tags:
        return "pointwise"
    name = op._schema.name
    if name.startswith("aten::_foreach_"):
        if "norm" in name or "max" == name.rsplit("_", 1)[-1]:
            return None
        return "pointwise"
    return None


def _err(op, why: str) -> RaggedShardOpError:
    return RaggedShardOpError(
        f"RaggedShard: {op} is not supported on RaggedShard DTensors: {why}. A RaggedShard local tensor is "
        "a flat 1-D range of rows, so only pointwise/foreach ops on tensors of the same global shape and "
        "full sum/p-norm reductions run on it. Convert first, e.g. x.redistribute(mesh, [Shard(0)]) or "
        "x.full_tensor(), or work on x.to_local(). (see docs/raggedshard.md)"
    )


def _is_scalar_like(spec: DTensorSpec) -> bool:
    return spec.tensor_meta is not None and spec.tensor_meta.shape.numel() == 1 and not any(
        isinstance(p, RaggedShard) for p in spec.placements
    )


def _columns(op_schema) -> list[list[DTensorSpec]]:
    """Group the DTensor args into per-output 'columns' (foreach lists are zipped)."""
    args = (*op_schema.args_schema, *op_schema.kwargs_schema.values())
    lists = [a for a in args if isinstance(a, (list, tuple)) and any(isinstance(x, DTensorSpec) for x in a)]
    singles = [a for a in args if isinstance(a, DTensorSpec)]
    if not lists:
        return [singles]
    n = max(len(x) for x in lists)
    cols = []
    for i in range(n):
        col = [x[i] for x in lists if i < len(x) and isinstance(x[i], DTensorSpec)]
        cols.append(col + singles)
    return cols


def _check_pointwise(op_schema) -> None:
    op = op_schema.op
    for col in _columns(op_schema):
        rs = [s for s in col if any(isinstance(p, RaggedShard) for p in s.placements)]
        if not rs:
            continue
        ref = rs[0]
        for s in col:
            if s is ref or _is_scalar_like(s):
                continue
            if s.shape != ref.shape:
                raise _err(
                    op,
                    f"operand of shape {tuple(s.shape)} {s.placements} would broadcast against the RaggedShard "
                    f"operand of shape {tuple(ref.shape)} {ref.placements}",
                )
            if s.mesh != ref.mesh:
                raise ValueError(
                    f"RaggedShard: {op} got operands on different meshes {ref.mesh} and {s.mesh}; "
                    "put all operands on the same DeviceMesh"
                )


def _check_reduction(op_schema) -> None:
    op = op_schema.op
    idx = _REDUCTIONS[op]
    args = op_schema.args_schema
    # inf-norms reduce with max/min, which fails on empty local pieces
    if op in (aten.linalg_vector_norm.default, aten.norm.Scalar, aten._foreach_norm.Scalar) and len(args) > 1:
        if args[1] in (float("inf"), float("-inf"), "inf", "-inf"):
            raise _err(op, "inf-norms reduce with max/min, which is undefined on empty local pieces")
    if idx is None or len(args) <= idx or args[idx] is None:
        return
    dims = args[idx]
    if isinstance(dims, int):
        dims = [dims]
    spec = args[0]
    ndim = len(spec.shape)
    norm = {d % ndim for d in dims} if ndim else set()
    if len(dims) and norm != set(range(ndim)):
        raise _err(op, f"it reduces over dims {list(dims)} only; only full reductions (all dims) are supported")


def guard_propagation(stock):
    """Wrap a ``propagate_op_sharding(op_schema)`` callable with the RaggedShard op checks."""

    def propagate(op_schema):
        if not schema_has_ragged(op_schema):
            return stock(op_schema)
        kind = classify(op_schema.op)
        if kind is None:
            raise _err(op_schema.op, "its result is not a function of each rank's flat element range")
        if kind == "pointwise":
            _check_pointwise(op_schema)
        else:
            _check_reduction(op_schema)
        return stock(op_schema)

    propagate.__ragged_original__ = stock
    return propagate


# ---- patch A ---------------------------------------------------------------------------------
def make_fill_placeholders(stock):
    from torch.distributed.tensor._ops.single_dim_strategy import _ShardingPlaceholder

    def _fill_single_dim_strategy_placeholders(unique_input_placements, strategies):
        out = stock(unique_input_placements, strategies)
        ragged = sorted((p for p in unique_input_placements if isinstance(p, RaggedShard)), key=repr)
        for rs in ragged:
            for s in strategies:
                holders = [p for p in s if isinstance(p, _ShardingPlaceholder)]
                if holders and all(p.dim == 0 for p in holders):
                    out.append([rs if isinstance(p, _ShardingPlaceholder) else p for p in s])
        return out

    _fill_single_dim_strategy_placeholders.__ragged_original__ = stock
    return _fill_single_dim_strategy_placeholders


# ---- patch B ---------------------------------------------------------------------------------
def make_map_after_reduction(stock, get_placement_from_reduction_op):
    def map_placements_after_reduction(placements, reduction_dims, reduction_dims_map, reduction_op):
        if not any(isinstance(p, RaggedShard) for p in placements):
            return stock(placements, reduction_dims, reduction_dims_map, reduction_op)
        out = []
        for p in placements:
            if isinstance(p, RaggedShard):
                if not all(d in reduction_dims for d in p.dims):
                    raise RaggedShardOpError(
                        f"RaggedShard: reduction over dims {list(reduction_dims)} does not cover the ragged dims "
                        f"{p.dims} of {p}; only full reductions are supported"
                    )
                out.append(get_placement_from_reduction_op(reduction_op))
            else:
                out.extend(stock((p,), reduction_dims, reduction_dims_map, reduction_op))
        return tuple(out)

    map_placements_after_reduction.__ragged_original__ = stock
    return map_placements_after_reduction


# ---- patch C: is_tensor_shardable ------------------------------------------------------------
def make_is_tensor_shardable(stock):
    """Reject invalid RaggedShard compositions as strategy candidates.

    Patch A offers RaggedShard on every mesh dim, so torch's cross-mesh-dim expansion
    (``_ops/utils.py expand_to_full_mesh_op_strategy`` and the Dijkstra search in
    ``single_dim_strategy.py``) could pick e.g. ``(RS, RS)`` or an RS whose ``local_units`` do
    not match the mesh dim. Both filter candidates through ``is_tensor_shardable``, so answering
    False for those keeps only layouts that ``check_placements`` accepts.
    """
    from raggedfsdp.placement._redistribute import check_placements, has_ragged

    def is_tensor_shardable(shape, spec, *args, **kwargs):
        if not has_ragged(spec.placements):
            return stock(shape, spec, *args, **kwargs)
        try:
            check_placements(tuple(spec.placements), tuple(int(s) for s in shape), spec.mesh)
        except ValueError:
            return False
        return True

    is_tensor_shardable.__ragged_original__ = stock
    return is_tensor_shardable

