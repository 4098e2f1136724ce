"""DBuffer: one FSDP unit's flat storage for one role (veScale-FSDP paper, section 3).

Note [DBuffer roles]
    Per FSDP unit the runtime keeps up to four DBuffers laid out by one planner ``Layout``
    (``m`` ranks, shard size ``S`` elements):

    * sharded params   ``(S,)``   original dtype, persistent master copy; each optimizer-facing
      parameter is a RaggedShard DTensor whose local tensor is a 1-D *view* into it;
    * unsharded params ``(m*S,)`` ``param_dtype``; filled by one in-place all-gather whose input is
      the sharded buffer (or, with ``param_dtype`` set, this rank's slice after one fused cast); the
      module's unsharded parameters are views ``[offset, offset+numel)``; freed after use by
      resizing the storage to 0 (the views and autograd's saved aliases stay valid);
    * unsharded grads  ``(m*S,)`` ``param_dtype`` (or ``reduce_dtype``); allocated in the unit's
      post-backward, after autograd computed each parameter's gradient as its own tensor: the grad
      fold copies them in with one multi-tensor copy (Note [grad fold] in ``raggedfsdp/fsdp/_grads.py``;
      views are pre-set as ``.grad`` only inside a no-sync window), then it is reduce-scattered in place;
    * sharded grads    ``(S,)``   original dtype, persistent; the optimizer-facing ``.grad``
      DTensors are views into it.

    Every collective is even-sized (``S`` elements per rank), so it runs as one
    ``all_gather_single`` / ``reduce_scatter_single`` on gloo and NCCL alike, with no copy-in or
    copy-out. Padding lies only between tensors (planner guarantee) and is kept at zero. A unit
    that mixes frozen and trainable params has a *segmented* parameter layout (Note [segmented
    layout] in ``raggedfsdp/planner/layout.py``): its params are all-gathered one segment at a time
    (still in place, even-sized), and its grad roles always use the rank-major ``GradLayout``.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence

import torch
import torch.distributed as dist

from raggedfsdp._release import handoff, hold_until_released, use_count
from raggedfsdp.buffer.streams import (
    BufferLifetimeError,
    current_stream,
    debug_enabled,
    stream_key,
    stream_model,
)
from raggedfsdp.planner import Layout

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def free_storage(t: torch.Tensor) -> None:
    """Release ``t``'s storage (all views of it keep their metadata). Not collective."""
    st = t.untyped_storage()
    if st.size() != 0:
        st.resize_(0)


def alloc_storage(t: torch.Tensor) -> bool:
    """Re-allocate ``t``'s storage to its full size; returns True if it had been freed. Not collective."""
    st = t.untyped_storage()
    nbytes = t.numel() * t.element_size()
    if st.size() != nbytes:
        st.resize_(nbytes)
        return True
    return False


