"""A fast path for element-wise ``torch._foreach_*`` ops on DTensors (RaggedShard, and any other
placement but Partial).

Why: ``torch.optim``'s foreach implementations (AdamW, Adam, SGD, ...) call about ten
``torch._foreach_*`` ops per step, each on lists of every parameter, gradient or state tensor, and
DTensor's sharding propagation of such an op grows with the square of the list length:

* torch 2.13 / 2.14 (``_sharding_prop.py``): a foreach op's strategy is built per list index, and for
  each index ``_propagate_use_strided_shard_flag`` walks every spec of the whole schema. A cache miss
  of one ``_foreach_*`` op over 785 parameters costs seconds; the first AdamW step of the 128-expert
  MoE bench (785 params) took **43-52 s** on the CPU box (torch's ``fully_shard`` alike), and so does
  every later step whose set of parameters holding a ``.grad`` differs from all earlier ones (an MoE
  expert that got no token on any rank: a new list, a new cache key): 46-54 s per such step. With
  this fast path: 0.23 s for the first step, 0.10 s for such a step (benchmarks/README.md,
  "Sharding propagation of foreach ops").
* torch 2.11 / 2.12 dispatch these ops in Python (``OpDispatcher._unwrap_to_op_info_impl`` walks the
  lists with pytree, then propagation hashes every spec): 18 ms of host time per AdamW step with 785
  parameters on the CPU box and 21 ms on an H200 (benchmarks/README.md, "The first GPU runs").

What: a DTensor custom op handler (``OpDispatcher._custom_op_handlers``, the dict torch's own
``loss_parallel`` extends, and ``placement/_ops.py`` for ``_foreach_norm``) on the element-wise
foreach overloads (:data:`OPS`) that torch's DTensor has a sharding strategy for
(:func:`supported_ops`: the others stay torch's business, so nothing that fails there starts working
here). It takes the fast path when every tensor argument is a list of DTensors of one length, every list
matches the first position by position (the same mesh object, equal placements, equal global shapes) and
no placement is Partial (RaggedShard, or torch's own ``Shard`` / ``_StridedShard`` / ``Replicate``: a
tensor-parallel user's parameters take it too; for an in-place op, every list has the first list's
floating dtypes too: see :func:`_verdict`): the op then runs once on the local tensors, and out-of-place
results are wrapped with the first list's specs. That is what torch's dispatch computes for an
element-wise op on equal specs (the op guard of ``placement/_ops.py`` keeps RaggedShard on element-wise
ops), bitwise (``tests/dist/test_foreach_fast_path.py``), with no sharding propagation. A single tensor
operand takes it only as a replicated 0-dim DTensor on the lists' mesh (``clip_grad_norm_``'s clip
coefficient in ``_foreach_mul_``), and a finite-order ``_foreach_norm`` (order 0 excepted: torch reduces
that count with ``Partial("sum")``) of such a list is computed on the local pieces
(:func:`norm_fast_path`, reached through ``placement/_ops.py``'s norm handler) with torch's output specs
(``_NormPartial``): ``clip_grad_norm_`` of 785 grads took 8-9 s at its first call and at every new set
of grads on torch 2.13, 0.66 s with it. Any other call -- another single tensor operand, a plain tensor
in a list, mismatched specs, a Partial placement -- goes through torch's own dispatch
(:func:`~raggedfsdp.placement._ops.call_torch_dispatch`), unchanged.

When: installed with the other patches (``placement/_patches.py`` item 10) on every torch;
``RAGGEDFSDP_FOREACH_FAST_PATH=0`` never installs it (A/B benchmarks, or to rule it out when
reporting a bug), ``=1`` or unset installs it. Local: no communication.
"""

from __future__ import annotations

import itertools
import operator
import os
import threading

import torch

aten = torch.ops.aten

ENV = "RAGGEDFSDP_FOREACH_FAST_PATH"

