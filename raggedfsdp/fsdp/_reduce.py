"""The gradient reduction path: launch, a typed record of each in-flight reduction, the root's
bounded FIFO of them, and the lazy install of sharded grads.

Note [bounded gradient memory]
    Every unit under one root shares one :class:`ReduceQueue` (FSDP2: ``comm_ctx.reduce_scatter_states``,
    ``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py: post_backward``). Before a unit launches
    its reduce-scatter, the oldest in-flight reductions are completed until fewer than
    ``max_inflight`` (K, default 1, ``FSDPModule.set_reduce_scatter_max_input_buffers``) remain, so at
    most K reduce-scatter inputs are alive at once, plus the unsharded grads autograd is filling for the
    next unit: K + 1 unsharded grad buffers at any time of backward.

    Post-processing is split in two:

    * eager -- :meth:`PendingReduce.complete_reduce_scatter`: wait the reduce-scatter (on CUDA a stream
      wait, no host sync), free its unsharded input at once, then either launch the HSDP all-reduce of the
      ``(S,)`` output (async, on the all-reduce stream) or install the values: divide and copy/add into the
      sharded grad buffer (for CPU offload: a non-blocking D2H copy into pinned memory with an event).
    * lazy -- :meth:`ReduceQueue.finish_backward` (root's final callback): wait what is left, exchange the
      used-parameter flags of every unit in **one** small all-reduce per mesh, check that every rank ran
      the same units (Note [unit agreement] in ``_agreement.py``), and set the sharded params' ``.grad``.

Note [early free]
    K bounds the reduce-scatter inputs alive when communication is slow. When it keeps up, an input
    need not live until the next unit's post-backward (where FSDP2 releases it): up to 8 gradients of
    each unit, spread over its params (the tensor pre-hook ``UnitGrads.on_grad``, Note [grad hooks] in
    ``_grads.py``), and every pre-backward call :meth:`ReduceQueue.poll`,
    which completes, oldest first, the in-flight reduce-scatters whose work already reports
    ``is_completed()`` (a non-blocking query; on CUDA an event query, no host sync) and frees their
    inputs then. So while unit i's gradients are computed, unit i+1's reduce-scatter input is alive
    only until that collective has finished; at the backward peak (all of unit i's gradients alive)
    it is usually gone, one unit-sized buffer less than FSDP2. The order of collectives is unchanged:
    a record whose completion would issue a collective (HSDP's replicate all-reduce) is left to
    ``make_room`` / ``drain``, which run at the same points on every rank. ``RuntimeOptions.early_free =
    False``
    turns polling off (the worst case: what a network slower than the backward gives). The reduce-scatter
    is settled when issued (below), so on CPU it reports completion at once. The memory tests fix what
    collectives report (``tests/_memory.py: comm_completion``) rather than trust the backend or the
    fake process group, whose works report not completed on torch 2.11-2.14 and completed on 2.15.

Note [settled reduce-scatter]
    torch's FSDP2 issues its reduce-scatter synchronously on the reduce-scatter stream
    (``async_op=False`` in ``_fsdp_collectives.py: foreach_reduce``) and keeps only its input and an
    event until the next unit's post-backward. We do the same: :func:`launch_reduce` issues it async and
    at once waits it on the stream it was issued from (:meth:`CommHandle.settle`). On NCCL that is a
    stream wait (the host does not block; :meth:`CommHandle.is_done` queries an event recorded after
    it). On gloo the host blocks until the collective is done, and that wait is what releases the
    scratch clone of the input that gloo's reduce-scatter makes (``aten::clone <
    c10d::_reduce_scatter_base_``) and holds until ``wait()``; its work reports ``is_completed()``
    only after ``wait()``. Left async, the clone and the input lived through the next unit's backward
    (+1 unit at the fwd+bwd peak on gloo, 1.05-1.10x FSDP2's; ``benchmarks/README.md``, "Settled
    reduce-scatter"). The price on gloo is no overlap of the reduce-scatter with the next unit's
    backward on the host, which FSDP2 on gloo does not have either.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from raggedfsdp.buffer import CommHandle, DBuffer, all_reduce_
from raggedfsdp.buffer.streams import on_stream
from raggedfsdp.buffer.wire_reduce import reduce_scatter_wire
from raggedfsdp.fsdp._agreement import Agreement
from raggedfsdp.fsdp._common import GradState, RuntimeOptions, check, labelled
from raggedfsdp.fsdp._loops import unique_by_id

if TYPE_CHECKING:
    from raggedfsdp.fsdp._param_group import FSDPParamGroup


class ReduceStage(enum.Enum):
    REDUCE_SCATTER = "reduce-scatter in flight"  # the unsharded input is alive
    ALL_REDUCE = "all-reduce in flight"  # HSDP: replicate-dim all-reduce of the (S,) output
    INSTALLED = "installed"  # values in the sharded grad buffer; .grad set at the end of backward
    DEFERRED = "deferred"  # HSDP set_requires_all_reduce(False): kept as the group's partial sum


@dataclass
class PendingReduce:
    """One unit's gradient reduction from launch to install.

    ``out`` is ``(S,)`` elements in ``reduce_dtype``: the sharded grad buffer itself (``direct``: fresh
    grads, AVG, same dtype and device) or a temporary. ``flags`` are this rank's used-parameter bits of
    the unit's trainable params (host-side, OR-ed over no-sync micro-batches).
    """

    group: FSDPParamGroup
    rs: CommHandle
    rs_input: DBuffer  # unsharded, freed when the reduce-scatter is waited
    out: DBuffer
    direct: bool
    fresh: bool
    post_divide: float | None  # None: AVG already divided
    flags: tuple[bool, ...]
    params: tuple = ()  # the trainable FSDPParams the flags belong to (requires_grad may change later)
    stage: ReduceStage = ReduceStage.REDUCE_SCATTER
    ar: CommHandle | None = None
    offload_event: object | None = None  # CUDA event of the D2H copy (CPU offload)
    host_out: torch.Tensor | None = None  # pinned D2H copy to add on the host (offload, accumulating)
    attach: bool = True

    # ---- eager part ---------------------------------------------------------------------------
    def complete_reduce_scatter(self, queue: ReduceQueue) -> None:
        """Wait the reduce-scatter, free its input, then launch the HSDP all-reduce or install. Local
        except for the HSDP all-reduce (collective over the replicate group)."""
        check(self.stage is ReduceStage.REDUCE_SCATTER, f"complete_reduce_scatter in stage {self.stage}")
        g = self.group
        compute = g.compute_stream()
        self.rs.wait(queue.rs_stream)  # the side stream, then the compute stream, are ordered after it
        hsdp = g.is_hsdp and g.replicate_world > 1
        if not hsdp:  # post-reduce work (divide, copy/add into the sharded grads) on the RS stream, as FSDP2;
            # a local copy issued on the compute stream (world size 1, lifecycle.reduce_grads: no side
            # stream on its handle) is installed on the compute stream too, which alone is ordered after it
            local = self.rs.work is None and self.rs.stream is None
            with on_stream(compute if local else queue.rs_stream):
                self._install_values(free_out=False)
        self.rs.wait(compute)  # ... which the compute stream waits with the collective (CommHandle.wait)
        self.rs_input.free()
        g.grads.reduce_scattered()
        if not hsdp:
            if not self.direct:
                self.out.free()  # allocated on the compute stream, which now waited its last use
            return
        if not g.all_reduce_grads:  # set_requires_all_reduce(False): keep the shard-reduced sum
            g.grads.defer_partial(self.out.data, self.params, self.flags)
            self.out.free()
            self.stage, self.attach = ReduceStage.DEFERRED, False
            return
        partial = g.grads.take_partial()
        if partial is not None:
            self.out.data.add_(partial)
        queue.make_room_all_reduce()
        queue.agreement.note(g, "all-reduce")
        self.ar = all_reduce_(self.out, g.replicate_group, stream=queue.ar_stream)
        self.ar.context = queue.agreement.context(g)
        self.stage = ReduceStage.ALL_REDUCE
        queue.all_reduces.append(self)

    def complete_all_reduce(self, queue: ReduceQueue) -> None:
        check(self.stage is ReduceStage.ALL_REDUCE, f"complete_all_reduce in stage {self.stage}")
        self.ar.wait(queue.ar_stream)
        self.ar.wait(self.group.compute_stream())
        self._install_values()

    def _install_values(self, free_out: bool = True) -> None:
        """Divide and move the reduced shard into the sharded grad buffer, on the current stream (the
        reduce-scatter stream, or the compute stream after an HSDP all-reduce); ``free_out``: free the
        ``(S,)`` temporary here (only when the current stream is the one that allocated it)."""
        g = self.group
        out = self.out.data
        if g.all_reduce_hook is not None:  # FSDPModule.set_all_reduce_hook: FSDP2 runs it on the reduce
            _run_all_reduce_hook(g, out)  # output after the HSDP all-reduce, before the post-divide
        if self.post_divide is not None and self.post_divide != 1.0:
            out.div_(self.post_divide)
        if not self.direct:
            with labelled(f"raggedfsdp::install_grads ({g.unit_name})"):
                sg = g.bufs.sharded_grad_buffer().data
            if sg.device == out.device:
                sg.copy_(out) if self.fresh else sg.add_(out)
            elif out.device.type == "cpu" or not sg.is_pinned():
                # offload without pinned memory (or a CPU compute device): a blocking copy, then add
                sg.copy_(out) if self.fresh else sg.add_(out.to(sg.device, dtype=sg.dtype))
            else:  # CPU offload on an accelerator: non-blocking D2H into pinned memory, event
                if self.fresh:
                    sg.copy_(out, non_blocking=True)
                else:
                    self.host_out = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
                    self.host_out.copy_(out, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record()
                self.offload_event = ev
            if free_out:
                self.out.free()  # a temporary, allocated on the compute stream and used only there now
        self.stage = ReduceStage.INSTALLED

    # ---- lazy part ----------------------------------------------------------------------------
    def finish_host_side(self) -> None:
        """CPU offload on an accelerator: wait the D2H copy, add it on the host when accumulating."""
        if self.offload_event is not None:
            self.offload_event.synchronize()  # inherent to CPU offload: the CPU optimizer reads these
            self.offload_event = None
        if self.host_out is not None:
            self.group.bufs.sharded_grad_buffer().data.add_(self.host_out.to(self.group.orig_dtype))
            self.host_out = None

    def drop(self) -> None:
        """reset_iter_state: wait whatever is in flight and free the record's buffers, installing nothing."""
        for h in (self.rs, self.ar):
            if h is not None:
                h.wait(self.group.compute_stream())
        if self.offload_event is not None:
            self.offload_event.synchronize()
        self.rs_input.free()
        if not self.direct:
            self.out.free()
        self.host_out = None


