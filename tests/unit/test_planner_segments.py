"""plan_segments (issue 39 item 5): trainable tensors as their own segment of a unit's buffer.

(1) LoRA-like units -- frozen base weights with small trainable adapters A ``(r, d_in)`` and B
``(d_out, r)`` in PEFT's order, 1-4 layers per unit, ``r`` in {4, 8, 16}, ws 2-8, element and row
blocks -- give no rank more than 1.25x an even split of the trainable elements, and with element
blocks (the default) none less than 1/1.25 of it (planned as one buffer they do not: the adapters of
a one-linear unit all land on the last rank).
(2) The planner's guarantees, checked by an independent reference: every element of the unsharded
buffer is painted with its owner rank and its position in that rank's shard from the segment sizes
alone (``test_planner_reference``'s approach, extended to segments), then the layout's pieces,
offsets, blocks and contiguity are read against the painting; each segment's shard size is the brute
force minimum for its order (``test_planner_reference.brute_min_shard_size``).
"""

from __future__ import annotations

import random

import pytest
from test_planner_reference import brute_min_shard_size

from raggedfsdp.planner import Layout, plan_layout, plan_segments, segment_share, validate_layout
from raggedfsdp.planner.policy import granularity_for

EVEN_SLACK = 1.25


def _lora_unit(d: int, r: int, layers: int, block: str = "element"):
    """A transformer layer's linears with PEFT-style LoRA (base weight, base bias, lora_A, lora_B per
    linear; q/k/v/o ``d x d``, up ``d -> 4d``, down ``4d -> d``), ``layers`` of them in one unit, plus a
    frozen norm per layer. Returns ``(shapes, granularities, trainable flags)``."""
    shapes, train = [], []
    for _ in range(layers):
        shapes.append((d,))
        train.append(False)  # norm
        for d_in, d_out in [(d, d)] * 4 + [(d, 4 * d), (4 * d, d)]:
            shapes += [(d_out, d_in), (d_out,), (r, d_in), (d_out, r)]
            train += [False, False, True, True]
    grans = [granularity_for(s, block)[0] for s in shapes]
    return shapes, grans, train


def _one_linear_unit(d: int, r: int, block: str = "element"):
    shapes = [(2 * d, d), (2 * d,), (r, d), (2 * d, r)]
    return shapes, [granularity_for(s, block)[0] for s in shapes], [False, False, True, True]


def _numel(s):
    n = 1
    for x in s:
        n *= x
    return n


def _plan(shapes, grans, train, ws, **kw):
    return plan_segments(
        [_numel(s) for s in shapes], grans, ws, [int(t) for t in train], align=4, shapes=shapes, **kw
    )


def _trainable_ratio(lay, train):
    share = segment_share(lay, [i for i, t in enumerate(train) if t])
    even = sum(share) / lay.world_size
    return max(share) / even, min(share) / even


@pytest.mark.parametrize("block", ["element", "row"])
@pytest.mark.parametrize("r", [4, 8, 16])
def test_lora_units_trainable_share_within_1_25_of_even(r, block):
    for ws in range(2, 9):
        for d in (64, 256):
            cases = [(f"{k} layers", _lora_unit(d, r, k, block)) for k in (1, 2, 4)]
            cases.append(("one LoRA linear", _one_linear_unit(d, r, block)))
            for name, (shapes, grans, train) in cases:
                for order in ("default", "best"):
                    lay = _plan(shapes, grans, train, ws, order=order)
                    validate_layout(lay)
                    hi, lo = _trainable_ratio(lay, train)
                    where = f"{name}, d={d}, r={r}, {block} blocks, ws={ws}, order={order}: {lay.segments}"
                    # the memory a rank pays is the largest share; with row blocks a block that is most
                    # of an even share (one LoRA linear, r=4, ws 8: A's rows are 2/3 of it) can cost one
                    # more block on a rank, so there the bound is one block above even
                    even = sum(_numel(s) for s, t in zip(shapes, train) if t) / ws
                    big = max(g for g, t in zip(grans, train) if t)
                    assert hi <= (EVEN_SLACK if big <= even / 2 else 1 + big / even), (where, hi, lo)
                    if block == "element":  # and no rank idles (with row blocks the greedy fill of the
                        assert lo >= 1 / EVEN_SLACK, (where, hi, lo)  # minimum S_t may leave the last short)
                    # total bytes stay balanced too: equal shards, padding as one buffer's up to the
                    # rounding of one more segment (align per rank) and, with row blocks, one block row
                    one = plan_layout([_numel(s) for s in shapes], grans, ws, align=4, order=order)
                    slack = 4 + (max(g for g, t in zip(grans, train) if t) if block == "row" else 0)
                    assert lay.shard_size <= one.shard_size + slack, (where, lay.shard_size, one.shard_size)


