"""The gradient path's named C-level loops (``raggedfsdp/fsdp/_loops.py``) against their plain-Python
references, on random inputs: params and tensors stand in as objects whose ``==`` raises (the loops must
compare by identity, as the references do), with ``None`` and shared objects mixed in."""

from __future__ import annotations

import random

import pytest

from raggedfsdp.fsdp import _loops


class _Obj:
    def __eq__(self, other):  # FSDPParam / Tensor: == is a value comparison, never wanted here
        raise AssertionError("compared with ==")

    __hash__ = object.__hash__


def _cases(n_cases=200, seed=0):
    rng = random.Random(seed)
    for _ in range(n_cases):
        n = rng.choice([0, 1, 2, 5, 17])
        fps = [_Obj() for _ in range(n)]
        grads = [rng.choice([None, _Obj()]) for _ in range(n)]
        views = [g if (g is not None and rng.random() < 0.5) else rng.choice([None, _Obj()]) for g in grads]
        yield rng, fps, grads, views


@pytest.mark.parametrize("seed", [0, 1])
def test_loops_match_their_references(seed):
    checked = 0
    for rng, fps, grads, views in _cases(seed=seed):
        for v in (None, views):
            assert _loops.pairs_to_fold(fps, grads, v) == _loops.pairs_to_fold_reference(fps, grads, v)
        used = [rng.random() < 0.5 for _ in fps]
        assert _loops.to_attach(fps, used, grads) == _loops.to_attach_reference(fps, used, grads)
        other = list(fps) if rng.random() < 0.5 else [rng.choice(fps + [None]) for _ in fps]
        assert _loops.same_objects(fps, other) == _loops.same_objects_reference(fps, other)
        assert _loops.same_objects(fps, fps[:-1]) == _loops.same_objects_reference(fps, fps[:-1])
        groups = [rng.sample(fps, rng.randint(0, len(fps))) for _ in range(rng.randint(0, 3))]
        assert _loops.unique_by_id(groups) == _loops.unique_by_id_reference(groups)
        keys = [id(fp) for fp in fps]
        start = {k: rng.random() < 0.3 for k in keys if rng.random() < 0.5}
        a, b = dict(start), dict(start)
        flags = [rng.choice([0, 1, False, True]) for _ in keys]
        _loops.or_into(a, keys, flags)
        _loops.or_into_reference(b, keys, flags)
        assert a == b and list(a) == list(b)
        checked += 1
    assert checked == 200


def test_loops_results_are_not_trivial():
    """The reference cases above exercise both outcomes of every filter (a check that cannot pass on
    empty results alone)."""
    fps, grads = [_Obj(), _Obj(), _Obj()], [None, _Obj(), _Obj()]
    views = [None, grads[1], _Obj()]
    assert _loops.pairs_to_fold(fps, grads, views) == [(fps[2], grads[2])]
    assert _loops.pairs_to_fold(fps, grads) == [(fps[1], grads[1]), (fps[2], grads[2])]
    assert _loops.to_attach(fps, [True, False, False], [None, None, _Obj()]) == [fps[0], fps[2]]
    assert _loops.unique_by_id([[fps[1], fps[0]], [fps[0], fps[2]]]) == [fps[1], fps[0], fps[2]]
