"""Where a parameter's elements live: the flat piece of each rank of its ragged mesh dim (no communication).

A managed parameter is an ``nn.Parameter(DTensor)`` with placements ``(RaggedShard,)`` (FSDP) or
``(Replicate(), RaggedShard)`` (HSDP); its local tensor is the flat, contiguous piece
``RaggedShard.flat_range(shape, rank)`` of the row-major flattened tensor. A plain tensor, or a
DTensor that is ``Replicate()`` on every mesh dim, is "whole on every rank" and is treated as a
single-rank layout (no communication; each rank updates its own copy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from raggedfsdp.placement.ragged_shard import RaggedShard


@dataclass(frozen=True)
class ShardInfo:
    """Layout of one parameter over the process group of its RaggedShard mesh dim.

    Attributes:
        shape: global shape (for ``tp="local"``: the TP-local shape the ranges refer to).
        local: this rank's flat 1-D local tensor (a view: writes land in the parameter).
        group: process group of the ragged mesh dim (``None``: not sharded).
        rank: this rank's index in ``group`` (0 if ``None``).
        ranges: flat element range ``[a, b)`` of every rank of ``group``, in rank order.
        group_key: hashable identity of ``group`` (its global ranks) used to batch collectives.
    """

    shape: tuple[int, ...]
    local: Tensor
    group: object
    rank: int
    ranges: tuple[tuple[int, int], ...]
    group_key: tuple[int, ...]
    tp_cols: int = 0  # > 0: ranges are in TP-major order of this many column blocks (2-D Shard(1), tp="global")

    @property
    def world_size(self) -> int:
        return len(self.ranges)


def local_flat(t: Tensor) -> Tensor:
    """The flat local tensor of a DTensor / tensor (a view)."""
    from torch.distributed.tensor import DTensor

    loc = t._local_tensor if isinstance(t, DTensor) else t
    return loc.view(-1) if loc.is_contiguous() else loc.reshape(-1)


def shard_info(p: Tensor, name: str = "", *, tp: str = "reject") -> ShardInfo:
    """:class:`ShardInfo` of ``p`` (plain tensor or DTensor). Not collective, except that ``tp="global"``
    creates (once per mesh, cached) the process group over the ragged and TP dims: call it on every rank.

    ``tp`` says what to do with tensor-parallel ``Shard`` placements next to the RaggedShard (FSDP x TP,
    Note [FSDP x TP] in ``raggedfsdp/fsdp/_tp.py``; RaggedShard is applied to the TP-local tensor):

    * ``"reject"``: raise (an optimizer that would see partial matrices);
    * ``"local"``: the layout of this rank's TP-local tensor over the ragged dim's group (``shape`` is
      the TP-local shape): for element- or tile-wise optimizers whose blocks the TP split keeps whole;
    * ``"global"``: the whole logical tensor over the group of the ragged dim x the TP ``Shard`` dim:
      ``ranges`` are intervals of the *TP-major* flat order (TP-local tensor ``t`` at offset
      ``t * local_numel``), which is the row-major order for ``Shard(0)``; for a 2-D ``Shard(1)``
      weight ``tp_cols`` is the TP size (see :func:`tp_major_to_matrix`). For Muon: Newton-Schulz on the
      full logical matrix, owners over the whole dp x tp group.

    Raises:
        NotImplementedError: ``Partial`` placements; ``tp="reject"`` with a ``Shard``; ``tp="global"`` with
            more than one ``Shard`` mesh dim or a ``Shard(d)`` other than ``Shard(0)`` / a 2-D ``Shard(1)``.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    shape = tuple(int(s) for s in p.shape)
    if not isinstance(p, DTensor):
        return ShardInfo(shape, local_flat(p), None, 0, ((0, p.numel()),), ())
    rs_dim, tp_dims = None, []
    for i, pl in enumerate(p.placements):
        if isinstance(pl, RaggedShard):
            rs_dim = i
        elif type(pl) is Shard and tp != "reject":
            tp_dims.append(i)
        elif not isinstance(pl, Replicate):
            raise NotImplementedError(
                f"raggedfsdp.optim: parameter {name or tuple(shape)} has placements {p.placements}; only "
                "RaggedShard with Replicate (FSDP / HSDP) or tensor-parallel Shard companions and plain tensors "
                "are supported here"
            )
    mesh = p.device_mesh
    import torch.distributed as dist

    if rs_dim is None:
        if tp_dims:
            raise NotImplementedError(
                f"raggedfsdp.optim: parameter {name or tuple(shape)} is tensor-parallel {p.placements} but not "
                "sharded by fully_shard; shard it with raggedfsdp.fully_shard over the dp mesh"
            )
        return ShardInfo(shape, local_flat(p), None, 0, ((0, p.numel()),), ())
    rs: RaggedShard = p.placements[rs_dim]
    local_shape = _tp_local_shape(shape, mesh, p.placements, tp_dims)
    if not tp_dims or tp == "local":
        group = mesh.get_group(rs_dim)
        ranks = tuple(dist.get_process_group_ranks(group))
        return ShardInfo(local_shape, local_flat(p), group, mesh.get_local_rank(rs_dim),
                         tuple(rs.flat_ranges(local_shape)), ranks)
    if len(tp_dims) > 1:
        raise NotImplementedError(
            f"raggedfsdp.optim: parameter {name or tuple(shape)} has placements {p.placements}: more than one "
            "Shard mesh dim (e.g. EP x TP) is not supported by this optimizer"
        )
    j = tp_dims[0]
    d = p.placements[j].dim % len(shape)
    if not (d == 0 or (d == 1 and len(shape) == 2)):
        raise NotImplementedError(
            f"raggedfsdp.optim: parameter {name or tuple(shape)}: {p.placements[j]} of a {len(shape)}-D tensor; "
            "only Shard(0) (any rank) and Shard(1) of a 2-D matrix are supported"
        )
    group, order = _group_over(mesh, (rs_dim, j))
    n_local = math.prod(local_shape)
    ranges = tuple((c[j] * n_local + a, c[j] * n_local + b)
                   for c in order for a, b in [rs.flat_range(local_shape, c[rs_dim])])
    me = dist.get_rank(group)
    return ShardInfo(shape, local_flat(p), group, me, ranges, tuple(dist.get_process_group_ranks(group)),
                     tp_cols=mesh.size(j) if d == 1 else 0)


