"""Note [gloo release] at interpreter exit (``raggedfsdp/_release.py``): the atexit handler keeps for
good a held tensor that a work (simulated: a C++ reference, another tensor's ``.grad``) still owns, so
that the work's release never frees a Python object, and forgets the released ones. Reference: the
tensors' own lifetimes (weak references), with and without the simulated work."""

from __future__ import annotations

import gc
import weakref

import torch

from raggedfsdp import _release


def test_exit_handler_keeps_only_what_a_work_still_owns():
    _release._HELD.clear()
    owned, free = torch.ones(3), torch.ones(2)
    bases = _release.use_count(owned), _release.use_count(free)
    keeper = torch.empty(3)
    keeper.grad = owned  # the "work" still holds it
    free_keeper = torch.empty(2)
    free_keeper.grad = free
    _release.hold_until_released(owned, bases[0])
    _release.hold_until_released(free, bases[1])
    free_keeper.grad = None  # that "work" let go
    assert _release.unreleased() == 1
    w_owned, w_free = weakref.ref(owned), weakref.ref(free)
    del owned, free
    assert _release.keep_unreleased_forever() == 1 and not _release._HELD
    gc.collect()
    assert w_free() is None  # released: dropped as usual
    assert w_owned() is not None  # still owned: kept
    keeper.grad = None  # the work lets go: the Python object survives it (nothing freed off-thread)
    gc.collect()
    assert w_owned() is not None
    assert _release.keep_unreleased_forever() == 0  # idempotent
