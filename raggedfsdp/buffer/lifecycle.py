"""The buffer lifecycle of one FSDP unit: gather params, free params, begin grads, reduce grads.

``UnitBuffers`` owns the unit's DBuffers (Note [DBuffer roles] in ``dbuffer.py``) and is the only
code that allocates or frees them during a step; ``raggedfsdp/fsdp`` decides *when* (hooks) and
keeps the records of in-flight work. Transitions (all local except where a collective is named):

    gather_params   sharded --all-gather--> unsharded params      (allocates ``params``)
    free_params     unsharded params --> freed                    (reshard; in post-backward before the
                    grad buffer is allocated, Note [grad fold] in fsdp/_grads.py)
    begin_grads     allocate + zero the unsharded grads           (views pre-set only for a no-sync window or a user .grad)
    fold_grads      autograd's per-parameter grads --> the flat buffer, once per backward (post-backward,
                    after the unit's params are freed and the oldest reduce-scatter input; Note [grad fold]
                    in fsdp/_grads.py)
    hold_grads      no-sync backward: fold the grads into the ``reduce_dtype`` accumulator, free them
    reduce_grads    unsharded grads --reduce-scatter--> ``(S,)`` output (the input stays alive until
                    the returned handle is waited; the caller then frees it)

Gradient layout: the grad roles (``grads``, ``acc``, the reduce-scatter input/output, ``sharded_grads``)
are laid out by ``grad_layout``: the parameter layout itself while every tensor of the unit has gradient
storage, or a :class:`~raggedfsdp.planner.GradLayout` (only the trainable tensors' pieces, compacted per
rank) after :meth:`UnitBuffers.set_grad_members` named a subset -- frozen parameters then hold no
gradient storage (Note [frozen parameters] in ``raggedfsdp/fsdp/_grads.py``). A segmented parameter
layout (a unit planned with its trainable tensors in their own segment, Note [segmented layout] in
``raggedfsdp/planner/layout.py``) is not rank-major, so its grad roles always use a ``GradLayout``
(of every tensor when all are members).

Every buffer is allocated on the current (compute) stream; collectives are issued from the stream
passed in, which first waits on the compute stream (Note [stream invariant] in ``streams.py``).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence

import torch
import torch.distributed as dist

from raggedfsdp._release import handoff, hold_until_released, use_count
from raggedfsdp.buffer.dbuffer import DBuffer
from raggedfsdp.buffer.streams import CommHandle, current_stream, debug_enabled, on_stream, wait_stream
from raggedfsdp.planner import GradLayout, Layout, plan_grad_layout


class UnitBuffers:
    """The flat buffers of one FSDP unit.

    Args:
        layout: the unit's plan; ``S = layout.shard_size`` and ``m * S = layout.total_size`` elements.
        rank: this rank's index in the shard group.
        shapes: global shapes of the unit's tensors (layout order).
        orig_dtype / param_dtype / reduce_dtype: of the sharded master + sharded grads, of the unsharded
            params + grads, of the reduce-scatter.
        device: compute device (unsharded buffers). storage_device: sharded buffers (CPU for offload).
        pin: pin the CPU sharded buffers (offload with an accelerator).
    """

    def __init__(
        self,
        layout: Layout,
        *,
        rank: int,
        shapes: Sequence[torch.Size],
        orig_dtype: torch.dtype,
        param_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        device: torch.device,
        storage_device: torch.device,
        pin: bool = False,
    ):
        self.layout, self.rank, self.shapes = layout, rank, list(map(torch.Size, shapes))  # shared, read only
        self.orig_dtype, self.param_dtype, self.reduce_dtype = orig_dtype, param_dtype, reduce_dtype
        self.device, self.storage_device, self.pin = device, storage_device, pin
        self.sharded = DBuffer(
            layout,
            sharded=True,
            rank=rank,
            dtype=orig_dtype,
            device=storage_device,
            shapes=self.shapes,
            pin_memory=pin,
            name="sharded params",
        )
        self.params = self._unsharded(param_dtype, "unsharded params", layout=layout)
        self.grad_layout: Layout | GradLayout = layout  # see the module docstring
        self._grad_layouts: dict[tuple[int, ...], GradLayout] = {}  # cached per member set
        self.param_layout_grads = self._unsharded(param_dtype, "unsharded grads")  # the views' buffer
        self.grads = self.param_layout_grads
        self.acc: DBuffer | None = (
            None  # reduce_dtype no-sync accumulator (FSDP2: unsharded_accumulated_grad)
        )
        self.sharded_grads: DBuffer | None = None
        if not layout.rank_major:  # a segmented layout: the grad roles are always compacted
            self.set_grad_members(tuple(range(len(self.shapes))))

    def _unsharded(self, dtype: torch.dtype, name: str, allocate: bool = False, layout=None) -> DBuffer:
        return DBuffer(
            layout or self.grad_layout,
            sharded=False,
            rank=self.rank,
            dtype=dtype,
            device=self.device,
            shapes=self.shapes,
            allocate=allocate,
            name=name,
        )

    # ---- gradient layout ---------------------------------------------------------------------
    @property
    def compact_grads(self) -> bool:
        """True while the grad roles use a compacted :class:`GradLayout` (some tensors have no slot)."""
        return self.grad_layout is not self.layout

    def set_grad_members(self, members: tuple[int, ...] | None):
        """Lay the grad roles out for ``members`` (tensor indices with gradient storage; ``None``: all, the
        parameter layout). Allocated unsharded grads / accumulator / sharded grads are moved into the new
        layout (values of tensors in both layouts kept, new slots zero); the old sharded grad DBuffer is
        dropped here, so the caller re-points any ``.grad`` views of it. Returns the previous layout if
        it changed (for :meth:`relayout_sharded`), else ``None``. Local (one copy per piece, only when the
        member set changes)."""
        if members is not None and len(members) == len(self.shapes):
            members = None
        if members is None and not self.layout.rank_major:
            # a segmented parameter layout is not rank-major: it cannot be reduce-scattered as one
            # buffer, so its grad roles always use the (rank-major) GradLayout, here of every tensor
            members = tuple(range(len(self.shapes)))
        if members is None:
            new = self.layout
        else:
            new = self._grad_layouts.get(members)
            if new is None:
                new = self._grad_layouts[members] = plan_grad_layout(self.layout, members)
        if new is self.grad_layout:
            return None
        old, old_grads, old_acc, old_sg = self.grad_layout, self.grads, self.acc, self.sharded_grads
        self.grad_layout = new
        self.grads = (
            self.param_layout_grads
            if new is self.layout
            else self._unsharded(self.param_dtype, "unsharded grads")
        )
        self.acc, self.sharded_grads = None, None
        if old_grads.is_allocated:
            self.begin_grads()
            _move_pieces(old, new, old_grads.data, self.grads.data, sharded=False, rank=self.rank)
            old_grads.free()
        if old_acc is not None and old_acc.is_allocated:
            self.acc = self._unsharded(self.reduce_dtype, "reduce_dtype accumulated grads", allocate=True)
            self.acc.zero_()
            _move_pieces(old, new, old_acc.data, self.acc.data, sharded=False, rank=self.rank)
            old_acc.free()
        if old_sg is not None and old_sg.is_allocated and old_sg.data.device.type != "meta":
            _move_pieces(old, new, old_sg.data, self.sharded_grad_buffer().data, sharded=True, rank=self.rank)
        return old

    def relayout_sharded(self, t: torch.Tensor, old) -> torch.Tensor:
        """A ``(Sg,)`` tensor laid out by ``old`` (e.g. HSDP's deferred partial reduction) moved into the
        current grad layout (new slots zero). Local."""
        out = torch.zeros(self.grad_layout.shard_size, dtype=t.dtype, device=t.device)
        _move_pieces(old, self.grad_layout, t, out, sharded=True, rank=self.rank)
        return out

    def fold_grads(self, grads: Sequence[tuple[int, torch.Tensor]]) -> None:
        """Fold autograd's unsharded gradients into the unit's flat grads (Note [grad fold] in
        ``raggedfsdp/fsdp/_grads.py``). ``grads``: ``(tensor index, grad)`` pairs, each grad in
        ``param_dtype`` with its tensor's global shape. Target: the allocated unsharded grads if they
        are (a no-sync window holding them: add); else the ``reduce_dtype`` accumulator when
        ``reduce_dtype != param_dtype`` (cast while copying, as FSDP2's ``chunk_cat`` into its
        reduce-scatter input; added to when it holds a no-sync window's sum); else the unsharded grads.
        A target allocated here is zero-filled (padding, params without a gradient) and written by
        copy. One ``torch._foreach_copy_`` / ``_foreach_add_`` for the whole unit (one multi-tensor
        kernel on CUDA). Local."""
        if not grads:
            return
        if self.grads.is_allocated:
            into, fresh = self.grads, False
        elif self.reduce_dtype != self.param_dtype:
            if self.acc is None:
                self.acc = self._unsharded(self.reduce_dtype, "reduce_dtype accumulated grads")
            into = self.acc
            fresh = into.alloc()
            if fresh:
                into.zero_()
        else:
            into = self.grads
            fresh = into.alloc()  # zero-filled below: only what the copy leaves
        compact = self.compact_grads
        idx, gs = map(list, zip(*grads))
        if not all(map(operator.is_, map(_LAYOUT, gs), itertools.repeat(torch.strided))):
            gs = [g if g.layout is torch.strided else g.to_dense() for g in gs]  # nn.Embedding(sparse=True)
        shapes = list(map(self.shapes.__getitem__, idx))
        if not compact and list(map(_SHAPE, gs)) == shapes:
            # the per-step case: each grad straight into its tensor-shaped view, the loops in C (no
            # per-tensor reshape in Python)
            dsts, srcs = list(map(self._shaped_views(into).__getitem__, idx)), gs
        elif not compact:
            flats = list(map(torch.Tensor.reshape, gs, itertools.repeat(-1)))
            dsts, srcs = list(map(self._flat_views(into).__getitem__, idx)), flats
        else:
            dsts, srcs = [], []
            for i, g in zip(idx, gs):
                flat = g.reshape(-1)
                for a, b, off in self.grad_layout.segments(i):
                    dsts.append(into.data.narrow(0, off, b - a))
                    srcs.append(flat[a:b])
        with torch.no_grad():
            if fresh:
                if into is self.grads:  # a fresh unsharded grad buffer: zero what the copy does not write
                    covered = not compact and len(grads) == len(self.layout.numels)
                    if covered:  # every tensor: only the padding between them (Note [grad fold])
                        gaps = self._gap_views(into)
                        if gaps:
                            torch._foreach_zero_(gaps)
                    else:
                        into.zero_()
                torch._foreach_copy_(dsts, srcs)
            else:
                torch._foreach_add_(dsts, srcs)

    def _flat_views(self, buf: DBuffer) -> list[torch.Tensor]:
        """Tensor ``i``'s flat ``(numel,)`` view of the unsharded ``buf`` (parameter layout), cached per
        buffer: views of a freed storage stay valid when it is re-allocated (Note [DBuffer roles]), so the
        per-parameter ``narrow`` runs once, not at every fold."""
        cache = getattr(buf, "_flat_views", None)
        if cache is None or cache[0] is not buf.data:
            lay = self.layout
            cache = (buf.data, [buf.data.narrow(0, o, n) for o, n in zip(lay.offsets, lay.numels)])
            buf._flat_views = cache
        return cache[1]

    def _shaped_views(self, buf: DBuffer) -> list[torch.Tensor]:
        """Tensor ``i``'s view of the unsharded ``buf`` (parameter layout) in its own shape, cached like
        :meth:`_flat_views`."""
        cache = getattr(buf, "_shaped_views", None)
        if cache is None or cache[0] is not buf.data:
            cache = (buf.data, list(map(torch.Tensor.view, self._flat_views(buf), self.shapes)))
            buf._shaped_views = cache
        return cache[1]

    def _gap_views(self, buf: DBuffer) -> list[torch.Tensor]:
        """Views of the unsharded ``buf`` (parameter layout) that no tensor covers: the padding between
        tensors and at the end of each rank's range (zero in every buffer, Note [DBuffer roles]); cached
        like :meth:`_flat_views`."""
        cache = getattr(buf, "_gap_views", None)
        if cache is None or cache[0] is not buf.data:
            lay, gaps, pos = self.layout, [], 0
            for o, n in sorted(zip(lay.offsets, lay.numels)):
                if o > pos:
                    gaps.append(buf.data.narrow(0, pos, o - pos))
                pos = max(pos, o + n)
            if lay.total_size > pos:
                gaps.append(buf.data.narrow(0, pos, lay.total_size - pos))
            cache = (buf.data, gaps)
            buf._gap_views = cache
        return cache[1]

    def sharded_output(self, dtype: torch.dtype, name: str = "reduce-scatter output") -> DBuffer:
        """A fresh ``(Sg,)`` buffer (the grad layout's shard) on the compute device (zero-filled padding is
        not needed: it is written)."""
        return DBuffer(
            self.grad_layout,
            sharded=True,
            rank=self.rank,
            dtype=dtype,
            device=self.device,
            shapes=self.shapes,
            name=name,
        )

    def sharded_grad_buffer(self, zero: bool = True) -> DBuffer:
        """The persistent ``(Sg,)`` sharded grads (orig dtype, storage device), created (or re-grown)
        zeroed; ``zero=False``: a new or re-grown buffer is left unwritten (the caller overwrites all of
        it: a fresh reduce-scatter output, which after ``hand_off_sharded_grads`` is every step's case)."""
        if self.sharded_grads is None:
            self.sharded_grads = DBuffer(
                self.grad_layout,
                sharded=True,
                rank=self.rank,
                dtype=self.orig_dtype,
                device=self.storage_device,
                shapes=self.shapes,
                pin_memory=self.pin,
                name="sharded grads",
            )
            if zero:
                self.sharded_grads.zero_()
        elif self.sharded_grads.alloc() and zero:  # released by release_sharded_grads(): re-grown, zeroed
            self.sharded_grads.zero_()
        return self.sharded_grads

    def hand_off_sharded_grads(self) -> bool:
        """Drop this unit's reference to the sharded grad storage once ``.grad`` views of it are set, so
        that those views own it (as FSDP2's ``.grad`` tensors own theirs): ``optimizer.zero_grad(
        set_to_none=True)`` then frees it at once. The next reduce allocates a fresh zeroed buffer (and
        copies in any ``.grad`` still held, for accumulation). Pinned (offload) buffers are kept. Local.
        Returns True if handed off."""
        b = self.sharded_grads
        if b is None or self.pin or b.data.device.type == "meta" or not b.is_allocated:
            return False
        if debug_enabled():
            b.check_no_pending_use("hand off")
        self.sharded_grads = None
        return True

    def release_sharded_grads(self) -> bool:
        """Free the ``(S,)`` sharded grad storage while no ``.grad`` views it (after
        ``zero_grad(set_to_none=True)``), so that between steps and early in backward a unit holds no
        gradient memory -- as FSDP2, whose sharded grads are allocated per unit in backward. Views of
        it stay valid and are re-grown by :meth:`sharded_grad_buffer`. Pinned (offload) buffers are
        kept: re-pinning every step costs more than it saves. Local. Returns True if it freed."""
        b = self.sharded_grads
        if b is None or self.pin or b.data.device.type == "meta" or not b.is_allocated:
            return False
        b.free()
        return True

    # ---- params ----------------------------------------------------------------------------
    def gather_params(
        self, group, *, stream=None, source: torch.Tensor | None = None, source_group=None
    ) -> CommHandle:
        """Allocate the unsharded params and all-gather them from ``source`` (default: the sharded
        master) over ``source_group or group``, issued from ``stream``. Collective over that group."""
        compute = current_stream(self.device)
        self.params.alloc()
        wait_stream(stream, compute)  # the fresh block and the master are ready for the side stream
        with on_stream(stream), torch.no_grad():
            if source is None:
                work = self.params.all_gather_from(self.sharded.data, group, async_op=True)
            else:
                from raggedfsdp.buffer.dbuffer import _all_gather_single

                base = use_count(source)
                work = _all_gather_single(
                    *handoff(self.params.data, source), group=source_group, async_op=True
                )
                hold_until_released(source, base)  # Note [gloo release]
        return CommHandle(work, [self.params], stream, "all-gather")

    def free_params(self) -> None:
        """Free the unsharded params. Local."""
        self.params.free()

    # ---- grads -----------------------------------------------------------------------------
    def begin_grads(self) -> bool:
        """Allocate the unsharded grads zero-filled if they are freed; True if they were. Local."""
        fresh = self.grads.alloc()
        if fresh:
            self.grads.zero_()
        return fresh

    def hold_grads(self) -> None:
        """No-sync backward with ``reduce_dtype != param_dtype``: add the unsharded grads into the
        ``reduce_dtype`` accumulator (one fused cast-add) and free them (FSDP2 semantics). Local."""
        if self.acc is None:
            self.acc = self._unsharded(self.reduce_dtype, "reduce_dtype accumulated grads")
        if self.acc.alloc():
            self.acc.data.copy_(self.grads.data)
        else:
            self.acc.data.add_(self.grads.data)
        self.grads.free()

    def has_grads(self) -> bool:
        return self.grads.is_allocated or (self.acc is not None and self.acc.is_allocated)

    def storages(self) -> list[torch.Tensor]:
        """The flat storages this unit holds, as 1-D tensors (each role's ``DBuffer.data``): the sharded
        params ``(S,)``, the unsharded params and grads ``(m*S,)`` (the parameter-layout grad buffer and,
        when gradients are compacted, the compacted one), the no-sync accumulator and the sharded grads
        ``(S,)`` -- those that exist. A freed buffer (``resize_(0)``) is listed with 0 bytes of storage.
        Local, no collective; what a measurer counts as the runtime's own memory (``bench/measure.py``)."""
        bufs = (self.sharded, self.params, self.param_layout_grads, self.grads, self.acc, self.sharded_grads)
        out, seen = [], set()
        for b in bufs:
            if b is not None and id(b) not in seen:
                seen.add(id(b))
                out.append(b.data)
        return out

    def free_grads(self) -> None:
        self.grads.free()
        if self.acc is not None:
            self.acc.free()

    def reduce_grads(
        self, group, *, out: DBuffer, op=dist.ReduceOp.SUM, stream=None
    ) -> tuple[CommHandle, DBuffer]:
        """Reduce-scatter the unit's unsharded grads (cast to ``reduce_dtype``) into ``out`` ``(S,)``,
        issued from ``stream``. Collective over ``group``.

        Returns ``(handle, input)``: ``input`` (the grads, the accumulator or a ``reduce_dtype`` copy
        made on the compute stream, after which the ``param_dtype`` grads are freed at once) must stay
        allocated until ``handle`` is waited on the compute stream; then free it.
        """
        if self.acc is not None and self.acc.is_allocated:
            inp = self.acc
            if self.grads.is_allocated:
                inp.data.add_(self.grads.data)
                self.grads.free()
        elif self.reduce_dtype != self.grads.data.dtype and self.grad_layout.world_size > 1:
            inp = self._unsharded(self.reduce_dtype, "reduce-scatter input", allocate=True)
            inp.data.copy_(self.grads.data)  # one fused cast of the whole unit
            self.grads.free()  # read only by the compute stream so far
        else:
            inp = self.grads
        if self.grad_layout.world_size == 1:
            # One rank: the "reduce-scatter" is a local (casting) copy into ``out`` (no temporary). It runs
            # on the compute stream, so the handle is complete at once and the input is freed at the next
            # poll, before the next unit's backward allocates (on a side stream the host could not know it
            # done without waiting, and the input lived through that backward: +4 activations of peak on
            # the H200, tests/gpu). The copy is one unit-sized kernel, microseconds.
            out.data.copy_(inp.data)
            return CommHandle(None, [inp, out], None, "reduce-scatter"), inp
        wait_stream(stream, current_stream(self.device))
        with on_stream(stream):
            work = inp.reduce_scatter_(out.data, group, op=op, async_op=True)
        return CommHandle(work, [inp, out], stream, "reduce-scatter"), inp


def _move_pieces(old, new, src: torch.Tensor, dst: torch.Tensor, *, sharded: bool, rank: int) -> None:
    """Copy every piece of the tensors present in both grad layouts from ``src`` (laid out by ``old``) to
    ``dst`` (by ``new``): this rank's pieces for sharded buffers, every rank's for unsharded ones."""

    def members(lay):
        return set(lay.members) if isinstance(lay, GradLayout) else set(range(len(lay.numels)))

    base = new.base if isinstance(new, GradLayout) else new
    with torch.no_grad():
        for i in sorted(members(old) & members(new)):
            for r in [rank] if sharded else range(base.world_size):
                a, b = base.piece(i, r)
                if b == a:
                    continue
                so, do = old.shard_offset(i, r), new.shard_offset(i, r)
                if not sharded:
                    so, do = so + r * old.shard_size, do + r * new.shard_size
                dst.narrow(0, do, b - a).copy_(src.narrow(0, so, b - a))


def all_reduce_(buf: DBuffer, group, *, op=dist.ReduceOp.SUM, stream=None) -> CommHandle:
    """All-reduce ``buf`` in place over ``group`` (HSDP replicate dim), issued from ``stream``. Collective."""
    wait_stream(stream, current_stream(buf.data.device))
    with on_stream(stream):
        work = dist.all_reduce(handoff(buf.data), op=op, group=group, async_op=True)  # Note [gloo release]
    return CommHandle(work, [buf], stream, "all-reduce")


_LAYOUT = operator.attrgetter("layout")
_SHAPE = operator.attrgetter("shape")

__all__ = ["UnitBuffers", "all_reduce_"]