def _tp_local_shape(shape, mesh, placements, tp_dims) -> tuple[int, ...]:
    out = list(shape)
    for j in tp_dims:
        d = placements[j].dim % len(shape)
        out[d] //= mesh.size(j)
    return tuple(out)


_GROUPS: dict = {}


def _group_over(mesh, dims: tuple[int, int]):
    """The process group over mesh dims ``dims`` (this rank's slice of the other dims) and every group
    rank's mesh coordinates, in group-rank order. Collective the first time per (mesh, dims): every rank
    must call it in the same order (cached afterwards)."""
    import torch.distributed as dist

    names = tuple(mesh.mesh_dim_names[i] for i in sorted(dims))
    key = (tuple(mesh.mesh.flatten().tolist()), tuple(mesh.mesh.shape), names)
    if key not in _GROUPS:
        sub = mesh[names]
        _GROUPS[key] = sub._flatten("_".join(names) + "_raggedfsdp_optim").get_group()
    group = _GROUPS[key]
    coords = []
    for r in dist.get_process_group_ranks(group):
        c = (mesh.mesh == r).nonzero()
        coords.append(tuple(int(x) for x in c[0].tolist()))
    return group, coords


def tp_major_to_matrix(x: Tensor, rows: int, cols: int, tp_cols: int) -> Tensor:
    """A matrix in TP-major flat order (``tp_cols`` column blocks one after another) as the ``(rows, cols)``
    matrix; ``tp_cols == 0``: the order is already row-major. Local (a copy when permuted)."""
    if not tp_cols:
        return x.view(rows, cols)
    return x.view(tp_cols, rows, cols // tp_cols).permute(1, 0, 2).reshape(rows, cols)


def matrix_to_tp_major(x: Tensor, tp_cols: int) -> Tensor:
    """Inverse of :func:`tp_major_to_matrix`: flat, TP-major."""
    if not tp_cols:
        return x.reshape(-1)
    rows, cols = x.shape
    return x.view(rows, tp_cols, cols // tp_cols).permute(1, 0, 2).reshape(-1)


def like_param(p: Tensor, local: Tensor) -> Tensor:
    """Wrap ``local`` (flat, ``p``'s local numel, any dtype) as a DTensor laid out like ``p`` (or return it)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return local.view(p.shape)
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                              stride=torch.empty(p.shape, device="meta").stride())
