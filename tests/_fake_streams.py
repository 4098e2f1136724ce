"""A CPU model of CUDA stream ordering, to check the FSDP runtime's stream waits without a GPU.

On CPU every stream is ``None`` and ``Work.wait()`` blocks the host, so the debug lifetime check of
``raggedfsdp/buffer/streams.py`` is always satisfied and a missing stream wait is invisible.
:class:`FakeStreams` (installed with :func:`fake_streams`, Note [fake streams] in ``streams.py``) makes
every side stream a distinct token and keeps a *vector clock* per token, i.e. the happens-before
graph CUDA would build:

* work issued on stream ``s`` (a collective, a ``wait_*``) is a new point on ``s``'s timeline;
* ``wait_stream(w, o)``, ``wait_event(w, e)`` (after ``record_event(e, o)``) and a collective
  handle's ``wait(stream=w)`` (under NCCL ``Work.wait()`` only orders the current stream after the
  collective; it does not block the host) join ``w``'s clock with ``o``'s / the event's / the
  collective's completion point;

and checks, on every collective issue and every ``DBuffer.free`` (debug mode), the two rules of
Note [stream invariant]:

1. a collective issued on side stream ``s`` must be ordered after everything already enqueued on the
   allocating stream of each buffer it uses (``s`` waited the compute stream just before issue);
2. a buffer may be freed only when its allocating stream is ordered after every collective that used it.

A violation raises :class:`raggedfsdp.buffer.BufferLifetimeError` at once (and is kept in
``violations``). The current stream is thread-local (``on_stream`` pushes), defaulting to one
"compute" token per device, as CUDA's per-device default stream. ``edges`` records every ordering
edge for inspection. Only ordering is modelled, not timing.
"""

from __future__ import annotations

import contextlib
import itertools
import threading

import torch


class FakeStream:
    """A side-stream token. ``device_index`` / ``cuda_stream`` make ``stream_key`` distinct per token."""

    def __init__(self, idx: int, name: str, device: torch.device):
        self.device_index = -1
        self.cuda_stream = idx
        self.id = idx
        self.name = name
        self.device = device
        self.clock: dict[int, int] = {idx: 0}

    def __repr__(self):
        return f"<fake stream {self.name}#{self.id}>"


class FakeEvent:
    def __init__(self, idx: int):
        self.id = idx
        self.clock: dict[int, int] | None = None  # None until recorded
        self.stream = None


def _join(a: dict, b: dict) -> None:
    for k, v in b.items():
        if a.get(k, -1) < v:
            a[k] = v


