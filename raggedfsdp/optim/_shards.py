"""Where a parameter's elements live: the flat piece of each rank of its ragged mesh dim (no communication).

A managed parameter is an ``nn.Parameter(DTensor)`` with placements ``(RaggedShard,)`` (FSDP) or
``(Replicate(), RaggedShard)`` (HSDP); its local tensor is the flat, contiguous piece
``RaggedShard.flat_range(shape, rank)`` of the row-major flattened tensor. A plain tensor, or a
DTensor that is ``Replicate()`` on every mesh dim, is "whole on every rank" and is treated as a
single-rank layout (no communication; each rank updates its own copy).

Expert parallel: an expert stack ``(E, d, h)`` sharded by FSDP beside EP has placements
``(RaggedShard, Shard(0))`` on a ``(dp, ep)`` mesh (``models.apply_ep`` + ``apply_fsdp(experts_mesh=)``).
A ``Shard`` on a *stack* dim (any dim but the last two) splits whole matrices between ranks, so the
optimizer sees this rank's EP-local stack ``(E/ep, d, h)`` as the parameter, laid out by the RaggedShard
over the remaining mesh dims (``ShardInfo.shape`` is then the local shape): every expert matrix stays
whole for Muon and 8-bit tiles stay global tiles. A ``Shard`` on a matrix dim (tensor parallel) still raises.
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
    """

    shape: tuple[int, ...]
    local: Tensor
    group: object
    rank: int
    ranges: tuple[tuple[int, int], ...]
    group_key: tuple[int, ...]

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
    shape, mesh, placements = stack_local_view(p)
    rs_dim = None
    for i, pl in enumerate(placements):
        if isinstance(pl, RaggedShard):
            rs_dim = i
        elif not isinstance(pl, Replicate):
            raise NotImplementedError(
                f"raggedfsdp.optim: parameter {name or tuple(shape)} has placements {p.placements}; only "
                "RaggedShard with Replicate companions (FSDP / HSDP), Shard on an expert-stack dim (EP) and "
                "plain tensors are supported (tensor-parallel Shard placements would give the optimizer "
                "partial matrices)"
            )
    if rs_dim is None:
        return ShardInfo(shape, local_flat(p), None, 0, ((0, local_flat(p).numel()),), ())
    rs: RaggedShard = placements[rs_dim]
    group = mesh.get_group(rs_dim)
    import torch.distributed as dist

    ranks = tuple(dist.get_process_group_ranks(group))
    return ShardInfo(shape, local_flat(p), group, mesh.get_local_rank(rs_dim), tuple(rs.flat_ranges(shape)), ranks)


def stack_local_view(p) -> tuple[tuple[int, ...], object, tuple]:
    """``(shape, mesh, placements)`` of DTensor ``p`` once its ``Shard`` placements on stack dims (EP) are
    taken as local: the shape divided along them, the mesh without their mesh dims. Not collective.

    A parameter without such placements is returned as is (global shape, its mesh and placements).
    """
    from torch.distributed.tensor import Shard

    shape = [int(s) for s in p.shape]
    mesh, pls = p.device_mesh, tuple(p.placements)
    stack = [j for j, pl in enumerate(pls) if type(pl) is Shard and pl.dim % len(shape) < len(shape) - 2]
    if not stack:
        return tuple(shape), mesh, pls
    for j in stack:
        d = pls[j].dim % len(shape)
        shape[d] //= mesh.size(j)  # even: FSDP x EP requires it (fsdp/_tp.py)
    keep = [j for j in range(mesh.ndim) if j not in stack]
    if not keep:
        return tuple(shape), None, ()
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(f"raggedfsdp.optim: an expert-parallel parameter needs named mesh dims, got {mesh}")
    sub = mesh[tuple(names[j] for j in keep)] if len(keep) > 1 else mesh[names[keep[0]]]
    return tuple(shape), sub, tuple(pls[j] for j in keep)


def like_param(p: Tensor, local: Tensor) -> Tensor:
    """Wrap ``local`` (flat, ``p``'s local numel, any dtype) as a DTensor laid out like ``p`` (or return it)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return local.view(p.shape)
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                              stride=torch.empty(p.shape, device="meta").stride())