# element-wise foreach ops torch.optim uses (and their in-place / out-of-place twins); every overload
# but the ``out=`` ones
_NAMES = (
    "_foreach_add",
    "_foreach_sub",
    "_foreach_mul",
    "_foreach_div",
    "_foreach_lerp",
    "_foreach_addcmul",
    "_foreach_addcdiv",
    "_foreach_sqrt",
    "_foreach_neg",
    "_foreach_maximum",
    "_foreach_minimum",
    "_foreach_clamp_min",
    "_foreach_clamp_max",
    "_foreach_reciprocal",
    "_foreach_pow",
    "_foreach_sign",
    "_foreach_abs",
    "_foreach_exp",
    "_foreach_copy",
    "_foreach_zero",
)


def _ops() -> tuple:
    out = []
    for base in _NAMES:
        for name in (base, base + "_"):
            packet = getattr(aten, name, None)
            if packet is None:
                continue
            for ov in packet.overloads():
                if "out" not in ov:
                    out.append(getattr(packet, ov))
    return tuple(out)


OPS = _ops()

_SPEC = operator.attrgetter("_spec")
_LOCAL = operator.attrgetter("_local_tensor")
_PLACEMENTS = operator.attrgetter("placements")
_IS_PARTIAL = operator.methodcaller("is_partial")
_MESH = operator.attrgetter("mesh")
_GSHAPE = operator.attrgetter("tensor_meta.shape")
_CALLS = [0, 0]  # [fast path taken, fallen back]: read by tests and benchmarks (fast_path_counts)


def fast_path_counts() -> tuple[int, int]:
    """``(fast, fallback)``: calls of the handler that took the fast path / torch's dispatch so far."""
    return _CALLS[0], _CALLS[1]


def _is_tensor_list(a) -> bool:
    return isinstance(a, (list, tuple)) and len(a) > 0 and isinstance(a[0], torch.Tensor)


def _eligible(lists) -> list | None:
    """The first list's specs if the fast path applies to these tensor-list arguments, else None.

    The verdict is cached by the identity of every operand's spec (Note [verdict cache])."""
    return _verdict(lists)[0]


_NO = (None, False)


def _verdict(lists) -> tuple:
    """``(specs, inplace_ok)``: :func:`_eligible`'s answer, and whether an in-place op may take the fast
    path on these lists too (every list's dtypes equal the first list's, position by position, all
    floating point or complex): torch checks an in-place foreach op whole before writing anything, the
    local op writes tensor by tensor, so a dtype it would refuse (an ``int64`` self and a float
    operand) must be refused by torch's dispatch, not half-way through the list."""
    from torch.distributed.tensor import DTensor

    n = len(lists[0])
    for lst in lists:
        if len(lst) != n or not all(map(isinstance, lst, itertools.repeat(DTensor))):
            return _NO
    spec_lists = [list(map(_SPEC, lst)) for lst in lists]
    key = (len(lists), *map(id, itertools.chain.from_iterable(spec_lists)))
    hit = _VERDICTS.get(key)
    if hit is not None:
        return hit[0]
    verdict = _check(spec_lists)
    with _VERDICTS_LOCK:  # eviction picks the oldest key: two threads must not both delete it
        _VERDICTS[key] = (verdict, spec_lists)  # holds the specs: their ids cannot be reused meanwhile
        while len(_VERDICTS) > _VERDICTS_MAX:
            del _VERDICTS[next(iter(_VERDICTS))]  # the oldest entry
    return verdict


# Note [verdict cache]: torch.optim calls about ten foreach ops per step on the same lists, and the
# DTensors in them keep their spec objects across steps (params and optimizer states are the same
# tensors; the sharded grads and out-of-place results are built from cached specs), so checking the
# specs once per list of spec objects, not once per op, takes the per-op cost from ~1 ms to ~0.1 ms per
# 400 params. A spec is never changed in place once a DTensor carries it (torch builds new ones), and
# an entry holds its specs, so an id in a key always names the spec it was computed for. Bounded:
# at most _VERDICTS_MAX lists of specs, oldest out first (a few per parameter group and step); writes
# under a lock (an optimizer per thread), reads without.
_VERDICTS: dict = {}
_VERDICTS_MAX = 256
_VERDICTS_LOCK = threading.Lock()
_FLOATING = operator.attrgetter("is_floating_point")
_COMPLEX = operator.attrgetter("is_complex")
_DTYPE = operator.attrgetter("tensor_meta.dtype")


