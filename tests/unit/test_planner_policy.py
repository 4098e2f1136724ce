"""Granularity policy: block specs -> (granularity, RaggedShard dims), and planning named params."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import Shard

from raggedfsdp.placement import RaggedShard
from raggedfsdp.planner import validate_layout
from raggedfsdp.planner.policy import (
    BlockSpec,
    granularity_for,
    make_policy,
    plan_params,
    ragged_dims,
    resolve_blocks,
)


@pytest.mark.parametrize(
    "shape, block, want",
    [
        ((4096, 1024), "element", (1, (0, 1))),
        ((4096, 1024), "row", (1024, (0,))),
        ((4096, 1024), None, (1, (0, 1))),  # the default: element granularity (least padding)
        ((4096, 1024), "rows:32", (32 * 1024, (0,))),
        ((4096, 1000), "tile:32x32", (32 * 1000, (0,))),  # partial edge tiles stay on one rank
        ((4096, 1024), (128, 128), (128 * 1024, (0,))),
        ((4096, 1024), "matrix", (4096 * 1024, (0,))),
        ((7168,), "row", (1, (0,))),  # a vector's rows are its elements
        ((7168,), "element", (1, (0,))),
        ((7168,), "rows:32", (32, (0,))),
        ((7168,), "matrix", (7168, (0,))),
        ((128, 2880, 5760), "row", (5760, (0, 1))),
        ((128, 2880, 5760), "rows:128", (128 * 5760, (0, 1))),
        ((128, 2880, 5760), "tile:32x32", (32 * 5760, (0, 1))),
        ((128, 2880, 5760), "slice", (2880 * 5760, (0,))),
        ((128, 2880, 5760), "element", (1, (0, 1, 2))),
        ((10240, 1, 4), "row", (4, (0,))),
        ((0, 16), "rows:32", (1, (0, 1))),  # empty: nothing to cut
        ((), "element", (1, ())),
    ],
)
def test_granularity_for_table(shape, block, want):
    assert granularity_for(shape, block) == want


def test_dims_is_shortest_compatible_prefix():
    for shape in [(6, 10, 4), (3, 5), (2, 3, 4, 5), (12,)]:
        numel = math.prod(shape)
        for g in [d for d in range(1, numel + 1) if numel % d == 0]:
            dims = ragged_dims(shape, g)
            k = len(dims)
            assert dims == tuple(range(k)) and k >= 1
            assert g % math.prod(shape[k:]) == 0
            assert k == 1 or g % math.prod(shape[k - 1 :]) != 0


def test_shard_stride_lcm():
    # a (8, 6, 4) tensor with Shard(1): stride(1) = 4, so even element blocks become whole rows of 4
    assert granularity_for((8, 6, 4), "element", strides=(4,)) == (4, (0, 1))
    assert granularity_for((8, 6, 4), "rows:3", strides=(4,)) == (12, (0, 1))
    assert granularity_for((8, 6), "rows:2", strides=(1,)) == (12, (0,))
    with pytest.raises(ValueError, match=r"'w'.*blocks of 20"):
        granularity_for((8, 6), "element", strides=(20,), name="w")


@pytest.mark.parametrize(
    "shape, block, match",
    [
        ((40, 64), "rows:32", r"'w' shape=\(40, 64\) has 40 rows .* 32 rows"),
        ((2880, 4096), "tile:128x128", r"'w' shape=\(2880, 4096\) has 2880 rows per matrix.*128"),
        ((64,), "tile:32x32", r"'w' .*need ndim >= 2"),
        ((4, -1), "row", r"'w' has a negative dim"),
        ((4, 4), "rows:3x", r"cannot parse 'rows:3x'"),
        ((4, 4), "blob", r"cannot parse 'blob'"),
    ],
)
def test_bad_blocks_name_the_tensor(shape, block, match):
    with pytest.raises(ValueError, match=match):
        granularity_for(shape, block, name="w")


def test_blockspec_roundtrip():
    for s in ["element", "row", "rows:32", "tile:32x32", "slice", "matrix"]:
        assert str(BlockSpec.parse(s)) == s
    assert BlockSpec.parse((32, 16)) == BlockSpec("tile", 32, 16)
    with pytest.raises(ValueError):
        BlockSpec("rows", 0)


def _model():
    return torch.nn.Sequential(
        torch.nn.Embedding(96, 32),
        torch.nn.Linear(32, 64),
        torch.nn.LayerNorm(64),
        torch.nn.Linear(64, 32, bias=False),
    )


@pytest.mark.parametrize("world_size", [2, 3, 8, 17])
def test_plan_params_with_orig_param_policy(world_size):
    """A tile policy for matrices: each 32-row group lands on one rank; RaggedShard agrees."""
    model = _model()
    params = list(model.named_parameters())
    lay = plan_params(params, world_size, policy=make_policy("tile:32x32", "element"), align=8, order="best")
    validate_layout(lay)
    blocks = resolve_blocks(params, make_policy("tile:32x32"))
    for i, (b, (name, p)) in enumerate(zip(blocks, params)):
        assert lay.names[i] == name and lay.shapes[i] == tuple(p.shape)
        assert b.granularity == (32 * p.shape[-1] if p.ndim == 2 else 1)
        units = lay.local_units(i)
        rs = RaggedShard(b.dims, units)
        rs.validate_shape(p.shape, world_size)
        for r in range(world_size):
            assert rs.flat_range(p.shape, r) == lay.piece(i, r)
            lo, hi = lay.piece(i, r)
            if p.ndim == 2 and hi > lo:
                assert lo % (32 * p.shape[1]) == 0 and (hi - lo) % (32 * p.shape[1]) == 0


def test_policy_none_means_element_and_shape_inputs():
    """``None`` (and no policy) is DEFAULT_BLOCK, element granularity; the explicit ``row`` stays rows."""
    named = [("a", (6, 5)), ("b", torch.empty(7))]
    for pol in (lambda p: None, None):
        blocks = resolve_blocks(named, pol)
        assert [(b.granularity, b.dims, b.block) for b in blocks] == [
            (1, (0, 1), "element"),
            (1, (0,), "element"),
        ]
    blocks = resolve_blocks(named, lambda p: "row")
    assert [(b.granularity, b.dims, b.block) for b in blocks] == [(5, (0,), "row"), (1, (0,), "row")]


def test_dtensor_like_shard_dim_strides_are_used():
    class FakeDTensor:  # quacks like a DTensor with (Shard(1),) placements
        placements = (Shard(1),)
        shape = (8, 12, 4)

        def to_local(self):
            return torch.empty(8, 6, 4)

    (b,) = resolve_blocks([("w", FakeDTensor())], make_policy("element"))
    assert b.shape == (8, 6, 4) and b.granularity == 4 and b.dims == (0, 1)


@pytest.mark.parametrize("block", ["element", "row", "rows:16", "tile:32x8", "slice", "matrix"])
def test_stacked_experts_units_match_ragged_shard(block):
    """A fused (E, H, W) expert stack next to a matrix and a vector: RaggedShard(dims, units) agrees."""
    params = [("experts", (4, 64, 32)), ("w", (96, 32)), ("b", (32,))]
    for world_size in (3, 8):
        lay = plan_params(params, world_size, policy=make_policy(block, "element"), align=4, order="best")
        validate_layout(lay)
        for i, b in enumerate(resolve_blocks(params, make_policy(block, "element"))):
            units = lay.local_units(i)
            rs = RaggedShard(b.dims, units)
            rs.validate_shape(b.shape, world_size)
            assert [rs.flat_range(b.shape, r) for r in range(world_size)] == [
                lay.piece(i, r) for r in range(world_size)
            ]


def _blocks_allowed(shape, need):
    """Every block spec a tensor of ``shape`` may take under ``need`` (None: no need), found by brute
    force over a fixed menu: coarser blocks are allowed only if each is a whole number of the needed block."""
    menu = ["element", "row", "rows:2", "rows:3", "slice", "matrix"]
    if need is not None:
        menu.append(need)
    out = []
    for spec in menu:
        try:
            g = granularity_for(shape, spec)[0]
        except ValueError:
            continue  # the block does not tile this tensor
        if need is None or g % granularity_for(shape, need)[0] == 0:
            out.append(g)
    return sorted(set(out))


@pytest.mark.parametrize(
    "shapes, needs, m, align",
    [
        ([(6, 5), (7,), (4, 3)], [None, None, None], 4, 2),
        ([(6, 5), (7,), (4, 3)], [None, None, None], 5, 1),
        ([(2, 3, 4), (9,), (6, 2)], [None, None, None], 3, 2),
        ([(6, 5), (3,), (4, 3)], ["tile:2x5", None, None], 3, 1),  # one tensor declares tiles
        ([(6, 4), (4, 6), (5,)], ["tile:3x4", "tile:2x3", None], 4, 2),
    ],
)
def test_default_is_least_padding_over_allowed_granularities(shapes, needs, m, align):
    """Issue 22 item 1: with no declared block (``None``) a parameter gets the granularity with least padding
    its needs allow. Reference: the independent brute-force planner (``test_planner_reference``) over every
    combination of allowed per-tensor blocks; the policy's layout (``None`` -> DEFAULT_BLOCK) must reach
    that minimum."""
    import itertools

    from test_planner_reference import brute_min_shard_size

    named = [(f"t{i}", s) for i, s in enumerate(shapes)]
    need_of = dict(zip((n for n, _ in named), needs))
    policy = lambda s: next(need_of[n] for n, sh in named if sh == s)  # noqa: E731
    lay = plan_params(named, m, policy=lambda p: policy(tuple(p)), align=align)
    numels = [math.prod(s) for s in shapes]
    perm = list(range(len(shapes)))
    allowed = [_blocks_allowed(s, nd) for s, nd in zip(shapes, needs)]
    assert all(len(a) >= 2 for a in allowed)  # a real choice for every tensor
    best = min(brute_min_shard_size(numels, list(g), perm, m, align) for g in itertools.product(*allowed))
    assert lay.shard_size == best, (lay.shard_size, best, allowed)
    # and the declared needs are kept: no rank boundary cuts a declared block
    for i, (s, nd) in enumerate(zip(shapes, needs)):
        g = granularity_for(s, nd)[0]
        assert all(lo % g == 0 and hi % g == 0 for lo, hi in (lay.piece(i, r) for r in range(m))), (s, nd)