@dataclass
class ReduceQueue:
    """The root-level FIFO of in-flight reductions (see Note [bounded gradient memory])."""

    max_inflight: int = 1
    inflight: deque = field(default_factory=deque)  # stage REDUCE_SCATTER, oldest first
    all_reduces: deque = field(default_factory=deque)  # stage ALL_REDUCE, oldest first (at most 1)
    installed: list = field(default_factory=list)  # INSTALLED/DEFERRED, awaiting finish_backward
    rs_stream: object = None
    ar_stream: object = None
    peak_inflight: int = 0  # observability: the most reduce-scatter inputs alive at once
    agreement: Agreement = field(default_factory=Agreement)  # Note [unit agreement]: notes every collective
    options: RuntimeOptions = field(default_factory=RuntimeOptions)

    @property
    def busy(self) -> bool:
        """A reduction of this backward is not finished (in flight or not yet attached)."""
        return bool(self.inflight or self.installed or self.all_reduces)

    def poll(self) -> None:
        """Complete, oldest first, the in-flight reductions that have already finished and issue no
        collective on completion, freeing their unsharded inputs now (Note [early free]). Local,
        non-blocking."""
        while self.options.early_free and self.inflight:
            rec = self.inflight[0]
            g = rec.group
            if (g.is_hsdp and g.replicate_world > 1 and g.all_reduce_grads) or not rec.rs.is_done():
                return
            self._complete_oldest()

    def make_room(self) -> None:
        """Complete the oldest reductions until fewer than ``max_inflight`` reduce-scatters are in flight."""
        while len(self.inflight) >= self.max_inflight:
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        rec = self.inflight.popleft()
        rec.complete_reduce_scatter(self)
        self.installed.append(rec)

    def make_room_all_reduce(self) -> None:
        while self.all_reduces:
            self.all_reduces.popleft().complete_all_reduce(self)

    def push(self, rec: PendingReduce) -> None:
        self.inflight.append(rec)
        self.peak_inflight = max(self.peak_inflight, len(self.inflight))

    def complete_group(self, group: FSDPParamGroup) -> None:
        """Complete (oldest first) every reduction up to and including ``group``'s last one (a module whose
        backward runs twice must not accumulate into grads a reduce-scatter still reads)."""
        while any(r.group is group for r in self.inflight):
            self._complete_oldest()

    def drain(self) -> None:
        while self.inflight:
            self._complete_oldest()
        self.make_room_all_reduce()

    def finish_backward(self) -> None:
        """Root's final callback: complete everything, exchange used flags and check unit agreement, set
        ``.grad``. Collective (one small all-reduce per mesh, when some unit reduced grads). Raises
        :class:`CollectiveMismatchError` (Note [unit agreement])."""
        self.drain()
        recs, self.installed = self.installed, []
        for r in recs:
            r.finish_host_side()
        for r in recs:
            r.group.grads.reductions_finished()
        attach = [r for r in recs if r.attach]
        if not attach:  # no-sync / deferred micro-batch: no communication; the hash carries to the next check
            return
        used = self.agreement.exchange_used_flags(attach)
        groups: dict[int, tuple[FSDPParamGroup, list]] = {}
        for r in attach:
            groups.setdefault(id(r.group), (r.group, []))[1].append(r)
        for g, rs in groups.values():  # each param once, in order, over the unit's reductions
            params = unique_by_id([r.params for r in rs])
            g.grads.attach_sharded(list(zip(params, map(used.__getitem__, map(id, params)))))

    def reset(self) -> None:
        """reset_iter_state: wait and drop every record (the agreement is reset by its owner, the
        ``CommContext``). Local (waits collectives already issued)."""
        for r in (*self.inflight, *self.all_reduces):
            r.drop()
        for r in self.installed:
            if r.offload_event is not None:
                r.offload_event.synchronize()
        self.inflight.clear()
        self.all_reduces.clear()
        self.installed.clear()


