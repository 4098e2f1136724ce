"""Planned layout of one FSDP unit's tensors in a flat buffer (veScale-FSDP paper, section 2).

The buffer has ``world_size * shard_size`` elements; rank ``k`` owns ``[k*S, (k+1)*S)``. Each
tensor ``t`` occupies the contiguous range ``[offsets[t], offsets[t] + numels[t])``; padding lies
only between tensors; no rank boundary cuts a block of ``granularities[t]`` elements.

Note [segmented layout]
    A layout may be cut into *segments* (``segments = (S_0, S_1, ...)``, summing to ``S``): the
    unsharded buffer is segment 0's ``m * S_0`` elements, then segment 1's ``m * S_1``, ...; within
    segment ``s`` (global offset ``G_s = m * (S_0 + ... + S_{s-1})``) rank ``k`` owns
    ``[G_s + k*S_s, G_s + (k+1)*S_s)``, which sits in its ``(S,)`` shard at ``P_s = S_0 + ... +
    S_{s-1}``. Every tensor lies inside one segment; each segment on its own obeys the invariants
    above. ``raggedfsdp.planner.plan_segments`` uses it to give the trainable tensors of a unit that
    mixes frozen and trainable ones their own segment, so every rank holds ``~1/m`` of them (their
    gradients and optimizer state follow the pieces). The unsharded buffer is then not rank-major:
    it is all-gathered one segment at a time (``DBuffer.all_gather_from``), and the gradient roles
    always use a rank-major :class:`~raggedfsdp.planner.GradLayout`. With ``segments=None`` (one
    segment) everything is as described above.

Every size and offset in this module is counted in **elements** of the buffer's dtype, never bytes.
:func:`validate_layout` re-checks the four invariants (equal shards, whole blocks, contiguous
tensors, aligned shard size) from the stored numbers alone, independently of how they were planned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any


@dataclass(frozen=True)
class Layout:
    """Result of :func:`plan_layout`. All sizes are in elements (not bytes).

    Attributes:
        world_size: number of ranks ``m`` of the shard mesh dim.
        shard_size: per-rank shard size ``S`` (a positive multiple of ``align``).
        numels: per-tensor element counts, in the caller's order.
        granularities: per-tensor block size in elements (divides the numel).
        offsets: per-tensor global offset in the ``m*S`` buffer, in the caller's order.
        order: the permutation of tensor indices as laid out in the buffer.
        align: the collective alignment unit in elements (``S % align == 0``).
        shapes: optional per-tensor shapes (caller's order), carried for reports and ``dims``.
        names: optional per-tensor names (caller's order), carried for reports and errors.
        segments: ``None`` (one segment, rank-major) or the per-segment shard sizes ``(S_0, S_1, ..)``
            summing to ``shard_size``, each a positive multiple of ``align`` (Note [segmented layout]).
    """

    world_size: int
    shard_size: int
    numels: tuple[int, ...]
    granularities: tuple[int, ...]
    offsets: tuple[int, ...]
    order: tuple[int, ...]
    align: int = 1
    shapes: tuple[tuple[int, ...], ...] | None = None
    names: tuple[str, ...] | None = None
    segments: tuple[int, ...] | None = None

    # ---- sizes and padding statistics -----------------------------------------------------
    @property
    def total_size(self) -> int:
        """``m * S``: elements of the unsharded flat buffer."""
        return self.world_size * self.shard_size

    @property
    def total_numel(self) -> int:
        """``E = sum(numels)``: real (non-padding) elements."""
        return sum(self.numels)

    @property
    def padding(self) -> int:
        """``m * S - sum(numels)``: padding elements in the unsharded buffer."""
        return self.total_size - self.total_numel

    @property
    def padding_ratio(self) -> float:
        """Padding as a fraction of the unsharded buffer, ``(m*S - E) / (m*S)``."""
        total = self.total_size
        return self.padding / total if total else 0.0

    @property
    def lower_bound(self) -> int:
        """Smallest conceivable shard size: ``ceil(E/m)`` rounded up to ``align`` (and at least ``align``).

        This is what flat element-wise sharding (FSDP1 / DeepSpeed ZeRO-3 with the same alignment)
        needs; ``shard_size - lower_bound`` is the price of whole blocks and contiguous tensors.
        """
        per_rank = max(-(-self.total_numel // self.world_size), 1)
        return -(-per_rank // self.align) * self.align

    @property
    def excess_padding(self) -> int:
        """Padding beyond the flat lower bound, ``m * (S - lower_bound)``."""
        return self.world_size * (self.shard_size - self.lower_bound)

    def name(self, i: int) -> str:
        """Tensor ``i``'s name for messages (``"tensor <i>"`` when no names were given)."""
        return self.names[i] if self.names is not None else f"tensor {i}"

    # ---- segments (Note [segmented layout]) -------------------------------------------------
    @cached_property
    def segment_spans(self) -> tuple[tuple[int, int, int], ...]:
        """Per segment ``(G_s, S_s, P_s)``: its start in the unsharded buffer, its per-rank shard size
        and its start inside each rank's ``(S,)`` shard (elements). ``((0, S, 0),)`` for one segment."""
        if self.segments is None:
            return ((0, self.shard_size, 0),)
        out, p = [], 0
        for s in self.segments:
            out.append((self.world_size * p, s, p))
            p += s
        return tuple(out)

    @cached_property
    def _tensor_spans(self) -> tuple[tuple[int, int, int], ...]:
        spans = self.segment_spans
        m = self.world_size
        out = []
        for x, e in zip(self.offsets, self.numels):
            # a tensor lies inside one segment; an empty one at a segment's end belongs to that segment
            out.append(
                next(
                    (sp for sp in spans if x < sp[0] + m * sp[1] or (e == 0 and x == sp[0] + m * sp[1])),
                    spans[-1],
                )
            )
        return tuple(out)

    def segment_of(self, i: int) -> int:
        """Index of the segment holding tensor ``i`` (0 for a one-segment layout)."""
        if self.segments is None:
            return 0
        return self.segment_spans.index(self._tensor_spans[i])

    @property
    def rank_major(self) -> bool:
        """True for one segment: the unsharded buffer is the ranks' shards in rank order (one even
        all-gather / reduce-scatter of the whole buffer is correct)."""
        return self.segments is None

    # ---- per-rank pieces -------------------------------------------------------------------
    def piece(self, i: int, rank: int) -> tuple[int, int]:
        """Tensor ``i``'s piece on ``rank`` as ``(start, end)`` element offsets *within the tensor*. O(1)."""
        if self.segments is None:
            g0, S = 0, self.shard_size
        else:
            g0, S, _ = self._tensor_spans[i]
        x = self.offsets[i] - g0
        lo = max(x, rank * S)
        hi = min(x + self.numels[i], (rank + 1) * S)
        if hi <= lo:
            # empty piece: anchor it where the tensor meets this rank's range (for views of size 0)
            anchor = min(max(rank * S - x, 0), self.numels[i])
            return anchor, anchor
        return lo - x, hi - x

    def shard_offset(self, i: int, rank: int) -> int:
        """Offset of tensor ``i``'s piece inside ``rank``'s shard ``[0, S)`` (elements). O(1)."""
        start, _ = self.piece(i, rank)
        if self.segments is None:
            return min(max(self.offsets[i] + start - rank * self.shard_size, 0), self.shard_size)
        g0, S, p0 = self._tensor_spans[i]
        return p0 + min(max(self.offsets[i] - g0 + start - rank * S, 0), S)

    def local_units(self, i: int) -> tuple[int, ...]:
        """Per-rank unit counts of tensor ``i`` (piece length / granularity) for ``RaggedShard``. O(m)."""
        g = self.granularities[i]
        units = []
        for k in range(self.world_size):
            a, b = self.piece(i, k)
            units.append((b - a) // g if g else 0)
        return tuple(units)

    def ranks_of(self, i: int) -> range:
        """Ranks holding a non-empty piece of tensor ``i`` (empty range for a zero-size tensor)."""
        if self.numels[i] == 0:
            return range(0)
        g0, S = (0, self.shard_size) if self.segments is None else self._tensor_spans[i][:2]
        first = (self.offsets[i] - g0) // S
        last = (self.offsets[i] - g0 + self.numels[i] - 1) // S
        return range(first, last + 1)

    # ---- serialization ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; :meth:`from_dict` restores an equal ``Layout``."""
        d: dict[str, Any] = {
            "world_size": self.world_size,
            "shard_size": self.shard_size,
            "align": self.align,
            "numels": list(self.numels),
            "granularities": list(self.granularities),
            "offsets": list(self.offsets),
            "order": list(self.order),
        }
        if self.shapes is not None:
            d["shapes"] = [list(s) for s in self.shapes]
        if self.names is not None:
            d["names"] = list(self.names)
        if self.segments is not None:
            d["segments"] = list(self.segments)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Layout:
        shapes = d.get("shapes")
        names = d.get("names")
        segments = d.get("segments")
        return cls(
            world_size=int(d["world_size"]),
            shard_size=int(d["shard_size"]),
            numels=tuple(int(x) for x in d["numels"]),
            granularities=tuple(int(x) for x in d["granularities"]),
            offsets=tuple(int(x) for x in d["offsets"]),
            order=tuple(int(x) for x in d["order"]),
            align=int(d.get("align", 1)),
            shapes=None if shapes is None else tuple(tuple(int(v) for v in s) for s in shapes),
            names=None if names is None else tuple(str(n) for n in names),
            segments=None if segments is None else tuple(int(x) for x in segments),
        )


def dim0_shard_padding(shapes, world_size: int) -> int:
    """Padding, in elements, of torch's ``fully_shard`` (FSDP2) for tensors of ``shapes`` on ``world_size``
    ranks: each tensor is ``Shard(0)`` with dim 0 padded up to a multiple of ``world_size``
    (``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``, the padded ``_sharded_param_data``). The
    reference that :func:`padding_vs_fsdp2` compares a raggedfsdp layout with."""
    return sum((-int(s[0]) % world_size) * math.prod(int(d) for d in s[1:]) for s in shapes if len(s))


def padding_vs_fsdp2(layout: Layout) -> tuple[float, float]:
    """``(ours, fsdp2)``: the layout's padding and FSDP2's for the same tensors, each as a fraction of
    the real elements. Pure.

    Raises:
        ValueError: the layout carries no ``shapes`` (plan it with ``plan_layout(..., shapes=...)``).
    """
    if layout.shapes is None:
        raise ValueError("padding_vs_fsdp2: the layout has no shapes; plan it with shapes=")
    n = max(layout.total_numel, 1)
    return layout.padding / n, dim0_shard_padding(layout.shapes, layout.world_size) / n


def validate_layout(layout: Layout) -> None:
    """Check a layout's invariants from its numbers alone; raise ``ValueError`` naming the violation.

    Checked (paper section 2.2): (a) ``m * S`` buffer split into equal shards with ``S >= 1``;
    (b) no rank boundary ``k*S`` (``0 < k < m``) strictly inside a tensor at an offset that is not a
    multiple of its granularity; (c) each tensor is one contiguous in-bounds range, ranges are
    disjoint and follow ``layout.order``; (d) ``S % align == 0``. Also: lengths agree, ``order`` is
    a permutation, numels are non-negative and granularities positive divisors of their numels.
    A segmented layout (Note [segmented layout]): segment sizes are positive multiples of ``align``
    summing to ``S``, every tensor lies inside one segment, and (b) holds for each segment's rank
    boundaries ``G_s + k*S_s``.

    Cost: O(n + sum over tensors of the boundaries they cross) -- at most O(n + m).
    """
    m, S, a = layout.world_size, layout.shard_size, layout.align
    n = len(layout.numels)
    if m < 1:
        raise ValueError(f"invalid layout: world_size={m} must be >= 1")
    if a < 1:
        raise ValueError(f"invalid layout: align={a} must be >= 1")
    if S < 1 or S % a != 0:
        raise ValueError(f"invalid layout: shard_size={S} must be a positive multiple of align={a}")
    segs = (S,) if layout.segments is None else tuple(layout.segments)
    if not segs or any(s < 1 or s % a for s in segs) or sum(segs) != S:
        raise ValueError(
            f"invalid layout: segments={layout.segments} must be positive multiples of align={a} summing to "
            f"shard_size={S}"
        )
    for field in ("granularities", "offsets", "order"):
        if len(getattr(layout, field)) != n:
            raise ValueError(f"invalid layout: len({field})={len(getattr(layout, field))} != len(numels)={n}")
    for field in ("shapes", "names"):
        val = getattr(layout, field)
        if val is not None and len(val) != n:
            raise ValueError(f"invalid layout: len({field})={len(val)} != len(numels)={n}")
    if sorted(layout.order) != list(range(n)):
        raise ValueError(f"invalid layout: order={layout.order} is not a permutation of range({n})")
    cap = m * S
    starts, p = [], 0  # segment starts G_s in the unsharded buffer
    for s in segs:
        starts.append(m * p)
        p += s
    cursor = 0
    for i in layout.order:
        e, g, x = layout.numels[i], layout.granularities[i], layout.offsets[i]
        who = layout.name(i)
        if e < 0:
            raise ValueError(f"invalid layout: {who} has negative numel={e}")
        if g < 1 or e % g != 0:
            raise ValueError(f"invalid layout: {who} granularity={g} must be >= 1 and divide numel={e}")
        if layout.shapes is not None:
            prod = 1
            for d in layout.shapes[i]:
                prod *= d
            if prod != e:
                raise ValueError(
                    f"invalid layout: {who} shape={layout.shapes[i]} has {prod} elements, numel={e}"
                )
        if x < 0 or x + e > cap:
            raise ValueError(f"invalid layout: {who} range [{x}, {x + e}) is outside the buffer [0, {cap})")
        if e == 0:
            continue
        if x < cursor:
            raise ValueError(
                f"invalid layout: {who} starts at {x} before the previous tensor in order ends at {cursor}"
            )
        cursor = x + e
        s = max(j for j, g0 in enumerate(starts) if g0 <= x)
        g0, Ss = starts[s], segs[s]
        if x + e > g0 + m * Ss:
            raise ValueError(
                f"invalid layout: {who} range [{x}, {x + e}) crosses the end {g0 + m * Ss} of segment {s}"
            )
        k = (x - g0) // Ss + 1  # first boundary strictly after x
        while k < m and g0 + k * Ss < x + e:
            if (g0 + k * Ss - x) % g != 0:
                raise ValueError(
                    f"invalid layout: rank boundary {g0 + k * Ss} (k={k}, S={Ss}) cuts {who} at element "
                    f"{g0 + k * Ss - x}, not a multiple of its granularity {g}"
                )
            k += 1
