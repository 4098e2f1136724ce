"""Ops without a local rule on RaggedShard DTensors: redistribute as DTensor does, counted and checkable.

DTensor's contract (torch/distributed/tensor/_sharding_prop.py, ``_dispatch.py``): an op that
has no strategy for its inputs' placements still gives the right answer: sharding propagation
returns an ``OutputSharding`` with ``needs_redistribute=True`` and a ``redistribute_schema`` naming
the input placements the op needs, and ``OpDispatcher.redistribute_local_args`` redistributes the
inputs before running the op locally. RaggedShard follows it:

* **fallback** (:func:`fallback_sharding`): every RaggedShard input is stood in for by ``Shard(0)``
  on the same mesh dim (its pieces are also contiguous intervals of the flattened tensor), torch's
  own strategy runs on that schema, and the inputs are redistributed from RaggedShard straight to
  whatever placement that strategy asks for (one ``all_to_all_single`` to ``Shard(0)``, one padded
  all-gather to ``Replicate``, ``placement/_redistribute.py``). The op then runs exactly as it does
  on torch's ``Shard(0)`` DTensors (fully_shard's parameter placement): same values, same output
  placements. In-place and ``out=`` ops whose RaggedShard self/out would have to move raise
  :class:`RaggedShardOpError` (the result would land in a temporary); use the out-of-place op and
  ``copy_``. As for torch's own DTensors, a view op whose input had to move returns a copy.
* **views** (:func:`view_sharding`): ``view`` / ``reshape`` / ``_unsafe_view`` / ``squeeze`` /
  ``unsqueeze`` of a RaggedShard DTensor (contiguous, other mesh dims Replicate/Partial) keep the
  flat pieces: the result is a RaggedShard of the new shape with the same ``local_units`` (dims
  widened until ``sum(local_units)`` divides their rows), the local tensor a view of the input's.

Every implicit redistribution of a RaggedShard DTensor passes through torch's hook for them,
``ExplicitRedistributionContext.observe_redistribution`` (patched, ``placement/_patches.py``):
:func:`implicit_redistribution_count` counts them, and under :func:`strict_ops` (or
``RAGGEDFSDP_STRICT_OPS=1``) each one raises :class:`RaggedShardOpError` naming the op and the
placements, so a hidden all-gather in a training step can be found. Explicit ``redistribute`` /
``full_tensor`` calls are not counted.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import threading

import torch
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding
from torch.distributed.tensor.placement_types import Replicate, Shard

from raggedfsdp.placement.ragged_shard import RaggedShard

aten = torch.ops.aten


class RaggedShardOpError(RuntimeError):
    """An op on a RaggedShard DTensor that raggedfsdp refuses: an in-place op that would need its
    RaggedShard operand redistributed, a random op it does not handle, or any implicit
    redistribution of a RaggedShard DTensor under :func:`strict_ops`."""


# ---- counter and strict mode ----------------------------------------------------------------
_LOCK = threading.Lock()
_COUNT = 0
_BY_OP: collections.Counter = collections.Counter()
_STRICT_DEPTH = 0
ENV_STRICT = "RAGGEDFSDP_STRICT_OPS"


def implicit_redistribution_count(reset: bool = False) -> int:
    """Number of implicit redistributions of RaggedShard DTensors in this process so far.

    An implicit redistribution is one DTensor's dispatch performs for an op (an input moved from
    or to a RaggedShard placement before the op runs: a collective, usually an all-to-all or an
    all-gather); explicit ``redistribute()`` / ``full_tensor()`` calls are not counted. A normal
    FSDP training step (forward, backward, ``clip_grad_norm_``, optimizer step) makes none.
    ``reset=True`` returns the count and sets it to 0. Per process (rank), not collective.
    """
    global _COUNT
    with _LOCK:
        n = _COUNT
        if reset:
            _COUNT = 0
            _BY_OP.clear()
        return n


def implicit_redistributions_by_op() -> dict[str, int]:
    """``{op name: count}`` of the redistributions counted by :func:`implicit_redistribution_count`."""
    with _LOCK:
        return dict(_BY_OP)


def strict_ops_enabled() -> bool:
    """True inside :func:`strict_ops` or when the environment has ``RAGGEDFSDP_STRICT_OPS=1``."""
    return _STRICT_DEPTH > 0 or os.environ.get(ENV_STRICT, "0") not in ("", "0")


@contextlib.contextmanager
def strict_ops():
    """Debug mode: every implicit redistribution of a RaggedShard DTensor raises :class:`RaggedShardOpError`.

    The error names the op and the placements (from, to), so a hidden collective in a training step
    can be found; redistribute explicitly (``x.redistribute(mesh, [Shard(0)])``, ``x.full_tensor()``)
    where the collective is wanted. Process-wide (autograd's backward threads included) while the
    context is open; nests. The environment variable ``RAGGEDFSDP_STRICT_OPS=1`` enables it for the
    whole process. Source of the idea: torch's ``ExplicitRedistributionContext``
    (torch/distributed/tensor/_utils.py), which this mode narrows to RaggedShard DTensors.
    """
    global _STRICT_DEPTH
    with _LOCK:
        _STRICT_DEPTH += 1
    try:
        yield
    finally:
        with _LOCK:
            _STRICT_DEPTH -= 1


def _has_ragged(placements) -> bool:
    return any(isinstance(p, RaggedShard) for p in placements)


def note_implicit(op, src: DTensorSpec, dst: DTensorSpec) -> None:
    """Count one implicit redistribution involving a RaggedShard; raise under :func:`strict_ops`."""
    global _COUNT
    if not (_has_ragged(src.placements) or _has_ragged(dst.placements)):
        return
    name = str(getattr(op, "op", op))  # an OpSchema or an OpOverload
    if strict_ops_enabled():
        raise RaggedShardOpError(
            f"RaggedShard strict mode: {name} implicitly redistributes an operand of shape "
            f"{tuple(src.shape)} from {tuple(src.placements)} to {tuple(dst.placements)} (a collective). "
            "Redistribute explicitly where that is wanted (x.redistribute(mesh, [Shard(0)]) or "
            "x.full_tensor()), or leave raggedfsdp.strict_ops() / RAGGEDFSDP_STRICT_OPS=1 off "
            "(see docs/raggedshard.md)"
        )
    with _LOCK:
        _COUNT += 1
        _BY_OP[name] += 1


def _op_name(msg) -> str:
    """The op's name from torch's message (a ``LazyString`` from Python, a callable from C++) of
    ``_format_implicit_redistribution_msg``: "Implicit redistribution occurred for Op(op=aten...."."""
    text = str(msg() if callable(msg) and not isinstance(msg, str) else msg)
    import re

    m = re.search(r"(aten|prims|c10d_functional|_c10d_functional)\.[\w.]+", text)
    return m.group(0) if m else text[:200]


def make_observe_redistribution(stock):
    """``ExplicitRedistributionContext.observe_redistribution(cls, src_spec, dst_spec, msg)``: torch calls
    it for every implicit redistribution (``OpDispatcher.redistribute_local_args``)."""

    def observe_redistribution(cls, src_spec, dst_spec, redistribution_msg, *args, **kwargs):
        if _has_ragged(src_spec.placements) or _has_ragged(dst_spec.placements):
            note_implicit(_op_name(redistribution_msg), src_spec, dst_spec)
        return stock(cls, src_spec, dst_spec, redistribution_msg, *args, **kwargs)

    return observe_redistribution


# ---- fallback: stand in Shard(0), let torch's strategy choose ----------------------------------
def _map_specs(obj, fn):
    if isinstance(obj, DTensorSpec):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_specs(o, fn) for o in obj)
    return obj


def _iter_specs(obj):
    if isinstance(obj, DTensorSpec):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _iter_specs(o)


def _stand_in(spec: DTensorSpec) -> DTensorSpec:
    if not _has_ragged(spec.placements):
        return spec
    placements = tuple(Shard(0) if isinstance(p, RaggedShard) else p for p in spec.placements)
    return DTensorSpec(spec.mesh, placements, tensor_meta=spec.tensor_meta)


def _refuse(op, why: str) -> RaggedShardOpError:
    return RaggedShardOpError(
        f"RaggedShard: {op} on a RaggedShard DTensor {why}. Use the out-of-place op and copy_ the result "
        "back (x.copy_(op(x))), or convert first: x.redistribute(mesh, [Shard(0)]) / x.full_tensor() "
        "(see docs/raggedshard.md)"
    )


def fallback_sharding(propagator, op_schema: OpSchema, stock) -> OutputSharding:
    """Sharding of an op with no local RaggedShard rule: torch's strategy for the ``Shard(0)`` stand-in.

    ``stock`` is torch's ``propagate_op_sharding_non_cached``. Returns an ``OutputSharding`` whose
    ``redistribute_schema`` moves every RaggedShard input to the placement torch's strategy wants
    (so the op runs on torch's placements only). Raises :class:`RaggedShardOpError` for in-place /
    ``out=`` ops whose RaggedShard self/out would move, and for RaggedShard keyword tensors (torch
    redistributes positional args only). Not collective (propagation only).
    """
    op = op_schema.op
    for k, v in op_schema.kwargs_schema.items():
        if any(_has_ragged(s.placements) for s in _iter_specs(v)):
            raise _refuse(
                op, f"(keyword argument {k!r}) has no local rule, and keyword tensors are not redistributed"
            )
    if (
        op_schema.is_inplace_op()
        and op_schema.args_schema
        and any(_has_ragged(s.placements) for s in _iter_specs(op_schema.args_schema[0]))
    ):
        raise _refuse(op, "has no local rule, and an in-place op cannot redistribute its self argument")
    sub = OpSchema(
        op,
        tuple(_map_specs(a, _stand_in) for a in op_schema.args_schema),
        dict(op_schema.kwargs_schema),
        schema_info=op_schema.schema_info,
    )
    out = stock(propagator, sub)
    want = out.redistribute_schema if out.needs_redistribute and out.redistribute_schema is not None else sub
    return OutputSharding(
        out.output_spec,
        want,
        needs_redistribute=True,
        use_val_from_redistribute_schema=out.use_val_from_redistribute_schema,
    )


# ---- views keep the flat pieces --------------------------------------------------------------
VIEW_OPS = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.unsqueeze.default,
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
}


def view_placement(rs: RaggedShard, numel: int, shape) -> RaggedShard | None:
    """The RaggedShard of a tensor of ``shape`` with the same flat element ranges as ``rs`` on ``numel``
    elements: the same ``local_units``, ``dims=range(k)`` for the least ``k >= 1`` whose rows
    ``prod(shape[:k])`` are a multiple of ``sum(local_units)``. None for a 0-d ``shape``.

    Rank ``i`` owns elements ``[sum(u[:i]) * numel / U, ...)`` under any such ``k``, so the pieces are
    unchanged. Pure.
    """
    shape = tuple(int(s) for s in shape)
    u = sum(rs.local_units)
    for k in range(1, len(shape) + 1):
        if math.prod(shape[:k]) % u == 0:
            return RaggedShard(tuple(range(k)), rs.local_units)
    return None


def _contiguous(meta: TensorMeta) -> bool:
    want = torch._prims_common.make_contiguous_strides_for(meta.shape) if len(meta.shape) else ()
    return all(st == w for st, w, n in zip(meta.stride, want, meta.shape) if n > 1)


def view_sharding(propagator, op_schema: OpSchema) -> OutputSharding | None:
    """Sharding of a view op (:data:`VIEW_OPS`) of a RaggedShard DTensor that keeps the flat pieces,
    or None (then the op takes :func:`fallback_sharding`).

    The local op is rewritten to ``view(local, [local_numel])`` (torch's own mechanism for view
    ops: ``use_val_from_redistribute_schema``), so the result's local tensor is a view of the
    input's. Requires a contiguous input whose other mesh dims are Replicate or Partial.
    """
    spec = op_schema.args_schema[0]
    if not isinstance(spec, DTensorSpec) or spec.tensor_meta is None or not _contiguous(spec.tensor_meta):
        return None
    if any(not (isinstance(p, RaggedShard) or p.is_replicate() or p.is_partial()) for p in spec.placements):
        return None
    out_meta = propagator._propagate_tensor_meta_non_cached(op_schema)
    if not isinstance(out_meta, TensorMeta):
        return None
    placements = []
    for p in spec.placements:
        if isinstance(p, RaggedShard):
            p = view_placement(p, spec.tensor_meta.shape.numel(), out_meta.shape)
            if p is None:
                return None
        placements.append(p)
    out_spec = DTensorSpec(spec.mesh, tuple(placements), tensor_meta=out_meta)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, _ = compute_local_shape_and_global_offset(
        out_meta.shape, spec.mesh, placements, skip_offset=True
    )
    schema = OpSchema(aten.view.default, (spec, list(local_shape)), {})
    return OutputSharding(out_spec, schema, needs_redistribute=True, use_val_from_redistribute_schema=True)


def factory_sharding(propagator, op_schema: OpSchema) -> OutputSharding | None:
    """``new_empty`` / ``new_zeros`` / ``new_ones`` / ``new_full`` / ``new_empty_strided`` of a RaggedShard
    DTensor with its own shape: the result keeps the placement (its local tensor is a flat piece),
    as torch's ``new_factory_strategy`` keeps a ``Shard`` (``_ops/_tensor_ops.py``; a ``Partial``
    companion becomes ``Replicate`` except for the uninitialized ``new_empty*``). None for another
    shape: torch's strategy then gives a ``Replicate`` result with no communication."""
    spec = op_schema.args_schema[0]
    out_meta = propagator._propagate_tensor_meta_non_cached(op_schema)
    if not isinstance(out_meta, TensorMeta) or tuple(out_meta.shape) != tuple(spec.shape):
        return None
    keep_partial = op_schema.op in (aten.new_empty.default, aten.new_empty_strided.default)
    placements = tuple(Replicate() if p.is_partial() and not keep_partial else p for p in spec.placements)
    out = OutputSharding(DTensorSpec(spec.mesh, placements, tensor_meta=out_meta))
    return fix_local_shape_args(propagator, op_schema, out)


def fix_local_shape_args(propagator, op_schema: OpSchema, out: OutputSharding) -> OutputSharding:
    """torch rewrites the global shape arg of factory/view ops (``new_empty``, ``new_zeros``, ...) to the
    local shape only for ``Shard`` outputs (``_sharding_prop.py``, ``op_to_shape_and_stride_idx``);
    for a RaggedShard output the local shape is the flat piece ``[local_numel]`` (stride ``[1]``)."""
    idx = propagator.op_to_shape_and_stride_idx.get(op_schema.op)
    spec = out.output_spec
    if idx is None or not isinstance(spec, DTensorSpec) or not _has_ragged(spec.placements):
        return out
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape_idx, stride_idx = idx if isinstance(idx, tuple) else (idx, None)
    base = out.redistribute_schema or op_schema
    args = list(base.args_schema)
    local_shape, _ = compute_local_shape_and_global_offset(
        spec.shape, spec.mesh, spec.placements, skip_offset=True
    )
    args[shape_idx] = list(local_shape)
    if stride_idx is not None:
        args[stride_idx] = [1]
    schema = OpSchema(base.op, tuple(args), base.kwargs_schema)
    return OutputSharding(spec, schema, needs_redistribute=True, use_val_from_redistribute_schema=True)