def test_one_buffer_was_unbalanced():
    """The case the segments fix: planned as one buffer, a one-LoRA-linear unit puts every adapter on the
    last rank (ws 2: rank 0 none); the segmented plan splits them evenly."""
    shapes, grans, train = _one_linear_unit(256, 8)
    numels = [_numel(s) for s in shapes]
    tr = [i for i, t in enumerate(train) if t]
    one = plan_layout(numels, grans, 2, align=4, order="best")
    assert segment_share(one, tr) == (0, sum(numels[i] for i in tr))
    seg = _plan(shapes, grans, train, 2, order="best")
    assert segment_share(seg, tr) == (3072, 3072)


# ---- the guarantees, against an independent painting ----------------------------------------
def _paint(lay: Layout):
    """Owner rank and shard position of every element of the unsharded buffer, from the segment sizes
    alone: segment s starts at m * (S_0 + .. + S_{s-1}); its rank k owns the next S_s elements after
    k * S_s, which sit at (S_0 + .. + S_{s-1}) + j in rank k's shard."""
    m = lay.world_size
    sizes = list(lay.segments) if lay.segments is not None else [lay.shard_size]
    rank, pos, seg = [], [], []
    before = 0
    for s, S in enumerate(sizes):
        for k in range(m):
            for j in range(S):
                rank.append(k)
                pos.append(before + j)
                seg.append(s)
        before += S
    assert len(rank) == m * lay.shard_size
    return rank, pos, seg


