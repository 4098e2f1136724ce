"""Keep short-lived tensors given to a collective until the backend has let go of them.

Note [gloo release]
    ``Work.wait()`` returning does not mean gloo has let go of the work: ``ProcessGroupGloo::runLoop``
    marks a work complete (waking the waiter) and only then, after re-taking its queue lock, drops its
    reference (``workInProgress_[i].reset()``, ``torch/csrc/distributed/c10d/ProcessGroupGloo.cpp``); an
    async work is held by the worker for as long as it runs. A Python tensor whose last Python reference
    goes away while a work still holds it is kept alive by the work, and torch's PyObject preservation
    makes the tensor own its Python object: the gloo thread then frees both and must take the GIL to do
    so. If it asks for the GIL just as the interpreter starts to finalize (a rank returns from its last
    collective, ``barrier()``, ``destroy_process_group()`` and exits while the worker thread is
    descheduled at high load), CPython ends that thread (``PyThread_exit_thread``) inside the tensor's
    ``noexcept`` destructor and the process aborts with ``terminate called without an active
    exception`` (SIGABRT) after a successful run. ``destroy_process_group()`` cannot close the gap: the
    group is still referenced (by the model's FSDP units, the device mesh), so its worker threads live
    until the interpreter exits. ``benchmarks/teardown_soak.py --case user --leak-work`` reproduces the
    abort deterministically enough to count (a pending work holding the last reference at exit).

    So every *short-lived* tensor the library hands to a collective (the used-flag all-reduce vector,
    a cast slice, a redistribute's send/receive pieces) goes through :func:`hold_until_released` when
    the collective is issued: a Python reference is kept until the tensor's use count
    (``Tensor._use_count()``) is back to what it was before the collective, i.e. until every work that
    held it is gone, so the last reference is always dropped by Python on the main thread. Long-lived
    buffers (``DBuffer.data``) need nothing. Checked by ``tests/dist/test_teardown.py``.

    The hold itself must not end during finalization: the list of held tensors is a module global,
    cleared when the interpreter tears the modules down, and an entry a lagging worker still owns then
    (the last collective of the run, a ``full_tensor()`` just before ``barrier()`` and exit, with the
    worker descheduled at high load) would be dropped there, leaving the worker to free it with the
    GIL -- the abort again. So an ``atexit`` handler (run before that teardown, the interpreter whole)
    keeps every entry still owned by a work alive for good (one more Python reference, never dropped:
    the worker's release then frees nothing and needs no GIL; the process is ending) and drops the
    others. ``tests/unit/test_release.py``.
"""

from __future__ import annotations

import atexit
import ctypes

import torch

_HELD: list = []  # (tensor, use count before its collective), oldest first; one writer: this module
_LEGACY_KEEP = 64  # a torch without Tensor._use_count: keep the newest this many instead


def use_count(t: torch.Tensor) -> int:
    """References to ``t``'s TensorImpl (Python's and C++'s, e.g. a pending work's); -1 if this torch
    cannot tell."""
    f = getattr(t, "_use_count", None)
    return int(f()) if f is not None else -1


def hold_until_released(t: torch.Tensor | None, base: int) -> None:
    """Keep ``t`` alive until the collectives given it let go (Note [gloo release]). ``base``: its
    :func:`use_count` just before the collective was issued. Call right after issuing. Cheap: prunes
    the released entries. Local."""
    _prune()
    if t is None:
        return
    if base < 0:
        _HELD.append((t, base))
        del _HELD[:-_LEGACY_KEEP]
    elif use_count(t) > base:
        _HELD.append((t, base))


def unreleased() -> int:
    """How many tensors given to :func:`hold_until_released` a work still holds. Local; prunes."""
    _prune()
    return sum(b >= 0 for _, b in _HELD)


def keep_unreleased_forever() -> int:
    """``atexit``: make every held tensor a work still owns immortal (its Python object gets a reference
    that is never dropped) and forget the rest. Returns how many were kept. Local; idempotent."""
    kept = 0
    for t, b in _HELD:
        if b >= 0 and use_count(t) > b:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(t))
            kept += 1
    _HELD.clear()
    return kept


atexit.register(keep_unreleased_forever)


def _prune() -> None:
    if _HELD:
        _HELD[:] = [(t, b) for t, b in _HELD if b < 0 or use_count(t) > b]


__all__ = ["hold_until_released", "keep_unreleased_forever", "unreleased", "use_count"]
