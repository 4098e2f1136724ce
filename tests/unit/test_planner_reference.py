"""Independent reference checks for the planner tests (no code shared with raggedfsdp.planner).

``check_layout`` re-derives invariants (a)-(d) element by element; ``brute_min_shard_size`` finds the
minimum shard size for a fixed order by scanning S upward and searching *all* start positions.
Both are deliberately naive: they are the oracle, so they must stay obviously correct.
"""

from __future__ import annotations

from functools import cache


def check_layout(numels, grans, world_size, align, shard_size, offsets, order) -> None:
    """Assert the four layout invariants by painting the buffer element by element (small cases)."""
    m, S = world_size, shard_size
    assert S >= 1 and S % align == 0, f"(d) S={S} not a positive multiple of align={align}"
    owner = [-1] * (m * S)
    for i, (e, g, x) in enumerate(zip(numels, grans, offsets)):
        assert 0 <= x and x + e <= m * S, f"(c) tensor {i} [{x},{x + e}) outside buffer of {m * S}"
        for j in range(e):
            assert owner[x + j] == -1, f"(c) tensor {i} overlaps tensor {owner[x + j]} at {x + j}"
            owner[x + j] = i
        # (b) every block of g elements lies on a single rank
        for blk in range(e // g if g else 0):
            first, last = x + blk * g, x + blk * g + g - 1
            assert first // S == last // S, f"(b) block {blk} of tensor {i} spans ranks"
    # the layout follows `order`: non-empty tensors appear in that sequence
    seq = [i for i in order if numels[i] > 0]
    starts = [offsets[i] for i in seq]
    assert starts == sorted(starts), f"order {order} not respected by offsets {offsets}"


def _valid_starts(e, g, m, S):
    out = []
    for x in range(m * S - e + 1):
        ok = True
        for k in range(1, m):
            b = k * S
            if x < b < x + e and (b - x) % g != 0:
                ok = False
                break
        if ok:
            out.append(x)
    return out


def brute_feasible(numels, grans, perm, m, S) -> bool:
    """Exhaustive search over every start position of every tensor, in order ``perm``."""
    items = [(numels[i], grans[i]) for i in perm if numels[i] > 0]
    starts = [_valid_starts(e, g, m, S) for e, g in items]

    @cache
    def go(k, cursor):
        if k == len(items):
            return True
        e = items[k][0]
        return any(go(k + 1, x + e) for x in starts[k] if x >= cursor)

    return go(0, 0)


def brute_min_shard_size(numels, grans, perm, m, align) -> int:
    E = sum(numels)
    S = max(-(-E // m), 1)
    S = -(-S // align) * align
    while not brute_feasible(numels, grans, perm, m, S):
        S += align
    return S


# ---- the oracle's own sanity checks (hand-worked cases) -------------------------------------
def test_oracle_hand_cases():
    # one tensor of 3 blocks of 4 on 3 ranks: S=4 puts one block per rank
    assert brute_feasible([12], [4], [0], 3, 4)
    # S=5: every start crosses 5 or 10 off a block edge
    assert not brute_feasible([12], [4], [0], 3, 5)
    assert brute_min_shard_size([12, 1], [4, 1], [0, 1], 3, 1) == 8
    assert brute_min_shard_size([5, 7, 11], [1, 1, 1], [0, 1, 2], 4, 1) == 6
    assert brute_min_shard_size([100, 4, 4], [100, 1, 1], [0, 1, 2], 4, 1) == 100
    check_layout([8, 6, 3], [4, 3, 1], 3, 1, 7, (3, 11, 17), (0, 1, 2))
    import pytest

    with pytest.raises(AssertionError, match="spans ranks"):
        check_layout([8, 6, 3], [4, 3, 1], 3, 1, 7, (2, 11, 17), (0, 1, 2))
    with pytest.raises(AssertionError, match="overlaps"):
        check_layout([8, 6, 3], [4, 3, 1], 3, 1, 7, (3, 10, 17), (0, 1, 2))
