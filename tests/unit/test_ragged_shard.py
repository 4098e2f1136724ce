"""RaggedShard validation, layout math and N-D box decomposition (pure, no process group)."""

import itertools
import math
import pickle

import pytest
import torch

import raggedfsdp  # noqa: F401  (applies the torch patches)
from raggedfsdp import RaggedShard
from raggedfsdp.placement._checkpoint import flat_range_boxes


@pytest.mark.parametrize(
    "dims, units, match",
    [
        ((1,), (1, 1), r"dims=\(1,\) must be a non-empty prefix"),
        ((0, 2), (1, 1), r"dims=\(0, 2\) must be a non-empty prefix"),
        ((), (1,), r"dims=\(\) must be a non-empty prefix"),
        ((0,), (), r"local_units=\(\) must be non-negative"),
        ((0,), (1, -1), r"local_units=\(1, -1\) must be non-negative"),
        ((0,), (0, 0, 0), r"local_units=\(0, 0, 0\) must be non-negative with at least one positive"),
    ],
)
def test_constructor_errors(dims, units, match):
    with pytest.raises(ValueError, match=match):
        RaggedShard(dims, units)


@pytest.mark.parametrize(
    "dims, units, match",
    [
        ((0,), (1.7, 2), r"local_units=\(1.7, 2\) must be a sequence of ints; 1.7 is a float"),
        ((0,), (2.0, 2), r"local_units=\(2.0, 2\) must be a sequence of ints; 2.0 is a float"),
        ((0,), ("1", 2), r"local_units=\('1', 2\) must be a sequence of ints; '1' is a str"),
        ((0,), None, r"local_units=None must be a sequence of ints; None is a NoneType"),
        ((0.0,), (1, 2), r"dims=\(0.0,\) must be a sequence of ints; 0.0 is a float"),
    ],
)
def test_non_integer_arguments_are_a_type_error_naming_the_argument(dims, units, match):
    """``RaggedShard(local_units=(1.7, 2))`` silently became ``(1, 2)`` (issue 41 item 7)."""
    with pytest.raises(TypeError, match=match):
        RaggedShard(dims, units)


def test_integer_like_values_are_accepted():
    import numpy as np  # a test may use numpy; the library does not

    rs = RaggedShard((np.int64(0),), (np.int64(1), torch.tensor(2).item(), np.int32(1)))
    assert rs.local_units == (1, 2, 1) and all(type(u) is int for u in rs.local_units)


def test_validate_shape_errors():
    rs = RaggedShard((0,), (1, 2))
    with pytest.raises(ValueError, match=r"sum\(local_units\)=3 must divide the number of rows N=4"):
        rs.validate_shape((4, 5))
    with pytest.raises(ValueError, match=r"local_units=\(1, 2\) has 2 entries but the mesh dim has 3 ranks"):
        rs.validate_shape((6, 5), num_ranks=3)
    with pytest.raises(ValueError, match=r"dims=\(0, 1\) has more dims than the tensor shape \(6,\)"):
        RaggedShard((0, 1), (1,)).validate_shape((6,))
    rs.validate_shape((6, 5), num_ranks=2)


def test_identity_pickle_repr():
    a, b = RaggedShard([0, 1], [1, 0, 2]), RaggedShard((0, 1), (1, 0, 2))
    assert a == b and hash(a) == hash(b) and a != RaggedShard((0,), (1, 0, 2))
    assert pickle.loads(pickle.dumps(a)) == a
    assert repr(a) == "RaggedShard(dims=(0, 1), local_units=(1, 0, 2))" and str(a) == "RS(0, 1)(1, 0, 2)"
    assert (
        a.is_shard() and a.is_shard(1) and not a.is_shard(2) and not a.is_replicate() and not a.is_partial()
    )
    assert a.dim == 0


@pytest.mark.parametrize("shape", [(12,), (6, 4), (4, 3, 2), (2, 2, 3, 2), (0, 3), (4, 0)])
def test_layout_math_partitions(shape):
    g = torch.Generator().manual_seed(0)
    for k in range(1, len(shape) + 1):
        n = math.prod(shape[:k])
        for ws in range(1, 6):
            for _ in range(5):
                u = tuple(int(x) for x in torch.randint(0, 4, (ws,), generator=g))
                if not sum(u) or n % sum(u):
                    continue
                rs = RaggedShard(tuple(range(k)), u)
                rs.validate_shape(shape, ws)
                ranges = rs.flat_ranges(shape)
                assert ranges[0][0] == 0 and ranges[-1][1] == math.prod(shape)
                for (a, b), (c, d) in itertools.pairwise(ranges):
                    assert b == c
                full = torch.arange(math.prod(shape)).reshape(shape)
                for r in range(ws):
                    assert rs.local_numel(shape, r) == ranges[r][1] - ranges[r][0]
                    assert rs.local_numel(shape, r) % max(rs.row_numel(shape), 1) == 0
                    piece = rs.shard_full(full, r)
                    assert piece.dim() == 1 and torch.equal(
                        piece, full.reshape(-1)[ranges[r][0] : ranges[r][1]]
                    )


@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 3, 4), (2, 2, 2, 3), (3, 1, 2, 1, 2)])
def test_flat_range_boxes_bruteforce(shape):
    numel = math.prod(shape)
    full = torch.arange(numel).reshape(shape)
    for a in range(numel + 1):
        for b in range(a, numel + 1):
            boxes = flat_range_boxes(shape, a, b)
            assert sum(math.prod(s) for _, s, _ in boxes) == b - a
            pos = a
            for off, size, fs in boxes:
                assert fs == pos
                sl = full[tuple(slice(o, o + s) for o, s in zip(off, size))]
                assert torch.equal(sl.reshape(-1), torch.arange(fs, fs + math.prod(size)))
                pos += math.prod(size)
            assert len(boxes) <= 2 * len(shape) - 1


def test_row_aligned_piece_is_few_boxes():
    # a piece of whole rows of a dims=(0, 1) prefix never needs more than 2k-1 = 3 boxes
    shape = (5, 4, 3)
    rs = RaggedShard((0, 1), (3, 7, 10))
    for r in range(3):
        a, b = rs.flat_range(shape, r)
        assert len(flat_range_boxes(shape, a, b)) <= 3
