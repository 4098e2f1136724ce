"""What the library hands to a collective, so that a backend's worker thread never needs the GIL.

Note [gloo release]
    ``Work.wait()`` returning does not mean gloo has let go of the work: ``ProcessGroupGloo::runLoop``
    marks a work complete (waking the waiter) and only then, after re-taking its queue lock, drops its
    reference (``workInProgress_[i].reset()``); an async work is held by the worker for as long as it
    runs. The work holds the tensors it was given (and views it made of them, which hold their base),
    so the worker's release drops C++ references to them.

    Dropping a C++ reference to a tensor that has a Python object can take the GIL. On torch >= 2.10
    (Note [PyObject preservation for Tensor and Storages], ``c10/util/intrusive_ptr.h``) a
    ``TensorImpl`` / ``StorageImpl`` increfs its Python object when its use count goes 1 -> 2 and
    decrefs it when the count goes 2 -> 1 -- *whether or not Python still refers to the tensor*; the
    decref is ``ConcretePyInterpreterVTable::decref``: ``if (!Py_IsInitialized()) return;
    gil_scoped_acquire; Py_DECREF``. (Older torch takes the GIL only when the work holds the last
    reference.) So a worker releasing a work whose tensor has a Python object and no other C++
    reference asks for the GIL. If it asks just before the interpreter finalizes (a rank returns from
    its last collective, ``barrier()``, ``destroy_process_group()`` and exits while the worker thread is
    descheduled at high load) and gets the GIL only after, CPython ends the thread
    (``PyThread_exit_thread``) inside the ``noexcept`` destructor: ``terminate called without an
    active exception``, SIGABRT after a successful run. The stack (``tests/dist/test_teardown.py``
    reproduces it, ``benchmarks/teardown_soak.py --cores`` catches it)::

        take_gil <- PyEval_AcquireThread <- pybind11::gil_scoped_acquire
        <- ConcretePyInterpreterVTable::decref <- c10::TensorImpl::decref_pyobject
        <- std::vector<std::vector<at::Tensor>>::~vector <- ProcessGroupGloo::AsyncWork::~AsyncWork
        <- ProcessGroupGloo::runLoop

    Keeping a *Python* reference (what this module did first) does not prevent it: only another *C++*
    reference, dropped on the main thread, does. ``destroy_process_group()`` does not help either: the
    group is still referenced (FSDP units, the device mesh), so its worker threads live until exit.

    So every CPU tensor the library hands to a collective goes through :func:`handoff`, which returns a
    fresh alias (``t.new_empty(0).set_(t)``: its own ``TensorImpl``, not a view, sharing ``t``'s
    storage, sizes and strides) plus a *keeper* (``alias[...]``, a view: its autograd view info holds a
    C++ reference to the alias) and keeps both. The work holds only the alias (and views of it, whose
    base is the alias), whose use count is then ``2 + (the work's references)``: the worker's release
    never takes it to 1, so it never touches Python; ``t`` itself is never given to the backend. The
    pair is dropped on the main thread once the alias's count is back to 2 (the worker let go), at the
    next :func:`handoff`. At exit an ``atexit`` handler (the interpreter still whole) keeps for good the
    keeper of every pair a work still holds (:func:`keep_unreleased_forever`). The alias has its own
    version counter: a collective's write no longer bumps ``t._version`` (the library's unsharded
    parameter buffer preserves it anyway; no other collective output's version is read). CUDA tensors
    are handed as they are (NCCL's watchdog holds works until it polls them: an alias would keep a
    buffer alive past its owner's free) and keep the earlier Python hold, :func:`hold_until_released`.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes

import torch

_HELD: list = []  # (alias, keeper) from handoff, or (tensor, use count before its collective); oldest first
_LEGACY_KEEP = 64  # a torch without Tensor._use_count: keep the newest this many instead
_HAS_USE_COUNT = hasattr(torch.Tensor, "_use_count")


def use_count(t: torch.Tensor) -> int:
    """References to ``t``'s TensorImpl (Python's and C++'s, e.g. a pending work's); -1 if this torch
    cannot tell."""
    f = getattr(t, "_use_count", None)
    return int(f()) if f is not None else -1


def handoff(*tensors: torch.Tensor | None):
    """The tensors to give one collective in place of ``tensors`` (Note [gloo release]): for a CPU
    tensor, an alias sharing its storage, sizes and strides (same dtype, writes land in the tensor)
    that the library holds by a C++ reference until the backend lets go of it; the tensor itself
    otherwise (``None`` for ``None``). One tensor in, one out; several in, a tuple out. Pass every
    tensor of the collective in one call, right before issuing it (a call first drops the pairs of
    earlier collectives their work let go of: a pair made for a collective not yet issued would look
    released), and give the collective the results. Local; about 10 us a tensor."""
    _prune()
    out = tuple(map(_alias, tensors))
    return out[0] if len(out) == 1 else out


def _alias(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None or t.device.type != "cpu" or not _HAS_USE_COUNT:
        return t
    with torch.no_grad(), _normal_tensors():
        alias = t.new_empty(0).set_(t)
        keeper = alias[...]
    _HELD.append((alias, keeper))
    return alias


def _normal_tensors():
    """Under inference mode an alias would be an inference tensor, whose views keep no base."""
    return torch.inference_mode(False) if torch.is_inference_mode_enabled() else contextlib.nullcontext()


def hold_until_released(t: torch.Tensor | None, base: int) -> None:
    """Keep a Python reference to ``t`` until the collectives given it let go (the earlier form of Note
    [gloo release], kept for tensors :func:`handoff` returns as they are). ``base``: its
    :func:`use_count` just before the collective was issued. Call right after issuing. Cheap: prunes
    the released entries. Holds nothing for a CPU ``t`` given through :func:`handoff` (the work holds
    the alias, not ``t``). Local."""
    _prune()
    if t is None:
        return
    if base < 0:
        _HELD.append((t, base))
        del _HELD[:-_LEGACY_KEEP]
    elif use_count(t) > base:
        _HELD.append((t, base))


def _still_held(entry) -> bool:
    t, b = entry
    if isinstance(b, torch.Tensor):  # (alias, keeper): the alias's Python object and the keeper
        return use_count(t) > 2
    return b < 0 or use_count(t) > b


def unreleased() -> int:
    """How many tensors handed to collectives a work still holds. Local; prunes."""
    _prune()
    return sum(isinstance(b, torch.Tensor) or b >= 0 for _, b in _HELD)


def keep_unreleased_forever() -> int:
    """``atexit``: keep for good every entry a work still holds (the keeper of an alias: one Python
    reference that is never dropped, so the alias's use count never falls to 1 and the worker's release
    needs no GIL; for a tensor held the earlier way, the tensor) and forget the rest. Returns how many
    were kept. Local; idempotent."""
    kept = 0
    for entry in _HELD:
        t, b = entry
        if (isinstance(b, torch.Tensor) or b >= 0) and _still_held(entry):
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(b if isinstance(b, torch.Tensor) else t))
            kept += 1
    _HELD.clear()
    return kept


atexit.register(keep_unreleased_forever)


def _prune() -> None:
    if _HELD:
        _HELD[:] = filter(_still_held, _HELD)


__all__ = ["handoff", "hold_until_released", "keep_unreleased_forever", "unreleased", "use_count"]
