"""Shared helpers for the optimizer tests: ragged layouts and DTensor parameters built from full tensors."""

from __future__ import annotations

import torch


def rand_units(n_rows: int, ws: int, seed: int, zeros: bool = True) -> tuple[int, ...]:
    """Uneven per-rank units (zeros allowed when ``zeros``) whose sum divides ``n_rows``."""
    g = torch.Generator().manual_seed(seed)
    lo = 0 if zeros else 1
    for _ in range(200):
        u = tuple(int(x) for x in torch.randint(lo, 4, (ws,), generator=g))
        if sum(u) and n_rows % sum(u) == 0:
            return u
    return tuple([n_rows] + [0] * (ws - 1))


def layout(kind: str, shape, ws: int, seed: int, block_rows: int = 1):
    """A ``RaggedShard`` for ``shape`` over ``ws`` ranks (uneven, zeros allowed).

    ``row``: whole rows of ``shape[-1]``, each rank a multiple of ``block_rows`` rows; ``element``:
    element granular; ``whole``: everything on rank ``seed % ws``.
    """
    import math

    from raggedfsdp import RaggedShard

    if kind == "element":
        return RaggedShard(tuple(range(len(shape))), rand_units(math.prod(shape), ws, seed))
    if kind == "whole":
        return RaggedShard((0,), tuple(1 if r == seed % ws else 0 for r in range(ws)))
    assert kind == "row", kind
    nrows = math.prod(shape[:-1])
    return RaggedShard(tuple(range(len(shape) - 1)), rand_units(nrows // block_rows, ws, seed))


def make_param(full: torch.Tensor, mesh, placements, rank_in_dim: int):
    """``nn.Parameter(DTensor)`` with ``placements`` holding this rank's piece of ``full`` (a copy)."""
    from torch.distributed.tensor import DTensor

    rs = placements[-1]
    local = rs.shard_full(full, rank_in_dim)
    stride = full.stride()
    return torch.nn.Parameter(
        DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=stride)
    )


def set_grad(p, full_grad: torch.Tensor, rank_in_dim: int) -> None:
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        rs = p.placements[-1]
        p.grad = DTensor.from_local(
            rs.shard_full(full_grad, rank_in_dim),
            p.device_mesh,
            p.placements,
            run_check=False,
            shape=full_grad.shape,
            stride=full_grad.stride(),
        )
    else:
        p.grad = full_grad.clone()


def full(p) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p.full_tensor() if isinstance(p, DTensor) else p.detach()
