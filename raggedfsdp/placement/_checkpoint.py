"""Distributed-checkpoint (DCP) support for RaggedShard DTensors: N-D boxes, no gather.

A rank's RaggedShard piece is a contiguous range of the C-ordered flattened tensor made of whole
rows of the ``dims`` prefix. Such a range is a union of at most ``2k - 1`` axis-aligned N-D boxes
(``k = len(dims)``): a partial leading run, a full middle block, a partial trailing run, applied
recursively per dim (:func:`flat_range_boxes`). Each box becomes one DCP chunk / ``WriteItem``
in GLOBAL coordinates, so each rank writes only its own piece and DCP's ordinary overlap
matching loads any saved layout into any other one (other local_units or dims, Shard, Replicate,
a plain tensor, another world size).

Installed by ``raggedfsdp/_torch_patches.py`` on the DTensor CLASS (not on instances), so it also
covers optimizer states (``zeros_like(param)``) and ``load_state_dict(assign=True)`` copies.
Patched symbols (all delegate to torch when no RaggedShard is present):

* ``DTensor.__create_write_items__`` / ``__create_chunk_list__`` / ``__get_tensor_shard__``
  (torch/distributed/tensor/_api.py): one chunk per box instead of one per DTensor.
* ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset`` (and the names
  imported from it in ``checkpoint.planner_helpers`` and ``_state_dict_utils``): exact for
  RaggedShard pieces that are boxes (always for ``dims=(0,)``); raises ``ValueError`` for pieces
  that are not rectangular instead of silently describing the whole tensor.
* ``torch.distributed._state_dict_utils.distribute_tensor`` and ``_distribute_tensors``: used by
  ``set_model_state_dict(full_state_dict=True[, broadcast_from_rank0=True])``; the ragged piece is
  sliced from the full tensor as a flat range.

Source: paper-notes section 1.4 (veScale ``_break_ragged_box``, design only);
fsdp2-internals.md section 3.6 (DCP save/load path in torch 2.13).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from raggedfsdp.placement._redistribute import (
    _coord,
    _stock_local_shape,
    base_placements,
    check_placements,
    has_ragged,
    ragged_mesh_dim,
)
from raggedfsdp.placement.ragged_shard import RaggedShard

Box = tuple[tuple[int, ...], tuple[int, ...], int]  # (offsets, sizes, flat start) in one tensor


def flat_range_boxes(shape: Sequence[int], start: int, end: int) -> list[Box]:
    """Decompose elements ``[start, end)`` of a C-contiguous tensor of ``shape`` into N-D boxes.

    Returns ``(offsets, sizes, flat_start)`` triples in increasing flat order; their volumes sum to
    ``end - start`` and each box is one contiguous run of the range (pure, no communication).
    """
    shape = tuple(int(s) for s in shape)
    if start >= end:
        return []
    if len(shape) == 0:
        return [((), (), start)]
    if len(shape) == 1:
        return [((start,), (end - start,), start)]
    inner = math.prod(shape[1:])
    r0, o0 = divmod(start, inner)
    r1, o1 = divmod(end, inner)

    def sub(row: int, a: int, b: int) -> list[Box]:
        return [((row, *o), (1, *s), row * inner + f) for o, s, f in flat_range_boxes(shape[1:], a, b)]

    if r0 == r1:
        return sub(r0, o0, o1)
    out: list[Box] = []
    if o0:
        out += sub(r0, o0, inner)
        r0 += 1
    if r1 > r0:
        out.append(((r0, *([0] * (len(shape) - 1))), (r1 - r0, *shape[1:]), r0 * inner))
    if o1:
        out += sub(r1, 0, o1)
    return out


def local_boxes(dt) -> list[Box]:
    """This rank's boxes of a RaggedShard DTensor in GLOBAL coordinates (flat start local to the piece).

    Not collective. ``flat_start`` of each returned box is the element offset inside the flat local
    tensor. Handles RaggedShard composed with Replicate / Shard(d >= len(dims)) on other mesh dims.
    """
    spec = dt._spec
    mesh, pl, gshape = spec.mesh, tuple(spec.placements), tuple(spec.shape)
    check_placements(pl, gshape, mesh)
    i = ragged_mesh_dim(pl)
    rs: RaggedShard = pl[i]
    base_pl = base_placements(pl)
    fn = _stock_clsgo()
    base_shape, base_off = fn(gshape, mesh, list(base_pl))
    a, b = rs.flat_range(tuple(base_shape), _coord(mesh, i))
    out = []
    for off, size, fs in flat_range_boxes(tuple(base_shape), a, b):
        out.append((tuple(o + g for o, g in zip(off, base_off)), size, fs - a))
    return out


def _stock_clsgo():
    from torch.distributed.tensor import _utils

    fn = _utils.compute_local_shape_and_global_offset
    return getattr(fn, "__ragged_original__", fn)


def _empty_chunk_owner(dt) -> bool:
    """For a 0-element tensor one rank must still write a (0-size) chunk so the key is saved."""
    return dt.numel() == 0 and all(dt.device_mesh.get_coordinate() is None or c == 0
                                   for c in dt.device_mesh.get_coordinate())


def create_write_items(dt, fqn: str):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    props = TensorProperties.create_from_tensor(dt._local_tensor)
    boxes = local_boxes(dt)
    if not boxes and _empty_chunk_owner(dt):
        boxes = [((0,) * dt.dim(), tuple(dt.shape), 0)]
    return [
        WriteItem(
            index=MetadataIndex(fqn, torch.Size(off), k),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(size)),
                properties=props,
                size=dt.size(),
            ),
        )
        for k, (off, size, _) in enumerate(boxes)
    ]


def create_chunk_list(dt):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s, _ in local_boxes(dt)]


def get_tensor_shard(dt, index):
    """The box of ``index`` as an N-D view into the flat local tensor (writes land in place)."""
    boxes = local_boxes(dt)
    local = dt._local_tensor
    if not boxes and dt.numel() == 0:
        return local.view(dt.shape) if local.numel() == 0 else local
    cands = []
    if index.index is not None and 0 <= index.index < len(boxes):
        cands.append(boxes[index.index])
    cands += boxes
    for off, size, fs in cands:
        if torch.Size(off) == index.offset:
            return local.narrow(0, fs, math.prod(size)).view(size)
    raise ValueError(f"RaggedShard checkpoint: no local box at offset {tuple(index.offset)} for {index.fqn}")


# ---- compute_local_shape_and_global_offset -----------------------------------------------
def make_compute_local_shape_and_global_offset(stock):
    @functools.wraps(stock)
    def compute_local_shape_and_global_offset(global_shape, mesh, placements, *args, **kwargs):
        if not has_ragged(placements):
            return stock(global_shape, mesh, placements, *args, **kwargs)
        placements = tuple(placements)
        gshape = tuple(int(s) for s in global_shape)
        check_placements(placements, gshape, mesh)
        if not mesh._is_current_rank_part_of_mesh():
            return (0,) * len(gshape), (0,) * len(gshape)
        i = ragged_mesh_dim(placements)
        rs: RaggedShard = placements[i]
        base_shape, base_off = stock(gshape, mesh, list(base_placements(placements)))
        base_shape = tuple(base_shape)
        a, b = rs.flat_range(base_shape, _coord(mesh, i))
        boxes = flat_range_boxes(base_shape, a, b)
        if not boxes:  # empty piece: a 0-size box at its position along dim 0
            inner = math.prod(base_shape[1:])
            row0 = min(a // inner, base_shape[0]) if inner else 0
            sizes = (0, *base_shape[1:])
            off = (row0, *([0] * (len(base_shape) - 1)))
            return sizes, tuple(o + g for o, g in zip(off, base_off))
        if len(boxes) > 1:
            raise ValueError(
                f"compute_local_shape_and_global_offset: the {rs} piece of shape {gshape} on this rank is not a "
                f"rectangle (it is {len(boxes)} boxes). Use raggedfsdp.placement._checkpoint.local_boxes(dtensor), "
                "or coarser dims (dims=(0,)) so each piece is whole rows"
            )
        off, size, _ = boxes[0]
        return tuple(size), tuple(o + g for o, g in zip(off, base_off))

    return compute_local_shape_and_global_offset


# ---- _state_dict_utils -------------------------------------------------------------------
def make_distribute_tensors(stock):
    @functools.wraps(stock)
    def _distribute_tensors(local_state_dict, keys, device, pg=None):
        from torch.distributed.tensor import DTensor

        rest = []
        for key in keys:
            item = local_state_dict.get(key)
            if (
                isinstance(item, (tuple, list))
                and len(item) == 2
                and isinstance(item[0], DTensor)
                and has_ragged(item[0].placements)
            ):
                local_state, full = item
                mesh, pl = local_state.device_mesh, tuple(local_state.placements)
                check_placements(pl, tuple(full.shape), mesh)
                base_pl = base_placements(pl)
                bshape, boff = _stock_clsgo()(tuple(full.shape), mesh, list(base_pl))
                base = full[tuple(slice(o, o + s) for o, s in zip(boff, bshape))]
                i = ragged_mesh_dim(pl)
                piece = pl[i].shard_full(base, _coord(mesh, i)).to(device)
                if local_state.is_meta:
                    ret = DTensor.from_local(piece, mesh, pl, shape=local_state.shape, stride=local_state.stride())
                else:
                    ret = local_state
                    ret.to_local().copy_(piece)
                local_state_dict[key] = ret
            else:
                rest.append(key)
        if rest:
            stock(local_state_dict, rest, device, pg)

    return _distribute_tensors


def install(set_attr, original, registry) -> None:
    """Install the DCP patches (called by ``raggedfsdp._torch_patches.apply``)."""
    from torch.distributed.tensor import DTensor

    for name, impl in (
        ("__create_write_items__", lambda self, fqn, object, _s=None: create_write_items(self, fqn)),
        ("__create_chunk_list__", lambda self: create_chunk_list(self)),
        ("__get_tensor_shard__", lambda self, index: get_tensor_shard(self, index)),
    ):
        stock = DTensor.__dict__[name]
        if getattr(stock, "__ragged_patched__", False):
            continue

        def make(stock=stock, impl=impl):
            @functools.wraps(stock)
            def method(self, *args, **kwargs):
                if has_ragged(self._spec.placements):
                    self._raise_if_contains_partial_placements()  # as torch: no Partial in checkpoints
                    return impl(self, *args, **kwargs)
                return stock(self, *args, **kwargs)

            method.__ragged_patched__ = True
            method.__ragged_original__ = stock
            return method

        registry[f"torch.distributed.tensor._api:DTensor.{name}"] = stock
        setattr(DTensor, name, make())

    utils = "torch.distributed.tensor._utils"
    clsgo = make_compute_local_shape_and_global_offset(original(utils, "compute_local_shape_and_global_offset"))
    for mod in (utils, "torch.distributed.checkpoint.planner_helpers", "torch.distributed._state_dict_utils"):
        set_attr(mod, "compute_local_shape_and_global_offset", clsgo)
    sdu = "torch.distributed._state_dict_utils"
    from torch.distributed.tensor import _api

    set_attr(sdu, "distribute_tensor", _api.distribute_tensor)
    set_attr(sdu, "_distribute_tensors", make_distribute_tensors(original(sdu, "_distribute_tensors")))
