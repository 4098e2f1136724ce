"""Planner interface, invariants, errors and the Layout helpers used by the FSDP runtime."""

from __future__ import annotations

import pytest
from test_planner_reference import check_layout

from raggedfsdp.placement import RaggedShard
from raggedfsdp.planner import Layout, plan_layout, validate_layout

# a LLaMA-like unit: q, k, v, o, gate, up, down (row granularity) + two norms (element)
H, KV, FF = 64, 16, 176
SHAPES = [(H, H), (KV, H), (KV, H), (H, H), (FF, H), (FF, H), (H, FF), (H,), (H,)]
NUMELS = [a * (b if len(s) > 1 else 1) for s in SHAPES for a, b in [(s[0], s[-1])]]
ROWG = [s[1] if len(s) > 1 else 1 for s in SHAPES]


def test_backward_compatible_call_and_invariants():
    for m in (1, 2, 3, 8, 13, 64, 257):
        for align in (1, 8):
            lay = plan_layout(NUMELS, ROWG, m, align=align)
            assert isinstance(lay, Layout)
            validate_layout(lay)
            assert lay.world_size == m and lay.shard_size % align == 0
            assert lay.total_size == m * lay.shard_size >= sum(NUMELS)
            assert lay.padding == m * lay.shard_size - sum(NUMELS)
            assert lay.shard_size >= lay.lower_bound
            if m * lay.shard_size <= 200_000:
                check_layout(NUMELS, ROWG, m, align, lay.shard_size, lay.offsets, lay.order)


def test_granularities_none_means_elements():
    lay = plan_layout([5, 7, 11], None, 4)
    assert lay.granularities == (1, 1, 1)
    assert lay.shard_size == 6 and lay.padding == 1  # ceil(23 / 4)


def test_pieces_match_ragged_shard():
    """piece/shard_offset/local_units agree with RaggedShard(dims, local_units).flat_range."""
    names = [f"p{i}" for i in range(len(SHAPES))]
    for m in (2, 5, 16):
        lay = plan_layout(NUMELS, ROWG, m, align=4, shapes=SHAPES, names=names)
        for i, shape in enumerate(SHAPES):
            units = lay.local_units(i)
            assert sum(units) * lay.granularities[i] == NUMELS[i]
            covered = 0
            for r in range(m):
                a, b = lay.piece(i, r)
                assert (b - a) % lay.granularities[i] == 0
                off = lay.shard_offset(i, r)
                assert 0 <= off and off + (b - a) <= lay.shard_size
                if b > a:
                    assert r * lay.shard_size + off == lay.offsets[i] + a
                    assert a == covered
                covered += b - a
            assert covered == NUMELS[i]
            assert list(lay.ranks_of(i)) == [r for r in range(m) if units[r]]
            rs = RaggedShard((0,), units)  # row granularity: one unit = one row of the tensor
            for r in range(m):
                assert rs.flat_range(shape, r) == lay.piece(i, r)


def test_deterministic_and_pure():
    a = plan_layout(NUMELS, ROWG, 24, align=8, order="best", shapes=SHAPES)
    b = plan_layout(list(NUMELS), tuple(ROWG), 24, align=8, order="best", shapes=SHAPES)
    assert a == b and hash(a) == hash(b)


@pytest.mark.parametrize("order", ["default", "granularity", "shape", "size", "best"])
def test_named_orders(order):
    lay = plan_layout(NUMELS, ROWG, 12, align=8, order=order, shapes=SHAPES)
    validate_layout(lay)
    assert sorted(lay.order) == list(range(len(NUMELS)))
    if order == "default":
        assert lay.order == tuple(range(len(NUMELS)))
    best = plan_layout(NUMELS, ROWG, 12, align=8, order="best", shapes=SHAPES)
    assert best.shard_size <= lay.shard_size


def test_shape_order_without_shapes_uses_numels():
    lay = plan_layout([4, 100, 10], None, 2, order="shape")
    assert lay.order == (1, 2, 0)


