"""Peak live memory of a code region: the one method raggedfsdp's tests and benchmarks use.

``PeakMemory(device)`` is a context manager. On exit it holds, in **bytes**:

- ``peak_bytes``: the highest number of live bytes reached inside the region, **above the live
  bytes at entry** (a region that only frees memory reports 0);
- ``baseline_bytes``: live bytes at entry;
- ``end_bytes``: live bytes at exit (``end_bytes - baseline_bytes`` is the region's net growth).

``reset()`` inside the region closes the current window and opens a new one (so one region can
measure consecutive phases against one origin); after exit ``windows`` lists every window as a
:class:`MemoryWindow` and the three fields above describe the last one. It is local to the calling
process (no collective: every rank measures itself) and does not nest.

How it measures
---------------
**CUDA** (``device.type == "cuda"``): the caching allocator's counters. Entry (and ``reset()``)
synchronizes the device, calls ``torch.cuda.reset_peak_memory_stats(device)`` and reads
``torch.cuda.memory_allocated``; exit synchronizes and reads ``torch.cuda.max_memory_allocated``.
So ``peak_bytes = max_memory_allocated - memory_allocated(at entry)``, in the allocator's
512-byte-rounded blocks, over every stream and thread of the device. ``peak_reserved_bytes`` (the
reserved high-water mark of the last window, cache included) is filled too. Source:
``torch/cuda/memory.py``.

**CPU**: exact bytes of tensor storages, from torch's CPU allocator itself. The region runs under
``torch.profiler.profile(activities=[CPU], profile_memory=True)``, which records one ``[memory]``
event per allocation (``+n`` bytes) and per free (``-n`` bytes) made through torch's CPU allocator,
time-stamped on the same clock as the profiler's op events. The running sum of those events is the
live-byte curve relative to entry and its maximum is ``peak_bytes``; ``reset()`` drops a
``record_function`` marker into the same event stream, so windows split at the exact event.
Because the events come from the allocator, this sees what a ``TorchDispatchMode`` + storage-weakref
tracker cannot: a storage freed and regrown in place with ``untyped_storage().resize_(0)`` /
``resize_(n)`` (how raggedfsdp's DBuffer and torch's FSDP2 free and re-allocate unsharded buffers)
is a ``-n`` then a ``+n`` event, and temporaries made inside a kernel count too. Sources:
``c10/core/CPUAllocator.cpp`` (``ProfiledCPUMemoryReporter``), ``torch/autograd/profiler_util.py``.

**Switching the CPU accounting on.** Importing this module changes nothing. c10 reports the free of a
block only if its process-wide accounting flag was set when the block was allocated
(:func:`enable_cpu_allocator_accounting`, in ``placement/_patches.py``; the first CPU
:class:`PeakMemory` sets it too). A process that builds what it measures before it enters a region
calls ``enable_cpu_allocator_accounting()`` first; :func:`measure_train_step` builds inside its
region, so it needs nothing.

On CPU ``baseline_bytes`` of the first window is the total size of the distinct tensor storages
reachable from Python objects at entry (a ``gc`` scan: parameters, gradients, optimizer state; a
storage held only by C++, e.g. by a live autograd graph, is not seen, so it is a lower bound), and
every later figure is that plus the exact allocator sum. ``peak_bytes`` and differences between
figures of one region are exact.

Limits (CPU): the profiler follows the thread that entered the region and the threads torch hands
its state to (autograd engine, ``at::launch``); memory allocated *or freed* on other threads is not
seen. gloo is such a case: its reduce-scatter allocates a unit-sized scratch buffer on the calling
thread that its worker thread often frees, so under gloo the curve drifts upwards by unit-sized
steps, nondeterministically. Measure FSDP runs with the single-threaded fake process group
(``torch.testing._internal.distributed.fake_pg``; collectives are no-ops, every FSDP buffer is
allocated and freed exactly as under a real backend, minus backend scratch), as
``tests/dist/test_fsdp_memory.py`` and ``benchmarks/memory_vs_torch.py`` do, or on CUDA. The
profiler slows each op by a few microseconds: keep timed code outside the region.

``tests/unit/test_memory.py`` checks the method against known allocations (including a
``resize_(0)`` / ``resize_(n)`` cycle) and against the process's RSS; ``docs/memory.md`` has the
details and how tests and benchmarks use it.

Example (any rank; collectives inside the region are the caller's)::

    with PeakMemory("cpu") as m:
        model(x).sum().backward()
    print(m.peak_bytes / 2**20, "MiB above the step's start")
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import NamedTuple, Self

import torch


__all__ = [
    "MemoryWindow",
    "enable_cpu_allocator_accounting",
    "PeakMemory",
    "StepMemory",
    "live_tensor_bytes",
    "measure_train_step",
    "storage_bytes",
]

# Not applied on import: c10's process-wide CPU allocation accounting, for the peak-memory method
# (this module). c10's ``ProfiledCPUMemoryReporter`` (c10/core/CPUAllocator.cpp) keeps
# its table of live CPU blocks, and the running total it stamps on every profiler memory event
# (``total_allocated``), only while the *calling thread* profiles -- unless the c10 flag
# ``FLAGS_caffe2_report_cpu_memory_usage`` is set. With the flag set, every thread's allocations
# and frees update the total (gloo's worker threads free collective scratch the main thread
# allocated), and frees of blocks allocated before a profiler session are reported with their
# size. torch has no Python setter for c10 flags, so this writes the exported global with ctypes.
# Cost: one mutex + hash-map update per CPU allocation for the rest of the process; with
# TORCH_CPP_LOG_LEVEL=INFO c10 also logs every allocation (the default level, WARNING, does not).
_CPU_ACCOUNTING: bool | None = None


def enable_cpu_allocator_accounting() -> bool:
    """Set c10's ``FLAGS_caffe2_report_cpu_memory_usage`` for this process; True when it is set.

    Idempotent, local, never raises: returns False (and the caller falls back to per-thread
    accounting) when this torch build does not export the flag (e.g. a static or non-Linux build).
    ``tests/unit/test_memory.py`` asserts it returns True on the supported Linux wheels.
    """
    global _CPU_ACCOUNTING
    if _CPU_ACCOUNTING is not None:
        return _CPU_ACCOUNTING
    import ctypes
    import glob
    import os

    libdir = os.path.join(os.path.dirname(torch.__file__), "lib")
    _CPU_ACCOUNTING = False
    for path in sorted(
        glob.glob(os.path.join(libdir, "libc10.*")) + glob.glob(os.path.join(libdir, "c10.dll"))
    ):
        try:
            flag = ctypes.c_bool.in_dll(ctypes.CDLL(path), "FLAGS_caffe2_report_cpu_memory_usage")
        except (OSError, ValueError):
            continue
        flag.value = True
        _CPU_ACCOUNTING = bool(flag.value)
        break
    return _CPU_ACCOUNTING


_MARK = "raggedfsdp.PeakMemory.reset"
# Not on import (importing changes nothing global): the first PeakMemory sets c10's flag, or the
# measuring process calls enable_cpu_allocator_accounting() before it allocates what it measures.


class MemoryWindow(NamedTuple):
    """One measurement window (bytes): live at its start, its peak above that, live at its end."""

    baseline_bytes: int
    peak_bytes: int
    end_bytes: int


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (an iterable of tensors or ``None``).

    Each storage counts once however many views of it are passed; a ``DTensor`` counts its local
    tensor; meta tensors and freed (``resize_(0)``) storages count 0. Local, no collective.
    """
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        t = getattr(t, "_local_tensor", t)
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        try:
            st = t.untyped_storage()
            if st.nbytes():
                seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        except (RuntimeError, NotImplementedError):  # wrapper subclasses (e.g. TP's AsyncCollectiveTensor
            continue  # outputs) without a storage, or whose storage is no longer valid
    return sum(seen.values())


