"""The gradient side of one FSDP unit: open for gradients, fold, reduce, install, ``.grad``.

:class:`UnitGrads` is composed into :class:`~raggedfsdp.fsdp._param_group.FSDPParamGroup` as
``group.grads`` and is the only writer of the unit's gradient state (``GradState``, the pending
sharded grads, HSDP's deferred partial sum, the grad members, the used flags); the reduce records of
``_reduce.py`` change it only through its transition methods (``reduce_started``,
``reduce_scattered``, ``defer_partial``, ``take_partial``, ``reductions_finished``). The buffer
transitions are :class:`raggedfsdp.buffer.UnitBuffers`. The order of a unit's post-backward (make
room, reshard, :meth:`UnitGrads.fold`, :meth:`UnitGrads.after_fold`, launch the reduce) is the group's,
``FSDPParamGroup.post_backward``, as in torch's FSDP2.

State machine (``GradState``; ``post_backward`` is the group's)::

    NONE --prepare()--> ACCUMULATING --post_backward()--> REDUCING --reduce_scattered()--> NONE
                                     \\--no-sync--> HELD --next synced post_backward()--> REDUCING

Note [grad fold]
    During backward autograd keeps each parameter's gradient as its own tensor, as in FSDP2; the unit's
    flat ``(m*S,)`` grad buffer (the reduce-scatter input) is allocated only in ``post_backward``, after
    (1) the oldest in-flight reduce-scatters are completed down to K - 1 (Note [bounded gradient
    memory] in ``_reduce.py``) and (2) the unit's unsharded params are freed. The gradients are then
    copied into it with one multi-tensor copy (a ``reduce_dtype`` buffer directly when it differs from
    ``param_dtype``: one cast while copying) and dropped right after. So at any moment of backward at most K
    reduce-scatter inputs, one unit's params and one unit's per-parameter grads are alive (plus the
    prefetched unit's params), the same four unit-sized buffers as FSDP2. Pre-setting ``.grad`` to views
    of a flat buffer allocated at the unit's first gradient costs more: the whole buffer exists from
    the first gradient on, *and* autograd still computes every weight gradient into a fresh tensor that
    it then adds into the view, so the largest weight's gradient is alive on top of the whole buffer
    (``tests/dist/test_fsdp_memory.py`` compares the peak with FSDP2's). The fold is also less memory
    traffic: zero-fill + copy (1 write + 1 read + 1 write per element) against zero-fill + in-place
    add (1 write + 2 reads + 1 write). The one place views still pay off is a
    no-sync window whose unsharded grads are held in ``param_dtype`` (``reduce_dtype`` unset or equal):
    ``prepare_grads`` pre-sets ``.grad`` to views of the held buffer, so each micro-batch adds into
    it in place and only one weight gradient is alive beyond it (FSDP2 holds the per-parameter grads
    of the unit on top of its accumulated ones). Not under ``backward(create_graph=True)``: autograd
    then sets ``.grad = .grad + new`` out of place, and the fold would add the view's sum a second time.
    Sparse gradients (``nn.Embedding(sparse=True)``) are densified by the fold.

Note [frozen parameters]
    While every parameter of a unit requires grad, the grad roles use the parameter layout (each
    tensor's gradient lands at its parameter's offset). When some are frozen (LoRA: a frozen base with
    small adapters), the grad roles use a :class:`~raggedfsdp.planner.GradLayout` of the *grad members*
    instead -- the trainable params when grads begin (plus, within one accumulation window, any that
    held grads) -- cached per member set: ``(m*Sg,)`` unsharded, ``(Sg,)`` sharded, ``Sg`` ~ the largest
    rank's trainable pieces, so frozen params hold no gradient storage. A unit that mixes frozen and
    trainable params at ``fully_shard`` time is planned with its trainable ones as their own segment
    (Note [segmented layout] in ``raggedfsdp/planner/layout.py``), so those pieces, and ``Sg``, are
    ~1/m of the trainable params on every rank; its grad roles then always use a ``GradLayout``.
    The fold (Note [grad fold]) writes each member's grad into its rank segments (one slice per rank
    it spans); a no-sync window adds autograd's tensors into the held compacted buffer at each
    post-backward (no views).
    Each sharded ``.grad`` stays a view with its param's own RaggedShard spec. A change of the member
    set moves held values into the new layout and re-points kept sharded ``.grad`` views (a param that
    left the set keeps its ``.grad`` as its own tensor).

Note [grad hooks]
    Per step nothing runs per parameter in Python: autograd keeps each gradient as its own tensor and
    the fold (Note [grad fold]) finds them (``.grad`` set) and marks them used, in C-level loops. A
    tensor pre-hook (:meth:`UnitGrads.on_grad`) sits on at most ``POLL_HOOKS_PER_UNIT`` (8) of a
    unit's unsharded params, spread evenly over them, as the points where backward polls the
    in-flight reduce-scatters (Note [early free] in ``_reduce.py``). Only while ``.grad`` views are
    pre-set (a no-sync window holding ``param_dtype`` grads), where a gradient is added into its view
    and leaves no trace the fold can see, does every trainable param get the hook (``_hook_all``,
    removed when views are no longer pre-set). A hook on every param would cost host time per step
    in proportion to the number of params, which the hook-free FSDP2 does not pay.

Note [sharded grad lifetime]
    Once backward has set a unit's sharded ``.grad`` views (``attach_sharded``), the unit drops its own
    reference to that ``(Sg,)`` storage (``UnitBuffers.hand_off_sharded_grads``): the ``.grad`` views
    alone own it, as FSDP2's ``.grad`` tensors own theirs, so ``optimizer.zero_grad(set_to_none=True)``
    frees it at once -- between steps and in eval a unit holds no gradient memory. The next reduce
    allocates a fresh zeroed buffer; ``.grad`` views still held then (accumulation across backwards
    without ``zero_grad``) are copied into it (``_adopt_foreign_grad``). Pinned (offload) buffers stay
    with the unit.
"""

