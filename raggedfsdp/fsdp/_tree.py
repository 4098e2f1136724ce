"""Walks over the tensors of a module's inputs and outputs, as torch FSDP2 walks them.

``torch.utils._pytree.tree_flatten`` treats an unregistered ``@dataclass`` (and any class it does not
know) as a leaf, so a unit whose output is a dataclass fed to the next unit got no pre-backward hook
and was never re-gathered in backward ("setStorage: ... out of bounds for storage of size 0"). torch
2.13's ``fully_shard`` walks

* the outputs (pre-backward hooks) and the inputs (the post-backward ``autograd.Function``) with
  ``collect_grad_tensors`` / ``replace_grad_tensors`` (``torch/distributed/fsdp/_common_utils.py``):
  tensor, NamedTuple, dataclass, dict, list / tuple, in that order; sets are not entered;
* the mixed-precision casts (``cast_forward_inputs``, ``output_dtype``) with
  ``torch.distributed.utils._apply_to_tensors``: also ``OrderedDict``, ``PackedSequence`` and sets.

Both are private torch functions, so they are re-implemented here (same branch order, same
rebuilding: ``dataclasses.replace``, ``type(x)(*items)`` for a NamedTuple); tests/dist/test_fsdp_api.py
checks that a dataclass / NamedTuple / nested output trains with torch's ``fully_shard``'s gradients.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.nn.utils.rnn import PackedSequence

_MAX_DEPTH = 128  # torch's _MAX_TRAVERSE_DEPTH: a cycle fails loudly instead of recursing forever


def _is_namedtuple(obj: Any) -> bool:
    fields = getattr(type(obj), "_fields", None)
    return (
        isinstance(obj, tuple)
        and hasattr(obj, "_asdict")
        and isinstance(fields, tuple)
        and all(isinstance(f, str) for f in fields)
    )


def _is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def _too_deep(depth: int, what: str) -> None:
    if depth >= _MAX_DEPTH:
        raise RuntimeError(
            f"raggedfsdp: {what} exceeded depth {_MAX_DEPTH} walking a module's inputs or outputs, likely a "
            "circular reference in the structure"
        )


# Note [no closure cycles]: each walk is a module-level recursive function with its state passed in,
# not a nested ``visit`` that calls itself: such a closure refers to its own cell, a reference cycle
# that keeps the walked tensors (a unit's output activations) alive until the garbage collector runs
# -- measured as one extra activation (512 KiB) in the backward peak of
# tests/dist/test_fsdp_memory.py::test_grad_buffer_allocated_at_first_gradient.


def grad_tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors that require grad in ``obj`` (tensors, NamedTuples, dataclasses, dicts, lists,
    tuples, nested), in the order :func:`replace_grad_tensors` consumes them. Local."""
    out: list[torch.Tensor] = []
    _collect(obj, out, 0)
    return out


def _collect(x: Any, out: list, depth: int) -> None:
    _too_deep(depth, "grad_tensors")
    if isinstance(x, torch.Tensor):
        if x.requires_grad:
            out.append(x)
    elif _is_namedtuple(x):
        for item in x:
            _collect(item, out, depth + 1)
    elif _is_dataclass_instance(x):
        for f in dataclasses.fields(x):
            _collect(getattr(x, f.name), out, depth + 1)
    elif isinstance(x, dict):
        for v in x.values():
            _collect(v, out, depth + 1)
    elif isinstance(x, (list, tuple)):
        for item in x:
            _collect(item, out, depth + 1)


def replace_grad_tensors(obj: Any, new: Iterator[torch.Tensor]) -> Any:
    """``obj`` with each tensor :func:`grad_tensors` found replaced by the next of ``new``; containers
    holding a replaced tensor are rebuilt (a dataclass by ``dataclasses.replace``, a NamedTuple by
    its constructor), the others returned as they are. Local."""
    return _replace(obj, new, 0)


def _replace(x: Any, new: Iterator[torch.Tensor], depth: int) -> Any:
    _too_deep(depth, "replace_grad_tensors")
    if isinstance(x, torch.Tensor):
        return next(new) if x.requires_grad else x
    if _is_namedtuple(x):
        items = [_replace(item, new, depth + 1) for item in x]
        return type(x)(*items) if any(a is not b for a, b in zip(items, x)) else x
    if _is_dataclass_instance(x):
        changes = {}
        for f in dataclasses.fields(x):
            old = getattr(x, f.name)
            v = _replace(old, new, depth + 1)
            if v is not old:
                changes[f.name] = v
        return dataclasses.replace(x, **changes) if changes else x
    if isinstance(x, dict):
        items = {k: _replace(v, new, depth + 1) for k, v in x.items()}
        if all(items[k] is x[k] for k in x):
            return x
        out = type(x)() if isinstance(x, OrderedDict) else {}
        out.update(items)
        return out
    if isinstance(x, (list, tuple)):
        items = [_replace(item, new, depth + 1) for item in x]
        if all(a is b for a, b in zip(items, x)):
            return x
        return items if type(x) is list else (tuple(items) if type(x) is tuple else type(x)(items))
    return x


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    """``fn`` applied to every tensor of ``obj`` as ``torch.distributed.utils._apply_to_tensors`` does
    (tensors, dataclasses, OrderedDicts, ``PackedSequence`` (its data, in place of nothing), dicts,
    NamedTuples, lists, tuples, sets); used for the ``param_dtype`` input cast, the ``output_dtype``
    cast and the root's move of inputs to the compute device. Local."""
    return _map(fn, obj, 0)


def _map(fn: Callable[[torch.Tensor], torch.Tensor], x: Any, depth: int) -> Any:
    _too_deep(depth, "map_tensors")
    if isinstance(x, torch.Tensor):
        return fn(x)
    if _is_dataclass_instance(x):
        changes = {f.name: _map(fn, getattr(x, f.name), depth + 1) for f in dataclasses.fields(x)}
        return dataclasses.replace(x, **changes)
    if isinstance(x, OrderedDict):
        od = x.__class__()
        for k, v in x.items():
            od[k] = _map(fn, v, depth + 1)
        return od
    if isinstance(x, PackedSequence):
        _map(fn, x.data, depth + 1)
        return x
    if isinstance(x, dict):
        return {k: _map(fn, v, depth + 1) for k, v in x.items()}
    if _is_namedtuple(x):
        return type(x)(*(_map(fn, item, depth + 1) for item in x))
    if isinstance(x, (list, tuple, set)):
        return type(x)(_map(fn, item, depth + 1) for item in x)
    return x


def cast_floating(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """The cast FSDP2 applies (``_fsdp_common.py: _cast_fp_tensor``): floating tensors of another dtype
    go to ``dtype``, the rest unchanged."""

    def fn(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    return fn
