"""plan_grad_layout (issue 13 item 1) against a brute-force simulation of the even reduce-scatter.

Reference: label every element of every member tensor, write each member's full "gradient" into the
``m * Sg`` unsharded buffer through ``segments``, cut the buffer into ``m`` equal ``Sg`` shards (what
an even reduce-scatter delivers to each rank) and read every rank's piece back through
``shard_offset``: it must be exactly the tensor's elements ``piece(i, r)`` of the parameter layout,
no two pieces may overlap, and ``Sg`` must be the aligned per-rank maximum.
"""

from __future__ import annotations

import random

import pytest

from raggedfsdp.planner import plan_grad_layout, plan_layout


def _random_case(rng):
    m = rng.randint(1, 6)
    n = rng.randint(1, 8)
    grans = [rng.choice([1, 2, 3, 4, 8]) for _ in range(n)]
    numels = [g * rng.randint(0, 12) for g in grans]
    align = rng.choice([1, 2, 4])
    layout = plan_layout(numels, grans, m, align=align)
    members = sorted(rng.sample(range(n), rng.randint(1, n)))
    return layout, members


@pytest.mark.parametrize("seed", range(300))
def test_grad_layout_matches_reduce_scatter_simulation(seed):
    layout, members = _random_case(random.Random(seed))
    gl = plan_grad_layout(layout, members)
    m, sg, al = layout.world_size, gl.shard_size, layout.align
    assert sg >= al and sg % al == 0
    buf = [None] * (m * sg)
    for i in members:
        covered = 0
        for a, b, dst in gl.segments(i):
            for k in range(a, b):
                assert buf[dst + k - a] is None, "two pieces overlap in the unsharded grad buffer"
                buf[dst + k - a] = (i, k)
            covered += b - a
        assert covered == layout.numels[i]
        off = gl.contiguous_offset(i)
        if off is not None:  # one view [off, off + numel) holds the tensor in order
            assert [buf[off + k] for k in range(layout.numels[i])] == [
                (i, k) for k in range(layout.numels[i])
            ]
    need = 0
    for r in range(m):
        shard = buf[r * sg : (r + 1) * sg]
        used = 0
        for i in members:
            a, b = layout.piece(i, r)
            o = gl.shard_offset(i, r)
            assert 0 <= o and o + (b - a) <= sg and o % al == 0
            assert shard[o : o + (b - a)] == [(i, k) for k in range(a, b)]
            used += -(-(b - a) // al) * al
        need = max(need, used)
    assert sg == max(-(-need // al) * al, al), "Sg is not the aligned largest rank's member pieces"
    for i in set(range(len(layout.numels))) - set(members):
        with pytest.raises(KeyError, match="no gradient storage"):
            gl.shard_offset(i, 0)


def test_grad_layout_rejects_bad_members():
    layout = plan_layout([4, 4], [1, 1], 2)
    with pytest.raises(ValueError, match="members"):
        plan_grad_layout(layout, [0, 0])
    with pytest.raises(ValueError, match="members"):
        plan_grad_layout(layout, [2])
