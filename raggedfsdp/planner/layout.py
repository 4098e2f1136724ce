"""Planned layout of one FSDP unit's tensors in a flat buffer (veScale-FSDP paper, section 2).

The buffer has ``world_size * shard_size`` elements; rank ``k`` owns ``[k*S, (k+1)*S)``. Each
tensor ``t`` occupies the contiguous range ``[offsets[t], offsets[t] + numels[t])``; padding lies
only between tensors; no rank boundary cuts a block of ``granularities[t]`` elements.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """Result of :func:`plan_layout`. All sizes are in elements (not bytes).

    Attributes:
        world_size: number of ranks ``m`` of the shard mesh dim.
        shard_size: per-rank shard size ``S`` (a multiple of ``align``).
        numels: per-tensor element counts, in the caller's order.
        granularities: per-tensor block size in elements (divides the numel).
        offsets: per-tensor global offset in the ``m*S`` buffer, in the caller's order.
        order: the permutation of tensor indices as laid out in the buffer.
        align: the collective alignment unit in elements.
    """

    world_size: int
    shard_size: int
    numels: tuple[int, ...]
    granularities: tuple[int, ...]
    offsets: tuple[int, ...]
    order: tuple[int, ...]
    align: int = 1

    @property
    def total_size(self) -> int:
        """``m * S``: elements of the unsharded flat buffer."""
        return self.world_size * self.shard_size

    @property
    def padding(self) -> int:
        """``m * S - sum(numels)``: padding elements in the unsharded buffer."""
        return self.total_size - sum(self.numels)

    @property
    def padding_ratio(self) -> float:
        total = self.total_size
        return self.padding / total if total else 0.0

    def piece(self, i: int, rank: int) -> tuple[int, int]:
        """Tensor ``i``'s piece on ``rank`` as ``(start, end)`` element offsets *within the tensor*."""
        lo = max(self.offsets[i], rank * self.shard_size)
        hi = min(self.offsets[i] + self.numels[i], (rank + 1) * self.shard_size)
        if hi <= lo:
            # empty piece: anchor it where the tensor meets this rank's range (for views of size 0)
            anchor = min(max(rank * self.shard_size - self.offsets[i], 0), self.numels[i])
            return anchor, anchor
        return lo - self.offsets[i], hi - self.offsets[i]

    def shard_offset(self, i: int, rank: int) -> int:
        """Offset of tensor ``i``'s piece inside ``rank``'s shard ``[0, S)``."""
        start, _ = self.piece(i, rank)
        return min(max(self.offsets[i] + start - rank * self.shard_size, 0), self.shard_size)

    def local_units(self, i: int) -> tuple[int, ...]:
        """Per-rank unit counts of tensor ``i`` (piece length / granularity) for ``RaggedShard``."""
        g = self.granularities[i]
        units = []
        for k in range(self.world_size):
            a, b = self.piece(i, k)
            units.append((b - a) // g if g else 0)
        return tuple(units)
