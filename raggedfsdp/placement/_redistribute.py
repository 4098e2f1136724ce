"""Communication for RaggedShard DTensors: gather, reduce-scatter, ragged<->ragged all-to-all.

Everything here is a collective over one mesh dimension's process group: every rank of that
mesh-dim group must call it with the same placement and shape. Gloo has no uneven list
``all_gather`` (fsdp2-internals.md section 0.8), so every gather pads each rank's flat piece to the
largest piece and uses one even ``all_gather_single``; reduce-scatter does the same in reverse.
Ragged -> ragged (and ragged <-> ``Shard(0)``, whose pieces are also contiguous flat intervals) is
ONE ``all_to_all_single`` that moves only the overlapping element intervals.

Composition with other mesh dims (paper-notes section 1.3): at most one RaggedShard per placement
tuple; it is applied innermost, i.e. on the local tensor that the other mesh dims' placements
(Replicate, Partial, ``Shard(d)``) produce -- FSDP2's order of sharding for FSDP x TP, where FSDP
shards the TP-local tensor. A ``Shard(d)`` with ``d < len(dims)`` (a dim the ragged rows span) must
split that dim evenly, so the local tensor RaggedShard applies to has one shape on every rank;
``_StridedShard`` raises ``ValueError``.

Source of the dispatch this replaces: torch/distributed/tensor/_redistribute.py
``redistribute_local_tensor``; veScale ``vescale/dtensor/_redistribute.py`` (design only).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from raggedfsdp._compat import single_tensor_collectives
from raggedfsdp._release import handoff, hold_until_released, use_count
from raggedfsdp.placement.ragged_shard import RaggedShard

# torch >= 2.13 names (all_gather_single, ...); 2.11 / 2.12 spell them *_into_tensor / *_tensor
_all_gather_single, _reduce_scatter_single = single_tensor_collectives()


# ---------------------------------------------------------------------------------------------
# placement-tuple helpers (no communication)
# ---------------------------------------------------------------------------------------------
def has_ragged(placements: Sequence[Placement]) -> bool:
    return any(isinstance(p, RaggedShard) for p in placements)


def ragged_mesh_dim(placements: Sequence[Placement]) -> int | None:
    """Index of the (single) RaggedShard in ``placements``, or None."""
    for i, p in enumerate(placements):
        if isinstance(p, RaggedShard):
            return i
    return None


def _stock_local_shape(global_shape, mesh, placements) -> tuple[int, ...]:
    from torch.distributed.tensor import _utils

    fn = _utils.compute_local_shape_and_global_offset
    fn = getattr(fn, "__ragged_original__", fn)
    shape, _ = fn(tuple(global_shape), mesh, list(placements))
    return tuple(int(s) for s in shape)


def base_placements(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """``placements`` with the RaggedShard replaced by ``Replicate()``."""
    return tuple(Replicate() if isinstance(p, RaggedShard) else p for p in placements)


def base_local_shape(global_shape: Sequence[int], mesh, placements: Sequence[Placement]) -> tuple[int, ...]:
    """N-D shape of the local tensor before the RaggedShard is applied (other mesh dims only)."""
    return _stock_local_shape(global_shape, mesh, base_placements(placements))


def check_placements(placements: Sequence[Placement], global_shape: Sequence[int], mesh) -> None:
    """Raise ``ValueError`` unless ``placements`` is a supported RaggedShard composition on ``mesh``.

    Supported: at most one RaggedShard; on the other mesh dims Replicate, Partial, or ``Shard(d)``
    (an even split when ``d < len(dims)``); the RaggedShard must fit the local shape those produce.
    Not collective.
    """
    placements = tuple(placements)
    if len(placements) != mesh.ndim:
        raise ValueError(
            f"placements={placements} has {len(placements)} entries but the mesh {mesh} has {mesh.ndim} "
            "dims; give one placement per mesh dim"
        )
    idx = [i for i, p in enumerate(placements) if isinstance(p, RaggedShard)]
    if not idx:
        return
    if len(idx) > 1:
        raise ValueError(
            f"placements={placements}: at most one RaggedShard per placement tuple is supported; "
            "use Replicate() on the other mesh dims"
        )
    i = idx[0]
    rs: RaggedShard = placements[i]
    rs.validate_mesh(mesh, i)
    ndim = len(global_shape)
    k = len(rs.dims)
    base = [int(s) for s in global_shape]  # the shape RaggedShard is applied to (innermost)
    for j, p in enumerate(placements):
        if j == i or p.is_replicate() or p.is_partial():
            continue
        if type(p) is Shard:
            d = p.dim + ndim if p.dim < 0 else p.dim
            if d >= k:
                continue  # the cut is inside each ragged row: any (even uneven) Shard composes
            if not 0 <= d < ndim or base[d] % mesh.size(j):
                raise ValueError(
                    f"placements={placements}: {p} on mesh dim {j} cuts tensor dim {d} of shape "
                    f"{tuple(global_shape)} (size {base[d] if 0 <= d < ndim else '?'}), which lies inside "
                    f"the ragged rows of {rs} (dims={rs.dims}), into {mesh.size(j)} uneven parts; "
                    "RaggedShard is applied to the local tensor the other placements produce, which must "
                    f"then have the same shape on every rank: make dim {d} divisible by {mesh.size(j)} (pad "
                    f"it), or Shard a dim >= {k}"
                )
            base[d] //= mesh.size(j)
            continue
        raise ValueError(
            f"placements={placements}: {p} on mesh dim {j} cannot be combined with RaggedShard; "
            "supported companions are Replicate(), Partial() and Shard(d) (even when d < len(dims))"
        )
    rs.validate_shape(tuple(base), mesh.size(i))


def _coord(mesh, mesh_dim: int) -> int:
    return mesh.get_local_rank(mesh_dim) if mesh.ndim > 1 else mesh.get_local_rank()


def _group(mesh, mesh_dim: int):
    return mesh.get_group(mesh_dim)


# ---------------------------------------------------------------------------------------------
# collectives over one mesh dim
# ---------------------------------------------------------------------------------------------
def gather_ragged(
    local: torch.Tensor, placement: RaggedShard, base_shape, mesh, mesh_dim: int
) -> torch.Tensor:
    """All-gather the flat pieces of ``placement`` over ``mesh_dim`` into a tensor of ``base_shape``.

    Collective: every rank of the mesh-dim group calls it. Pads each piece to the largest piece
    (in elements) and uses one even ``all_gather_single``, then slices out the padding.
    Returns a tensor of ``base_shape`` with ``local``'s dtype. Raises ``ValueError`` if ``local``
    has the wrong number of elements for this rank.
    """
    base_shape = tuple(int(s) for s in base_shape)
    world = mesh.size(mesh_dim)
    placement.validate_shape(base_shape, world)
    rank = _coord(mesh, mesh_dim)
    sizes = [placement.local_numel(base_shape, r) for r in range(world)]
    flat = local.reshape(-1)
    if flat.numel() != sizes[rank]:
        raise ValueError(
            f"{placement}: rank {rank} of mesh dim {mesh_dim} holds {flat.numel()} elements but the layout "
            f"of shape {base_shape} needs {sizes[rank]}; build the local tensor with "
            "placement.flat_range(shape, rank)"
        )
    if world == 1:
        return flat.view(base_shape)
    m = max(sizes)
    if flat.numel() == m:
        send = flat.contiguous()
    else:
        send = flat.new_zeros(m)
        send[: flat.numel()].copy_(flat)
    out = flat.new_empty(world * m)
    _held(_all_gather_single, out, send, group=_group(mesh, mesh_dim))
    if any(s != m for s in sizes):
        out = torch.cat([out[r * m : r * m + sizes[r]] for r in range(world)])
    return out.view(base_shape)


def _held(collective, out: torch.Tensor, inp: torch.Tensor, *args, **kwargs):
    """Run a (synchronous) collective on the temporaries ``out`` / ``inp`` and keep them until the
    backend's worker has let go of them (Note [gloo release] in ``raggedfsdp/_release.py``)."""
    bases = use_count(out), use_count(inp)
    result = collective(*handoff(out, inp), *args, **kwargs)
    hold_until_released(out, bases[0])
    hold_until_released(inp, bases[1])
    return result