def _check(spec_lists) -> tuple:
    specs = spec_lists[0]
    n = len(specs)
    placements = list(map(_PLACEMENTS, specs))
    # the loops in C: every spec has its own placements tuple (a Python loop over them cost 3.5 ms per
    # 800 params per op)
    if any(map(_IS_PARTIAL, itertools.chain.from_iterable(placements))):
        return _NO
    meshes = list(map(id, map(_MESH, specs)))
    if meshes.count(meshes[0]) != n or any(s.tensor_meta is None for s in specs):
        return _NO
    shapes = list(map(_GSHAPE, specs))
    for other in spec_lists[1:]:
        if (
            list(map(_PLACEMENTS, other)) != placements
            or list(map(id, map(_MESH, other))) != meshes
            or any(s.tensor_meta is None for s in other)
            or list(map(_GSHAPE, other)) != shapes
        ):
            return _NO
    dtypes = list(map(_DTYPE, specs))
    inplace_ok = all(list(map(_DTYPE, other)) == dtypes for other in spec_lists[1:]) and all(
        map(operator.or_, map(_FLOATING, dtypes), map(_COMPLEX, dtypes))
    )
    return specs, inplace_ok


def _replicated_scalar(t, mesh) -> bool:
    """``t`` is a 0-dim DTensor replicated over ``mesh`` (e.g. ``clip_grad_norm_``'s clip coefficient)."""
    from torch.distributed.tensor import DTensor

    return (
        isinstance(t, DTensor)
        and t._spec.mesh is mesh
        and len(t._spec.shape) == 0
        and all(p.is_replicate() for p in t._spec.placements)
    )


def foreach_handler(op_call, args, kwargs):
    """Custom DTensor handler of the ops in :data:`OPS` (see the module docstring). Local."""
    from raggedfsdp.placement._ops import call_torch_dispatch

    lists = [a for a in args if _is_tensor_list(a)]
    specs, inplace_ok = _verdict(lists) if lists else _NO
    inplace = not op_call._schema.returns
    if specs is not None:
        mesh = specs[0].mesh
        # a single tensor operand takes the fast path only as a replicated 0-dim DTensor on the lists'
        # mesh (its local value is every rank's value: what torch's dispatch multiplies by too)
        scalars = [a for a in args if isinstance(a, torch.Tensor)]
        if (
            (inplace and not inplace_ok)
            or not all(_replicated_scalar(a, mesh) for a in scalars)
            or (
                inplace
                and any(a.dtype.is_complex and not specs[0].tensor_meta.dtype.is_complex for a in scalars)
            )
            or any(isinstance(v, torch.Tensor) or _is_tensor_list(v) for v in kwargs.values())
        ):
            specs = None
    if specs is None:
        _CALLS[1] += 1
        return call_torch_dispatch(op_call, args, kwargs)
    _CALLS[0] += 1
    local_args = [
        list(map(_LOCAL, a)) if _is_tensor_list(a) else a._local_tensor if isinstance(a, torch.Tensor) else a
        for a in args
    ]
    out = op_call(*local_args, **kwargs)
    if inplace:  # the local tensors were updated
        return None
    from raggedfsdp._compat import dtensor_wrapper

    wrap = dtensor_wrapper()
    return [wrap(o, s if o.dtype == s.tensor_meta.dtype else _with_dtype(s, o)) for o, s in zip(out, specs)]


