"""Pure pieces of the RaggedShard op rules: the view placement keeps every rank's flat range, and
RaggedPartial is a Partial that compares unequal to torch's (so torch reduces it before other ops)."""

from __future__ import annotations

import itertools
import math
import pickle

import pytest
import torch


@pytest.mark.parametrize(
    "shape,units,new_shapes",
    [
        ((6, 4), (1, 0, 2), [(24,), (3, 2, 4), (6, 2, 2), (2, 12), (1, 6, 4), (4, 6)]),
        ((5, 4), (2, 0, 3), [(20,), (10, 2), (2, 10), (5, 2, 2), (1, 20)]),
        ((4, 2, 3), (1, 1, 0, 2), [(24,), (8, 3), (4, 6), (2, 2, 2, 3)]),
        ((0, 3), (1, 2), [(0,), (3, 0)]),
    ],
)
def test_view_placement_keeps_each_ranks_flat_range(shape, units, new_shapes):
    from raggedfsdp import RaggedShard
    from raggedfsdp.placement._implicit import view_placement

    rs = RaggedShard((0,), units)
    numel = math.prod(shape)
    for new in new_shapes:
        out = view_placement(rs, numel, new)
        assert out is not None and out.local_units == units, (new, out)
        out.validate_shape(new, len(units))
        assert out.flat_ranges(new) == rs.flat_ranges(shape), (new, out)
        # the least dims that work: one fewer would not divide the rows
        k = len(out.dims)
        assert k == 1 or math.prod(new[: k - 1]) % sum(units) != 0


def test_view_placement_element_granularity_and_0d():
    from raggedfsdp import RaggedShard
    from raggedfsdp.placement._implicit import view_placement

    rs = RaggedShard((0, 1), (5, 0, 19))  # element granularity of (6, 4)
    for new in itertools.permutations((2, 3, 4)):
        out = view_placement(rs, 24, new)
        assert out.flat_ranges(new) == rs.flat_ranges((6, 4))
    assert view_placement(RaggedShard((0,), (1,)), 1, ()) is None


def test_ragged_partial_is_a_partial_unequal_to_torchs():
    from torch.distributed.tensor import Partial

    from raggedfsdp.placement import RaggedPartial
    from raggedfsdp.placement._ops import InfNormPartial

    p = RaggedPartial("max")
    assert isinstance(p, Partial) and p.is_partial() and p.reduce_op == "max"
    assert p != Partial("max") and Partial("max") != p and p != InfNormPartial("max")
    assert p == RaggedPartial("max") and hash(p) == hash(RaggedPartial("max"))
    assert pickle.loads(pickle.dumps(p)) == p and repr(p) == "RaggedPartial('max')"
    assert isinstance(InfNormPartial("min"), RaggedPartial)
    with pytest.raises(ValueError, match="reduce_op='product' must be"):
        RaggedPartial("product")


def test_reduction_identity_of_empty_pieces():
    from raggedfsdp.placement._reductions import _local_reduce

    e = torch.empty(0, 3)
    assert torch.equal(_local_reduce("max", e, [0], False), torch.full((3,), float("-inf")))
    assert torch.equal(
        _local_reduce("min", e.int(), [0, 1], False), torch.tensor(torch.iinfo(torch.int32).max)
    )
    assert not _local_reduce("any", e.bool(), [0], False).any()
    assert _local_reduce("all", e.bool(), [0], True).all() and _local_reduce(
        "all", e.bool(), [0], True
    ).shape == (1, 3)
