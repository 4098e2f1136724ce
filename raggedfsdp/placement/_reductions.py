"""Local reductions of RaggedShard DTensors: full, per-row and over the ragged dims (no communication).

A RaggedShard piece with ``dims=(0, ..., k-1)`` holds whole rows of the first ``k`` dims, so its flat
local tensor views as ``(local_rows, *shape[k:])``. A reduction over dims ``D`` then runs locally:

* ``D`` within the trailing dims (``D & {0..k-1}`` empty), e.g. ``x.sum(1)``, ``linalg.norm(x, dim=1)``,
  ``x.amax(-1)``, ``x.max(1)`` (values and indices): every row is reduced on the rank that holds it;
  the result is a RaggedShard with the same ``local_units`` (the row count is unchanged).
* ``D`` covering the ragged dims (``{0..k-1} <= D``), e.g. ``x.sum(0)``, ``x.mean()``, ``x.max()``,
  ``x.any()``, ``linalg.norm(x, dim=0)``: each rank reduces its rows and the result is a pending
  reduction, read with one all-reduce: ``Partial("sum")`` for ``sum``, ``_NormPartial(p)`` for
  p-norms (torch's own placements, as torch gives for ``Shard(0)``), and :class:`RaggedPartial`
  for ``mean`` (local sum / global count), ``max``/``amax``/``min``/``amin``, ``any``, ``all``.
  An empty piece contributes the identity (``-inf``/``+inf`` or the dtype's bounds for max/min,
  ``False`` for any, ``True`` for all): torch's ``max`` of an empty tensor raises.
* anything else (a reduction that splits the ragged dims, ``max.dim`` over the ragged dims, a
  companion other than Replicate, a non-contiguous tensor) goes to torch's dispatch, where the
  op guard redistributes it like ``Shard(0)`` (``placement/_implicit.py``).

:class:`RaggedPartial` differs from ``Partial`` in one way that matters: ``.item()`` / ``bool()``
(``aten._local_scalar_dense``) reduce it first, so every rank reads the global value. torch reads a
``Partial``'s local value there (``_sharding_prop.py`` special-cases ``_local_scalar_dense``), which
for ``nn.init.trunc_normal_``'s ``while mask.any()`` loop would let ranks run different numbers of
full-tensor draws (``placement/_random.py``) and leave their generators out of step. Any op over a
RaggedPartial reduces it first (it compares unequal to ``Partial``), giving a ``Replicate`` result.

Installed as DTensor custom op handlers (``DTensor._op_dispatcher._custom_op_handlers``,
torch/distributed/tensor/_dispatch.py) by ``placement/_patches.py``; for other DTensors they step
aside and torch's dispatch runs.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from raggedfsdp.placement._ops import RaggedPartial, _is_ragged, call_torch_dispatch
from raggedfsdp.placement.ragged_shard import RaggedShard

aten = torch.ops.aten

# op -> (kind, index of the dim arg or None, index of the keepdim arg or None)
REDUCTION_OPS = {
    aten.sum.dim_IntList: ("sum", 1, 2),
    aten.mean.default: ("mean", None, None),
    aten.mean.dim: ("mean", 1, 2),
    aten.amax.default: ("max", 1, 2),
    aten.amin.default: ("min", 1, 2),
    aten.max.default: ("max", None, None),
    aten.min.default: ("min", None, None),
    aten.any.default: ("any", None, None),
    aten.all.default: ("all", None, None),
    aten.any.dim: ("any", 1, 2),
    aten.any.dims: ("any", 1, 2),
    aten.all.dim: ("all", 1, 2),
    aten.all.dims: ("all", 1, 2),
    aten.max.dim: ("max_dim", 1, 2),
    aten.min.dim: ("min_dim", 1, 2),
}
# the pending reduction of each kind over the ragged dims (any/all as max/min: safe for bool on every backend)
_PARTIAL_OP = {"mean": "sum", "max": "max", "min": "min", "any": "max", "all": "min"}


def _identity(kind: str, dtype: torch.dtype):
    if dtype == torch.bool:
        return kind in ("min", "all")
    if dtype.is_floating_point:
        return float("-inf") if kind == "max" else float("inf")
    info = torch.iinfo(dtype)
    return info.min if kind == "max" else info.max


def _local_reduce(kind: str, x: torch.Tensor, dims: list[int], keepdim: bool, dtype=None, ord=None):
    if kind == "sum":
        return x.sum(dims, keepdim=keepdim, dtype=dtype)
    if kind == "mean":
        return x.mean(dims, keepdim=keepdim, dtype=dtype)
    if kind == "norm":
        return torch.linalg.vector_norm(x, ord, dims, keepdim, dtype=dtype)
    if kind in ("max", "min"):
        if x.numel() == 0:  # torch's amax/amin of an empty tensor raise: the identity of max/min
            shape = (
                [1 if d in dims else s for d, s in enumerate(x.shape)]
                if keepdim
                else [s for d, s in enumerate(x.shape) if d not in dims]
            )
            return torch.full(shape, _identity(kind, x.dtype), dtype=x.dtype, device=x.device)
        return x.amax(dims, keepdim) if kind == "max" else x.amin(dims, keepdim)
    if kind in ("any", "all"):
        out = x
        for d in sorted(dims, reverse=True):
            out = out.any(d, keepdim) if kind == "any" else out.all(d, keepdim)
        return out
    raise AssertionError(kind)


def _partial(kind: str, ord):
    from torch.distributed.tensor._ops._math_ops import NormReduction, get_placement_from_reduction_op

    from raggedfsdp.placement._ops import InfNormPartial

    if kind == "sum":
        return get_placement_from_reduction_op("sum")
    if kind == "norm":
        if ord in (float("inf"), float("-inf")):
            return InfNormPartial("max" if ord > 0 else "min")
        return get_placement_from_reduction_op(NormReduction(ord))
    return RaggedPartial(_PARTIAL_OP[kind])


def ragged_reduce(kind: str, x, dim, keepdim: bool, dtype=None, ord=None):
    """The local reduction of the RaggedShard DTensor ``x`` over ``dim`` (None or [] for all dims), or
    None when no local rule applies (the caller then uses torch's dispatch). Not collective.

    Returns a DTensor (a tuple of values and indices for ``max_dim``/``min_dim``) whose placement is
    a RaggedShard (rows kept) or a pending reduction (see the module docstring).
    """
    spec: DTensorSpec = x._spec
    meta = spec.tensor_meta
    shape = tuple(int(s) for s in meta.shape)
    ndim = len(shape)
    if ndim == 0 or any(not (isinstance(p, RaggedShard) or p.is_replicate()) for p in spec.placements):
        return None
    from raggedfsdp.placement._implicit import _contiguous

    if not _contiguous(meta) or (kind == "mean" and not (meta.dtype.is_floating_point or dtype is not None)):
        return None
    rs = next(p for p in spec.placements if isinstance(p, RaggedShard))
    k = len(rs.dims)
    dims = list(range(ndim)) if dim is None or (not isinstance(dim, int) and len(dim) == 0) else dim
    dims = sorted({d % ndim for d in ([dims] if isinstance(dims, int) else dims)})
    ragged = set(range(k))
    rows_kept = not ragged & set(dims)
    if not rows_kept and not ragged <= set(dims):
        return None  # the reduction splits the ragged rows
    if kind in ("max_dim", "min_dim") and not rows_kept:
        return None  # per-rank indices cannot be combined: torch forces Replicate there too
    local = x._local_tensor
    rest = shape[k:]
    rows = local.numel() // math.prod(rest) if math.prod(rest) else 0
    nd = local.reshape(rows, *rest)
    local_dims = [0] + [d - k + 1 for d in dims if d >= k] if not rows_kept else [d - k + 1 for d in dims]
    if kind in ("max_dim", "min_dim"):
        vals, idx = (nd.max if kind == "max_dim" else nd.min)(local_dims[0], keepdim)
        outs = (vals, idx)
    elif kind == "mean" and not rows_kept:  # a pending sum of local sums / the global count
        count = math.prod(shape[d] for d in dims)
        outs = (nd.sum(local_dims, keepdim=keepdim, dtype=dtype) / count,)
    else:
        outs = (_local_reduce(kind, nd, local_dims, keepdim, dtype, ord),)
    out_shape = (
        tuple(1 if d in dims else s for d, s in enumerate(shape))
        if keepdim
        else tuple(s for d, s in enumerate(shape) if d not in dims)
    )
    if rows_kept:
        placements = spec.placements
        outs = tuple(o.reshape(-1) for o in outs)
    else:
        placements = tuple(_partial(kind, ord) if isinstance(p, RaggedShard) else p for p in spec.placements)
        outs = tuple(o.reshape(out_shape) for o in outs)
    from torch.distributed.tensor import DTensor

    stride = tuple(torch._prims_common.make_contiguous_strides_for(out_shape)) if out_shape else ()
    res = tuple(
        DTensor(
            o,
            DTensorSpec(spec.mesh, placements, TensorMeta(torch.Size(out_shape), stride, o.dtype)),
            requires_grad=False,
        )
        for o in outs
    )
    return res if kind in ("max_dim", "min_dim") else res[0]


def reduction_handler(op_call, args, kwargs):
    """DTensor custom handler of :data:`REDUCTION_OPS`: :func:`ragged_reduce` for RaggedShard inputs it
    can reduce locally, torch's dispatch otherwise (which redistributes RaggedShard inputs)."""
    x = args[0] if args else kwargs.get("self")
    kind, dim_i, keep_i = REDUCTION_OPS[op_call]
    if _is_ragged(x) and set(kwargs) <= {"dtype"}:
        dim = args[dim_i] if dim_i is not None and len(args) > dim_i else None
        keepdim = bool(args[keep_i]) if keep_i is not None and len(args) > keep_i else False
        dims = [dim] if isinstance(dim, int) else dim
        no_dims = dims is not None and len(dims) == 0
        full_sum = kind == "sum" and (dims is None or no_dims or len({d % x.dim() for d in dims}) == x.dim())
        # a full sum keeps torch's strategy (Partial("sum"), placement/_ops.py patch B); any/all(dim=[])
        # reduce nothing in torch: both are left to torch's dispatch
        if not full_sum and not (no_dims and kind in ("any", "all")):
            out = ragged_reduce(kind, x, dim, keepdim, kwargs.get("dtype"))
            if out is not None:
                return out
    return call_torch_dispatch(op_call, args, kwargs)


def local_scalar_dense_handler(op_call, args, kwargs):
    """``.item()`` / ``bool()`` of a DTensor: a RaggedPartial is reduced first (every rank reads the global
    value); a RaggedShard is gathered first (an implicit redistribution, counted); else torch's path."""
    from torch.distributed.tensor import DTensor, Replicate

    x = args[0]
    if isinstance(x, DTensor) and any(
        isinstance(p, (RaggedPartial, RaggedShard)) for p in x._spec.placements
    ):
        if any(isinstance(p, RaggedShard) for p in x._spec.placements):
            from raggedfsdp.placement._implicit import note_implicit

            target = DTensorSpec(
                x._spec.mesh, tuple(Replicate() for _ in x._spec.placements), tensor_meta=x._spec.tensor_meta
            )
            note_implicit(op_call, x._spec, target)
        x = x.redistribute(
            x.device_mesh,
            [Replicate() if isinstance(p, (RaggedPartial, RaggedShard)) else p for p in x.placements],
        )
        args = (x, *args[1:])
    return call_torch_dispatch(op_call, args, kwargs)


def install(custom_handlers: dict) -> list:
    """Register the reduction and ``_local_scalar_dense`` handlers; returns the ops. Idempotent; raises
    ``RuntimeError`` if torch has its own handler for one of them."""
    mine = {op: reduction_handler for op in REDUCTION_OPS}
    mine[aten._local_scalar_dense.default] = local_scalar_dense_handler
    for op, fn in mine.items():
        cur = custom_handlers.get(op)
        if cur is not None and cur is not fn:
            raise RuntimeError(
                f"raggedfsdp: torch now has a DTensor custom handler for {op}; port placement/_reductions.py"
            )
        custom_handlers[op] = fn
    return list(mine)