from __future__ import annotations

import functools
import itertools
import operator
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from raggedfsdp._compat import dtensor_wrapper
from raggedfsdp.fsdp._common import (
    POST_ACCUMULATE_GRAD_HOOKS,
    attr_scan,
    all_none,
    FSDPParam,
    GradState,
    assign_each,
    check,
    labelled,
)
from raggedfsdp.fsdp._loops import pairs_to_fold, same_objects, to_attach

if TYPE_CHECKING:
    from raggedfsdp.fsdp._param_group import FSDPParamGroup

POLL_HOOKS_PER_UNIT = 8  # gradient pre-hooks per unit that poll the reduce-scatters (Note [grad hooks])


class UnitGrads:
    """The gradient state of one FSDP unit and its transitions (see the module notes).

    Args:
        group: the unit, read for what changes during its life: its buffers (``bufs``, new after
            ``reset_sharded_storage``), its trainable params (``trainable`` / ``tensors``, refreshed at
            each unshard), its reduce queue (``comm.reduces``, shared at the root's lazy init) and its
            name. The order of the post-backward is the group's (``FSDPParamGroup.post_backward``);
            the settings it decides by (``reduce_grads``, ``all_reduce_grads``, the dtypes) are passed in.
        fsdp_params: the unit's params, in unit order (fixed for the unit's life).
        index: ``id(fsdp_param) -> its index`` in ``fsdp_params``.
    """

    def __init__(self, group: FSDPParamGroup, fsdp_params: list[FSDPParam], index: dict[int, int]):
        self.group = group
        self.fsdp_params = fsdp_params
        self.index = index
        self.grad_state = GradState.NONE
        self.grad_fps: list[FSDPParam] = [fp for fp in fsdp_params if fp.requires_grad]  # with grad storage
        self._plan = _AttachPlan(None, [], [], [], [], None, [], [])  # attach_sharded's per-layout lists
        self.sg_pending = False  # the sharded grad buffer holds this backward's values, .grad not yet set
        self.partial_reduce: torch.Tensor | None = None  # HSDP: shard-reduced grads awaiting all-reduce
        self.partial_flags: dict[int, bool] | None = None  # id(fsdp_param) -> used, of deferred micro-batches
        self._view_hooks: list = []  # (fp, its unsharded param, handle): pre-hooks while .grad views are set

    # ---- transitions used by the reduce records (_reduce.py) ----------------------------------
    def reduce_started(self) -> None:
        """``launch_reduce`` issued the unit's reduce-scatter: the grads are read, the buffer pending."""
        self.grad_state = GradState.REDUCING
        self.sg_pending = True

    def reduce_scattered(self) -> None:
        """The reduce-scatter was waited and its unsharded input freed."""
        check(
            self.grad_state is GradState.REDUCING, f"reduce-scatter completed in grad state {self.grad_state}"
        )
        self.grad_state = GradState.NONE

    def defer_partial(self, out: torch.Tensor, params: tuple, flags: tuple[bool, ...]) -> None:
        """HSDP ``set_requires_all_reduce(False)``: keep (add) the shard-reduced ``out`` and its flags."""
        if self.partial_reduce is None:
            self.partial_reduce = out.clone()
        else:
            self.partial_reduce.add_(out)
        self.partial_flags = {id(fp): f for fp, f in zip(params, flags)}

    def take_partial(self) -> torch.Tensor | None:
        """HSDP: the deferred partial sum to add before the replicate all-reduce (and forget it)."""
        partial, self.partial_reduce = self.partial_reduce, None
        return partial

    def reductions_finished(self) -> None:
        """The root's final callback completed every reduction of this backward."""
        self.sg_pending = False

    # ---- backward ------------------------------------------------------------------------------
    def hook(self, fp: FSDPParam) -> None:
        """Register :meth:`on_grad` as ``fp``'s unsharded-param tensor pre-hook if ``fp`` is one of the
        unit's poll points: at most ``POLL_HOOKS_PER_UNIT`` params, spread evenly over the unit (Note
        [grad hooks]). Local."""
        n = len(self.fsdp_params)
        p = min(n, POLL_HOOKS_PER_UNIT)
        i = self.index[id(fp)]
        if (i * p) // n != ((i + 1) * p) // n:  # i ends one of p equal runs of the unit's params
            fp.unsharded.register_hook(functools.partial(self.on_grad, fp))  # C partial: 1 Python frame
            fp.hooked = True

    def _hook_all(self) -> None:
        """``.grad`` views are pre-set (Note [grad hooks]): every trainable param gets the pre-hook,
        so that a gradient added into a view still marks its param used. Local."""
        for fp in self.group.trainable:
            if not fp.hooked:
                handle = fp.unsharded.register_hook(functools.partial(self.on_grad, fp))
                self._view_hooks.append((fp, fp.unsharded, handle))
                fp.hooked = True

    def _unhook_views(self) -> None:
        """Remove the pre-hooks :meth:`_hook_all` added (views no longer pre-set). Local."""
        for fp, t, handle in self._view_hooks:
            handle.remove()
            if fp.unsharded is t:  # not re-created since (a new param got its own hooks)
                fp.hooked = False
        self._view_hooks = []

    def on_grad(self, fp: FSDPParam, _grad: torch.Tensor | None = None) -> None:
        """A gradient is about to be accumulated into ``fp`` (its tensor pre-hook, Note [grad hooks]):
        mark it used and poll the in-flight reduce-scatters (Note [early free]). While the unit's grad
        buffer is allocated (a no-sync window holds it, views pre-set by ``prepare``) point a ``.grad``
        that is ``None`` at its view, so autograd adds into it in place; otherwise autograd keeps the
        gradient as its own tensor until ``post_backward`` folds it in (Note [grad fold]) and marks it
        used there. Local."""
        fp.got_grad = True
        g = self.group
        if g.comm.reduces.inflight:  # free finished reduce-scatter inputs (Note [early free] in _reduce.py)
            g.comm.reduces.poll()
        # per step the grad buffer is not allocated here (the fold allocates it): one test, then done
        if g.bufs.grads.data.untyped_storage().nbytes() and self._may_view(fp):  # a no-sync window holds it
            fp.unsharded.grad = fp.grad_view

    def _may_view(self, fp: FSDPParam) -> bool:
        bufs = self.group.bufs
        return (
            fp.unsharded.grad is None
            and self.grad_state in (GradState.ACCUMULATING, GradState.HELD)
            and bufs.grads.is_allocated
            and not bufs.compact_grads
            and not torch.is_grad_enabled()
        )

    def prepare(self) -> None:
        """Open the unit for gradients (pre-backward). Autograd keeps each gradient as its own tensor and
        ``post_backward`` folds them into the flat buffer (Note [grad fold]); views are pre-set here only
        when the buffer is already allocated (a no-sync window holding ``param_dtype`` grads), and a
        ``.grad`` the user set is folded in first. Local (may wait this unit's previous
        reduce-scatter: a module whose backward runs twice)."""
        if not self.group.any_trainable:
            return
        if self.grad_state is GradState.REDUCING:
            self.group.comm.reduces.complete_group(self.group)
        check(self.grad_state is not GradState.REDUCING, "grads begun while their reduce-scatter is pending")
        self._sync_members()
        if self.group.bufs.compact_grads:  # autograd owns the unsharded grads until post_backward folds them
            if self._view_hooks:
                self._unhook_views()
            if self.grad_state is GradState.NONE:
                self.grad_state = GradState.ACCUMULATING
            return
        if self.grad_state is GradState.NONE:
            self.grad_state = GradState.ACCUMULATING
        views = not torch.is_grad_enabled()  # create_graph=True: autograd replaces .grad, never adds into it
        allocated = self.group.bufs.grads.is_allocated
        trainable = self.group.trainable
        if not (views and allocated) and all_none(map(_UNSHARDED_GRAD, trainable)):
            if self._view_hooks:
                self._unhook_views()
            return  # the per-step case: no .grad to fold or view to pre-set
        for fp in trainable:
            g = fp.unsharded.grad
            if g is not None and g is not fp.grad_view:  # e.g. user set it; fold it in
                allocated = True
                self.group.bufs.begin_grads()
                fp.grad_view.add_(g)
                fp.unsharded.grad = fp.grad_view if views else None
            elif g is None and views and allocated:
                fp.unsharded.grad = fp.grad_view
        if views and allocated:
            self._hook_all()
        elif self._view_hooks:
            self._unhook_views()

    def _sync_members(self) -> None:
        """Choose the grad layout for the current ``requires_grad`` (Note [frozen parameters]). Within an
        accumulation window (grads held), params that hold grads keep their slots. Local."""
        held = (
            self.grad_state is not GradState.NONE
            or self.group.bufs.has_grads()
            or self.partial_reduce is not None
        )
        if not held and same_objects(self.grad_fps, self.group.trainable):
            return  # the per-step case: the members are the trainable params (refreshed at each unshard)
        have = {id(fp) for fp in self.grad_fps}
        want = [fp for fp in self.fsdp_params if fp.requires_grad or (held and id(fp) in have)]
        if {id(fp) for fp in want} == have:
            return
        if self.grad_state is GradState.REDUCING:
            self.group.comm.reduces.complete_group(self.group)
        keep = {id(fp) for fp in want}
        for fp in self.fsdp_params:  # sharded .grad views of the old buffer: copy out or re-point below
            if fp.sharded_grad is not None and fp.sharded.grad is fp.sharded_grad and id(fp) not in keep:
                fp.sharded.grad = DTensor(fp.sharded_grad._local_tensor.clone(), fp.spec, requires_grad=False)
        kept = [fp for fp in want if fp.sharded_grad is not None and fp.sharded.grad is fp.sharded_grad]
        old = self.group.bufs.set_grad_members(tuple(self.index[id(fp)] for fp in want) if want else None)
        if old is not None and self.partial_reduce is not None:  # HSDP deferred all-reduce
            self.partial_reduce = self.group.bufs.relayout_sharded(self.partial_reduce, old)
        for fp in self.fsdp_params:
            fp.sharded_grad = None
        for fp in kept:
            fp.sharded_grad = DTensor(
                self.group.bufs.sharded_grad_buffer().local_view(self.index[id(fp)]),
                fp.spec,
                requires_grad=False,
            )
            fp.sharded.grad = fp.sharded_grad
        self.grad_fps = want

    def fold(self) -> bool:
        """Fold the grads autograd kept as its own tensors into the flat buffer and drop them (Note [grad
        fold]). True if the unit has grads to reduce (a unit whose pre-backward ran counts
        even if no gradient reached it on this rank: every rank that ran the unit's backward must take
        part in its reduce-scatter)."""
        any_grad = self.grad_state in (GradState.HELD, GradState.ACCUMULATING)
        compact = self.group.bufs.compact_grads
        fps_all = self.grad_fps
        grads = list(map(_UNSHARDED_GRAD, fps_all))
        if all_none(grads):
            stray = []
        else:  # a grad autograd kept as its own tensor (not a pre-set view of the buffer), in C loops
            stray = pairs_to_fold(fps_all, grads, None if compact else list(map(_GRAD_VIEW, fps_all)))
        if stray:
            if self.grad_state is GradState.REDUCING:  # a second backward through this unit
                self.group.comm.reduces.complete_group(self.group)
            if self.grad_state is GradState.NONE:
                self.grad_state = GradState.ACCUMULATING

            index = self.index
            if any(issubclass(t, DTensor) for t in set(map(type, grads))):
                # TP grads autograd left Partial: redistribute one at a time, freeing autograd's as we go
                fps = [fp for fp, _ in stray]
                del stray, grads
                folded = []
                for fp in fps:
                    g = fp.unsharded.grad
                    folded.append((index[id(fp)], fp.local_grad(g) if isinstance(g, DTensor) else g))
                    fp.unsharded.grad = None
                    fp.got_grad = True
                del g
            else:  # plain tensors: the loops in C; the fold below drops autograd's tensors
                fps, gs = map(list, zip(*stray))
                folded = list(zip(map(index.__getitem__, map(id, fps)), gs))
                del stray, grads, gs
                assign_each(list(map(_UNSHARDED, fps)), "grad", itertools.repeat(None))
                assign_each(fps, "got_grad", itertools.repeat(True))
            with labelled(f"raggedfsdp::fold_grads ({self.group.unit_name})"):
                self.group.bufs.fold_grads(folded)
            del folded  # autograd's tensors are freed here
            any_grad = True
        if any_grad and compact and not self.group.bufs.has_grads():
            # this rank ran the backward without grads: it still reduces (zeros)
            self.group.bufs.begin_grads()
        return any_grad

    def after_fold(self, any_grad: bool, reduce_grads: bool, all_reduce_grads: bool, cast: bool) -> bool:
        """The step of the unit's post-backward after the fold (``FSDPParamGroup.post_backward`` owns the
        order): True if the grads are to be reduce-scattered now (a zero buffer when this rank ran the
        unit's backward without grads); otherwise drop them (none) or hold them (``reduce_grads`` off:
        no-sync, accumulating in ``reduce_dtype`` like FSDP2: ``cast``, ``reduce_dtype != param_dtype``).
        Local."""
        if self.grad_state is GradState.REDUCING:
            return False  # already launched (e.g. the final callback after the post-backward hook)
        if not any_grad and self.holds_unreduced(reduce_grads, all_reduce_grads):
            # HSDP: a deferred partial sum awaits its all-reduce (it rides on a reduce-scatter of zeros)
            self.grad_state, any_grad = GradState.ACCUMULATING, True
        if not any_grad:
            self._drop_unsharded()
            return False
        bufs = self.group.bufs
        if not reduce_grads:
            if cast and bufs.grads.is_allocated:
                bufs.hold_grads()
            for fp in self.grad_fps:
                fp.unsharded.grad = None
            self.grad_state = GradState.HELD
            return False
        if not bufs.has_grads():  # ran backward but no param got a gradient here: reduce zeros
            bufs.begin_grads()
        return True

    def holds_unreduced(self, reduce_grads: bool, all_reduce_grads: bool) -> bool:
        """True if this unit holds grads of earlier micro-batches that a synced backward must reduce even
        though the unit did not run in it (as FSDP2, whose final callback runs every group's
        post-backward): no-sync grads (``HELD``), or HSDP's partial sum whose all-reduce was deferred by
        ``set_requires_all_reduce(False)``. Local; the same on every rank that ran the same units."""
        if not reduce_grads:
            return False
        return self.grad_state is GradState.HELD or (
            self.grad_state is GradState.NONE and self.partial_reduce is not None and all_reduce_grads
        )

    def _drop_unsharded(self) -> None:
        for fp in self.grad_fps:
            fp.unsharded.grad = None
        if self.grad_state is GradState.ACCUMULATING:
            self.group.bufs.free_grads()
            self.grad_state = GradState.NONE

    def take_used_flags(self) -> tuple[bool, ...]:
        """This rank's used bits of the trainable params since the last reduce (and reset them)."""
        flags = tuple(map(_GOT_GRAD, self.grad_fps))
        assign_each(self.grad_fps, "got_grad", itertools.repeat(False))
        if self.partial_flags is not None:  # micro-batches whose replicate all-reduce was deferred
            flags = tuple(f or self.partial_flags.get(id(fp), False) for f, fp in zip(flags, self.grad_fps))
            self.partial_flags = None
        return flags

    def release_unused_sharded(self) -> None:
        """Free the sharded grad buffer if no sharded param holds a ``.grad`` and no reduction of this
        iteration wrote it (called by the root before forward). Local."""
        if self.sg_pending:
            return
        with attr_scan():
            if not all_none(map(_SHARDED_PARAM_GRAD, self.fsdp_params)):
                return
        self.group.bufs.release_sharded_grads()

    def sharded_grads_fresh(self) -> bool:
        """True if no trainable sharded param holds a grad (``zero_grad(set_to_none=True)``) and no
        reduction of this backward wrote the buffer yet.

        Grads the user replaced with other tensors are copied into the buffer first; slices of params
        without a grad are zeroed so that accumulation adds onto zero for them.
        """
        if self.sg_pending:
            return False
        with attr_scan():
            held = list(map(_SHARDED_PARAM_GRAD, self.grad_fps))
        if all_none(held):
            return True  # the per-step case (zero_grad(set_to_none=True)): no per-parameter Python
        fresh = True
        for fp in self.grad_fps:
            if fp.sharded.grad is None:
                continue
            fresh = False
            if fp.sharded_grad is None or fp.sharded.grad is not fp.sharded_grad:
                self._adopt_foreign_grad(fp)
        if not fresh:
            buf = self.group.bufs.sharded_grad_buffer()
            for fp in self.grad_fps:
                if fp.sharded.grad is None:
                    buf.local_view(self.index[id(fp)]).zero_()
        return fresh

    def _adopt_foreign_grad(self, fp: FSDPParam) -> None:
        # the user replaced .grad with another tensor: move its values into our buffer view
        buf = self.group.bufs.sharded_grad_buffer()
        i = self.index[id(fp)]
        g = fp.sharded.grad
        local = g._local_tensor if isinstance(g, DTensor) else g
        buf.local_view(i).copy_(local.reshape(-1))
        fp.sharded_grad = DTensor(buf.local_view(i), fp.spec, requires_grad=False)
        fp.sharded.grad = fp.sharded_grad

    def attach_sharded(self, used: list[tuple[FSDPParam, bool]]) -> None:
        """Set ``.grad`` of every reduced sharded param used on some rank (or already holding one), then
        run the sharded param's post-accumulate-grad hooks (``register_post_accumulate_grad_hook``, e.g.
        an optimizer step in backward), as FSDP2 does after its reduce
        (``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``); here at the end of backward,
        where ``.grad`` is set (the lazy part of Note [bounded gradient memory]). Local.

        The per-step case -- every grad member attached, no hooks, the ``.grad`` views built afresh on a
        new buffer (Note [sharded grad lifetime]) -- runs as C-level loops over per-layout lists (no
        Python per parameter); anything else takes the per-parameter path (so does a pinned / offload
        unit, which keeps its views across steps)."""
        buf = self.group.bufs.sharded_grad_buffer()
        base = buf.data  # views of it stay valid while it is freed and re-grown (Note [DBuffer roles])
        fps, us = zip(*used) if used else ((), ())
        with attr_scan():
            todo = to_attach(fps, us, list(map(_SHARDED_PARAM_GRAD, fps)))
            shardeds = list(map(_SHARDED, todo))
            hooks = list(map(POST_ACCUMULATE_GRAD_HOOKS, shardeds))
        plan = self._attach_plan(buf)
        # ({} after a removed hook: any() is False)
        if same_objects(todo, plan.fps) and not any(hooks) and _no_sharded_grads(todo):
            # every piece in one split (a third of 785 narrow calls' time), picked in member order
            views = map(base.split_with_sizes(plan.split_sizes).__getitem__, plan.pick)
            sgs = list(map(_dtensor_wrap(), views, plan.specs))
            with attr_scan():
                assign_each(shardeds, "grad", sgs)
            if not self.group.bufs.hand_off_sharded_grads():  # pinned: the unit keeps the views
                assign_each(todo, "sharded_grad", sgs)
                assign_each(todo, "sharded_grad_base", itertools.repeat(base))
                return
        else:
            self._attach_each(todo, buf, base)
            if not self.group.bufs.hand_off_sharded_grads():
                return
        # Note [sharded grad lifetime]: the .grad views own the storage from here on
        assign_each(self.fsdp_params, "sharded_grad", itertools.repeat(None))
        assign_each(self.fsdp_params, "sharded_grad_base", itertools.repeat(None))

    def _attach_plan(self, buf) -> _AttachPlan:
        """The sharded grad buffer's per-member local pieces, rebuilt when the layout, the members or the
        params (``ParamTensors``, new after ``reset_sharded_storage``) change. Local."""
        plan = self._plan
        if (
            plan.layout is not buf.layout
            or plan.tensors is not self.group.tensors
            or not same_objects(plan.fps, self.grad_fps)
        ):
            fps = list(self.grad_fps)
            index = self.index
            pieces = [buf.layout.piece(index[id(fp)], buf.rank) for fp in fps]
            offs = [buf.layout.shard_offset(index[id(fp)], buf.rank) for fp in fps]
            numels = [b - a for a, b in pieces]
            sizes, pick, pos = [], [0] * len(fps), 0
            for off, n, j in sorted(zip(offs, numels, range(len(fps)))):  # pieces in buffer order, gaps
                if off > pos:
                    sizes.append(off - pos)
                pick[j], pos = len(sizes), off + n
                sizes.append(n)
            if buf.data.numel() > pos:
                sizes.append(buf.data.numel() - pos)
            plan = self._plan = _AttachPlan(
                buf.layout, fps, offs, numels, [fp.spec for fp in fps], self.group.tensors, sizes, pick
            )
        return plan

    def _attach_each(self, todo: list[FSDPParam], buf, base: torch.Tensor) -> None:
        """The per-parameter ``.grad`` install (hooks, kept or partial views). Local."""
        plan = self._attach_plan(buf)
        spans = {id(fp): (o, n) for fp, o, n in zip(plan.fps, plan.offsets, plan.numels)}
        for fp in todo:
            sharded = fp.sharded
            sg = fp.sharded_grad
            if sg is None or fp.sharded_grad_base is not base:  # built once per sharded grad buffer
                span = spans.get(id(fp))
                if span is None:  # not a grad member of this layout (it left the set with its .grad)
                    i = self.index[id(fp)]
                    a, b = buf.layout.piece(i, buf.rank)
                    span = (buf.layout.shard_offset(i, buf.rank), b - a)
                view = base.narrow(0, *span)  # buf.local_view(i)
                if sg is None or sg._local_tensor.data_ptr() != view.data_ptr():
                    sg = fp.sharded_grad = _dtensor_wrap()(view, fp.spec)
                fp.sharded_grad_base = base
            sharded.grad = sg
            hooks = getattr(sharded, "_post_accumulate_grad_hooks", None)
            if hooks:
                for hook in hooks.values():
                    hook(sharded)

    def reset(self) -> None:
        """reset_iter_state for this unit's gradients: drop unsharded grads, free their buffer, clear every
        per-iteration field. Local."""
        g = self.group
        for fp in self.fsdp_params:
            if fp.unsharded is not None:
                fp.unsharded.grad = None
            fp.got_grad = False
        g.bufs.free_grads()
        if self._view_hooks:
            self._unhook_views()
        self.grad_state = GradState.NONE
        self.sg_pending = False
        self.partial_reduce = None
        self.partial_flags = None


