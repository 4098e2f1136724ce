"""Sharding propagation for RaggedShard DTensors: what runs locally, and what redistributes.

A RaggedShard local tensor is a flat 1-D range of rows. Ops with a local rule run on the pieces
with no communication: pointwise / foreach / like / copy ops on tensors of the SAME global shape,
full sum / p-norm reductions (here), ``new_*`` factories (placement kept for the same shape), views
(``placement/_implicit.py``) and the reductions of ``placement/_reductions.py``. Every other op
(t/transpose/permute, mm/matmul/linear, indexing/slicing, cat, broadcasting pointwise ops, ...)
redistributes its RaggedShard inputs as DTensor does for an op without a strategy for its inputs:
``placement/_implicit.py`` stands ``Shard(0)`` in for the RaggedShard, lets torch's strategy choose
and moves the inputs there (counted; :func:`~raggedfsdp.placement._implicit.strict_ops` makes each
such redistribution raise :class:`RaggedShardOpError` naming the op). Random ops other than those of
``placement/_random.py`` raise.

Mechanism (installed by ``raggedfsdp/placement/_patches.py``):

* :func:`make_guarded_propagation` wraps ``ShardingPropagator.propagate_op_sharding_non_cached``: any
  op whose args carry a RaggedShard is classified here BEFORE torch's strategies run.
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
from torch.distributed.tensor.placement_types import Partial

from raggedfsdp.placement._patches import dispatch_without_handler
from raggedfsdp.placement._implicit import (  # RaggedShardOpError: re-exported
    VIEW_OPS,
    RaggedShardOpError,
    factory_sharding,
    fallback_sharding,
    fix_local_shape_args,
    view_sharding,
)
from raggedfsdp.placement.ragged_shard import RaggedShard

aten = torch.ops.aten

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
    """The ops torch registers with its pointwise strategy
    (torch/distributed/tensor/_ops/_pointwise_ops.py)."""
    try:
        from torch.distributed.tensor._ops import _pointwise_ops as pw

        return frozenset(pw.pointwise_ops) | frozenset(getattr(pw, "_specially_registered_ops", ()))
    except (ImportError, AttributeError):  # pragma: no cover - fall back to the op tag
        return frozenset()


_POINTWISE = _torch_pointwise_ops()


_FACTORY_OPS = {
    aten.new_empty.default,
    aten.new_zeros.default,
    aten.new_ones.default,
    aten.new_full.default,
    aten.new_empty_strided.default,
}


def classify(op) -> str | None:
    """``'pointwise'``, ``'reduction'``, ``'factory'``, ``'random'`` or None (no local rule here)."""
    tags = set(op.tags)
    if torch.Tag.nondeterministic_seeded in tags:
        return "random"  # the ones raggedfsdp handles never get here (placement/_random.py)
    if op in _REDUCTIONS:
        return "reduction"
    if op in _FACTORY_OPS:
        return "factory"
    if op in _LIKE_OPS or op in _POINTWISE or torch.Tag.pointwise in tags:
        return "pointwise"
    name = op._schema.name
    if name.startswith("aten::_foreach_"):
        if "norm" in name or name == "aten::_foreach_max":  # reductions (not _foreach_clamp_max)
            return None
        return "pointwise"
    return None


def _err(op, why: str) -> RaggedShardOpError:
    return RaggedShardOpError(
        f"RaggedShard: {op} is not supported on RaggedShard DTensors: {why}. Convert first, e.g. "
        "x.redistribute(mesh, [Shard(0)]) or x.full_tensor(), or work on x.to_local(). "
        "(see docs/raggedshard.md)"
    )


def _is_scalar_like(spec: DTensorSpec) -> bool:
    return (
        spec.tensor_meta is not None
        and spec.tensor_meta.shape.numel() == 1
        and not any(isinstance(p, RaggedShard) for p in spec.placements)
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


def _pointwise_is_local(op_schema) -> bool:
    """True unless a non-scalar operand would broadcast against a RaggedShard operand (then the op
    redistributes). Raises ``ValueError`` for operands on different meshes."""
    op = op_schema.op
    for col in _columns(op_schema):
        rs = [s for s in col if any(isinstance(p, RaggedShard) for p in s.placements)]
        if not rs:
            continue
        ref = rs[0]
        for s in col:
            if s is ref or _is_scalar_like(s):
                continue
            if s.mesh != ref.mesh:
                raise ValueError(
                    f"RaggedShard: {op} got operands on different meshes {ref.mesh} and {s.mesh}; "
                    "put all operands on the same DeviceMesh"
                )
            if s.shape != ref.shape:
                return False
    return True


def _reduction_is_local(op_schema) -> bool:
    """True for a reduction over all dims (``placement/_reductions.py`` reduces over some dims)."""
    op = op_schema.op
    idx = _REDUCTIONS[op]
    args = op_schema.args_schema
    # inf-norms of linalg_vector_norm / _foreach_norm are computed by inf_norm_handler (empty pieces
    # contribute 0); aten.norm.Scalar's inf-norm would run max/min on possibly empty local pieces
    if op is aten.norm.Scalar and len(args) > 1 and args[1] in (float("inf"), float("-inf")):
        return False
    if idx is None or len(args) <= idx or args[idx] is None:
        return True
    dims = args[idx]
    if isinstance(dims, int):
        dims = [dims]
    ndim = len(args[0].shape)
    return not len(dims) or {d % ndim for d in dims} == set(range(ndim))


def make_guarded_propagation(stock):
    """``ShardingPropagator.propagate_op_sharding_non_cached(self, op_schema)`` for RaggedShard operands.

    Ops with a local rule run torch's strategies (patches A-D keep RaggedShard or map it to the
    reduction's Partial; RaggedShard outputs of factory ops get the flat local shape) or the view
    rule; every other op gets :func:`~raggedfsdp.placement._implicit.fallback_sharding`. torch
    caches the result (Python LRU + the C++ dispatch cache), so this runs once per op/spec
    combination; the implicit redistributions it asks for are counted when they run.
    """

    def propagate_op_sharding_non_cached(self, op_schema):
        if not schema_has_ragged(op_schema):
            return stock(self, op_schema)
        op = op_schema.op
        kind = classify(op)
        if kind == "random":
            raise _err(
                op,
                "random ops draw each rank's numbers from its own generator, raggedfsdp handles only "
                "the in-place fills and *_like ops of placement/_random.py",
            )
        if op in VIEW_OPS or kind == "factory":
            out = (view_sharding if op in VIEW_OPS else factory_sharding)(self, op_schema)
            if out is not None:
                return out
            if kind == "factory":  # another shape: a Replicate result, no communication (torch's rule)
                return stock(self, op_schema)
        elif (kind == "pointwise" and _pointwise_is_local(op_schema)) or (
            kind == "reduction" and _reduction_is_local(op_schema)
        ):
            return fix_local_shape_args(self, op_schema, stock(self, op_schema))
        return fallback_sharding(self, op_schema, stock)

    return propagate_op_sharding_non_cached


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

    return _fill_single_dim_strategy_placeholders


# ---- patch B ---------------------------------------------------------------------------------
def make_map_after_reduction(stock):
    get_placement_from_reduction_op = stock.__globals__["get_placement_from_reduction_op"]

    def map_placements_after_reduction(placements, reduction_dims, reduction_dims_map, reduction_op):
        if not any(isinstance(p, RaggedShard) for p in placements):
            return stock(placements, reduction_dims, reduction_dims_map, reduction_op)
        out = []
        for p in placements:
            if isinstance(p, RaggedShard):
                if not all(d in reduction_dims for d in p.dims):
                    raise RaggedShardOpError(
                        f"RaggedShard: reduction over dims {list(reduction_dims)} does not cover the ragged "
                        f"dims {p.dims} of {p}; only reductions over all dims are supported; convert "
                        "first with x.redistribute(...) or x.full_tensor()"
                    )
                out.append(get_placement_from_reduction_op(reduction_op))
            else:
                out.extend(stock((p,), reduction_dims, reduction_dims_map, reduction_op))
        return tuple(out)

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

    return is_tensor_shardable


# ---- inf-norms: an empty local piece contributes the identity of max (0) -----------------------
# Reached through DTensor._op_dispatcher._custom_op_handlers (torch/distributed/tensor/_dispatch.py):
# torch computes the local norm and marks the result Partial(max) (an all-reduce MAX when read),
# but linalg_vector_norm / _foreach_norm of an EMPTY local tensor raise for ord=+-inf ("no identity").
# Max of absolute values has identity 0 (and -inf-norms, a min, identity +inf), so an empty piece
# contributes that; the result is InfNormPartial("max") (("min") for -inf), read with one all-reduce.
#
# Note [norm of inf-norms]: torch.nn.utils.get_total_norm / clip_grad_norm_ take the inf-norm of
# torch.stack(per-tensor norms). torch's reduction strategy (_ops/_math_ops.py
# common_reduction_strategy) treats a max over a Partial("max") input as "linear" and keeps the
# result Partial("max"), so the returned total norm is each rank's LOCAL max: .item() / .to_local()
# differ per rank (torch's _local_scalar_dense reads the local value of a Partial), unlike the
# p-norms, whose _NormPartial input forces a reduction and a Replicate result. The per-tensor
# inf-norms are therefore marked with InfNormPartial, a Partial("max"/"min") subclass; a norm of an
# InfNormPartial input (the norm of norms) first all-reduces it (one collective for the whole
# stack), so the total is Replicate and equal on every rank, as for p-norms.
_INF = (float("inf"), float("-inf"))


class RaggedPartial(Partial):
    """``Partial(reduce_op)`` produced by a local reduction of a RaggedShard DTensor (``mean``, ``max``,
    ``min``, ``amax``, ``amin``, ``any``, ``all``; ``placement/_reductions.py``).

    Reduced exactly as ``Partial`` (one all-reduce when read). Unlike torch's ``Partial``,
    ``.item()`` / ``bool()`` reduce it first, so every rank reads the global value (torch reads the
    local one); and since it compares unequal to ``Partial``, any op over it reduces it first
    (``Replicate`` result).
    """

    def __init__(self, reduce_op: str = "sum"):
        if reduce_op not in ("sum", "avg", "max", "min"):
            raise ValueError(f"RaggedPartial: reduce_op={reduce_op!r} must be 'sum', 'avg', 'max' or 'min'")
        super().__init__(reduce_op)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.reduce_op == self.reduce_op

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.reduce_op))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.reduce_op!r})"

    def __str__(self) -> str:
        return f"RaggedP({self.reduce_op})"

    def __reduce__(self):
        return (type(self), (self.reduce_op,))

    def __fx_repr__(self) -> str:
        return f"{type(self).__name__}({self.reduce_op!r})"


class InfNormPartial(RaggedPartial):
    """``Partial("max")`` (or ``("min")``) of per-rank inf-norms: a pending max/min over the mesh dim.

    Produced by ``linalg.vector_norm(x, +-inf)`` / ``_foreach_norm(xs, +-inf)`` of a RaggedShard
    DTensor (one non-negative scalar per rank). Reducing it is an all-reduce MAX (MIN), exactly as
    ``Partial("max")``; as a :class:`RaggedPartial`, ``.item()`` and any op over it (a norm of
    norms included, Note [norm of inf-norms]) reduce it first. Compares unequal to a plain
    ``Partial`` and to ``RaggedPartial``.
    """

    def __init__(self, reduce_op: str = "max"):
        if reduce_op not in ("max", "min"):
            raise ValueError(f"InfNormPartial: reduce_op={reduce_op!r} must be 'max' or 'min'")
        super().__init__(reduce_op)

    def __str__(self) -> str:
        return f"InfNormP({self.reduce_op})"


# torch's own DTensor custom handlers that a raggedfsdp handler stands in front of (op -> torch's
# handler; e.g. torch 2.11's ``minmax_dim_handler`` for ``aten.max.dim``): a call raggedfsdp does not
# handle itself goes to them. One writer: :func:`chain_handler`.
TORCH_HANDLERS: dict = {}


def chain_handler(custom_handlers: dict, op, fn) -> None:
    """Register ``fn`` as ``op``'s DTensor custom handler; a handler torch already has for ``op`` is kept
    in :data:`TORCH_HANDLERS` and runs the calls ``fn`` passes to :func:`call_torch_dispatch`."""
    cur = custom_handlers.get(op)
    if cur is not None and cur is not fn and op not in TORCH_HANDLERS:
        TORCH_HANDLERS[op] = cur
    custom_handlers[op] = fn


def call_torch_dispatch(op_call, args, kwargs):
    """Run ``op_call`` as torch would: its own custom handler for the op if it has one
    (:data:`TORCH_HANDLERS`) and no operand is RaggedShard, else its DTensor dispatch with raggedfsdp's
    handler stepped aside on this thread only (``_patches.dispatch_without_handler``: other threads'
    calls of the op keep the handler; torch's shared handler dict is not touched)."""
    torch_handler = TORCH_HANDLERS.get(op_call)
    if torch_handler is not None and not any(_is_ragged(t) for t in (*args, *kwargs.values())):
        # torch's handler reads Shard placements only (2.11's minmax_dim_handler would reduce a
        # RaggedShard operand's local piece as if it were replicated): a RaggedShard operand takes the
        # propagation path below, which redistributes it
        return torch_handler(op_call, args, kwargs)
    return dispatch_without_handler(op_call, args, kwargs)


_DTENSOR: list = []  # torch's DTensor class, imported at first use (these run on every handled call)


def _dtensor_cls():
    if not _DTENSOR:
        from torch.distributed.tensor import DTensor

        _DTENSOR.append(DTensor)
    return _DTENSOR[0]


def _has_placement(t, kind) -> bool:
    """``t`` is a DTensor with a ``kind`` placement on some mesh dim (a plain loop: a handler's per-call
    check on every operand, e.g. each tensor of a ``_foreach_norm`` list)."""
    if not isinstance(t, _dtensor_cls()):
        return False
    for p in t._spec.placements:
        if isinstance(p, kind):
            return True
    return False


def _is_ragged(t) -> bool:
    return _has_placement(t, RaggedShard)


def _reduce_inf_partials(t):
    """``t`` with every InfNormPartial mesh dim all-reduced to Replicate (``t`` itself if it has none)."""
    from torch.distributed.tensor import Replicate

    if not _has_placement(t, InfNormPartial):
        return t
    return t.redistribute(
        t.device_mesh, [Replicate() if isinstance(p, InfNormPartial) else p for p in t.placements]
    )


def _ragged_inf_norm(dt, ord: float, keepdim: bool = False, dtype=None):
    """``linalg.vector_norm(dt, ord=+-inf)`` of a RaggedShard DTensor over all dims (no communication)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import TensorMeta

    spec = dt._spec
    local = dt._local_tensor
    if local.numel() == 0:  # identity element of max (|x| >= 0) or of min
        local = local.new_zeros(1) if ord > 0 else local.new_full((1,), float("inf"))
    val = torch.linalg.vector_norm(local, ord, dtype=dtype)
    ndim = len(spec.shape)
    if keepdim:
        val = val.reshape((1,) * ndim)
    op = "max" if ord > 0 else "min"  # torch's own inf-norm strategy also reduces with Partial(max/min)
    placements = []
    for p in spec.placements:
        if p.is_replicate():
            placements.append(p)
        elif p.is_shard() or isinstance(p, RaggedShard):
            placements.append(InfNormPartial(op))
        else:
            raise _err(aten.linalg_vector_norm.default, f"an inf-norm of a {p} (pending-reduction) operand")
    meta = TensorMeta(val.shape, val.stride(), val.dtype)
    return DTensor(val, DTensorSpec(spec.mesh, tuple(placements), tensor_meta=meta), requires_grad=False)


def inf_norm_handler(op_call, args, kwargs):
    """Custom DTensor handler of ``linalg_vector_norm`` / ``_foreach_norm``.

    RaggedShard norms over some dims are ``placement/_reductions.py``'s; inf-norms over all dims are
    computed here (empty pieces contribute the identity); a norm of InfNormPartial inputs reduces
    them first (Note [norm of inf-norms]); a ``_foreach_norm`` list that mixes RaggedShard DTensors
    with plain tensors is computed per tensor (torch's foreach dispatch rejects the mix); everything
    else is torch's own dispatch.
    """
    from torch.distributed.tensor import DTensor

    if op_call is aten._foreach_norm.Scalar:
        tensors = args[0]
        if any(_has_placement(t, InfNormPartial) for t in tensors):
            tensors = [_reduce_inf_partials(t) for t in tensors]
        ord = float(args[1] if len(args) > 1 else kwargs.get("ord", 2))
        dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
        ragged = any(_is_ragged(t) for t in tensors)
        mixed = ragged and not all(isinstance(t, DTensor) for t in tensors)
        if ragged and not mixed and ord not in _INF:
            from raggedfsdp.placement import _foreach  # the fast path (patch 10), if installed

            out = _foreach.norm_fast_path(tensors, args[1] if len(args) > 1 else kwargs.get("ord", 2), dtype)
            if out is not None:
                return out
        if (ord in _INF and ragged) or mixed:
            return [
                _ragged_inf_norm(t, ord, dtype=dtype)
                if ord in _INF and _is_ragged(t)
                else torch.linalg.vector_norm(t, ord, dtype=dtype)
                for t in tensors
            ]
        return call_torch_dispatch(op_call, (tensors, *args[1:]), kwargs)
    names = ("self", "ord", "dim", "keepdim")
    a = dict(zip(names, args))
    a.update({k: v for k, v in kwargs.items() if k in names})
    x, ord, dim = _reduce_inf_partials(a["self"]), float(a.get("ord", 2)), a.get("dim")
    full = dim is None or (
        x.dim() > 0 and {d % x.dim() for d in ([dim] if isinstance(dim, int) else dim)} == set(range(x.dim()))
    )
    if ord in _INF and _is_ragged(x) and full:
        return _ragged_inf_norm(x, ord, bool(a.get("keepdim", False)), kwargs.get("dtype"))
    if _is_ragged(x) and not full:  # per-row norms, or norms over the ragged dims (placement/_reductions.py)
        from raggedfsdp.placement._reductions import ragged_reduce

        out = ragged_reduce("norm", x, dim, bool(a.get("keepdim", False)), kwargs.get("dtype"), ord)
        if out is not None:
            return out
    if x is not a["self"]:
        args = (x, *args[1:]) if args else args
        if not args:
            kwargs = {**kwargs, "self": x}
    return call_torch_dispatch(op_call, args, kwargs)


NORM_OPS = (aten.linalg_vector_norm.default, aten._foreach_norm.Scalar)


def install_norm_handlers(custom_handlers: dict) -> list:
    """Register :func:`inf_norm_handler`; returns the ops. Idempotent; raises if torch has its own handler."""
    for op in NORM_OPS:
        cur = custom_handlers.get(op)
        if cur is not None and cur is not inf_norm_handler:
            raise RuntimeError(
                f"raggedfsdp: torch now has a DTensor custom handler for {op}; port placement/_ops.py"
            )
        custom_handlers[op] = inf_norm_handler
    return list(NORM_OPS)


# ---- patch D: map_placements_after_broadcast -------------------------------------------------
def make_map_placements_after_broadcast(stock):
    """torch 2.11/2.12 run pointwise ops through ``common_pointwise_strategy``, which maps the output
    placements onto each operand with ``_ops/utils.py map_placements_after_broadcast`` and asserts
    that anything not Replicate/Partial is a ``Shard``. RaggedShard stays RaggedShard on an operand of
    the same shape (the guard allows no other non-scalar operand) and becomes Replicate on an
    operand broadcast along the ragged dims (a scalar)."""
    from torch.distributed.tensor import Replicate

    def map_placements_after_broadcast(placements, shape, broadcast_dims_map, *args, **kwargs):
        if not any(isinstance(p, RaggedShard) for p in placements):
            return stock(placements, shape, broadcast_dims_map, *args, **kwargs)
        out = []
        for p in placements:
            if not isinstance(p, RaggedShard):
                out.extend(stock((p,), shape, broadcast_dims_map, *args, **kwargs))
                continue
            mapped = [broadcast_dims_map[d] for d in p.dims]
            if all(m == -1 for m in mapped):
                out.append(Replicate())
            elif mapped == list(p.dims) and len(shape) == len(broadcast_dims_map):
                out.append(p)
            else:
                raise RaggedShardOpError(
                    f"RaggedShard: {p} of an output of shape {tuple(shape)} cannot be mapped onto an operand "
                    f"broadcast along its ragged dims (map {broadcast_dims_map}); operands of a pointwise op "
                    "on RaggedShard DTensors must have the same global shape or be scalars"
                )
        return tuple(out)

    return map_placements_after_broadcast
