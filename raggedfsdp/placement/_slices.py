"""The slices ``x[i]`` of a RaggedShard DTensor along dim 0 as RaggedShard DTensors and back, locally.

A RaggedShard piece is a contiguous range of the flattened tensor, so its intersection with slice
``i`` (elements ``[i * n, (i + 1) * n)``, ``n = prod(shape[1:])``) is a contiguous range of that
slice: the slices are RaggedShard DTensors at element granularity (``dims = (0, ..., ndim - 2)``,
``local_units`` = each rank's element count in the slice) whose local tensors are views of the
piece. This is what a state-dict adapter that splits stacked weights (MoE experts stored as one
``(E, ...)`` parameter, saved as ``E`` separate HF tensors) needs to do without a gather, where for
``Shard(0)`` it takes whole local rows (torchtitan's ``MoEStateDictAdapter._get_local_experts_weights``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from raggedfsdp.placement._redistribute import _coord, ragged_mesh_dim
from raggedfsdp.placement.ragged_shard import RaggedShard


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(tuple(shape)):
        stride.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(stride))


def _check(shape: Sequence[int], placements: Sequence, what: str) -> tuple[int, RaggedShard]:
    from torch.distributed.tensor import Replicate

    i = ragged_mesh_dim(placements)
    others = [p for j, p in enumerate(placements) if j != i]
    if i is None or not all(isinstance(p, Replicate) for p in others):
        raise ValueError(
            f"{what}: needs placements with one RaggedShard and Replicate() on every other mesh dim (FSDP or "
            f"HSDP), got {tuple(placements)}; redistribute first, e.g. x.redistribute(mesh, [Shard(0)])"
        )
    if len(shape) < 2 or math.prod(shape[1:]) == 0:
        raise ValueError(
            f"{what}: needs a tensor of >= 2 dims with non-empty slices, got shape {tuple(shape)}; "
            "a vector has no tensor slices (use x.full_tensor() or x.redistribute)"
        )
    return i, placements[i]


def slice_placements(shape: Sequence[int], placements: Sequence, index: int) -> tuple:
    """The placements of slice ``index`` (``x[index]``, shape ``shape[1:]``) of a DTensor of ``shape`` with
    ``placements`` (one RaggedShard, Replicate elsewhere): the RaggedShard becomes
    ``RaggedShard(dims=(0, ..., len(shape) - 2), local_units=<each rank's element count in the slice>)``.
    Pure; ``ValueError`` for other placements or shapes without non-empty slices."""
    i, rs = _check(shape, placements, "slice_placements")
    n = math.prod(shape[1:])
    lo, hi = index * n, (index + 1) * n
    counts = tuple(max(0, min(b, hi) - max(a, lo)) for a, b in rs.flat_ranges(tuple(shape)))
    sub = RaggedShard(tuple(range(len(shape) - 1)), counts)
    return tuple(sub if j == i else p for j, p in enumerate(placements))


def unbind_ragged(x) -> list:
    """``[x[i] for i in range(x.shape[0])]`` of a RaggedShard DTensor without communication.

    Args:
        x: a DTensor of shape ``(E, *rest)`` (``rest`` non-empty, non-zero) with one RaggedShard and
            ``Replicate()`` on its other mesh dims (what raggedfsdp's ``fully_shard`` gives, FSDP or HSDP).

    Returns: ``E`` DTensors of shape ``rest`` on ``x``'s mesh, placements :func:`slice_placements`,
    whose local tensors are VIEWS of ``x``'s flat local tensor (a write into a slice, e.g. by
    ``dcp.load``, lands in ``x``). Not collective: any rank may call it, each gets its own views.

    Raises: ``ValueError`` for other placements (name them and how to redistribute) or shapes.
    """
    from torch.distributed.tensor import DTensor

    shape, pls = tuple(x.shape), tuple(x.placements)
    i, rs = _check(shape, pls, "unbind_ragged")
    a, _ = rs.flat_range(shape, _coord(x.device_mesh, i))
    local = x._local_tensor
    n = math.prod(shape[1:])
    out = []
    for e in range(shape[0]):
        start = min(max(a, e * n), a + local.numel()) - a
        stop = max(min(a + local.numel(), (e + 1) * n), a) - a
        out.append(
            DTensor.from_local(
                local.narrow(0, start, max(stop - start, 0)),
                x.device_mesh,
                slice_placements(shape, pls, e),
                run_check=False,
                shape=torch.Size(shape[1:]),
                stride=_contiguous_stride(shape[1:]),
            )
        )
    return out


def stack_ragged(slices: Sequence, mesh, placements: Sequence, shape: Sequence[int]):
    """Inverse of :func:`unbind_ragged`: the DTensor of ``shape`` (``(len(slices), *slice shape)``) with
    ``placements`` (one RaggedShard, Replicate elsewhere) on ``mesh`` whose slices are ``slices``.

    Slices already in the :func:`slice_placements` layout (what :func:`unbind_ragged` gives, and what
    ``dcp.load`` fills in place) are joined locally (one ``torch.cat`` of the local pieces, a copy);
    any other DTensor slice is first redistributed to that layout (collective: then every rank of
    ``mesh`` must call it). ``ValueError`` for a wrong number of slices, a slice of the wrong shape,
    or placements :func:`unbind_ragged` refuses.
    """
    from torch.distributed.tensor import DTensor

    shape, pls = tuple(int(s) for s in shape), tuple(placements)
    _check(shape, pls, "stack_ragged")
    if len(slices) != shape[0]:
        raise ValueError(
            f"stack_ragged: got {len(slices)} slices for shape {shape}; give one per index of dim 0"
        )
    locals_ = []
    for e, s in enumerate(slices):
        if tuple(s.shape) != shape[1:]:
            raise ValueError(f"stack_ragged: slice {e} has shape {tuple(s.shape)}, expected {shape[1:]}")
        want = slice_placements(shape, pls, e)
        if not isinstance(s, DTensor) or s.device_mesh != mesh:
            full = s.full_tensor() if isinstance(s, DTensor) else s
            s = torch.distributed.tensor.distribute_tensor(full, mesh, want)
        elif tuple(s.placements) != want:
            s = s.redistribute(mesh, want)
        locals_.append(s._local_tensor.reshape(-1))
    return DTensor.from_local(
        torch.cat(locals_),
        mesh,
        pls,
        run_check=False,
        shape=torch.Size(shape),
        stride=_contiguous_stride(shape),
    )
