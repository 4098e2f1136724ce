"""Streams, collective handles and the debug-mode buffer-lifetime invariant.

Note [stream invariant]
    Every FSDP buffer (unsharded params, unsharded grads, reduce-scatter input/output) is allocated
    on the *compute* stream (the current stream when the hook runs), like the inputs of torch FSDP2's
    copy-in (``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``). Collectives are issued
    from dedicated streams on CUDA (all-gather, reduce-scatter, all-reduce; each first waits on the
    compute stream, so what it reads or overwrites is ready), and a storage is freed only after the
    stream that allocated it has waited every collective that used it. The caching allocator hands
    a freed block only to later work on its allocating stream, so that wait is what makes re-use
    safe without ``record_stream``.

    With ``RAGGEDFSDP_DEBUG=1`` in the environment (or :func:`set_debug(True) <set_debug>`) each
    :class:`~raggedfsdp.buffer.DBuffer` records the collectives launched on it and the streams that
    waited them, and :meth:`DBuffer.free` raises :class:`BufferLifetimeError` if one was not waited
    on the allocating stream. On CPU (gloo) the "stream" is ``None`` and ``Work.wait()`` is the wait.

Note [fake streams]
    On CPU every stream is ``None``, so the check above cannot see a missing stream wait. A test can
    install a stream *model* with :func:`set_stream_model` (``tests/_fake_streams.py``): then
    :func:`new_stream` makes distinct side-stream tokens on any device, :func:`current_stream`,
    :func:`on_stream`, :func:`wait_stream`, :func:`record_event` / :func:`wait_event` and
    :meth:`CommHandle.wait` go through the model, which records the happens-before graph CUDA would
    have, and ``DBuffer.free`` / collective issue ask it whether the ordering holds. Every
    stream-ordering call of the runtime goes through these functions (never ``torch.cuda.*`` directly),
    so the model sees all of them. Without a model (the default) nothing changes.
"""

from __future__ import annotations

import contextlib
import itertools
import os

import torch

_DEBUG = [os.environ.get("RAGGEDFSDP_DEBUG", "0") not in ("", "0")]
_MODEL: list = [None]  # Note [fake streams]: a test's stream model, or None (real CUDA streams / CPU no-ops)
_ids = itertools.count()


class BufferLifetimeError(RuntimeError):
    """A buffer was freed (or re-used) while a collective using it had not been waited on its stream."""


def set_debug(flag: bool) -> None:
    """Turn the runtime's cheap invariant checks on or off (default: env ``RAGGEDFSDP_DEBUG``). Local."""
    _DEBUG[0] = bool(flag)


def debug_enabled() -> bool:
    return _DEBUG[0]


def set_stream_model(model) -> None:
    """Install (or with ``None`` remove) a stream model (Note [fake streams]); tests only. Local."""
    _MODEL[0] = model


def stream_model():
    return _MODEL[0]


def stream_key(stream):
    """A hashable identity of a stream (``None`` for CPU)."""
    return None if stream is None else (stream.device_index, stream.cuda_stream)


def new_stream(device: torch.device | None, priority: int = 0):
    """A side stream on ``device``: a CUDA stream, a stream-model token, or ``None`` (CPU, no model)."""
    if _MODEL[0] is not None and device is not None:
        return _MODEL[0].new_stream(device, priority)
    if device is not None and device.type == "cuda":
        return torch.cuda.Stream(device=device, priority=priority)
    return None


def current_stream(device: torch.device):
    """The current CUDA stream of ``device``, or ``None`` for CPU / meta (no streams)."""
    if _MODEL[0] is not None:
        return _MODEL[0].current(device)
    if device.type == "cuda":
        return torch.cuda.current_stream(device)
    return None


@contextlib.contextmanager
def on_stream(stream):
    """``torch.cuda.stream(stream)`` if ``stream`` is a CUDA stream, else a no-op."""
    if _MODEL[0] is not None and stream is not None:
        with _MODEL[0].on(stream):
            yield
    elif stream is None:
        yield
    else:
        with torch.cuda.stream(stream):
            yield


def wait_stream(waiter, other) -> None:
    """``waiter.wait_stream(other)`` for CUDA streams; no-op on CPU."""
    if waiter is not None and other is not None and waiter is not other:
        if _MODEL[0] is not None:
            _MODEL[0].wait_stream(waiter, other)
        else:
            waiter.wait_stream(other)


def new_event(device: torch.device):
    """An event to order streams on ``device`` (``torch.cuda.Event``; a model token; ``None`` on CPU)."""
    if _MODEL[0] is not None:
        return _MODEL[0].new_event()
    return torch.cuda.Event() if device.type == "cuda" else None


def record_event(event, stream=None) -> None:
    """``event.record(stream)`` (default: the current stream); no-op for ``None``."""
    if event is None:
        return
    if _MODEL[0] is not None:
        _MODEL[0].record_event(event, stream)
    else:
        event.record(stream) if stream is not None else event.record()


