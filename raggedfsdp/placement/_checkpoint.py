"""Distributed-checkpoint (DCP) support for RaggedShard DTensors: N-D boxes, no gather.

A rank's RaggedShard piece is a contiguous range of the C-ordered flattened tensor made of whole
rows of the ``dims`` prefix. Such a range is a union of at most ``2k - 1`` axis-aligned N-D boxes
(``k = len(dims)``): a partial leading run, a full middle block, a partial trailing run, applied
recursively per dim (:func:`flat_range_boxes`). Each box becomes one DCP chunk / ``WriteItem``
in GLOBAL coordinates, so each rank writes only its own piece and DCP's ordinary overlap
matching loads any saved layout into any other one (other local_units or dims, Shard, Replicate,
a plain tensor, another world size).

Installed by ``raggedfsdp/placement/_patches.py`` in the code of torch's functions (so every alias and
every DTensor, e.g. optimizer states from ``zeros_like`` and ``load_state_dict(assign=True)`` copies,
is covered). All delegate to torch when no RaggedShard is present:

* ``DTensor.__create_write_items__`` / ``__create_chunk_list__`` / ``__get_tensor_shard__``
  (torch/distributed/tensor/_api.py): one chunk per box instead of one per DTensor.
* ``torch.distributed.tensor._utils._compute_local_shape_and_global_offset`` (which the public
  ``compute_local_shape_and_global_offset`` calls): the flat local shape with ``skip_offset=True``;
  otherwise the piece as one N-D box (always for ``dims=(0,)``), ``ValueError`` for pieces that are
  not rectangular instead of silently describing the whole tensor.
* ``torch.distributed._state_dict_utils._distribute_tensors``: used by
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
    return dt.numel() == 0 and all(
        dt.device_mesh.get_coordinate() is None or c == 0 for c in dt.device_mesh.get_coordinate()
    )


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


# ---- _compute_local_shape_and_global_offset ----------------------------------------------
class _MeshShape:
    """The ``ndim`` / ``size(i)`` of a mesh, from its shape only (for :func:`check_placements`)."""

    def __init__(self, shape):
        self.shape = tuple(int(s) for s in shape)
        self.ndim = len(self.shape)

    def size(self, i: int) -> int:
        return self.shape[i]

    def __repr__(self) -> str:
        return f"mesh of shape {self.shape}"


def make_compute_local_shape_and_global_offset(stock):
    """torch's plain-data ``_compute_local_shape_and_global_offset`` (``tensor/_utils.py``) for RaggedShard.

    The public ``compute_local_shape_and_global_offset`` calls it. For RaggedShard the local tensor
    is flat, so ``skip_offset=True`` (asked by callers that size the local tensor: the factories,
    ``new_empty``-like ops, cost models) gives ``(local_numel,)``. With offsets (DCP-style callers that
    locate the piece in the global tensor) it gives the piece as ONE N-D box in global coordinates
    (always possible for ``dims=(0,)`` and empty pieces) and raises ``ValueError`` otherwise.
    """

    def _compute_local_shape_and_global_offset(
        global_shape, mesh_shape, my_coordinate, placements, skip_offset=False
    ):
        if not has_ragged(placements):
            return stock(global_shape, mesh_shape, my_coordinate, placements, skip_offset)
        placements = tuple(placements)
        gshape = tuple(int(s) for s in global_shape)
        check_placements(placements, gshape, _MeshShape(mesh_shape))
        i = ragged_mesh_dim(placements)
        rs: RaggedShard = placements[i]
        coord = int(my_coordinate[i] if isinstance(my_coordinate, (list, tuple)) else my_coordinate(i))
        base_shape, base_off = stock(
            gshape, mesh_shape, my_coordinate, list(base_placements(placements)), False
        )
        base_shape = tuple(int(s) for s in base_shape)
        a, b = rs.flat_range(base_shape, coord)
        if skip_offset:
            return (b - a,), ()
        boxes = flat_range_boxes(base_shape, a, b)
        if not boxes:  # empty piece: a 0-size box at its position along dim 0
            inner = math.prod(base_shape[1:])
            row0 = min(a // inner, base_shape[0]) if inner else 0
            sizes = (0, *base_shape[1:])
            off = (row0, *([0] * (len(base_shape) - 1)))
            return sizes, tuple(int(o) + int(g) for o, g in zip(off, base_off))
        if len(boxes) > 1:
            raise ValueError(
                f"compute_local_shape_and_global_offset: the {rs} piece of shape {gshape} on this rank is "
                f"not a rectangle (it is {len(boxes)} boxes). Use "
                "raggedfsdp.placement._checkpoint.local_boxes(dtensor), or coarser dims (dims=(0,)) so each "
                "piece is whole rows"
            )
        off, size, _ = boxes[0]
        return tuple(size), tuple(int(o) + int(g) for o, g in zip(off, base_off))

    return _compute_local_shape_and_global_offset


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
                    ret = DTensor.from_local(
                        piece, mesh, pl, shape=local_state.shape, stride=local_state.stride()
                    )
                else:
                    ret = local_state
                    ret.to_local().copy_(piece)
                local_state_dict[key] = ret
            else:
                rest.append(key)
        if rest:
            stock(local_state_dict, rest, device, pg)

    return _distribute_tensors


# ---- DTensor's DCP protocol methods (torch/distributed/tensor/_api.py) ------------------
def _method(stock, impl):
    def method(self, *args, **kwargs):
        if has_ragged(self._spec.placements):
            self._raise_if_contains_partial_placements()  # as torch: no Partial in checkpoints
            return impl(self, *args, **kwargs)
        return stock(self, *args, **kwargs)

    return method


def make_create_write_items(stock):
    return _method(stock, lambda self, fqn, object: create_write_items(self, fqn))


def make_create_chunk_list(stock):
    return _method(stock, create_chunk_list)


def make_get_tensor_shard(stock):
    return _method(stock, get_tensor_shard)


# ---- safetensors files: at most one chunk of a name per file -----------------------------
def part_file_name(file_name: str, part: int) -> str:
    """The name of part ``part`` of a file: ``shard-00001-model-00001-of-00001.safetensors`` ->
    ``shard-00001-model-00001-of-00001.part1.safetensors``."""
    stem, dot, ext = file_name.rpartition(".")
    return f"{stem}.part{part}.{ext}" if dot and stem else f"{file_name}.part{part}"


def split_safetensors_files(file_queue):
    """Refill ``file_queue`` (``(path, file_name, write_items)``) so no file holds 2 chunks of one fqn.

    A safetensors file maps each name to ONE tensor; torch's writer (``filesystem.py``
    ``_write_files_from_queue``: ``tensor_dict[write_item.index.fqn] = tensor``) keeps the last
    chunk of a name and drops the others, silently. A RaggedShard piece that is not a rectangle is
    several chunks of its fqn on one rank (:func:`local_boxes`), so the ``k``-th chunk of a name in
    a file goes to the file :func:`part_file_name` ``(file_name, k)`` next to it, with its own
    ``saved_offsets``. torch's readers of such a folder (``HuggingFaceStorageReader`` and the HF
    consolidation, which glob ``*.safetensors`` and merge the chunks of a name by their offsets)
    then see every chunk. Entries without a repeated name are put back unchanged. Local, no
    communication; ``ValueError`` (before anything is written) if an entry's path does not end
    with its file name, where the part file could not be placed next to it.
    """
    import pathlib
    import queue

    entries = []
    while True:
        try:
            entries.append(file_queue.get_nowait())
        except queue.Empty:
            break
    out: queue.Queue = queue.Queue()
    for path, file_name, items in entries:
        parts: list[list] = [[]]
        seen: dict[str, int] = {}
        for item in items:
            fqn = item.index.fqn if item.tensor_data is not None else None
            k = seen.get(fqn, 0) if fqn is not None else 0
            if fqn is not None:
                seen[fqn] = k + 1
            while len(parts) <= k:
                parts.append([])
            parts[k].append(item)
        out.put((path, file_name, parts[0]))
        for k, part in enumerate(parts[1:], start=1):
            name = part_file_name(str(file_name), k)
            if not str(path).endswith(str(file_name)):
                raise ValueError(
                    f"RaggedShard checkpoint: a safetensors file holds {len(parts)} chunks of "
                    f"{part[0].index.fqn!r} (a RaggedShard piece that is not whole rows) and its path "
                    f"{path!r} does not end with its file name {file_name!r}, so the extra chunks cannot be "
                    "written to files next to it. Save with dcp.save's default FileSystemWriter, or use "
                    "shard_placement_fn=lambda p: Shard(0) in fully_shard so each piece is whole rows"
                )
            new_path = str(path)[: len(str(path)) - len(str(file_name))] + name
            out.put((type(path)(new_path) if isinstance(path, pathlib.PurePath) else new_path, name, part))
    while not out.empty():
        file_queue.put(out.get_nowait())
    return file_queue


def make_write_data(stock):
    """torch's ``_FileSystemWriter._write_data`` (``checkpoint/filesystem.py``): for the safetensors format
    (``HuggingFaceStorageWriter``, ``FileSystemWriter(serialization_format=SAFETENSORS)``) each file gets at
    most one chunk per fqn (:func:`split_safetensors_files`); torch's code does the writing."""

    def _write_data(self, planner, file_queue):
        fmt = getattr(self, "serialization_format", None)
        if fmt is not None and getattr(fmt, "value", None) == "safetensors":
            file_queue = split_safetensors_files(file_queue)
        return stock(self, planner, file_queue)

    return _write_data
