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
    tp_cols: int = 0  # > 0: TP-major order of this many column blocks (2-D Shard(1), shard_info tp="global")

    @property
    def world_size(self) -> int:
        return len(self.ranges)


def local_flat(t: Tensor) -> Tensor:
    """The flat local tensor of a DTensor / tensor (a view)."""
    from torch.distributed.tensor import DTensor

    loc = t._local_tensor if isinstance(t, DTensor) else t
    return loc.view(-1) if loc.is_contiguous() else loc.reshape(-1)


def shard_info(p: Tensor, name: str = "", *, tp: str = "reject") -> ShardInfo:
    """:class:`ShardInfo` of ``p`` (plain tensor or DTensor). Not collective.

    ``tp`` says what to do with tensor-parallel ``Shard`` placements next to the RaggedShard (FSDP x TP,
    Note [FSDP x TP] in ``raggedfsdp/fsdp/_tp.py``; RaggedShard is applied to the TP-local tensor):

    * ``"reject"``: raise (an optimizer that would see partial matrices);
    * ``"local"``: the layout of this rank's TP-local tensor over the ragged dim (``shape`` is the
      TP-local shape): for element- or tile-wise optimizers whose blocks the TP split keeps whole;
    * ``"global"``: the whole logical tensor: one piece per (TP coordinate, ragged coordinate), in
      *TP-major* flat order (TP-local tensor ``t`` at offset ``t * local_numel``, which is the
      row-major order for ``Shard(0)``), held by the ranks at those coordinates (other dims replicate);
      for a 2-D ``Shard(1)`` weight ``tp_cols`` is the TP size (:func:`tp_major_to_matrix`). For Muon:
      Newton-Schulz on the full logical matrix, owners over the whole dp x tp world.

    Raises:
        NotImplementedError: ``Partial`` placements; ``tp="reject"`` with a ``Shard``; ``tp="global"``
            with more than one ``Shard`` mesh dim or a ``Shard(d)`` other than ``Shard(0)`` / 2-D
            ``Shard(1)``.
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
                "RaggedShard with Replicate (FSDP / HSDP) or tensor-parallel Shard companions and plain "
                "tensors are supported here"
            )
    if rs_dim is None:
        if tp_dims:
            raise NotImplementedError(
                f"raggedfsdp.optim: parameter {name or tuple(shape)} is tensor-parallel {p.placements} but "
                "not sharded by fully_shard; shard it with raggedfsdp.fully_shard over the dp mesh"
            )
        return ShardInfo(shape, local_flat(p), None, 0, ((0, p.numel()),), ())
    mesh = p.device_mesh
    rs: RaggedShard = p.placements[rs_dim]
    group = mesh.get_group(rs_dim)
    import torch.distributed as dist

    ranks = tuple(dist.get_process_group_ranks(group))
    local_shape = list(shape)
    for j in tp_dims:
        local_shape[p.placements[j].dim % len(shape)] //= mesh.size(j)
    local_shape = tuple(local_shape)
    if not tp_dims or tp == "local":
        world, me, holders, replica = _world_layout(mesh, rs_dim)
        return ShardInfo(
            local_shape,
            local_flat(p),
            group,
            mesh.get_local_rank(rs_dim),
            tuple(rs.flat_ranges(local_shape)),
            ranks,
            world,
            me,
            holders,
            replica,
        )
    if len(tp_dims) > 1:
        raise NotImplementedError(
            f"raggedfsdp.optim: parameter {name or tuple(shape)} has placements {p.placements}: more than "
            "one Shard mesh dim (e.g. EP x TP) is not supported by this optimizer"
        )
    j = tp_dims[0]
    d = p.placements[j].dim % len(shape)
    if not (d == 0 or (d == 1 and len(shape) == 2)):
        raise NotImplementedError(
            f"raggedfsdp.optim: parameter {name or tuple(shape)}: {p.placements[j]} of a {len(shape)}-D "
            "tensor; only Shard(0) (any rank) and Shard(1) of a 2-D matrix are supported"
        )
    world, me, holders, replica = _world_layout(mesh, rs_dim, j)
    n_local = math.prod(local_shape)
    ranges = tuple(
        (t * n_local + a, t * n_local + b)
        for t in range(mesh.size(j))
        for a, b in rs.flat_ranges(local_shape)
    )
    piece = mesh.get_local_rank(j) * mesh.size(rs_dim) + mesh.get_local_rank(rs_dim)
    return ShardInfo(
        shape,
        local_flat(p),
        group,
        piece,
        ranges,
        ranks,
        world,
        me,
        holders,
        replica,
        tp_cols=mesh.size(j) if d == 1 else 0,
    )


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


def _world_layout(mesh, rs_dim: int, tp_dim: int | None = None):
    """``(world, me, holders, replica)`` of :class:`ShardInfo` for a mesh whose dim ``rs_dim`` is ragged
    (and, with ``tp_dim``, whose pieces are also split over that TP dim: pieces ``t * n_rs + i``).

    Every other mesh dim is a replicate dim: the replica index of a rank is its row-major coordinate
    over those dims. Pure metadata (``mesh.mesh``), cached per mesh.
    """
    import torch.distributed as dist

    key = (tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist()), rs_dim, tp_dim)
    hit = _WORLD_CACHE.get(key)
    if hit is None:
        grid = mesh.mesh
        world = tuple(sorted(grid.flatten().tolist()))
        index = {g: w for w, g in enumerate(world)}
        if tp_dim is None:
            moved = grid.movedim(rs_dim, -1).reshape(-1, grid.shape[rs_dim])  # (replicas, pieces)
        else:  # (replicas, tp, rs) -> pieces t-major
            moved = grid.movedim((tp_dim, rs_dim), (-2, -1)).reshape(
                -1, grid.shape[tp_dim] * grid.shape[rs_dim]
            )
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
    """Wrap ``local`` (flat, ``p``'s local numel, any dtype) as a DTensor laid out like ``p`` (or return
    it)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return local.view(p.shape)
    return DTensor.from_local(
        local,
        p.device_mesh,
        p.placements,
        run_check=False,
        shape=p.shape,
        stride=torch.empty(p.shape, device="meta").stride(),
    )


def wrap_like(p: Tensor, local: Tensor, shape, units) -> Tensor:
    """``local`` (flat) as a DTensor laid out like ``p`` with global ``shape``, or a plain view.

    ``units=None``: ``p``'s own placements (state shaped like the parameter); else the ragged dim
    becomes ``RaggedShard((0,), units)`` (dim-0 slabs per rank, e.g. AdamW8bit's tile rows or
    Shampoo's bands), the replicate dims stay.
    """
    from torch.distributed.tensor import DTensor

    shape = tuple(shape)
    if not isinstance(p, DTensor):
        return local.view(shape)
    placements = tuple(
        (RaggedShard((0,), units) if units is not None else pl) if isinstance(pl, RaggedShard) else pl
        for pl in p.placements
    )
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, p.device_mesh, placements, run_check=False, shape=shape, stride=stride)