def norm_fast_path(tensors, ord, dtype):
    """``torch._foreach_norm(tensors, ord, dtype=dtype)`` for a finite ``ord`` on a list that
    :func:`foreach_handler` would take (RaggedShard DTensors, matching specs, no Partial): each local
    piece's norm (an empty piece's is 0), returned as torch's dispatch returns it -- a 0-dim DTensor
    with ``_NormPartial(ord)`` on every sharded mesh dim and ``Replicate`` on the others -- without
    sharding propagation (``clip_grad_norm_``: 8-9 s per new set of 785 grads on torch 2.13 otherwise).
    ``None`` when the fast path is not installed or does not apply. Called by
    ``placement/_ops.py``'s norm handler. Local."""
    from torch.distributed.tensor import DTensor

    if DTensor._op_dispatcher._custom_op_handlers.get(aten._foreach_mul_.List) is not foreach_handler:
        return None  # the fast path is not installed in torch's dispatcher (RAGGEDFSDP_FOREACH_FAST_PATH=0)
    if float(ord) == 0:  # torch reduces the count of non-zeros with Partial("sum"), not _NormPartial
        return None
    specs = _eligible([tensors])
    if specs is None:
        return None
    try:
        from torch.distributed.tensor._ops._math_ops import _NormPartial
    except ImportError:  # torch moved it: its own dispatch computes the same
        return None
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    from raggedfsdp._compat import dtensor_wrapper

    vals = torch._foreach_norm(list(map(_LOCAL, tensors)), ord, dtype=dtype)
    mesh, out_specs = specs[0].mesh, {}
    wrap = dtensor_wrapper()
    res = []
    for v, sp in zip(vals, specs):
        key = (sp.placements, v.dtype)
        out = out_specs.get(key)
        if out is None:  # one spec per layout, shared by its outputs (as torch's cached output sharding)
            pl = tuple(p if p.is_replicate() else _NormPartial(ord) for p in sp.placements)
            out = out_specs[key] = DTensorSpec(mesh, pl, tensor_meta=TensorMeta(v.shape, v.stride(), v.dtype))
        res.append(wrap(v, out))
    _CALLS[0] += 1
    return res


def _with_dtype(spec, local: torch.Tensor):
    import dataclasses

    from torch.distributed.tensor._dtensor_spec import TensorMeta

    meta = spec.tensor_meta
    return dataclasses.replace(spec, tensor_meta=TensorMeta(meta.shape, meta.stride, local.dtype))


def wanted() -> bool:
    """Whether :func:`install` should register the handler: ``RAGGEDFSDP_FOREACH_FAST_PATH`` = ``0``
    turns it off; ``1``, ``auto`` or unset turn it on (every torch: see the module docstring). Raises
    ``ValueError`` for another value."""
    v = os.environ.get(ENV, "auto").strip().lower()
    if v not in ("0", "1", "auto", ""):
        raise ValueError(f"{ENV}={v!r}: use 0 (off), 1 (on) or auto (on, the default)")
    return v != "0"


def supported_ops() -> list:
    """The ops of :data:`OPS` that this torch's DTensor can run at all (a sharding strategy or rule is
    registered for them): only those get the fast path, so it never makes an op work that torch's own
    dispatch rejects (2.11: 50 of the 95, 2.13: 79). Empty if torch's registries moved (no fast path)."""
    from torch.distributed.tensor import DTensor

    prop = DTensor._op_dispatcher.sharding_propagator
    regs = [
        getattr(prop, a, None) for a in ("op_strategy_funcs", "op_to_rules", "op_single_dim_strategy_funcs")
    ]
    regs = [r for r in regs if isinstance(r, dict)]
    return [op for op in OPS if any(op in r for r in regs)]


def install(custom_handlers: dict) -> list:
    """Register :func:`foreach_handler` for :func:`supported_ops` if :func:`wanted`; returns the ops
    registered. Idempotent; raises ``RuntimeError`` if torch has its own handler for one of them."""
    if not wanted():
        return []
    ops = supported_ops()
    for op in ops:
        cur = custom_handlers.get(op)
        if cur is not None and cur is not foreach_handler:
            raise RuntimeError(
                f"raggedfsdp: torch now has a DTensor custom handler for {op}; port placement/_foreach.py"
            )
    for op in ops:
        custom_handlers[op] = foreach_handler
    return ops


def uninstall(custom_handlers: dict) -> None:
    """Remove the handler (tests). Local."""
    for op in OPS:
        if custom_handlers.get(op) is foreach_handler:
            del custom_handlers[op]