_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


def reduce_scatter_ragged(
    tensor: torch.Tensor, placement: RaggedShard, reduce_op: str, mesh, mesh_dim: int
) -> torch.Tensor:
    """Reduce the per-rank partial values ``tensor`` (full base shape) and keep this rank's flat piece.

    Collective over ``mesh_dim``. ``reduce_op`` in ``sum | avg | max | min``. Uses one even
    ``reduce_scatter_single`` of per-rank pieces padded to the largest piece. Returns a flat
    contiguous tensor of ``placement.local_numel(tensor.shape, rank)`` elements.
    """
    if reduce_op not in _REDUCE_OPS:
        raise ValueError(
            f"reduce_scatter_ragged: reduce_op={reduce_op!r} must be one of {sorted(_REDUCE_OPS)}"
        )
    world = mesh.size(mesh_dim)
    shape = tuple(tensor.shape)
    placement.validate_shape(shape, world)
    rank = _coord(mesh, mesh_dim)
    ranges = placement.flat_ranges(shape)
    flat = tensor.reshape(-1)
    if world == 1:
        return flat.clone()
    sizes = [b - a for a, b in ranges]
    m = max(sizes)
    if m == 0:
        return flat.new_empty(0)
    buf = flat.new_zeros(world, m)
    for r, (a, b) in enumerate(ranges):
        buf[r, : b - a].copy_(flat[a:b])
    out = flat.new_empty(m)
    _held(_reduce_scatter_single, out, buf.view(-1), op=_REDUCE_OPS[reduce_op], group=_group(mesh, mesh_dim))
    if reduce_op == "avg":
        out.div_(world)
    return out[: sizes[rank]]


