"""Where a parameter's elements live: the flat piece of each rank of its ragged mesh dim (no communication).

A managed parameter is an ``nn.Parameter(DTensor)`` with placements ``(RaggedShard,)`` (FSDP) or
``(Replicate(), RaggedShard)`` (HSDP); its local tensor is the flat, contiguous piece
``RaggedShard.flat_range(shape, rank)`` of the row-major flattened tensor. A plain tensor, or a
DTensor that is ``Replicate()`` on every mesh dim, is "whole on every rank" and is treated as a
single-rank layout (no communication; each rank updates its own copy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from raggedfsdp.placement.ragged_shard import RaggedShard


@dataclass(frozen=True)
class ShardInfo:
    """Layout of one parameter over the process group of its RaggedShard mesh dim.

    Attributes:
        shape: global shape.
        local: this rank's flat 1-D local tensor (a view: writes land in the parameter).
        group: process group of the ragged mesh dim (``None``: not sharded).
        rank: this rank's index in ``group`` (0 if ``None``).
        ranges: flat element range ``[a, b)`` of every rank of ``group``, in rank order.
        group_key: hashable identity of ``group`` (its global ranks) used to batch collectives.
        world: sorted global ranks of the whole mesh (every replica and shard rank); ``()`` if not
            sharded. World index ``w`` is the rank ``world[w]`` (= its rank in a group of ``world``).
        me: this rank's world index.
        holders: for every piece ``s`` (``ranges[s]``), the world indices holding a copy of it,
            ordered by replica index (HSDP ``(R, S)``: ``R`` holders per piece; FSDP: one).
        replica: the replica index of every world index (its position in its piece's holders).
    """

    shape: tuple[int, ...]
    local: Tensor
    group: object
    rank: int
    ranges: tuple[tuple[int, int], ...]
    group_key: tuple[int, ...]
    world: tuple[int, ...] = ()
    me: int = 0
    holders: tuple[tuple[int, ...], ...] = ((0,),)
    replica: tuple[int, ...] = (0,)

    @property
    def world_size(self) -> int:
        return len(self.ranges)


def local_flat(t: Tensor) -> Tensor:
    """The flat local tensor of a DTensor / tensor (a view)."""
    from torch.distributed.tensor import DTensor

    loc = t._local_tensor if isinstance(t, DTensor) else t
    return loc.view(-1) if loc.is_contiguous() else loc.reshape(-1)


def shard_info(p: Tensor, name: str = "") -> ShardInfo:
    """:class:`ShardInfo` of ``p`` (plain tensor or DTensor). Not collective.

    Raises:
        NotImplementedError: a DTensor with a ``Shard``/``Partial`` placement (tensor parallel):
            the optimizer would see only a TP-local block of each matrix.
    """
    from torch.distributed.tensor import DTensor, Replicate

    shape = tuple(int(s) for s in p.shape)
    if not isinstance(p, DTensor):
        return ShardInfo(shape, local_flat(p), None, 0, ((0, p.numel()),), ())
    rs_dim = None
    for i, pl in enumerate(p.placements):
        if isinstance(pl, RaggedShard):
            rs_dim = i
        elif not isinstance(pl, Replicate):
            raise NotImplementedError(
                f"raggedfsdp.optim: parameter {name or tuple(shape)} has placements {p.placements}; only "
                "RaggedShard with Replicate companions (FSDP / HSDP) and plain tensors are supported "
                "(tensor-parallel Shard placements would give the optimizer partial matrices)"
            )
    if rs_dim is None:
        return ShardInfo(shape, local_flat(p), None, 0, ((0, p.numel()),), ())
    mesh = p.device_mesh
    rs: RaggedShard = p.placements[rs_dim]
    group = mesh.get_group(rs_dim)
    import torch.distributed as dist

    ranks = tuple(dist.get_process_group_ranks(group))
    world, me, holders, replica = _world_layout(mesh, rs_dim)
    return ShardInfo(shape, local_flat(p), group, mesh.get_local_rank(rs_dim), tuple(rs.flat_ranges(shape)), ranks,
                     world, me, holders, replica)


def _world_layout(mesh, rs_dim: int):
    """``(world, me, holders, replica)`` of :class:`ShardInfo` for a mesh whose dim ``rs_dim`` is ragged.

    Every other mesh dim is a replicate dim: the replica index of a rank is its row-major coordinate
    over those dims. Pure metadata (``mesh.mesh``), cached per mesh.
    """
    import torch.distributed as dist

    key = (tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist()), rs_dim)
    hit = _WORLD_CACHE.get(key)
    if hit is None:
        grid = mesh.mesh
        world = tuple(sorted(grid.flatten().tolist()))
        index = {g: w for w, g in enumerate(world)}
        moved = grid.movedim(rs_dim, -1).reshape(-1, grid.shape[rs_dim])  # (replicas, pieces)
        holders = tuple(tuple(index[int(g)] for g in moved[:, s].tolist()) for s in range(moved.shape[1]))
        replica = [0] * len(world)
        for hs in holders:
            for k, w in enumerate(hs):
                replica[w] = k
        hit = _WORLD_CACHE[key] = (world, holders, tuple(replica))
    world, holders, replica = hit
    return world, world.index(dist.get_rank()), holders, replica


_WORLD_CACHE: dict = {}


def like_param(p: Tensor, local: Tensor) -> Tensor:
    """Wrap ``local`` (flat, ``p``'s local numel, any dtype) as a DTensor laid out like ``p`` (or return it)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return local.view(p.shape)
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                              stride=torch.empty(p.shape, device="meta").stride())
