"""Note [gloo release] (``raggedfsdp/_release.py``): what :func:`handoff` gives a collective and what the
exit handler keeps. A pending work is simulated by a C++ reference (another tensor's ``.grad``), as a
gloo work holds the tensors it was given. References: the tensor's own values and storage, use counts
(``Tensor._use_count``) and weak references -- never the module's own bookkeeping alone."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from raggedfsdp import _release


@pytest.fixture(autouse=True)
def _empty_hold():
    _release._HELD.clear()
    yield
    _release._HELD.clear()


def _work_holds(t: torch.Tensor) -> torch.Tensor:
    """A C++ reference to ``t``'s TensorImpl, as a pending work keeps."""
    holder = torch.empty_like(t)
    holder.grad = t
    return holder


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(12.0),
        lambda: torch.arange(12.0).view(3, 4).t(),  # non-contiguous
        lambda: torch.arange(12.0)[2:9],  # a view with an offset
        lambda: torch.zeros(0),
        lambda: torch.arange(6, dtype=torch.int64),
        lambda: torch.ones(5, dtype=torch.bfloat16),
        lambda: torch.zeros(4, dtype=torch.bool),
        lambda: torch.arange(4.0, requires_grad=True),
    ],
)
@pytest.mark.parametrize("inference", [False, True])
def test_handoff_gives_an_alias_the_library_holds_by_a_cpp_reference(make, inference):
    t = make()
    if inference:
        with torch.inference_mode():
            t = t.detach().clone()
    before = _release.use_count(t)
    with torch.inference_mode(inference):
        a = _release.handoff(t)
    assert a is not t and a._base is None  # its own TensorImpl, not a view (views of it hold it)
    assert (a.shape, a.stride(), a.dtype) == (t.shape, t.stride(), t.dtype)
    assert a.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    assert a.storage_offset() == t.storage_offset() and not a.requires_grad
    assert _release.use_count(t) == before  # the backend never gets t itself
    assert _release.use_count(a) == 2  # its Python object and the library's keeper
    if a.numel():
        with torch.no_grad():
            a.fill_(1)  # a collective's write lands in t
        assert bool((t == 1).all())
    work = _work_holds(a)
    del a
    gc.collect()
    assert _release.unreleased() == 1
    work.grad = None  # the work lets go: the alias's count falls to 2, never to 1 off the main thread
    assert _release.unreleased() == 0


def test_handoff_of_one_collective_keeps_every_tensor_until_it_is_issued():
    """Every tensor of one collective goes through one call: a pair made earlier for the same, not yet
    issued collective looks released (its count is 2) and must not be pruned by the next one."""
    x, y = torch.zeros(3), torch.zeros(2)
    a, b = _release.handoff(x, y)
    assert [p[0] for p in _release._HELD] == [a, b]
    works = _work_holds(a), _work_holds(b)  # issued
    _release.handoff(torch.zeros(1))  # the next collective's call prunes only what was let go of
    assert [p[0] for p in _release._HELD][:2] == [a, b]
    del works
    _release.handoff(torch.zeros(1))
    assert all(p[0] is not a and p[0] is not b for p in _release._HELD)


def test_exit_handler_keeps_for_good_what_a_work_still_holds():
    owned, free = _release.handoff(torch.ones(3), torch.ones(2))
    work_owned, work_free = _work_holds(owned), _work_holds(free)
    work_free.grad = None  # that work let go
    keepers = {id(a): weakref.ref(k) for a, k in _release._HELD}
    w_owned_keeper, w_free_keeper = keepers[id(owned)], keepers[id(free)]
    del keepers
    assert _release.keep_unreleased_forever() == 1 and not _release._HELD
    gc.collect()
    assert w_free_keeper() is None  # released: dropped as usual
    assert w_owned_keeper() is not None  # still held by a work: kept for good
    work_owned.grad = None  # the worker lets go after the exit handler ran
    assert _release.use_count(owned) >= 2  # so its release never took the count to 1 (no GIL needed)
    assert _release.keep_unreleased_forever() == 0  # idempotent


def test_non_cpu_tensors_are_handed_as_they_are_and_held_the_earlier_way():
    t = torch.empty(3, device="meta")
    assert _release.handoff(t) is t and not _release._HELD
    base = _release.use_count(t)
    work = _work_holds(t)
    _release.hold_until_released(t, base)
    w = weakref.ref(t)
    del t
    gc.collect()
    assert w() is not None and _release.unreleased() == 1
    work.grad = None
    assert _release.unreleased() == 0