def alltoall_intervals(flat: torch.Tensor, src_ranges, dst_ranges, mesh, mesh_dim: int) -> torch.Tensor:
    """Move contiguous flat element intervals between ranks with ONE ``all_to_all_single``.

    ``src_ranges[r]`` / ``dst_ranges[r]``: element interval ``[a, b)`` of the flattened tensor that
    rank ``r`` holds before / after; both partition ``[0, numel)`` in rank order. Collective over
    ``mesh_dim``. Returns this rank's new flat contiguous piece.
    """
    rank = _coord(mesh, mesh_dim)
    a, b = src_ranges[rank]
    c, d = dst_ranges[rank]
    flat = flat.reshape(-1).contiguous()
    if flat.numel() != b - a:
        raise ValueError(f"alltoall_intervals: local piece has {flat.numel()} elements, expected {b - a}")
    in_splits = [max(0, min(b, d2) - max(a, c2)) for c2, d2 in dst_ranges]
    out_splits = [max(0, min(b2, d) - max(a2, c)) for a2, b2 in src_ranges]
    out = flat.new_empty(d - c)
    if mesh.size(mesh_dim) == 1:
        out.copy_(flat)
        return out
    _held(dist.all_to_all_single, out, flat, out_splits, in_splits, group=_group(mesh, mesh_dim))
    return out


