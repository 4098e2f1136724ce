"""RaggedShard: an uneven, block-granular DTensor placement (veScale-FSDP paper, section 1).

A tensor's leading ``dims`` (a prefix ``(0, ..., k-1)``) are flattened into ``N`` rows of
``R = prod(shape[k:])`` elements. ``local_units`` has one entry per rank of the mesh dimension;
with ``U = sum(local_units)`` (which must divide ``N``), rank ``i`` owns the contiguous rows
``[sum(u[:i]) * N/U, sum(u[:i+1]) * N/U)``, stored as a flat, contiguous 1-D local tensor
(possibly empty).

The class is a real ``torch.distributed.tensor.placement_types.Placement`` subclass. It works
through torch's own DTensor APIs (``distribute_tensor``, ``from_local``, ``redistribute``,
``full_tensor``, the DTensor factories, pointwise ops, ``torch.optim``, ``clip_grad_norm_``, DCP)
through the patches in ``raggedfsdp/placement/_patches.py``, which the first ``RaggedShard(...)`` of a
process installs (``import raggedfsdp`` alone changes nothing in torch).
See ``docs/raggedshard.md`` for the supported op set and mesh compositions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.distributed.tensor.placement_types import Placement, Shard

from raggedfsdp.placement import _patches


def _ints(name: str, values) -> tuple[int, ...]:
    """``values`` as a tuple of ints (``operator.index``: no float or string is truncated or parsed)."""
    import operator

    try:
        return tuple(operator.index(v) for v in values)
    except TypeError:
        bad = (
            next((v for v in values if not hasattr(v, "__index__")), values) if _iterable(values) else values
        )
        raise TypeError(
            f"RaggedShard: {name}={values!r} must be a sequence of ints; {bad!r} is a {type(bad).__name__} "
            "(e.g. RaggedShard(dims=(0,), local_units=(1, 2, 1)); round or scale the values yourself)"
        ) from None


def _iterable(values) -> bool:
    try:
        iter(values)
    except TypeError:
        return False
    return True


class RaggedShard(Placement):
    """Uneven, contiguous, block-granular sharding of a tensor's flattened leading dims.

    Args:
        dims: prefix ``(0, ..., k-1)`` of the tensor's dims flattened into rows; a row of
            ``R = prod(shape[k:])`` elements is the atomic unit that is never split.
            ``dims=(0,)`` is row granularity, ``dims=tuple(range(ndim))`` element granularity.
        local_units: per-rank unit counts (ints >= 0, not all zero), one per rank of the mesh
            dim the placement is used on. They are relative: with ``U = sum(local_units)``, one
            unit is ``N / U`` rows, so coarser blocks are expressed by using smaller counts.

    Local tensor: always a flat contiguous 1-D tensor of ``local_numel(shape, rank)`` elements
    (possibly 0), the rows ``row_range(shape, rank)`` of the tensor in C order.

    Raises:
        TypeError: ``dims`` or ``local_units`` not a sequence of integers (``1.7`` is not truncated
            to ``1``; integer-valued objects such as numpy ints pass ``operator.index``).
        ValueError: ``dims`` not a non-empty prefix, ``local_units`` empty, negative or all zero.
            (Shape/mesh mismatches are raised by :meth:`validate_shape` / :meth:`validate_mesh`.)

    Source: veScale-FSDP (arXiv 2602.22437) section 3.1 "RaggedShard"; paper-notes section 1.1.
    """

    def __init__(self, dims: Sequence[int], local_units: Sequence[int]):
        super().__init__()
        dims = _ints("dims", dims)
        local_units = _ints("local_units", local_units)
        if len(dims) == 0 or dims != tuple(range(len(dims))):
            raise ValueError(
                f"RaggedShard: dims={dims} must be a non-empty prefix (0, 1, ..., k-1) of the tensor dims; "
                "use dims=(0,) for row granularity or dims=tuple(range(t.ndim)) for element granularity"
            )
        if len(local_units) == 0 or any(u < 0 for u in local_units) or sum(local_units) == 0:
            raise ValueError(
                f"RaggedShard: local_units={local_units} must be non-negative with at least one positive "
                "entry and one entry per rank of the mesh dim, e.g. local_units=(1,) * world_size"
            )
        self.dims = dims
        self.local_units = local_units
        # DTensor's sharding propagation hashes and compares every operand's placements on every op
        # (a foreach op over 785 params: thousands of calls per optimizer step); precomputed once
        self._rs_hash = hash((type(self).__name__, dims, local_units))
        _patches.apply()  # lazy: the first RaggedShard of the process installs the patches

    # ---- identity -------------------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        return other is self or (
            type(other) is type(self) and self.dims == other.dims and self.local_units == other.local_units
        )

    def __hash__(self) -> int:
        return self._rs_hash

    def __repr__(self) -> str:
        return f"RaggedShard(dims={self.dims}, local_units={self.local_units})"

    def __str__(self) -> str:
        return f"RS{self.dims}{self.local_units}"

    def __reduce__(self):
        return (type(self), (self.dims, self.local_units))

    def __fx_repr__(self) -> str:  # used by torch.fx codegen; the pybind base raises
        return f"RaggedShard(dims={self.dims}, local_units={self.local_units})"

    # ---- DTensor duck typing ----------------------------------------------------------------
    # Decision (docs/raggedshard.md "is_shard() and .dim"): RaggedShard answers is_shard() = True
    # and .dim = 0, because torch's cost model (_collective_utils.redistribute_cost) must price
    # RS -> Replicate as an all-gather: with is_shard() False it is "free", and the strategy search
    # turns local pointwise ops (optimizer steps) into hidden all-gathers with Replicate outputs.
    # Every torch path that then acts on it as a Shard calls a Shard method, and those raise
    # below (__getattr__) instead of computing even-Shard(0) pieces.
    @property
    def dim(self) -> int:
        """The first flattened tensor dim (always 0), for torch code that reads ``.dim`` of shardings."""
        return 0

    def is_shard(self, dim: int | None = None) -> bool:
        """True (for ``dim`` None or one of ``dims``): a RaggedShard is a sharding of those dims."""
        return dim is None or dim in self.dims

    def __getattr__(self, name: str):
        # only reached for names the class does not define: a Shard method means a torch code path
        # took this placement for an even Shard(0); refuse loudly rather than compute wrong pieces
        if name.startswith("_") and not name.startswith("__") and hasattr(Shard, name):
            raise AttributeError(
                f"RaggedShard has no Shard method {name!r}: a torch code path treated "
                f"RaggedShard(dims={self.dims}, local_units={self.local_units}) as an even Shard(0), which "
                "would give wrong local pieces. This DTensor path is not supported for RaggedShard: "
                "redistribute to Shard(0)/Replicate first (x.redistribute(mesh, [Shard(0)])), or report the "
                "torch entry point to raggedfsdp (docs/raggedshard.md)"
            )
        raise AttributeError(f"'RaggedShard' object has no attribute {name!r}")

    def is_replicate(self) -> bool:
        return False

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return False

    # ---- layout math (pure, no communication) -------------------------------------------
    def row_numel(self, shape: Sequence[int]) -> int:
        """Elements per row ``R = prod(shape[k:])``."""
        return math.prod(shape[len(self.dims) :])

    def num_rows(self, shape: Sequence[int]) -> int:
        """Rows ``N = prod(shape[:k])``."""
        return math.prod(shape[: len(self.dims)])

    def validate_shape(self, shape: Sequence[int], num_ranks: int | None = None) -> None:
        """Raise ``ValueError`` unless this placement can shard a tensor of ``shape`` over ``num_ranks``."""
        shape = tuple(int(s) for s in shape)
        if len(self.dims) > len(shape):
            raise ValueError(
                f"RaggedShard: dims={self.dims} has more dims than the tensor shape {shape}; "
                f"use dims=tuple(range(k)) with k <= {len(shape)}"
            )
        if num_ranks is not None and len(self.local_units) != num_ranks:
            raise ValueError(
                f"RaggedShard: local_units={self.local_units} has {len(self.local_units)} entries but the "
                f"mesh dim has {num_ranks} ranks; give one unit count per rank"
            )
        n, u = self.num_rows(shape), sum(self.local_units)
        if n % u != 0:
            raise ValueError(
                f"RaggedShard: sum(local_units)={u} must divide the number of rows N={n} of shape {shape} "
                f"over dims={self.dims}; scale local_units so their sum divides {n}, or use finer dims"
            )

    def validate_mesh(self, mesh, mesh_dim: int) -> None:
        """Raise ``ValueError`` unless ``len(local_units)`` equals ``mesh.size(mesh_dim)``."""
        n = mesh.size(mesh_dim)
        if len(self.local_units) != n:
            raise ValueError(
                f"RaggedShard: local_units={self.local_units} has {len(self.local_units)} entries but mesh "
                f"dim {mesh_dim} of {mesh} has {n} ranks; give one unit count per rank of that mesh dim"
            )

    def row_range(self, shape: Sequence[int], rank: int) -> tuple[int, int]:
        """Rows ``[start, end)`` of the flattened prefix owned by ``rank``."""
        ratio = self.num_rows(shape) // sum(self.local_units)
        start = sum(self.local_units[:rank]) * ratio
        return start, start + self.local_units[rank] * ratio

    def flat_range(self, shape: Sequence[int], rank: int) -> tuple[int, int]:
        """Elements ``[start, end)`` of the flattened tensor owned by ``rank`` (its local numel is
        end-start)."""
        r = self.row_numel(shape)
        a, b = self.row_range(shape, rank)
        return a * r, b * r

    def flat_ranges(self, shape: Sequence[int]) -> list[tuple[int, int]]:
        """``flat_range`` of every rank, in rank order (contiguous, covering ``[0, numel)``)."""
        return [self.flat_range(shape, r) for r in range(len(self.local_units))]

    def local_numel(self, shape: Sequence[int], rank: int) -> int:
        """Number of elements (not bytes) of ``rank``'s flat local tensor."""
        a, b = self.flat_range(shape, rank)
        return b - a

    # ---- local (no communication) helpers --------------------------------------------------
    def shard_full(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s flat contiguous piece (a fresh copy) of the full tensor ``full``. Not collective."""
        self.validate_shape(full.shape)
        a, b = self.flat_range(full.shape, rank)
        return full.reshape(-1)[a:b].clone()

    # ---- redistribute hooks used by torch's redistribute_local_tensor ---------------------
    # torch/distributed/tensor/_redistribute.py dispatches on is_shard() and calls these through
    # ``cast(Shard, placement)``. raggedfsdp routes any spec with a RaggedShard through its own
    # redistribute (raggedfsdp/placement/_redistribute.py), but keeps these for direct callers.
    def _to_replicate_tensor(self, local_tensor, mesh, mesh_dim, current_logical_shape):
        """Collective over ``mesh_dim``: all ranks' flat pieces -> full tensor of
        ``current_logical_shape``."""
        from raggedfsdp.placement._redistribute import gather_ragged

        return gather_ragged(local_tensor, self, tuple(current_logical_shape), mesh, mesh_dim)

    def _replicate_to_shard(self, local_tensor, mesh, mesh_dim, shard_index):
        """Local: slice this rank's flat piece out of a replicated tensor."""
        return self.shard_full(local_tensor, int(shard_index))

    def _reduce_shard_tensor(self, tensor, mesh, reduce_op, mesh_dim):
        """Collective over ``mesh_dim``: reduce a Partial tensor and keep this rank's flat piece."""
        from raggedfsdp.placement._redistribute import reduce_scatter_ragged

        return reduce_scatter_ragged(tensor, self, reduce_op, mesh, mesh_dim)