def check_segmented(lay: Layout, numels, grans, align):
    m, S = lay.world_size, lay.shard_size
    assert S % align == 0 and S >= 1
    if lay.segments is not None:
        assert sum(lay.segments) == S and all(s % align == 0 and s > 0 for s in lay.segments)
    rank, pos, seg = _paint(lay)
    used = [None] * (m * S)
    for i, (e, g) in enumerate(zip(numels, grans)):
        x = lay.offsets[i]
        assert 0 <= x and x + e <= m * S, f"(c) tensor {i} outside the buffer"
        if e == 0:
            continue
        assert len({seg[x + j] for j in range(e)}) == 1, f"tensor {i} crosses a segment end"
        for j in range(e):
            assert used[x + j] is None, f"(c) tensor {i} overlaps tensor {used[x + j]}"
            used[x + j] = i
        for b in range(e // g):  # (b) a block on one rank
            assert len({rank[x + b * g + t] for t in range(g)}) == 1, f"(b) tensor {i} block {b} is cut"
        for k in range(m):  # the layout's pieces and offsets are what the painting says
            js = [j for j in range(e) if rank[x + j] == k]
            a, bb = lay.piece(i, k)
            if js:
                assert (a, bb) == (js[0], js[-1] + 1), (i, k, (a, bb), js[0], js[-1])
                assert lay.shard_offset(i, k) == pos[x + js[0]], (i, k)
                assert [pos[x + j] for j in js] == list(range(pos[x + js[0]], pos[x + js[0]] + len(js)))
            else:
                assert a == bb
        assert list(lay.ranks_of(i)) == sorted({rank[x + j] for j in range(e)})
    # each rank's shard holds exactly S positions, none used twice
    for k in range(m):
        ps = sorted(pos[p] for p in range(m * S) if rank[p] == k)
        assert ps == list(range(S))


def _random_case(rng):
    m = rng.randint(1, 5)
    n = rng.randint(1, 6)
    grans = [rng.choice([1, 1, 2, 3, 4]) for _ in range(n)]
    numels = [g * rng.randint(0, 6) for g in grans]
    ids = [rng.randint(0, 2) for _ in range(n)]
    align = rng.choice([1, 2, 4])
    return numels, grans, m, ids, align


@pytest.mark.parametrize("seed", range(400))
def test_segments_keep_the_guarantees_and_are_exact(seed):
    numels, grans, m, ids, align = _random_case(random.Random(seed))
    lay = plan_segments(numels, grans, m, ids, align=align)
    validate_layout(lay)
    check_segmented(lay, numels, grans, align)
    assert Layout.from_dict(lay.to_dict()) == lay
    live = sorted({s for s, e in zip(ids, numels) if e})
    if len(live) <= 1 or m == 1:
        assert lay == plan_layout(numels, grans, m, align=align)
        return
    assert lay.segments is not None and len(lay.segments) == len(live)
    for s, size in zip(live, lay.segments):  # each segment: the brute-force minimum for its order
        idx = [i for i in range(len(numels)) if ids[i] == s or (ids[i] not in live and s == live[0])]
        want = brute_min_shard_size(
            [numels[i] for i in idx], [grans[i] for i in idx], range(len(idx)), m, align
        )
        assert size == want, (seed, s, size, want)
    best = plan_segments(numels, grans, m, ids, align=align, order="best")
    check_segmented(best, numels, grans, align)
    assert best.shard_size <= lay.shard_size


def test_explicit_permutation_is_kept_per_segment():
    numels, ids = [8, 4, 6, 2, 5], [0, 1, 0, 1, 1]
    lay = plan_segments(numels, None, 2, ids, order=[4, 2, 3, 0, 1])
    assert lay.order == (2, 0, 4, 3, 1)  # segment 0 (2 before 0), then segment 1 (4, 3, 1)
    check_segmented(lay, numels, [1] * 5, 1)


def test_bad_segment_ids_raise():
    with pytest.raises(ValueError, match=r"3 segment_ids for 2 tensors"):
        plan_segments([4, 4], None, 2, [0, 1, 1])
    with pytest.raises(ValueError, match=r"tensor 1 \('b'\) has segment id -1"):
        plan_segments([4, 4], None, 2, [0, -1], names=["a", "b"])
    with pytest.raises(ValueError, match=r"not a permutation"):
        plan_segments([4, 4], None, 2, [0, 1], order=[0, 0])


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(segments=(6, 5)), r"summing to shard_size=12"),
        (dict(align=2, segments=(5, 7)), r"multiples of align=2"),
        (dict(offsets=(2, 14, 16, 22)), r"\[2, 14\) crosses the end 12 of segment 0"),
        (dict(offsets=(0, 12, 15, 21)), r"rank boundary 18 \(k=1, S=6\) cuts tensor 2 at element 3"),
    ],
)
def test_validate_layout_rejects_bad_segments(change, match):
    import dataclasses

    # segment 0: tensor 0 on [0, 12), S_0 = 6; segment 1 from 12, S_1 = 6: rank 0 owns [12, 18), rank 1
    # [18, 24); tensor 2 (blocks of 2) on [14, 20) is cut at 18, 4 elements in
    good = plan_segments([12, 2, 6, 2], [1, 1, 2, 1], 2, [0, 1, 1, 1])
    assert good.segments == (6, 6) and good.offsets == (0, 12, 14, 20)
    validate_layout(good)
    check_segmented(good, [12, 2, 6, 2], [1, 1, 2, 1], 1)
    with pytest.raises(ValueError, match=match):
        validate_layout(dataclasses.replace(good, **change))


@pytest.mark.parametrize("seed", range(150))
def test_grad_layout_of_a_segmented_layout_matches_reduce_scatter_simulation(seed):
    """The compacted grad layout (every member, or a random subset) over a segmented parameter layout:
    writing each member through ``segments`` into the ``m * Sg`` buffer and cutting it into ``m`` equal
    shards (an even reduce-scatter) gives every rank exactly its pieces at ``shard_offset``."""
    from raggedfsdp.planner import plan_grad_layout

    rng = random.Random(seed)
    numels, grans, m, ids, align = _random_case(rng)
    lay = plan_segments(numels, grans, m, ids, align=align)
    n = len(numels)
    for members in (list(range(n)), sorted(rng.sample(range(n), rng.randint(1, n)))):
        gl = plan_grad_layout(lay, members)
        sg = gl.shard_size
        buf = [None] * (m * sg)
        for i in members:
            for a, b, dst in gl.segments(i):
                for k in range(a, b):
                    assert buf[dst + k - a] is None
                    buf[dst + k - a] = (i, k)
        for r in range(m):
            shard = buf[r * sg : (r + 1) * sg]
            for i in members:
                a, b = lay.piece(i, r)
                o = gl.shard_offset(i, r)
                assert shard[o : o + (b - a)] == [(i, k) for k in range(a, b)], (seed, i, r)