def test_explicit_permutation():
    perm = list(reversed(range(len(NUMELS))))
    lay = plan_layout(NUMELS, ROWG, 7, order=perm)
    assert lay.order == tuple(perm)
    validate_layout(lay)


def test_zero_size_and_empty():
    lay = plan_layout([], None, 4, align=8)
    assert lay.shard_size == 8 and lay.padding == 32
    lay = plan_layout([0, 6, 0], [3, 3, 5], 2)
    validate_layout(lay)
    assert lay.shard_size == 3
    assert lay.local_units(0) == (0, 0)


def test_coarse_block_larger_than_lower_bound():
    """A whole-matrix block must sit on one rank: S grows to hold it."""
    lay = plan_layout([100, 4, 4], [100, 1, 1], 4)
    assert lay.shard_size == 100
    assert lay.local_units(0) in ((1, 0, 0, 0), (0, 1, 0, 0))


def test_serialization_roundtrip():
    lay = plan_layout(NUMELS, ROWG, 9, align=8, shapes=SHAPES, names=[f"w{i}" for i in range(9)])
    assert Layout.from_dict(lay.to_dict()) == lay


# ---- bad input ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(numels=[4], granularities=[1], world_size=0), r"world_size=0"),
        (dict(numels=[4], granularities=[1], world_size=-2), r"world_size=-2"),
        (dict(numels=[4, -3], granularities=None, world_size=2), r"tensor 1 .*numel=-3"),
        (dict(numels=[12, 10], granularities=[4, 4], world_size=2), r"tensor 1 granularity=4 .*numel=10"),
        (dict(numels=[4], granularities=[0], world_size=2), r"tensor 0 .*granularity=0"),
        (dict(numels=[4], granularities=[-2], world_size=2), r"granularity=-2"),
        (dict(numels=[4], granularities=[1], world_size=2, align=0), r"align=0"),
        (dict(numels=[4], granularities=[1, 1], world_size=2), r"2 granularities for 1 tensors"),
        (dict(numels=[4, 4], granularities=None, world_size=2, order=[0, 0]), r"not a permutation"),
        (dict(numels=[4], granularities=None, world_size=2, order="random"), r"order='random'"),
        (dict(numels=[4], granularities=None, world_size=2, shapes=[(2, 3)]), r"shape=\(2, 3\)"),
    ],
)
def test_bad_input_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_layout(**kwargs)


def test_bad_input_names_tensor():
    with pytest.raises(ValueError, match=r"'layers.0.mlp.w2'.*granularity=32.*numel=40"):
        plan_layout([64, 40], [32, 32], 2, names=["layers.0.mlp.w1", "layers.0.mlp.w2"])


# ---- validate_layout catches each kind of violation ----------------------------------------
def _good():
    return plan_layout([8, 6, 3], [4, 3, 1], 3, align=1)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(shard_size=0), r"shard_size=0"),
        (dict(align=4), r"multiple of align=4"),
        (dict(offsets=(3, 11, 19)), r"outside the buffer"),
        (dict(offsets=(3, 10, 17)), r"before the previous tensor"),
        (dict(offsets=(2, 11, 17)), r"rank boundary 7 .*cuts tensor 0 at element 5"),
        (dict(order=(0, 0, 1)), r"not a permutation"),
        (dict(granularities=(4, 4, 1)), r"granularity=4 must .*divide numel=6"),
        (dict(world_size=0), r"world_size=0"),
        (dict(offsets=(0, 8)), r"len\(offsets\)"),
        (dict(shapes=((2, 4), (6,), (4,))), r"shape=\(4,\) has 4 elements"),
    ],
)
def test_validate_layout_rejects(change, match):
    good = _good()
    validate_layout(good)
    assert good.shard_size == 7 and good.offsets == (3, 11, 17)
    fields = {**good.__dict__, **change}
    with pytest.raises(ValueError, match=match):
        validate_layout(Layout(**fields))