def launch_reduce(group: FSDPParamGroup, queue: ReduceQueue) -> PendingReduce:
    """Reduce-scatter ``group``'s unsharded grads (collective over its shard group), after making room
    in ``queue``; returns the record (already pushed)."""
    grads = group.grads
    check(
        grads.grad_state in (GradState.ACCUMULATING, GradState.HELD) and group.bufs.has_grads(),
        f"reduce without grads (state {grads.grad_state})",
    )
    queue.make_room()
    ws = group.shard_world * group.replicate_world
    factor = group.gradient_divide_factor or float(ws)
    # AVG in the collective when it equals the requested division (no extra kernel); else SUM + one scale
    use_avg = factor == float(ws) and not group.is_hsdp and ws > 1
    op = dist.ReduceOp.AVG if use_avg else dist.ReduceOp.SUM
    fresh = grads.sharded_grads_fresh()
    # direct: the collective writes the sharded grads themselves (no (S,) temporary, no install copy).
    # World size 1 (factor 1): the "reduce-scatter" is one local (casting) copy into them, as FSDP2's
    # reduce output becomes .grad at world size 1 (_fsdp_collectives.py, foreach_reduce).
    same = group.reduce_dtype == group.orig_dtype and group.storage_device == group.device
    direct = fresh and same and ((use_avg and group.shard_world > 1) or (ws == 1 and factor == 1.0))
    with labelled(f"raggedfsdp::reduce_scatter ({group.unit_name})"):
        if not direct and not (group.is_hsdp and group.replicate_world > 1):
            # installed from the reduce-scatter stream (complete_reduce_scatter): allocate the sharded
            # grads here, on the compute stream and before the collective's stream waits it
            # (fresh: the install copies over all of it, so a re-grown buffer needs no zero-fill)
            group.bufs.sharded_grad_buffer(zero=not fresh)
        out = (
            group.bufs.sharded_grad_buffer(zero=False)  # the reduce-scatter writes all of it
            if direct
            else group.bufs.sharded_output(group.reduce_dtype)
        )
        group.tensors.clear_unsharded_grads()
        params = tuple(grads.grad_fps)
        flags = grads.take_used_flags()
        if group.reduce_scatter_unused_params:  # a zero .grad for params no rank used (FSDP2)
            flags = (True,) * len(flags)
        queue.agreement.note(group, "reduce-scatter", group.bufs.grad_layout.total_size)
        if group.nonfinite_probe is not None:  # this rank's own grads, before the collective mixes them
            group.nonfinite_probe.append((group.unit_name, _nonfinite(group.bufs)))
        if group.rs_wire_dtype is not None:  # Note [bf16-wire reduce-scatter]
            handle, inp = reduce_scatter_wire(
                group.bufs,
                group.shard_group,
                out=out,
                op=op,
                stream=queue.rs_stream,
                wire_dtype=group.rs_wire_dtype,
            )
        else:
            handle, inp = group.bufs.reduce_grads(group.shard_group, out=out, op=op, stream=queue.rs_stream)
        handle.context = queue.agreement.context(group)
        handle.settle()  # Note [settled reduce-scatter]
    grads.reduce_started()
    rec = PendingReduce(group, handle, inp, out, direct, fresh, None if use_avg else factor, flags, params)
    queue.push(rec)
    return rec