# ---------------------------------------------------------------------------------------------
# redistribute_local_tensor replacement
# ---------------------------------------------------------------------------------------------
def _chunk_rows(n: int, world: int, rank: int) -> tuple[int, int]:
    """torch.chunk row range (DTensor ``Shard`` semantics: ceil-sized chunks, trailing ones may be empty)."""
    size = -(-n // world) if n else 0
    return min(rank * size, n), min((rank + 1) * size, n)


def _interval_ranges(p: Placement, base_shape, world: int):
    """Flat element intervals of every rank for interval-like placements (RaggedShard, Shard(0))."""
    if isinstance(p, RaggedShard):
        return p.flat_ranges(base_shape)
    if type(p) is Shard and p.dim == 0 and len(base_shape) > 0:
        row = 1
        for s in base_shape[1:]:
            row *= s
        out = []
        for r in range(world):
            a, b = _chunk_rows(base_shape[0], world, r)
            out.append((a * row, b * row))
        return out
    return None


def _spec(mesh, placements, tensor_meta) -> DTensorSpec:
    return DTensorSpec(mesh, tuple(placements), tensor_meta=tensor_meta)


def _wait(t):
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t


def redistribute_ragged(
    local: torch.Tensor, current: DTensorSpec, target: DTensorSpec, stock
) -> torch.Tensor:
    """Redistribute ``local`` from ``current`` to ``target`` when either contains a RaggedShard.

    Collective over the mesh dims whose placement changes. ``stock`` is torch's original
    ``redistribute_local_tensor`` used for the non-ragged part. Paths:

    * only one mesh dim changes and both sides are interval-like there (RaggedShard with any
      dims/local_units, or Shard(0)): ONE ``all_to_all_single``;
    * ``Partial(sum|avg|max|min) -> RaggedShard`` on one mesh dim: one padded reduce-scatter;
    * otherwise: gather the ragged mesh dim (padded all-gather), run torch's redistribute on the
      remaining placements, then slice the target's ragged piece locally.
    """
    mesh = current.mesh
    if target.mesh != mesh:
        raise ValueError(
            f"RaggedShard redistribute: source mesh {mesh} and target mesh {target.mesh} differ; "
            "redistribute on the same mesh (cross-mesh transfers are not supported by DTensor)"
        )
    src, dst = tuple(current.placements), tuple(target.placements)
    if src == dst:
        return local
    gshape = tuple(current.shape)
    check_placements(src, gshape, mesh)
    check_placements(dst, gshape, mesh)
    meta = current.tensor_meta

    diff = [i for i in range(mesh.ndim) if src[i] != dst[i]]
    if len(diff) == 1:
        i = diff[0]
        others_ok = all(
            j == i or not (src[j].is_shard(0) or isinstance(src[j], RaggedShard)) for j in range(mesh.ndim)
        )
        if others_ok:
            world = mesh.size(i)
            pre = tuple(Replicate() if j == i else p for j, p in enumerate(src))
            base = base_local_shape(gshape, mesh, pre)
            sr, dr = _interval_ranges(src[i], base, world), _interval_ranges(dst[i], base, world)
            if sr is not None and dr is not None:
                out = alltoall_intervals(local, sr, dr, mesh, i)
                if isinstance(dst[i], RaggedShard):
                    return out
                a, b = _chunk_rows(base[0], world, _coord(mesh, i))
                return out.view((b - a, *base[1:]))
            if (
                isinstance(dst[i], RaggedShard)
                and type(src[i]) is Partial
                and src[i].reduce_op in _REDUCE_OPS
            ):
                return reduce_scatter_ragged(local.reshape(base), dst[i], src[i].reduce_op, mesh, i)

    # general path: un-ragged source, stock redistribute, ragged target sliced locally
    i = ragged_mesh_dim(src)
    if i is not None:
        cur_pl = base_placements(src)
        base = _stock_local_shape(gshape, mesh, cur_pl)
        local = gather_ragged(local, src[i], base, mesh, i)
        src = cur_pl
    dst_base = base_placements(dst)
    if src != dst_base:
        local = _wait(stock(local, _spec(mesh, src, meta), _spec(mesh, dst_base, meta), async_op=False))
    j = ragged_mesh_dim(dst)
    if j is not None:
        rs: RaggedShard = dst[j]
        local = rs.shard_full(local, _coord(mesh, j))
    return local


def local_piece_of_full(full: torch.Tensor, mesh, placements) -> torch.Tensor:
    """This rank's local tensor of ``full`` under ``placements`` (flat for RaggedShard). Not collective."""
    placements = tuple(placements)
    check_placements(placements, tuple(full.shape), mesh)
    from torch.distributed.tensor import _utils

    fn = _utils.compute_local_shape_and_global_offset
    fn = getattr(fn, "__ragged_original__", fn)
    bshape, boff = fn(tuple(full.shape), mesh, list(base_placements(placements)))
    base = full[tuple(slice(o, o + s) for o, s in zip(boff, bshape))]
    i = ragged_mesh_dim(placements)
    if i is None:
        return base.contiguous()
    return placements[i].shard_full(base, _coord(mesh, i))


def make_spec(mesh, placements, shape, stride, dtype) -> DTensorSpec:
    return DTensorSpec(
        mesh, tuple(placements), tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), dtype)
    )


def make_redistribute_local_tensor(stock):
    """The ``redistribute_local_tensor`` installed by ``raggedfsdp/placement/_patches.py`` (ragged specs ->
    here)."""

    def redistribute_local_tensor(local_tensor, current_spec, target_spec, *args, **kwargs):
        if has_ragged(current_spec.placements) or has_ragged(target_spec.placements):
            return redistribute_ragged(local_tensor, current_spec, target_spec, stock)
        return stock(local_tensor, current_spec, target_spec, *args, **kwargs)

    return redistribute_local_tensor