class FakeStreams:
    """The stream model (see the module docstring)."""

    def __init__(self):
        self._ids = itertools.count(1)
        self._local = threading.local()
        self.compute: dict[str, FakeStream] = {}
        self.by_key: dict[tuple, FakeStream] = {}
        self.edges: list[tuple[str, str, str]] = []  # (kind, waiter, waited)
        self.issued: dict[int, tuple[FakeStream, int, str]] = {}  # handle id -> (stream, point, what)
        self.counts = {"issue": 0, "wait_handle": 0, "wait_stream": 0, "wait_event": 0, "check_free": 0}
        self.issued_kinds: dict[str, int] = {}
        self.violations: list[str] = []

    # ---- streams ----------------------------------------------------------------------------
    def _make(self, device, name) -> FakeStream:
        s = FakeStream(next(self._ids), name, device)
        self.by_key[(s.device_index, s.cuda_stream)] = s
        return s

    def new_stream(self, device: torch.device, priority: int = 0):
        if device.type == "meta":
            return None
        return self._make(device, f"side(p{priority})")

    def _compute_of(self, device) -> FakeStream:
        key = str(device)
        if key not in self.compute:
            self.compute[key] = self._make(device, f"compute[{key}]")
        return self.compute[key]

    def current(self, device: torch.device):
        if device.type == "meta":
            return None
        stack = getattr(self._local, "stack", None)
        return stack[-1] if stack else self._compute_of(device)

    @contextlib.contextmanager
    def on(self, stream: FakeStream):
        stack = self._local.__dict__.setdefault("stack", [])
        stack.append(stream)
        try:
            yield
        finally:
            stack.pop()

    def _tick(self, s: FakeStream) -> int:
        s.clock[s.id] += 1
        return s.clock[s.id]

    # ---- ordering edges -------------------------------------------------------------------------
    def wait_stream(self, waiter: FakeStream, other: FakeStream) -> None:
        self.counts["wait_stream"] += 1
        _join(waiter.clock, other.clock)
        self._tick(waiter)
        self.edges.append(("wait_stream", waiter.name, other.name))

    def new_event(self):
        return FakeEvent(next(self._ids))

    def record_event(self, event: FakeEvent, stream=None) -> None:
        s = stream if stream is not None else self.current(torch.device("cpu"))
        self._tick(s)
        event.clock, event.stream = dict(s.clock), s

    def wait_event(self, stream: FakeStream, event: FakeEvent) -> None:
        self.counts["wait_event"] += 1
        if event.clock is not None:  # CUDA: waiting an event never recorded is a no-op
            _join(stream.clock, event.clock)
            self.edges.append(("wait_event", stream.name, event.stream.name))
        self._tick(stream)

    # ---- collectives and buffers -------------------------------------------------------------------
    def _alloc_stream(self, buf):
        return self.by_key.get(buf.alloc_stream_key)

    def issue(self, handle) -> None:
        dev = handle.buffers[0].data.device if handle.buffers else torch.device("cpu")
        s = handle.stream if handle.stream is not None else self.current(dev)
        if s is None:
            return
        self.counts["issue"] += 1
        self.issued_kinds[handle.what] = self.issued_kinds.get(handle.what, 0) + 1
        for b in handle.buffers:
            a = self._alloc_stream(b)
            if a is not None and a is not s and s.clock.get(a.id, -1) < a.clock[a.id]:
                self._fail(
                    f"{handle.what} #{handle.id} issued on {s} before it waited {a}, the stream that "
                    f"allocated its {b.name} buffer (work enqueued there is not ordered before it)"
                )
        self.issued[handle.id] = (s, self._tick(s), handle.what)

    def wait_handle(self, stream, handle) -> None:
        rec = self.issued.get(handle.id)
        if rec is None or stream is None:
            return
        self.counts["wait_handle"] += 1
        s, point, _ = rec
        if stream.clock.get(s.id, -1) < point:
            stream.clock[s.id] = point
        self._tick(stream)
        self.edges.append(("wait_handle", stream.name, f"{handle.what}#{handle.id}@{s.name}"))

    def ordered_after(self, stream, handle) -> bool:
        rec = self.issued.get(handle.id)
        if rec is None or stream is None:
            return True
        s, point, _ = rec
        return stream.clock.get(s.id, -1) >= point

    def check_free(self, buf, handle, action: str) -> None:
        self.counts["check_free"] += 1
        a = self._alloc_stream(buf)
        if not self.ordered_after(a, handle):
            s = self.issued[handle.id][0]
            self._fail(
                f"{action} of the {buf.name} buffer while its allocating stream {a} is not ordered after "
                f"{handle.what} #{handle.id} (issued on {s})"
            )

    def _fail(self, msg: str) -> None:
        from raggedfsdp.buffer import BufferLifetimeError

        self.violations.append(msg)
        raise BufferLifetimeError(f"raggedfsdp (stream model): {msg}")


@contextlib.contextmanager
def fake_streams():
    """Install a :class:`FakeStreams` model and debug mode for the block; yields the model. Build the
    FSDP model inside the block (its streams are made at lazy init). Local to this process."""
    from raggedfsdp.buffer.streams import debug_enabled, set_debug, set_stream_model, stream_model

    prev_model, prev_debug = stream_model(), debug_enabled()
    model = FakeStreams()
    set_stream_model(model)
    set_debug(True)
    try:
        yield model
    finally:
        set_stream_model(prev_model)
        set_debug(prev_debug)