def _run_all_reduce_hook(group: FSDPParamGroup, out: torch.Tensor) -> None:
    """``hook(out)`` on the unit's ``(S,)`` reduce output (this rank's flat shard of the reduced grads,
    padding included; its sum over the data-parallel ranks, or their mean when the collective averaged),
    in place, on the current stream or on the hook's own stream ordered both ways with it (FSDP2's
    ``foreach_reduce`` in ``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``). Local."""
    stream = group.all_reduce_hook_stream
    if stream is None:
        group.all_reduce_hook(out)
        return
    from raggedfsdp.buffer.streams import current_stream

    here = current_stream(out.device)
    stream.wait_stream(here)
    with on_stream(stream):
        group.all_reduce_hook(out)
    here.wait_stream(stream)


def _nonfinite(bufs) -> torch.Tensor:
    """0-d bool on the device: this rank's unreduced grads of a unit (accumulator + current micro-batch's
    grads) hold a NaN/Inf. One read of the unit's grads, no host sync."""
    parts = [b.data for b in (bufs.acc, bufs.grads) if b is not None and b.is_allocated and b.data.numel()]
    if not parts:
        return torch.zeros((), dtype=torch.bool, device=bufs.device)
    flags = [~torch.isfinite(p).all() for p in parts]
    return flags[0] if len(flags) == 1 else torch.stack(flags).any()
