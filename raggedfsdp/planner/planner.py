"""Planner v0: greedy earliest-fit per fixed order + search over S (see paper-notes section 2.4)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from raggedfsdp.planner.layout import Layout


def _place(numels, grans, order, m, S, case3_ok):
    """Greedy earliest-fit of ``order`` into ``m`` shards of size ``S``; offsets or None."""
    offsets = [0] * len(numels)
    p = 0
    cap = m * S
    for i in order:
        e, g = numels[i], grans[i]
        if e == 0:
            offsets[i] = min(p, cap)
            continue
        while True:
            b = (p // S + 1) * S
            if p + e <= b:
                x = p
                break
            j = (b - p) // g
            if j >= 1:
                x = b - j * g
                if x + e <= b + S or (S % g == 0 and case3_ok(g)):
                    break
            p = b
            if p >= cap:
                return None
        if x + e > cap:
            return None
        offsets[i] = x
        p = x + e
    return offsets


def plan_layout(
    numels: Sequence[int],
    granularities: Sequence[int] | None,
    world_size: int,
    *,
    align: int = 1,
    order: str | Sequence[int] = "default",
) -> Layout:
    """Lay out tensors of ``numels`` elements into ``world_size`` equal shards; pure and deterministic.

    Every rank must compute the identical plan from identical inputs (no communication here).

    Raises:
        ValueError: ``world_size < 1``, a negative numel, or a granularity not dividing its numel.
    """
    numels = [int(n) for n in numels]
    grans = [1] * len(numels) if granularities is None else [int(g) for g in granularities]
    if world_size < 1:
        raise ValueError(f"plan_layout: world_size={world_size} must be >= 1")
    for i, (e, g) in enumerate(zip(numels, grans)):
        if e < 0:
            raise ValueError(f"plan_layout: tensor {i} has negative numel {e}")
        if g < 1 or (e % g != 0):
            raise ValueError(f"plan_layout: tensor {i} granularity {g} must be >= 1 and divide its numel {e}")
    if order == "default":
        perm = list(range(len(numels)))
    else:
        perm = [int(i) for i in order]  # type: ignore[union-attr]
    m = world_size
    E = sum(numels)
    lb = max(-(-E // m), 1)
    best = None
    a = align
    cands = [align]
    for g in sorted(set(grans)):
        a = math.lcm(a, g)
        if a not in cands:
            cands.append(a)
    for a in cands:
        lo = -(-lb // a) * a
        hi = -(-max(E, 1) // a) * a
        ok = lambda g, a=a: a % g == 0  # noqa: E731
        if _place(numels, grans, perm, m, hi, ok) is None:
            continue
        while lo < hi:
            mid = (lo // a + (hi - lo) // a // 2) * a
            if _place(numels, grans, perm, m, mid, ok) is None:
                lo = mid + a
            else:
                hi = mid
        if best is None or hi < best:
            best = hi
    offsets = _place(numels, grans, perm, m, best, lambda g: best % g == 0)
    assert offsets is not None
    return Layout(m, best, tuple(numels), tuple(grans), tuple(offsets), tuple(perm), align)
