"""Exact minimum-shard-size planner for a fixed tensor order (veScale-FSDP paper, section 2).

Problem (paper section 2.2). Tensors ``t`` of ``e_t`` elements and block size ``g_t`` (``g_t | e_t``)
go, in a given order, into a flat buffer of ``m * S`` elements split into ``m`` equal shards. Each
tensor is one contiguous range (padding only between tensors); a rank boundary ``k*S`` strictly
inside a tensor must cut it at a multiple of ``g_t``; ``S`` is a multiple of ``align``. Minimise ``S``.
All quantities are element counts (not bytes).

Note: exactness for a fixed order
-----------------------------------
1. *Feasibility for one S is a greedy.* Whether a start ``x`` is valid for ``t`` depends only on
   ``(x mod S, e_t, g_t, S)`` and the end cap ``m*S``. Placing each tensor at the earliest valid
   start at or after the previous end is optimal: the earliest-valid-start map is non-decreasing in
   the cursor, so by induction every greedy end is <= the matching end of any feasible layout.
   :func:`_earliest` finds that start in O(1) (the paper's three cases: the tensor stays inside a
   shard; crosses one boundary at a block edge; or contains a whole shard -- "case 3" -- which is
   only valid when ``S % g_t == 0``). Because validity is periodic in ``x`` with period ``S``, at
   most one partial shard and one aligned start need to be tried. So a check is O(n).
2. *Feasibility is not monotone in S* (case 3 needs ``g_t | S``), but these are:

   - the **relaxation** R(S) that lets every tensor contain whole shards with no ``g_t | S`` test
     (only its first cut must be a block edge). R(S) is implied by feasibility.
   - for an integer ``a`` (a multiple of ``align``), H_a(S) on multiples of ``a``: feasibility
     with case 3 allowed only for tensors with ``g_t | a``.

   Proof sketch (both): given a layout for S and S' >= S, keep, rank by rank, the same contents at
   the same in-shard offsets, except that a tensor crossing into the next rank is shifted right so
   its head on the current rank has the same length (the extra S'-S elements become padding in
   front of it). A tensor that contained q whole shards of S now contains q' <= q whole shards of
   S' and ends at a (rank, offset) no later than before; it is still valid because its first cut
   is unchanged and, in H_a, ``g_t | a | S'``. Induction over tensors ends within ``m*S'``.
3. *Search.* Binary search R gives ``S_R <= S*``. Only tensors with ``e_t > S_R + g_t`` can ever
   contain a whole shard at ``S >= S_R``; let G be their distinct granularities. For the optimum
   S*, ``a* = lcm(align, {g in G : g | S*})`` divides S* and H_a*(S*) holds, and every H_a-feasible
   S is feasible, so ``S* = min over a in lcm-closure(align, G) of min{S in aZ, S >= S_R : H_a(S)}``.
   Candidates are visited best-first by their lower bound ``ceil(S_R/a)*a`` and pruned against the
   best S found (a multiple of ``a`` cannot beat a bound that ``a``'s own round-up already
   exceeds), each needing one O(n) check plus, rarely, a binary search over multiples of ``a``.
   Should a pathological input make more than ``_MAX_CANDIDATES`` candidates look promising, the
   search finishes by checking every multiple of ``align`` from the smallest open bound upward --
   slower, still exact.

Complexity: O(n log(E/align)) for the relaxation plus O(n) per candidate visited (O(n log) if one
needs a binary search). Transformer units have one to three relevant granularities, so one to a
few candidates; a 1,500-tensor MoE layer plans in a few milliseconds per order.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from raggedfsdp.planner.layout import Layout

_MAX_CANDIDATES = 512  # lcm candidates visited before the exact scan fallback (never hit by real models)

ORDERS = ("default", "granularity", "shape", "size")
"""Named orders tried by ``order="best"`` (ties go to the earlier name). The first three are the
paper's (section 2.4); ``size`` (largest tensors first) is ours: it lets big tensors anchor the
shard boundaries and small ones fill the gaps, and wins on some MoE layers."""


def _earliest(p: int, e: int, g: int, S: int, case3: bool) -> int:
    """Earliest valid start ``x >= p`` of a tensor (``e`` elements, block ``g``) for shard size ``S``.

    ``case3``: whether the tensor may contain a whole shard (caller guarantees the condition, or
    passes True for the relaxation). Returns -1 if no start is valid anywhere (ignoring the cap).
    """
    b = (p // S + 1) * S  # first boundary strictly after p
    if p + e <= b:
        return p  # case 1 (or ends exactly at the boundary)
    j = (b - p) // g
    if j:
        x = b - j * g  # earliest start whose cut at b is a block edge
        if case3 or x + e <= b + S:
            return x
    # no start in [p, b); starts in [b, b + S) are as good as in any later shard (period S)
    if e <= S:
        return b
    j = S // g
    if j:
        x = b + S - j * g
        if case3 or x + e <= b + 2 * S:
            return x
    return -1


def _fit(numels: list[int], grans: list[int], perm: Sequence[int], m: int, S: int, case3: list[bool]):
    """Greedy earliest-fit of ``perm`` into ``m`` shards of ``S``: offsets (caller's order) or None."""
    offsets = [0] * len(numels)
    cap = m * S
    p = 0
    for i in perm:
        e = numels[i]
        x = _earliest(p, e, grans[i], S, case3[i])
        if x < 0 or x + e > cap:
            return None
        offsets[i] = x
        p = x + e
    return offsets


def _feasible(numels, grans, perm, m, S, case3) -> bool:
    cap = m * S
    p = 0
    for i in perm:
        e = numels[i]
        x = _earliest(p, e, grans[i], S, case3[i])
        if x < 0:
            return False
        p = x + e
        if p > cap:
            return False
    return True


def _min_multiple(pred, a: int, lo: int, hi: int | None) -> int | None:
    """Smallest multiple ``S`` of ``a`` in ``[lo, hi)`` with monotone ``pred(S)``; ``hi=None``: unbounded."""
    lo = -(-lo // a) * a
    if pred(lo):
        return lo
    if hi is None:
        step = a
        top = lo + step
        while not pred(top):
            lo = top
            step *= 2
            top = lo + step
    else:
        top = (hi - 1) // a * a
        if top <= lo or not pred(top):
            return None
    # invariant: pred(lo) false, pred(top) true
    while top - lo > a:
        mid = lo + ((top - lo) // a // 2) * a
        if pred(mid):
            top = mid
        else:
            lo = mid
    return top


def _min_shard_size(numels: list[int], grans: list[int], perm: Sequence[int], m: int, align: int) -> int:
    """Exact ``min S`` for the fixed order ``perm`` (see the module note)."""
    n = len(numels)
    E = sum(numels)
    lb = max(-(-E // m), 1)
    if m == 1:
        return -(-lb // align) * align
    all_true = [True] * n
    s_relax = _min_multiple(lambda S: _feasible(numels, grans, perm, m, S, all_true), align, lb, None)
    assert s_relax is not None
    relevant = sorted({g for e, g in zip(numels, grans) if e > s_relax + g})

    def h(a: int):
        flags = [a % g == 0 for g in grans]
        return lambda S: _feasible(numels, grans, perm, m, S, flags)

    def bound(a: int) -> int:
        return -(-s_relax // a) * a

    # initial upper bound from the most permissive candidate (all relevant blocks may be case 3)
    a_full = align
    for g in relevant:
        a_full = math.lcm(a_full, g)
    best = _min_multiple(h(a_full), a_full, s_relax, None)
    assert best is not None
    if best == s_relax:
        return best
    # best-first walk of the lcm-closure of align and the relevant granularities by lower bound;
    # a child lcm(a, g) is a multiple of a, so its bound is >= a's and pruning a prunes its subtree
    heap = [(s_relax, align)]
    seen = {align}
    visited = 0
    while heap:
        lb_a, a = heapq.heappop(heap)
        if lb_a >= best:
            break
        visited += 1
        if visited > _MAX_CANDIDATES:
            # pathological closure: every optimum below `best` is >= lb_a, so scan exactly from there
            for S in range(lb_a, best, align):
                if _feasible(numels, grans, perm, m, S, [S % g == 0 for g in grans]):
                    return S
            return best
        s = _min_multiple(h(a), a, s_relax, best)
        if s is not None and s < best:
            best = s
        for g in relevant:
            b = math.lcm(a, g)
            if b not in seen and bound(b) < best:
                seen.add(b)
                heapq.heappush(heap, (bound(b), b))
    return best


def shard_size_lower_bound(
    numels: Sequence[int], granularities: Sequence[int] | None, world_size: int, align: int = 1
) -> int:
    """A lower bound on the shard size valid for *every* order (elements); inputs as :func:`plan_layout`.

    Necessary conditions for any layout with shard size ``S`` (each tensor looked at alone):

    1. ``m * S >= E`` and ``S % align == 0`` (the flat FSDP1 bound);
    2. ``S >= g_t`` for every non-empty tensor (a block lives on one rank; ``g_t > S`` would mean
       ``e_t > S`` and a cut);
    3. ``g_t | S`` if ``e_t >= 2S``: with two or more cuts, consecutive cuts are ``S`` apart and
       both at block edges; with one cut, head and tail are ``<= S`` and sum to ``e_t >= 2S``, so
       the head is exactly ``S``;
    4. if ``S < e_t < 2S`` and ``g_t`` does not divide ``S``: the tensor has exactly one cut, so a
       multiple of ``g_t`` (the head) lies in ``[e_t - S, S]``, i.e. ``floor(S/g_t)*g_t >= e_t - S``.

    The smallest ``S`` meeting all four is found by jumping from ``S`` to the next value that a
    violated condition could allow (never skipping a valid one). When the planner's result equals
    this bound it is optimal over all orders; when the bound already exceeds a padding target, no
    order and no planner under the same contract can meet it. Cost: O(n) to collect the distinct
    ``(numel, granularity)`` pairs, then O(distinct pairs) per jump, few jumps.
    """
    n = len(numels)
    grans = [1] * n if granularities is None else list(granularities)
    items = {(int(e), int(g)) for e, g in zip(numels, grans) if e > 0}
    return lower_bound_from_items(sum(int(e) for e in numels), items, world_size, align)


def lower_bound_from_items(total: int, items, world_size: int, align: int = 1) -> int:
    """:func:`shard_size_lower_bound` from the total element count and the *distinct* non-empty
    ``(numel, granularity)`` pairs (conditions 2-4 look at each tensor alone, so duplicates add
    nothing). Cost: O(distinct pairs) per jump; lets a caller bound a union of units by merging
    their pair sets instead of their tensor lists.
    """
    items = sorted(set(items))
    m = world_size
    S = max(-(-int(total) // m), 1, max((g for _, g in items), default=1))
    S = -(-S // align) * align
    while True:
        a, nxt = align, None
        for e, g in items:  # condition 3
            if e >= 2 * S:
                a = math.lcm(a, g)
                c = e // 2 + 1  # smallest S' with e < 2S'
                nxt = c if nxt is None else min(nxt, c)
        if S % a:
            S = min(-(-S // a) * a, -(-nxt // align) * align)
            continue
        jump = S
        for e, g in items:  # condition 4
            if S < e < 2 * S and S % g and (S // g) * g < e - S:
                nxt_div = (S // g + 1) * g
                lo, hi = S, e  # smallest S' in (S, e] with S' + floor(S'/g)*g >= e
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    if mid + (mid // g) * g >= e:
                        hi = mid
                    else:
                        lo = mid
                jump = max(jump, min(nxt_div, hi))
        if jump == S:
            return S
        S = -(-jump // align) * align


def _resolve_order(order, numels, grans, shapes) -> list[int]:
    n = len(numels)
    if isinstance(order, str):
        if order == "default":
            return list(range(n))
        if order == "granularity":
            # coarse blocks first (they need block-aligned cuts; fine-grained tensors then fill the
            # tail of the buffer where a boundary may fall anywhere); stable within equal blocks
            return sorted(range(n), key=lambda i: (-grans[i], -numels[i], i))
        if order == "shape":
            # group tensors of the same row length (trailing dims) together, larger rows first,
            # then larger tensors first; stable within equal shapes
            def key(i):
                s = shapes[i]
                row = math.prod(s[1:]) if len(s) > 1 else 1
                return (-row, -numels[i], tuple(-d for d in s), i)

            return sorted(range(n), key=key)
        if order == "size":
            return sorted(range(n), key=lambda i: (-numels[i], i))
        raise ValueError(
            f"plan_layout: order={order!r} must be one of {ORDERS + ('best',)} or a permutation of range({n})"
        )
    perm = [int(i) for i in order]
    if sorted(perm) != list(range(n)):
        raise ValueError(f"plan_layout: order={tuple(perm)} is not a permutation of range({n})")
    return perm


def _check_inputs(numels, granularities, world_size, align, shapes, names):
    n = len(numels)
    label = (lambda i: f"tensor {i} ({names[i]!r})") if names is not None else (lambda i: f"tensor {i}")
    if isinstance(world_size, bool) or int(world_size) != world_size or world_size < 1:
        raise ValueError(f"plan_layout: world_size={world_size!r} must be an integer >= 1")
    if isinstance(align, bool) or int(align) != align or align < 1:
        raise ValueError(f"plan_layout: align={align!r} must be an integer >= 1 (elements)")
    if granularities is not None and len(granularities) != n:
        raise ValueError(f"plan_layout: {len(granularities)} granularities for {n} tensors")
    if shapes is not None and len(shapes) != n:
        raise ValueError(f"plan_layout: {len(shapes)} shapes for {n} tensors")
    if names is not None and len(names) != n:
        raise ValueError(f"plan_layout: {len(names)} names for {n} tensors")
    out_n, out_g = [], []
    for i in range(n):
        e = numels[i]
        if isinstance(e, bool) or int(e) != e or e < 0:
            raise ValueError(f"plan_layout: {label(i)} has numel={e!r}; numels must be integers >= 0")
        e = int(e)
        g = 1 if granularities is None else granularities[i]
        if isinstance(g, bool) or int(g) != g or g < 1:
            raise ValueError(f"plan_layout: {label(i)} has granularity={g!r}; it must be an integer >= 1")
        g = int(g)
        if e % g != 0:
            raise ValueError(
                f"plan_layout: {label(i)} granularity={g} does not divide its numel={e} (remainder {e % g})"
            )
        if shapes is not None and math.prod(shapes[i]) != e:
            raise ValueError(
                f"plan_layout: {label(i)} shape={tuple(shapes[i])} does not have numel={e} elements"
            )
        out_n.append(e)
        out_g.append(g)
    return out_n, out_g


def plan_layout(
    numels: Sequence[int],
    granularities: Sequence[int] | None,
    world_size: int,
    *,
    align: int = 1,
    order: str | Sequence[int] = "default",
    shapes: Sequence[Sequence[int]] | None = None,
    names: Sequence[str] | None = None,
) -> Layout:
    """Lay out tensors of ``numels`` elements into ``world_size`` equal shards; pure and deterministic.

    Every rank computes the identical plan from identical inputs (no process group, no randomness).

    Args:
        numels: elements per tensor (>= 0), in the unit's parameter order.
        granularities: block size in elements per tensor (must divide its numel); ``None`` = all 1.
        world_size: ``m``, the number of shards (ranks of the FSDP mesh dim).
        align: ``S`` is a multiple of this many elements (collective alignment, e.g. 8 for 16 B of
            bf16). The planner aligns shard sizes only, not tensor starts.
        order: ``"default"`` (given order), ``"granularity"`` (coarser blocks first),
            ``"shape"`` (grouped by row length, then size; uses ``shapes``, or numels when absent),
            ``"size"`` (larger tensors first), ``"best"`` (minimum ``S`` over those four, each
            exact; ties go to the earlier one in :data:`ORDERS`, so to ``default`` first), or an
            explicit permutation of ``range(len(numels))``.
        shapes: optional tensor shapes (stored in the layout; used by ``order="shape"``).
        names: optional tensor names (stored in the layout; used in error messages).

    Returns:
        A :class:`Layout` whose ``shard_size`` is the exact minimum over all layouts that keep the
        chosen order (see the module note for the proof and cost).

    Raises:
        ValueError: ``world_size < 1``, ``align < 1``, a negative numel, a granularity < 1 or not
            dividing its numel (naming the tensor and values), mismatched lengths, a bad ``order``.
    """
    granularities = None if granularities is None else list(granularities)
    shapes = None if shapes is None else list(shapes)
    names = None if names is None else list(names)
    numels_l, grans = _check_inputs(list(numels), granularities, world_size, align, shapes, names)
    m, align = int(world_size), int(align)
    shapes_t = None if shapes is None else tuple(tuple(int(d) for d in s) for s in shapes)
    names_t = None if names is None else tuple(str(x) for x in names)
    sort_shapes = shapes_t if shapes_t is not None else tuple((e,) for e in numels_l)

    if isinstance(order, str) and order == "best":
        best_perm, best_S = None, None
        for name in ORDERS:
            perm = _resolve_order(name, numels_l, grans, sort_shapes)
            if best_perm is not None and perm == best_perm:
                continue
            S = _min_shard_size(numels_l, grans, perm, m, align)
            if best_S is None or S < best_S:
                best_perm, best_S = perm, S
        perm, S = best_perm, best_S
    else:
        perm = _resolve_order(order, numels_l, grans, sort_shapes)
        S = _min_shard_size(numels_l, grans, perm, m, align)
    offsets = _fit(numels_l, grans, perm, m, S, [S % g == 0 for g in grans])
    assert offsets is not None, "planner bug: the minimum shard size is not feasible"
    return Layout(m, S, tuple(numels_l), tuple(grans), tuple(offsets), tuple(perm), align, shapes_t, names_t)
