"""RaggedShard through torch's DTensor entry points: ``distribute_tensor``, ``from_local``, factories.

Each ``make_*`` takes torch's original function (``stock``) and returns the implementation that
``raggedfsdp/placement/_patches.py`` installs in the original's code object, so every alias of
``torch.distributed.tensor.distribute_tensor`` / ``DTensor.from_local`` / ``zeros`` ... reaches it,
whenever it was imported. Without a RaggedShard in ``placements`` they call ``stock`` unchanged.

Source: torch/distributed/tensor/_api.py (``distribute_tensor``, ``DTensor.from_local``,
``_dtensor_init_helper``), torch 2.11 - 2.15.
"""

from __future__ import annotations

import math

import torch

from raggedfsdp.placement._redistribute import (
    _coord,
    base_local_shape,
    base_placements,
    check_placements,
    has_ragged,
    local_piece_of_full,
    make_spec,
    ragged_mesh_dim,
)


def make_distribute_tensor(stock):
    def distribute_tensor(tensor, device_mesh=None, placements=None, *, src_data_rank=0):
        """RaggedShard: distributed as Replicate (broadcast from ``src_data_rank``), then sliced locally."""
        from torch.distributed.tensor import DTensor

        if placements is None or not has_ragged(placements):
            return stock(tensor, device_mesh, placements, src_data_rank=src_data_rank)
        mesh = device_mesh or _current_mesh()
        placements = tuple(placements)
        check_placements(placements, tuple(tensor.shape), mesh)
        base = stock(tensor.detach(), mesh, base_placements(placements), src_data_rank=src_data_rank)
        i = ragged_mesh_dim(placements)
        local = placements[i].shard_full(base._local_tensor, _coord(mesh, i))
        spec = make_spec(mesh, placements, tensor.shape, tensor.stride(), tensor.dtype)
        return DTensor(local.requires_grad_(tensor.requires_grad), spec, requires_grad=tensor.requires_grad)

    return distribute_tensor


def make_from_local(stock):
    def from_local(
        local_tensor, device_mesh=None, placements=None, *, run_check=False, shape=None, stride=None, **kwargs
    ):
        """RaggedShard: ``shape=`` and ``stride=`` are required (a flat piece does not imply them)."""
        if placements is not None and has_ragged(placements):
            if shape is None or stride is None:
                raise ValueError(
                    f"DTensor.from_local with {tuple(placements)}: a RaggedShard local tensor is a flat "
                    "piece, so the global shape cannot be inferred; pass shape=<global shape> and "
                    "stride=<global contiguous stride>"
                )
            mesh = device_mesh or _current_mesh()
            check_placements(tuple(placements), tuple(shape), mesh)
            i = ragged_mesh_dim(placements)
            base = base_local_shape(tuple(shape), mesh, placements)
            want = placements[i].local_numel(base, _coord(mesh, i))
            if local_tensor.dim() != 1 or local_tensor.numel() != want:
                raise ValueError(
                    f"DTensor.from_local with {placements[i]}: local_tensor must be 1-D with {want} elements "
                    f"on this rank for global shape {tuple(shape)}, got shape {tuple(local_tensor.shape)}; "
                    "use local_tensor.reshape(-1) of the rows placement.row_range(shape, rank)"
                )
        return stock(
            local_tensor, device_mesh, placements, run_check=run_check, shape=shape, stride=stride, **kwargs
        )

    return from_local


def _current_mesh():
    from torch.distributed.device_mesh import _mesh_resources

    return _mesh_resources.get_current_mesh()


_FULL_DRAW = ("rand", "randn", "linspace", "logspace")


def make_dtensor_init_helper(stock):
    def _dtensor_init_helper(init_op, size, device_mesh=None, placements=None, **kwargs):
        """DTensor factories with RaggedShard: the local tensor is this rank's flat piece.

        ``zeros/ones/empty/full`` allocate only the piece. ``rand/randn`` (and ``linspace/logspace``)
        compute the full tensor on every rank and keep the piece: same values as single-device
        ``torch.rand(size)`` with the same seed, whatever the layout (as ``placement/_random.py``).
        """
        from torch.distributed.tensor import DTensor

        if placements is None or not has_ragged(placements):
            return stock(init_op, size, device_mesh, placements, **kwargs)
        mesh = device_mesh or _current_mesh()
        placements = tuple(placements)
        size = torch.Size(size)
        check_placements(placements, tuple(size), mesh)
        if kwargs.get("layout", torch.strided) != torch.strided:
            raise ValueError(f"DTensor factory with {placements}: only layout=torch.strided is supported")
        kw = {k: v for k, v in kwargs.items() if k not in ("layout", "requires_grad")}
        kw["device"] = mesh.device_type
        requires_grad = bool(kwargs.get("requires_grad", False))
        name = getattr(init_op, "__name__", str(init_op))
        i = ragged_mesh_dim(placements)
        numel = placements[i].local_numel(base_local_shape(tuple(size), mesh, placements), _coord(mesh, i))
        if init_op is torch.full:
            local = torch.full((numel,), kw.pop("fill_value", 0), **kw)
        elif init_op in (torch.zeros, torch.ones, torch.empty):
            local = init_op((numel,), **kw)
        elif name in _FULL_DRAW:
            if name in ("linspace", "logspace"):
                full = init_op(steps=size[0], **kw)
            else:
                full = init_op(size, **kw)
            local = local_piece_of_full(full, mesh, placements)
        else:
            raise NotImplementedError(
                f"DTensor factory {name} is not supported with {placements}; create the tensor with "
                "Replicate() and redistribute, or use distribute_tensor"
            )
        stride = (
            tuple(int(s) for s in torch._prims_common.make_contiguous_strides_for(size)) if len(size) else ()
        )
        assert local.numel() == numel and math.prod(size) >= numel
        spec = make_spec(mesh, placements, size, stride, local.dtype)
        return DTensor(local.requires_grad_(requires_grad), spec, requires_grad=requires_grad)

    return _dtensor_init_helper