def wait_event(stream, event) -> None:
    """``stream.wait_event(event)``; no-op when either is ``None``."""
    if stream is None or event is None:
        return
    if _MODEL[0] is not None:
        _MODEL[0].wait_event(stream, event)
    else:
        stream.wait_event(event)


class CollectiveError(RuntimeError):
    """A collective raggedfsdp issued failed (peer abort, timeout, size mismatch); the message names
    the FSDP unit and this rank's collective sequence where the runtime knows them."""


class CommHandle:
    """A launched collective (or a local copy standing in for one) and the buffers it reads or writes.

    Args:
        work: the ``dist.Work`` (``None`` when no communication was needed, e.g. world size 1).
        buffers: the :class:`DBuffer` objects the collective uses (their storage must stay allocated).
        stream: the stream it was issued from (``None`` on CPU).
        what: a short label for error messages.
    """

    def __init__(self, work, buffers=(), stream=None, what: str = "collective"):
        self.id = next(_ids)
        self.work = work
        self.context = None  # optional () -> str naming who issued it, added to a failure's message
        self.buffers = list(buffers)
        self.stream = stream
        self.what = what
        self.waited_on: set = set()
        for b in self.buffers:
            b._note_use(self)
        if _MODEL[0] is not None:
            _MODEL[0].issue(self)

    @property
    def waited(self) -> bool:
        return bool(self.waited_on)

    def is_done(self) -> bool:
        """Non-blocking: True if the collective has finished (``Work.is_completed()``; for NCCL an event
        query, no host sync). False while it runs, and when it cannot be known without waiting (a local
        copy issued on a side stream). Used to free buffers early (Note [early free] in
        ``raggedfsdp/fsdp/_reduce.py``); :meth:`wait` is still what orders later work. Local."""
        if self.work is None:
            return self.stream is None
        return bool(self.work.is_completed())

    def wait(self, stream=None) -> None:
        """Order ``stream`` (CUDA; default: the current stream) after the collective; on gloo, block
        the host until it is done. Local. Safe to call more than once."""
        dev = self.buffers[0].data.device if self.buffers else torch.device("cpu")
        stream = stream if stream is not None else current_stream(dev)
        key = stream_key(stream)
        if key in self.waited_on:
            return
        with on_stream(stream):
            if _MODEL[0] is not None:
                _MODEL[0].wait_handle(stream, self)
            if self.work is not None:
                self._wait_work()
                if dev.type == "cpu":
                    # gloo's Work owns clones of its inputs: drop it once the host has waited (on CPU a
                    # completed wait orders every later use), or the scratch stays alive with the handle
                    self.work = None
            wait_stream(stream, self.stream)  # local copies and settled collectives on the side stream
        self.waited_on.add(key)
        for b in self.buffers:
            b._note_waited(self, key)

    def settle(self) -> None:
        """Wait the collective on the stream it was issued from, now: what a synchronous c10d call does
        (torch's FSDP2 issues its reduce-scatter so, ``_fsdp_collectives.py: foreach_reduce``). On CUDA
        that stream waits for it and the host does not; on gloo the host blocks until it is done and
        the work is dropped, with the scratch clone of the input gloo's reduce-scatter holds until
        ``wait()`` (Note [settled reduce-scatter] in ``raggedfsdp/fsdp/_reduce.py``). For every other
        stream the handle stays pending: :meth:`wait` still orders a stream after it, :meth:`is_done`
        asks an event recorded after it (CPU: done). Local; a no-op without a work or once settled."""
        if self.work is None or isinstance(self.work, _Settled):
            return
        with on_stream(self.stream):
            self._wait_work()
        event = None
        if self.stream is not None and _MODEL[0] is None:  # a CUDA side stream: query it later
            event = new_event(self.buffers[0].data.device)
            record_event(event, self.stream)
        self.work = _Settled(event)

    def _wait_work(self) -> None:
        try:
            self.work.wait()
        except RuntimeError as e:  # a peer aborted (e.g. gloo's size check) or timed out
            ctx = self.context() if self.context is not None else ""
            raise CollectiveError(f"raggedfsdp: the {self.what}{ctx} failed: {e}") from e


class _Settled:
    """The work of a settled collective (:meth:`CommHandle.settle`): already waited on its issuing
    stream. ``is_completed()``: that stream has passed it (an event query on CUDA; True on CPU, where
    the host waited). ``wait()``: nothing more; :meth:`CommHandle.wait` orders the waiting stream after
    the issuing one."""

    __slots__ = ("event",)

    def __init__(self, event):
        self.event = event

    def is_completed(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self, timeout=None) -> bool:
        return True


__all__ = [
    "BufferLifetimeError",
    "CollectiveError",
    "CommHandle",
    "current_stream",
    "debug_enabled",
    "new_event",
    "new_stream",
    "on_stream",
    "record_event",
    "set_debug",
    "set_stream_model",
    "stream_key",
    "stream_model",
    "wait_event",
    "wait_stream",
]