class _AttachPlan(NamedTuple):
    """``attach_sharded``'s lists for one sharded grad layout: each grad member's local piece of the
    ``(Sg,)`` buffer (``offsets`` / ``numels`` in elements) and its DTensor spec."""

    layout: Any  # the GradLayout / Layout these pieces belong to
    fps: list  # the grad members, in order
    offsets: list
    numels: list
    specs: list
    tensors: Any  # the unit's ParamTensors when built (a new one: params re-created)
    split_sizes: list  # the whole buffer split into pieces and the gaps between them, in order
    pick: list  # the split's index of each grad member's piece


_GOT_GRAD = operator.attrgetter("got_grad")
_UNSHARDED = operator.attrgetter("unsharded")
_GRAD_VIEW = operator.attrgetter("grad_view")
_SHARDED_PARAM_GRAD = operator.attrgetter("sharded.grad")
_UNSHARDED_GRAD = operator.attrgetter("unsharded.grad")
_SHARDED = operator.attrgetter("sharded")
_SHARDED_GRAD = operator.attrgetter("sharded_grad")


@functools.cache
def _dtensor_wrap():
    return dtensor_wrapper()  # resolved at first use: importing raggedfsdp reads no torch internal


def _no_sharded_grads(fps: list[FSDPParam]) -> bool:
    """True if no param of ``fps`` holds a sharded grad view of an earlier buffer (the per-step case)."""
    sgs = list(map(_SHARDED_GRAD, fps))
    return all_none(sgs)
