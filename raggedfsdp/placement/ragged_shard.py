"""RaggedShard: an uneven, block-granular DTensor placement (veScale-FSDP paper, section 1).

A tensor's leading ``dims`` (a prefix ``(0, ..., k-1)``) are flattened into ``N`` rows of
``R = prod(shape[k:])`` elements. ``local_units`` has one entry per rank of the mesh dimension;
with ``U = sum(local_units)`` (which must divide ``N``), rank ``i`` owns the contiguous rows
``[sum(u[:i]) * N/U, sum(u[:i+1]) * N/U)``, stored as a flat, contiguous 1-D local tensor
(possibly empty).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch.distributed.tensor.placement_types import Placement


class RaggedShard(Placement):
    """Uneven, contiguous, block-granular sharding of a tensor's flattened leading dims.

    Args:
        dims: prefix ``(0, ..., k-1)`` of the tensor's dims flattened into rows (the block unit).
        local_units: per-rank unit counts (>= 0, not all zero), one per rank of the mesh dim.

    Raises:
        ValueError: ``dims`` not a non-empty prefix, ``local_units`` negative or all zero.
    """

    def __init__(self, dims: Sequence[int], local_units: Sequence[int]):
        super().__init__()
        dims = tuple(int(d) for d in dims)
        local_units = tuple(int(u) for u in local_units)
        if len(dims) == 0 or dims != tuple(range(len(dims))):
            raise ValueError(
                f"RaggedShard: dims={dims} must be a non-empty prefix (0, 1, ..., k-1) of the tensor dims; "
                "use dims=(0,) for row granularity or dims=tuple(range(t.ndim)) for element granularity"
            )
        if len(local_units) == 0 or any(u < 0 for u in local_units) or sum(local_units) == 0:
            raise ValueError(
                f"RaggedShard: local_units={local_units} must be non-negative with at least one positive entry"
            )
        self.dims = dims
        self.local_units = local_units

    # ---- identity -------------------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self.dims == other.dims and self.local_units == other.local_units

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.dims, self.local_units))

    def __repr__(self) -> str:
        return f"RaggedShard(dims={self.dims}, local_units={self.local_units})"

    def __str__(self) -> str:
        return f"RS{self.dims}{self.local_units}"

    def __reduce__(self):
        return (type(self), (self.dims, self.local_units))

    # ---- layout math (pure, no communication) -------------------------------------------
    def row_numel(self, shape: Sequence[int]) -> int:
        """Elements per row ``R = prod(shape[k:])``."""
        return math.prod(shape[len(self.dims):])

    def num_rows(self, shape: Sequence[int]) -> int:
        """Rows ``N = prod(shape[:k])``."""
        return math.prod(shape[: len(self.dims)])

    def validate_shape(self, shape: Sequence[int], num_ranks: int | None = None) -> None:
        """Raise ``ValueError`` unless this placement can shard a tensor of ``shape`` over ``num_ranks``."""
        if len(self.dims) > len(shape):
            raise ValueError(f"RaggedShard: dims={self.dims} has more dims than the tensor shape {tuple(shape)}")
        if num_ranks is not None and len(self.local_units) != num_ranks:
            raise ValueError(
                f"RaggedShard: local_units={self.local_units} has {len(self.local_units)} entries but the mesh "
                f"dim has {num_ranks} ranks; give one unit count per rank"
            )
        n, u = self.num_rows(shape), sum(self.local_units)
        if n % u != 0:
            raise ValueError(
                f"RaggedShard: sum(local_units)={u} must divide the number of rows N={n} of shape {tuple(shape)} "
                f"over dims={self.dims}"
            )

    def row_range(self, shape: Sequence[int], rank: int) -> tuple[int, int]:
        """Rows ``[start, end)`` of the flattened prefix owned by ``rank``."""
        ratio = self.num_rows(shape) // sum(self.local_units)
        start = sum(self.local_units[:rank]) * ratio
        return start, start + self.local_units[rank] * ratio

    def flat_range(self, shape: Sequence[int], rank: int) -> tuple[int, int]:
        """Elements ``[start, end)`` of the flattened tensor owned by ``rank`` (its local numel is end-start)."""
        r = self.row_numel(shape)
        a, b = self.row_range(shape, rank)
        return a * r, b * r

    def local_numel(self, shape: Sequence[int], rank: int) -> int:
        a, b = self.flat_range(shape, rank)
        return b - a
