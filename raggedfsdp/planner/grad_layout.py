"""The gradient layout of a unit with frozen parameters: only the trainable tensors' pieces, compacted.

A unit's parameter :class:`~raggedfsdp.planner.Layout` fixes every tensor's piece on every rank
(``piece(i, r)``); a sharded gradient must be exactly its parameter's local piece (same RaggedShard
placement). When some tensors of the unit are frozen (``requires_grad=False``: a LoRA base), their
pieces need no gradient storage. :func:`plan_grad_layout` keeps, on each rank ``r``, only the pieces
of the *member* (trainable) tensors, in the parameter layout's order, each at an ``align``-rounded
offset, and sizes every rank's gradient shard

    Sg = align_up(max over r of sum over members i of align_up(|piece(i, r)|))   elements (>= align)

The unsharded gradient buffer is ``m * Sg`` elements, laid out rank segment by rank segment
(``[r*Sg, (r+1)*Sg)`` holds rank ``r``'s member pieces), so one even reduce-scatter gives each rank
exactly its members' pieces. A member tensor spanning several ranks is then in general *not* one
contiguous range of the unsharded buffer: :meth:`GradLayout.segments` lists where each piece goes.

All sizes and offsets are in **elements**. Pure Python; no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

from raggedfsdp.planner.layout import Layout


def _align_up(n: int, a: int) -> int:
    return -(-n // a) * a


@dataclass(frozen=True)
class GradLayout:
    """Per-rank compacted gradient shards of a unit's member tensors (see the module docstring).

    Duck-types the parts of :class:`Layout` a ``DBuffer`` uses (``world_size``, ``shard_size``,
    ``total_size``, ``piece``, ``shard_offset``), so sharded and unsharded grad buffers can be laid
    out by it.

    Attributes:
        base: the unit's parameter layout.
        members: indices (the base's caller order) of the tensors that have gradient storage, sorted.
        shard_size: ``Sg`` (a positive multiple of ``base.align``).
        offsets_by_rank: ``offsets_by_rank[j][r]`` is member ``members[j]``'s piece offset inside rank
            ``r``'s ``[0, Sg)`` gradient shard.
    """

    base: Layout
    members: tuple[int, ...]
    shard_size: int
    offsets_by_rank: tuple[tuple[int, ...], ...]

    @property
    def world_size(self) -> int:
        return self.base.world_size

    @property
    def rank_major(self) -> bool:
        """Always True: rank ``r``'s pieces are ``[r*Sg, (r+1)*Sg)`` of the unsharded grad buffer, also
        for a segmented parameter layout (Note [segmented layout] in ``layout.py``)."""
        return True

    @property
    def total_size(self) -> int:
        """``m * Sg``: elements of the unsharded gradient buffer."""
        return self.base.world_size * self.shard_size

    @property
    def numels(self) -> tuple[int, ...]:
        return self.base.numels

    def _slot(self, i: int) -> int:
        try:
            return self.members.index(i)
        except ValueError:
            raise KeyError(
                f"tensor {i} ({self.base.name(i)}) has no gradient storage in this layout "
                f"(members: {self.members})"
            ) from None

    def piece(self, i: int, rank: int) -> tuple[int, int]:
        """Tensor ``i``'s piece on ``rank`` (within the tensor), as in the parameter layout."""
        return self.base.piece(i, rank)

    def shard_offset(self, i: int, rank: int) -> int:
        """Offset of member ``i``'s piece inside ``rank``'s ``[0, Sg)`` gradient shard. Raises
        ``KeyError`` for a non-member."""
        return self.offsets_by_rank[self._slot(i)][rank]

    def segments(self, i: int) -> tuple[tuple[int, int, int], ...]:
        """Where member ``i``'s non-empty pieces go in the ``m * Sg`` unsharded buffer:
        ``(start, end, dst)`` = tensor elements ``[start, end)`` at buffer offset ``dst``, by rank."""
        j = self._slot(i)
        out = []
        for r in self.base.ranks_of(i):
            a, b = self.base.piece(i, r)
            if b > a:
                out.append((a, b, r * self.shard_size + self.offsets_by_rank[j][r]))
        return tuple(out)

    def contiguous_offset(self, i: int) -> int | None:
        """Start of member ``i`` in the unsharded buffer if its pieces are one contiguous range there
        (always true for a tensor on a single rank), else ``None``."""
        segs = self.segments(i)
        if not segs:
            return None
        for (a0, b0, d0), (_, _, d1) in pairwise(segs):
            if d1 != d0 + (b0 - a0):
                return None
        return segs[0][2]


def plan_grad_layout(layout: Layout, members) -> GradLayout:
    """Compact the pieces of ``members`` (tensor indices of ``layout``) per rank. O(n * m).

    Each rank's member pieces keep the parameter layout's order (by offset in the shard) and start at
    multiples of ``layout.align`` (collective/vector alignment of every sharded gradient). Raises
    ``ValueError`` for an index outside the layout or a duplicate member.
    """
    n, m, al = len(layout.numels), layout.world_size, layout.align
    mem = tuple(sorted({int(i) for i in members}))
    if len(mem) != len(list(members)) or any(not 0 <= i < n for i in mem):
        raise ValueError(
            f"plan_grad_layout: members={list(members)} must be distinct tensor indices in [0, {n})"
        )
    by_rank_offsets = {i: [0] * m for i in mem}
    need = 0
    for r in range(m):
        cursor = 0
        for i in sorted(mem, key=lambda i: (layout.shard_offset(i, r), layout.offsets[i])):
            a, b = layout.piece(i, r)
            by_rank_offsets[i][r] = cursor
            cursor += _align_up(b - a, al)
        need = max(need, cursor)
    sg = max(_align_up(need, al), al)
    return GradLayout(layout, mem, sg, tuple(tuple(by_rank_offsets[i]) for i in mem))


__all__ = ["GradLayout", "plan_grad_layout"]