def live_tensor_bytes(device: torch.device | str = "cpu") -> int:
    """Bytes of the distinct storages on ``device``'s type reachable from Python objects (a gc scan).

    A lower bound on the process's live tensor bytes (storages held only by C++, e.g. by a live
    autograd graph, are not seen). Local, no collective; one ``gc.get_objects()`` pass.
    """
    import warnings

    dev_type = torch.device(device).type
    tensors = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance() on deprecated torch module attributes warns
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor):
                    t = getattr(obj, "_local_tensor", obj)
                    if isinstance(t, torch.Tensor) and t.device.type == dev_type:
                        tensors.append(t)
            except Exception:  # noqa: BLE001, S112 - objects whose isinstance() misbehaves are skipped
                continue
    return storage_bytes(tensors)


def _op_chain(e, depth: int = 4) -> str:
    names, p = [], e.parent
    while p is not None and len(names) < depth:
        names.append(p.name)
        p = p.parent
    return " < ".join(names) or "(no op)"


def _cpu_timeline(prof, with_owner: bool = False):
    """CPU allocator events ``(time_ns, signed bytes, total_allocated[, ptr, op chain])`` and marker
    ``(start, end)`` ns."""
    results = getattr(prof.profiler, "kineto_results", None)
    tree = getattr(results, "experimental_event_tree", None)
    if tree is None:
        raise RuntimeError(
            "PeakMemory: this torch build's profiler exposes no event tree; the CPU method needs "
            "torch.profiler with profile_memory=True (torch >= 2.0 built with kineto)"
        )
    allocs, marks = [], []
    stack = list(tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        kind, fields = e.typed
        if kind == torch._C._profiler._EventType.Allocation:
            if fields.device.type == "cpu":
                ev = (e.start_time_ns, fields.alloc_size, fields.total_allocated)
                if with_owner:
                    ev += (fields.ptr, _op_chain(e) if fields.alloc_size > 0 else "")
                allocs.append(ev)
        elif kind == torch._C._profiler._EventType.TorchOp and e.name == _MARK:
            marks.append((e.start_time_ns, e.end_time_ns))
    allocs.sort(key=lambda x: x[0])
    marks.sort()
    return allocs, marks


def _cpu_windows(allocs, marks, baseline: int, global_total: bool) -> list[MemoryWindow]:
    """Split the allocator timeline at the markers (the first one is the region's entry)."""
    levels, running = [], 0
    for _, n, total, *_ in allocs:
        running += n
        levels.append(total if global_total else running)
    windows, i = [], 0
    entry_level = None
    start = peak = 0
    for m0, m1 in marks:
        while i < len(allocs) and allocs[i][0] < m0:  # events of the window this marker closes
            peak = max(peak, levels[i])
            i += 1
        level = levels[i - 1] if i else (entry_level or 0)
        while i < len(allocs) and allocs[i][0] <= m1:  # the marker's own sentinel alloc + free
            level = levels[i]
            i += 1
        if entry_level is None:
            entry_level = level
        else:
            windows.append(MemoryWindow(start, max(0, peak - start), level))
        start = peak = level
    while i < len(allocs):
        peak = max(peak, levels[i])
        i += 1
    end = levels[-1] if allocs else start
    windows.append(MemoryWindow(start, max(0, peak - start), end))
    off = baseline - entry_level
    return [MemoryWindow(w.baseline_bytes + off, w.peak_bytes, w.end_bytes + off) for w in windows]


def _peak_owners(allocs, marks, global_total: bool, top: int) -> list[list[tuple[int, str]]]:
    """Per window: the blocks allocated in it and live at its peak, ``(bytes, allocating op chain)``."""
    bounds = [m[1] for m in marks] + [float("inf")]
    return [
        _window_owners([e for e in allocs if t0 < e[0] < t1], global_total, top)
        for t0, t1 in zip(bounds[:-1], [m[0] for m in marks[1:]] + [float("inf")])
    ]


def _window_owners(evs, global_total: bool, top: int) -> list[tuple[int, str]]:
    live: dict[int, tuple[int, str]] = {}
    best, best_live, level, running = None, {}, 0, 0
    for _, n, total, ptr, chain in evs:
        running += n
        level = total if global_total else running
        if n > 0:
            live[ptr] = (n, chain)
        else:
            live.pop(ptr, None)
        if best is None or level > best:
            best, best_live = level, dict(live)
    return sorted(best_live.values(), key=lambda v: -v[0])[:top]


def _mark() -> None:
    """A profiler marker holding a 1-byte sentinel allocation: the allocator's level at this point."""
    with torch.profiler.record_function(_MARK):
        torch.empty(1, dtype=torch.uint8)


class PeakMemory:
    """Peak live bytes of a region on ``device`` (CUDA: allocator counters; CPU: allocator events).

    Args:
        device: ``torch.device`` or string; ``cuda`` / ``cuda:i`` use that device's caching
            allocator, any other device type uses the CPU method. Default ``"cpu"``.
        breakdown: CPU only: keep the ``breakdown`` largest blocks that were allocated in a window
            and are live at its peak, as ``(bytes, "op < parent op < ...")`` (the profiler ops that
            allocated them): what each peak is made of. ``peak_owners`` holds the last window's,
            ``window_owners`` every window's. Default 0 (off).

    Attributes (bytes; ``None`` until exit): ``peak_bytes``, ``baseline_bytes``, ``end_bytes``
    (of the last window), ``windows`` (every window, in order); CUDA also ``peak_reserved_bytes``.
    The module docstring describes the method and its limits.

    Raises:
        TypeError: ``device`` is not a ``torch.device`` or string.
        RuntimeError: entered while active, ``reset()`` outside the region, or (CPU) another
            ``torch.profiler`` session is already running in this process.
    """

    def __init__(self, device: torch.device | str = "cpu", *, breakdown: int = 0):
        if not isinstance(device, (torch.device, str)):
            raise TypeError(
                f"PeakMemory(device=...) takes a torch.device or a string such as 'cpu' or 'cuda:0', "
                f"got {type(device).__name__} ({device!r})"
            )
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        if self.is_cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.peak_bytes: int | None = None
        self.baseline_bytes: int | None = None
        self.end_bytes: int | None = None
        self.peak_reserved_bytes: int | None = None
        self.windows: list[MemoryWindow] = []
        self.breakdown = int(breakdown)
        self.peak_owners: list[tuple[int, str]] = []
        self.window_owners: list[list[tuple[int, str]]] = []
        self._prof = None
        self._active = False
        self._global_total = False if self.is_cuda else enable_cpu_allocator_accounting()

    def __enter__(self) -> Self:
        if self._active:
            raise RuntimeError("PeakMemory is already active; use a second PeakMemory after this one exits")
        self.peak_bytes = self.end_bytes = self.peak_reserved_bytes = None
        self.windows = []
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline_bytes = self._start = torch.cuda.memory_allocated(self.device)
        else:
            if torch.autograd.profiler._is_profiler_enabled:
                raise RuntimeError(
                    "PeakMemory on CPU runs torch.profiler and cannot start while another profiler "
                    "session (or another CPU PeakMemory) is running in this process; end that one first"
                )
            self.baseline_bytes = live_tensor_bytes("cpu")
            from torch.profiler import ProfilerActivity, profile

            prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            prof.__enter__()
            self._prof = prof
            _mark()
        self._active = True
        return self

    def _close_cuda_window(self) -> None:
        torch.cuda.synchronize(self.device)
        end = torch.cuda.memory_allocated(self.device)
        peak = max(0, torch.cuda.max_memory_allocated(self.device) - self._start)
        self.peak_reserved_bytes = torch.cuda.max_memory_reserved(self.device)
        self.windows.append(MemoryWindow(self._start, peak, end))

    def reset(self) -> None:
        """Close the current window here and open the next one (CPU: a marker, resolved at exit).

        Raises ``RuntimeError`` outside the region.
        """
        if not self._active:
            raise RuntimeError("PeakMemory.reset() called outside its `with` block")
        if self.is_cuda:
            self._close_cuda_window()
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            _mark()

    def __exit__(self, *exc) -> bool:
        self._active = False
        if self.is_cuda:
            self._close_cuda_window()
        else:
            prof, self._prof = self._prof, None
            prof.__exit__(None, None, None)
            allocs, marks = _cpu_timeline(prof, with_owner=self.breakdown > 0)
            if not marks:
                raise RuntimeError(
                    "PeakMemory lost its profiler session (another torch.profiler session started and "
                    "ended inside the region); its figures are unknown"
                )
            self.windows = _cpu_windows(allocs, marks, self.baseline_bytes, self._global_total)
            if self.breakdown:
                self.window_owners = _peak_owners(allocs, marks, self._global_total, self.breakdown)
                self.peak_owners = self.window_owners[-1]
        self.baseline_bytes, self.peak_bytes, self.end_bytes = self.windows[-1]
        return False

    def __repr__(self) -> str:
        def mib(x):
            return "?" if x is None else f"{x / 2**20:.3f} MiB"

        return (
            f"PeakMemory({self.device}, peak {mib(self.peak_bytes)} above baseline "
            f"{mib(self.baseline_bytes)}, end {mib(self.end_bytes)})"
        )


class StepMemory(NamedTuple):
    """One training step's memory, in bytes relative to the live bytes just before the model was built.

    ``state_bytes``: live at the start of the measured step (params, optimizer state and whatever
    the FSDP runtime keeps between steps); ``fwd_bwd_peak_bytes`` / ``optim_peak_bytes``: the peak
    during forward + backward / during ``optimizer.step()``; ``end_bytes``: live after the step's
    ``zero_grad``. A peak minus ``state_bytes`` is the step's transient memory.
    ``fwd_bwd_peak_owners``: with ``breakdown > 0`` (CPU), the largest blocks live at the forward +
    backward peak and the ops that allocated them (see :class:`PeakMemory`).
    """

    state_bytes: int
    fwd_bwd_peak_bytes: int
    optim_peak_bytes: int
    end_bytes: int
    fwd_bwd_peak_owners: tuple = ()


def measure_train_step(
    build: Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer]],
    loss_fn: Callable[[torch.nn.Module], torch.Tensor],
    device: torch.device | str = "cpu",
    warmup_steps: int = 1,
    breakdown: int = 0,
) -> StepMemory:
    """Build a model and optimizer, train ``warmup_steps`` steps, then measure one step with
    :class:`PeakMemory`.

    ``build()`` returns ``(model, optimizer)`` and runs inside the measured region (the model's
    state counts from zero); ``loss_fn(model)`` runs forward and returns the scalar loss. A step is
    ``loss_fn(model).backward(); optimizer.step(); optimizer.zero_grad(set_to_none=True)``; warm-up
    steps create the optimizer state and anything the runtime builds lazily. Collective when
    ``build`` / ``loss_fn`` are (every rank of an FSDP model calls it); the numbers are this rank's.
    The model and optimizer are dropped before returning. Used by ``tests/dist/test_fsdp_memory.py``,
    ``tests/gpu/test_gpu_fsdp.py`` and ``benchmarks/memory_vs_torch.py``.

    Raises:
        ValueError: ``warmup_steps < 1``.
    """
    if warmup_steps < 1:
        raise ValueError(
            f"measure_train_step(warmup_steps={warmup_steps}): need >= 1 warm-up step so that the "
            "optimizer state exists before the measured step"
        )
    gc.collect()
    with PeakMemory(device, breakdown=breakdown) as m:
        model, opt = build()
        for _ in range(warmup_steps):
            loss_fn(model).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        gc.collect()
        m.reset()  # window 1: the measured forward + backward
        loss_fn(model).backward()
        m.reset()  # window 2: the optimizer step
        opt.step()
        m.reset()  # window 3: zero_grad
        opt.zero_grad(set_to_none=True)
        m.reset()  # window 4: dropping the model
        del model, opt
    build_w, fb, st, zg, _ = m.windows
    origin = build_w.baseline_bytes
    return StepMemory(
        state_bytes=fb.baseline_bytes - origin,
        fwd_bwd_peak_bytes=fb.baseline_bytes + fb.peak_bytes - origin,
        optim_peak_bytes=st.baseline_bytes + st.peak_bytes - origin,
        end_bytes=zg.end_bytes - origin,
        fwd_bwd_peak_owners=tuple(m.window_owners[1]) if m.window_owners else (),
    )
