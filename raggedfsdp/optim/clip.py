"""Gradient-norm clipping for parameters on different device meshes (FSDP x TP x EP models).

``torch.nn.utils.clip_grad_norm_`` stacks the per-tensor norms into one DTensor, so it needs every
gradient on the same mesh and raises ``All operands in aten.stack.default must have the same
mesh`` otherwise (e.g. FSDP-only parameters on ``mesh["dp"]`` next to 2-D dp x tp DTensors).
:func:`clip_grad_norm_` computes torch's own norm per mesh, reads each one (one collective per
mesh), and combines the per-mesh norms as the norm of one concatenated vector would be:
``(sum_m n_m^p)^(1/p)`` for a p-norm, ``max_m n_m`` for ``inf`` and ``min_m n_m`` for ``-inf``.
A DTensor is one logical tensor whatever its placements, so a parameter replicated over some mesh
dim (HSDP, or an FSDP-only parameter repeated on every tp rank) is counted once. Plain tensors are
taken as replicated (the same on every rank), as torch's DTensor ops take 0-dim operands.

Idea from torchtitan's ``dist_utils.clip_grad_norm_`` (per-group totals, reduced with SUM of p-th
powers or MAX); written for this package. Single-device reference: ``torch.nn.utils.clip_grad_norm_``
on the unsharded model (tests/dist/test_clip_grad_norm.py).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


def _groups(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Tensors grouped by DeviceMesh (plain tensors in one group), in order of first appearance."""
    keys: list[object] = []
    groups: list[list[torch.Tensor]] = []
    for t in tensors:
        key = t.device_mesh if isinstance(t, DTensor) else None
        for i, k in enumerate(keys):
            if (k is None and key is None) or (k is not None and key is not None and k == key):
                groups[i].append(t)
                break
        else:
            keys.append(key)
            groups.append([t])
    return groups


def _check_norm_type(norm_type) -> float:
    try:
        p = float(norm_type)
    except (TypeError, ValueError):
        p = float("nan")
    if not (p > 0 or p == float("-inf")):
        raise ValueError(
            f"clip_grad_norm_: norm_type={norm_type!r} must be a positive number, float('inf') or "
            "float('-inf'); e.g. norm_type=2.0"
        )
    return p


@torch.no_grad()
def get_total_norm(
    tensors: Iterable[torch.Tensor] | torch.Tensor,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """The ``norm_type``-norm of all ``tensors`` viewed as one vector, for tensors on any meshes.

    Args:
        tensors: tensors (plain or DTensor, any placements incl. RaggedShard, on any meshes).
        norm_type: p > 0, ``inf`` or ``-inf``.
        error_if_nonfinite: raise ``RuntimeError`` if the norm is nan or +-inf.
        foreach: passed to ``torch.nn.utils.get_total_norm`` for each mesh.

    Returns:
        A plain 0-dim float tensor, the same value on every rank (no DTensor), on the device of
        the first tensor. ``tensor(0.)`` for no tensors.

    Collective: every rank must call it with its tensors in the same order (one all-reduce per
    distinct mesh, on that mesh's group). Raises ``ValueError`` for a bad ``norm_type``.
    """
    p = _check_norm_type(norm_type)
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else [t for t in tensors if t is not None]
    if not tensors:
        return torch.tensor(0.0)
    device = tensors[0].device
    totals = []
    for group in _groups(tensors):
        n = torch.nn.utils.get_total_norm(group, p, foreach=foreach)
        if isinstance(n, DTensor):
            n = n.full_tensor()  # Replicate: local read; Partial (e.g. torch's Shard inf-norm): all-reduce
        totals.append(n.to(device))
    dtype = functools.reduce(torch.promote_types, [t.dtype for t in totals])
    stacked = torch.stack([t.to(dtype) for t in totals])
    if math.isinf(p):
        total = stacked.max() if p > 0 else stacked.min()
    else:
        total = stacked.pow(p).sum().pow(1.0 / p)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"clip_grad_norm_: the total norm of order {p} of the gradients is non-finite ({total.item()}), "
            "so it cannot be clipped; pass error_if_nonfinite=False to scale the gradients by it anyway"
        )
    return total


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for parameters whose grads live on different meshes.

    Scales every ``.grad`` in place by ``min(1, max_norm / (total + 1e-6))``, where ``total`` is
    :func:`get_total_norm` of all grads (the norm of the single-process model's gradients).

    Args:
        parameters: parameters (plain tensors or DTensors on any meshes); those without ``.grad``
            are skipped.
        max_norm: the maximum total norm (a number >= 0).
        norm_type: p > 0, ``inf`` or ``-inf``.
        error_if_nonfinite: raise ``RuntimeError`` (before scaling) if the total norm is nan/inf.
        foreach: passed to torch's per-mesh norm and scaling.

    Returns:
        The total norm before clipping: a plain 0-dim float tensor, equal on every rank.

    Collective: every rank calls it with its parameters in the same order. Raises ``ValueError`` for
    a bad ``max_norm`` or ``norm_type``, ``TypeError`` if ``parameters`` holds a non-tensor.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    for i, q in enumerate(params):
        if not isinstance(q, torch.Tensor):
            raise TypeError(
                f"clip_grad_norm_: parameters[{i}] is a {type(q).__name__}, not a tensor; pass "
                "model.parameters()"
            )
    try:
        max_norm = float(max_norm)
    except (TypeError, ValueError):
        max_norm = float("nan")
    if not max_norm >= 0:
        raise ValueError(
            f"clip_grad_norm_: max_norm must be a number >= 0 (got {max_norm!r}), e.g. max_norm=1.0"
        )
    grads = [q.grad for q in params if q.grad is not None]
    total = get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
    if not grads:
        return total
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for group in _groups(grads):
        c = coef.to(group[0].device)  # 0-dim plain tensor: DTensor ops take it as replicated on any mesh
        if foreach is False:
            for g in group:
                g.mul_(c)
        else:
            torch._foreach_mul_(group, c)
    return total
