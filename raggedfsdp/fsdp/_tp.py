"""FSDP over a sub-mesh of parameters that already are DTensors (tensor / expert parallel).

Note [FSDP x TP]
    ``fully_shard(block, mesh=mesh["dp"])`` after ``parallelize_module(block, mesh["tp"], plan)``: each
    parameter is a DTensor on the ``tp`` dim of the same root mesh (``Shard(0)`` colwise, ``Shard(1)``
    rowwise, ``Replicate()``, an expert stack ``Shard(0)`` on ``ep``). As torch FSDP2
    (``torch/distributed/fsdp/_fully_shard/_fsdp_param.py: _init_sharding_spec_tp``,
    ``init_unsharded_param``):

    * the unit plans, shards and all-gathers the TP-LOCAL tensor (``FSDPParam.shape``): FSDP's
      collectives run over the dp dim only and never mix TP ranks' data;
    * the sharded parameter is one DTensor on ``DeviceMesh._concatenate([dp_mesh, tp_mesh])`` whose
      placements keep mesh-dim order: ``(RaggedShard, *tp)`` (HSDP ``(Replicate(), RaggedShard, *tp)``).
      RaggedShard is applied innermost (on the TP-local tensor, ``placement/_redistribute.py``), which
      is exactly what FSDP2 expresses with ``_StridedShard`` on the dp dim, so ``full_tensor()``,
      ``redistribute()``, DCP and the optimizers see the true global tensor;
    * the unsharded parameter during forward / backward is the TP-local DTensor on the TP mesh with the
      original TP placements, so TP's module hooks and the DTensor ops in forward keep working; its
      DTensor gradient is reduced by its local tensor (``FSDPParam.local_grad``).

    Block specs (``shard_placement_fn``) are defined on the global shape and no TP boundary may cut a
    block either (``raggedfsdp.planner.granularity_for_local``). TP placements must split their dims
    evenly (else the TP-local shapes, hence the ragged layouts, would differ across TP ranks).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from raggedfsdp._compat import concatenate_meshes, root_mesh
from raggedfsdp.placement import RaggedShard


def _root(mesh: DeviceMesh) -> DeviceMesh:
    return root_mesh(mesh)  # DeviceMesh._get_root_mesh, read through raggedfsdp/_compat.py


def tp_spec_of(p: nn.Parameter, fqn: str, dp_mesh: DeviceMesh) -> DTensorSpec | None:
    """The TP/EP DTensor spec of a parameter that ``fully_shard`` may shard again over ``dp_mesh``, or
    ``None`` for a plain tensor. Not collective.

    Raises:
        ValueError: a DTensor on a mesh of another root, on dims that overlap ``dp_mesh``'s, with a
            ``Partial`` or uneven ``Shard`` placement, or a non-contiguous local tensor.
        NotImplementedError: ``_StridedShard`` or other placements.
    """
    if not isinstance(p, DTensor):
        return None
    spec = p._spec
    tp_mesh = spec.mesh
    where = (
        f"fully_shard: parameter {fqn!r} is a DTensor with placements {tuple(spec.placements)} on {tp_mesh}"
    )
    if _root(tp_mesh) is not _root(dp_mesh) and _root(tp_mesh) != _root(dp_mesh):
        twin = _twin_submesh(dp_mesh, tp_mesh)
        if twin is not None:  # torch handed out an equal mesh of another root (see _twin_submesh)
            spec = DTensorSpec(twin, spec.placements, spec.tensor_meta)
            tp_mesh = twin
    if _root(tp_mesh) is not _root(dp_mesh) and _root(tp_mesh) != _root(dp_mesh):
        raise ValueError(
            f"{where}, which is not derived from the same root mesh as the FSDP mesh {dp_mesh}; build both "
            "from one init_device_mesh(..., mesh_dim_names=('dp', 'tp')) and pass mesh=root['dp'] to "
            "fully_shard"
        )
    dp_names = set(dp_mesh.mesh_dim_names or ())
    tp_names = set(tp_mesh.mesh_dim_names or ())
    if not dp_names or not tp_names or dp_names & tp_names:
        raise ValueError(
            f"{where}: the FSDP mesh dims {dp_mesh.mesh_dim_names} and the parameter's mesh dims "
            f"{tp_mesh.mesh_dim_names} must be named and disjoint (FSDP shards over the dims TP does not use)"
        )
    for j, pl in enumerate(spec.placements):
        if isinstance(pl, Replicate):
            continue
        if type(pl) is Shard:
            d = pl.dim % len(spec.shape)
            if spec.shape[d] % tp_mesh.size(j):
                raise ValueError(
                    f"{where}: {pl} splits dim {d} of size {spec.shape[d]} unevenly over {tp_mesh.size(j)} "
                    "ranks; "
                    "FSDP x TP needs one TP-local shape on every rank (make the dim divisible, e.g. pad it)"
                )
            continue
        if pl.is_partial():
            raise ValueError(
                f"{where}: a Partial parameter cannot be sharded; redistribute it to Replicate()"
            )
        if isinstance(pl, RaggedShard):
            raise ValueError(f"{where}: it is already sharded by fully_shard (tied across units?)")  # noqa: TRY004
        raise NotImplementedError(
            f"{where}: placement {pl} is not supported by fully_shard (use Shard/Replicate)"
        )
    if not p._local_tensor.is_contiguous():
        raise ValueError(f"{where}: its local tensor is not contiguous; make the TP-local data .contiguous()")
    return spec


def _twin_submesh(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> DeviceMesh | None:
    """The sub-mesh of ``dp_mesh``'s root with ``tp_mesh``'s dim names and ranks, or None. Local.

    Two root meshes in one process whose 1-D ``tp`` sub-meshes hold the same ranks compare equal, and torch
    (2.13, ``parallelize_module`` / ``distribute_tensor``) may give a parameter the first one it made: a TP
    parameter of the second model then sits on the first root's ``tp`` mesh although it was parallelized over
    the second's. Same ranks, same groups: the equal sub-mesh of the FSDP mesh's root stands in for it.
    """
    names = tuple(tp_mesh.mesh_dim_names or ())
    root = _root(dp_mesh)
    if not names or not set(names) <= set(root.mesh_dim_names or ()):
        return None
    twin = root[names] if len(names) > 1 else root[names[0]]
    return twin if twin.mesh.tolist() == tp_mesh.mesh.tolist() else None


def spmd_mesh(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> DeviceMesh:
    """The mesh of a sharded TP parameter: the dp dims then the TP dims (FSDP2's ``_spmd_mesh``). Local."""
    return concatenate_meshes([dp_mesh, tp_mesh])  # DeviceMesh._concatenate (raggedfsdp/_compat.py)


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """The tensor ``fully_shard`` plans and shards: a DTensor's local tensor, or ``p`` itself."""
    return p._local_tensor if isinstance(p, DTensor) else p