class DBuffer:
    """A flat 1-D buffer laid out by a planner :class:`Layout`: either one rank's shard or the global buffer.

    Args:
        layout: the unit's plan (sizes in elements).
        sharded: ``True`` for a rank-local ``(S,)`` shard, ``False`` for the global ``(m*S,)`` buffer.
        rank: this rank's index on the shard mesh dim.
        dtype, device: of the storage.
        shapes: per-tensor global shapes (same order as ``layout.numels``); a list of ``torch.Size`` is
            kept as given (shared, never mutated here: callers must not mutate it either).
        allocate: allocate storage now (``False`` creates it freed; call :meth:`alloc`).
        pin_memory: pin a CPU buffer (CPU offload with an accelerator compute device).

    Collective methods (``all_gather_from``, ``reduce_scatter_``, ``all_reduce_``) must be called by
    every rank of the given process group in the same order; all others are local.
    """

    def __init__(
        self,
        layout: Layout,
        *,
        sharded: bool,
        rank: int,
        dtype: torch.dtype,
        device: torch.device,
        shapes: Sequence[torch.Size],
        allocate: bool = True,
        pin_memory: bool = False,
        name: str = "buffer",
    ):
        self.name = name
        self.layout = layout
        self.sharded = sharded
        self.rank = rank
        if type(shapes) is list and all(map(operator.is_, map(type, shapes), itertools.repeat(torch.Size))):
            # shared, read only: a buffer made every step (the sharded grads after their hand-off) makes
            # no new Size objects, which would outlive the step into the GC's oldest generation
            self.shapes = shapes
        else:
            self.shapes = list(map(torch.Size, shapes))
        numel = layout.shard_size if sharded else layout.total_size
        self.data = torch.empty(numel, dtype=dtype, device=device, pin_memory=pin_memory)  # 1D flat
        self.alloc_stream_key = stream_key(current_stream(self.data.device))
        self._uses: dict[int, tuple[object, set]] = {}  # debug mode: handle id -> (handle, waited streams)
        if not allocate and device.type != "meta":
            free_storage(self.data)

    # ---- memory -------------------------------------------------------------------------
    @property
    def is_allocated(self) -> bool:
        return self.data.untyped_storage().size() == self.data.numel() * self.data.element_size()

    def alloc(self, zero: bool = False) -> bool:
        """Allocate the storage if freed (optionally zero-filled); returns True if it was (re)allocated."""
        fresh = alloc_storage(self.data)
        if fresh:
            self.alloc_stream_key = stream_key(current_stream(self.data.device))
            self._uses.clear()
        if fresh and zero:
            self.data.zero_()
        return fresh

    def free(self) -> None:
        """Release the storage. In debug mode raises :class:`BufferLifetimeError` if a collective that
        used it was not waited on the stream that allocated it (Note [stream invariant]). Local."""
        if debug_enabled() and self.is_allocated:
            self.check_no_pending_use("free")
        self._uses.clear()
        free_storage(self.data)

    # ---- debug-mode lifetime tracking (see raggedfsdp/buffer/streams.py) ------------------
    def _note_use(self, handle) -> None:
        if debug_enabled():
            self._uses[handle.id] = (handle, set())

    def _note_waited(self, handle, key) -> None:
        entry = self._uses.get(handle.id)
        if entry is not None:
            entry[1].add(key)

    def check_no_pending_use(self, action: str) -> None:
        """Raise if a collective using this buffer was not waited on its allocating stream."""
        model = stream_model()
        for handle, waited in self._uses.values():
            if model is not None:  # Note [fake streams]: the recorded happens-before graph decides
                model.check_free(self, handle, action)
            if self.alloc_stream_key not in waited:
                raise BufferLifetimeError(
                    f"raggedfsdp: {action} of the {self.name} buffer ({self.data.numel()} x "
                    f"{self.data.dtype}) while {handle.what} #{handle.id} that uses it was not waited on the "
                    f"stream that allocated it (waited on: {sorted(map(str, waited)) or 'none'}); this is a "
                    "runtime bug, please report it"
                )

    # ---- views ---------------------------------------------------------------------------
    def tensor_view(self, i: int) -> torch.Tensor:
        """Global buffer only: tensor ``i`` as a contiguous view of its global shape."""
        assert not self.sharded
        off, n = self.layout.offsets[i], self.layout.numels[i]
        return self.data.narrow(0, off, n).view(self.shapes[i])

    def local_view(self, i: int) -> torch.Tensor:
        """Sharded buffer only: this rank's 1-D piece of tensor ``i`` (possibly empty)."""
        assert self.sharded
        a, b = self.layout.piece(i, self.rank)
        return self.data.narrow(0, self.layout.shard_offset(i, self.rank), b - a)

    def rank_slice(self) -> torch.Tensor:
        """Global buffer only: this rank's ``(S,)`` slice ``[rank*S, (rank+1)*S)`` (a rank-major layout)."""
        assert not self.sharded and getattr(self.layout, "rank_major", True)
        S = self.layout.shard_size
        return self.data.narrow(0, self.rank * S, S)

    # ---- group-wide fused ops (one kernel for the whole unit) ----------------------------
    def zero_(self) -> DBuffer:
        self.data.zero_()
        return self

    # ---- collectives (in place, even-sized) ------------------------------------------------
    def all_gather_from(self, shard: torch.Tensor, group, async_op: bool = False):
        """Fill this global buffer from every rank's ``(S,)`` ``shard``. Collective over ``group``.

        Same dtype: ``shard`` is the all-gather input directly (no copy-in). Other dtype: one fused cast
        into this rank's slice, then an in-place all-gather with that slice as input. A segmented layout
        (Note [segmented layout] in ``raggedfsdp/planner/layout.py``) runs one such all-gather per segment
        (segment ``s``'s ``(S_s,)`` piece of every shard into its ``m * S_s`` range); the returned work
        waits for all of them.
        """
        assert not self.sharded and shard.numel() == self.layout.shard_size
        if not getattr(self.layout, "rank_major", True) and self.layout.world_size > 1:
            return self._all_gather_segments(shard, group, async_op)
        if shard.dtype == self.data.dtype and shard.device == self.data.device:
            inp = shard
        else:  # one fused cast (and/or H2D copy for CPU offload) into this rank's slice
            inp = self.rank_slice()
            # non_blocking even from pageable memory, as FSDP2: the driver stages it without the stream
            # synchronize a blocking H2D copy costs (at every unshard, after all queued compute)
            inp.copy_(shard, non_blocking=True)
        if self.layout.world_size == 1:
            if inp.data_ptr() != self.data.data_ptr():
                self.data.copy_(inp)
            return None
        base = use_count(inp)
        work = _all_gather_single(*handoff(self.data, inp), group=group, async_op=async_op)
        hold_until_released(inp, base)  # a cast slice dies here (Note [gloo release])
        return work

    def _all_gather_segments(self, shard: torch.Tensor, group, async_op: bool):
        """:meth:`all_gather_from` for a segmented layout: one in-place all-gather per segment."""
        m, works = self.layout.world_size, []
        same = shard.dtype == self.data.dtype and shard.device == self.data.device
        for g0, s, p0 in self.layout.segment_spans:
            out = self.data.narrow(0, g0, m * s)
            if same:
                inp = shard.narrow(0, p0, s)
            else:  # the fused cast into this rank's slice of the segment, as above
                inp = out.narrow(0, self.rank * s, s)
                inp.copy_(shard.narrow(0, p0, s), non_blocking=True)
            bases = use_count(out), use_count(inp)
            works.append(_all_gather_single(*handoff(out, inp), group=group, async_op=async_op))
            hold_until_released(out, bases[0])  # short-lived views (Note [gloo release])
            hold_until_released(inp, bases[1])
        return _Works(works) if async_op else None

    def reduce_scatter_(self, out: torch.Tensor | None, group, op=dist.ReduceOp.SUM, async_op: bool = False):
        """Reduce this global ``(m*S,)`` buffer over ``group`` into ``out`` (``(S,)``, same dtype) or, if
        ``None``, in place into :meth:`rank_slice`. Collective over ``group``: one
        ``reduce_scatter_single`` (``reduce_scatter_tensor`` on torch 2.11) with ``op`` as given, the
        same call on every backend (gloo supports it for even sizes, ``SUM`` and ``AVG``, fp32 / bf16 /
        fp16). World size 1: a local copy, no collective.
        """
        assert not self.sharded
        if out is None:
            out = self.rank_slice()
        if self.layout.world_size == 1:
            if out.data_ptr() != self.data.data_ptr():
                out.copy_(self.data)
            return None
        base = use_count(out)
        work = _reduce_scatter_single(*handoff(out, self.data), op=op, group=group, async_op=async_op)
        hold_until_released(out, base)  # Note [gloo release]
        return work


class _Works:
    """The works of one logical collective issued as several (a segmented all-gather): ``wait()`` waits
    each in issue order, ``is_completed()`` is True when all are. Behaves like ``dist.Work`` for both."""

    def __init__(self, works):
        self._works = [w for w in works if w is not None]

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def wait(self, timeout=None) -> bool:
        for w in self._works:
            w.wait()
        self._works = []  # gloo's works own clones of their inputs: drop them once waited
        return True


__all__ = ["DBuffer", "alloc_storage", "free_storage"]
