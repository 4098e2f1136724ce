"""``FSDPModule``: the methods ``fully_shard`` adds to a module (torch 2.13 FSDP2 API,
``torch/distributed/fsdp/_fully_shard/_fully_shard.py``), ``UnshardHandle``, and
:func:`set_runtime_options` (raggedfsdp's runtime knobs)."""

from __future__ import annotations

from raggedfsdp.fsdp._common import AGREEMENT_CHECKS
from raggedfsdp.fsdp._param_group import FSDPParamGroup
from raggedfsdp.fsdp._state import FSDPState


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` completes the all-gather."""

    def __init__(self, group: FSDPParamGroup | None):
        self._group = group

    def wait(self) -> None:
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group = None


class FSDPModule:
    """Mixin swapped into a ``fully_shard``'ed module's class (like torch's ``FSDPModule``)."""

    def __new__(cls, *args, **kwargs):
        # indexing into e.g. a fully_shard'ed ModuleList builds the original class, not the FSDP one
        orig = cls.__mro__[2]
        self = orig.__new__(orig, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    def _fsdp_state(self) -> FSDPState:
        return self._raggedfsdp_state  # type: ignore[attr-defined]

    def _fsdp_states(self, recurse: bool) -> list[FSDPState]:
        if not recurse:
            return [self._fsdp_state()]
        out = []
        for m in self.modules():  # type: ignore[attr-defined]
            st = getattr(m, "_raggedfsdp_state", None)
            if st is not None and st not in out:
                out.append(st)
        return out

    def reshard(self) -> None:
        """Free this unit's unsharded params (not recursive). Local."""
        g = self._fsdp_state().group
        if g is not None:
            g.reshard()

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this unit's params (collective over its shard group); ``async_op`` returns a handle."""
        st = self._fsdp_state()
        g = st.group
        if g is None:
            return UnshardHandle(None) if async_op else None
        g.unshard(async_op=async_op)
        handle = UnshardHandle(g)
        if async_op:
            return handle
        handle.wait()
        return None

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Turn reduce-scatter (and HSDP all-reduce) on or off; off accumulates unsharded grads locally."""
        for st in self._fsdp_states(recurse):
            if st.group is not None:
                st.group.reduce_grads = requires_gradient_sync
                st.group.all_reduce_grads = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: ``False`` reduce-scatters but defers the replicate-dim all-reduce (the shard-reduced sum
        is kept and added to the next synced backward). Local setting; no effect on 1-D meshes."""
        for st in self._fsdp_states(recurse):
            if st.group is not None:
                st.group.all_reduce_grads = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Free (``True``) or keep (``False``) the unsharded params between forward and backward.

        Raises ``TypeError`` for a non-bool. Local setting (every rank should set the same value).
        """
        if not isinstance(reshard_after_forward, bool):
            raise TypeError(f"set_reshard_after_forward: expects a bool, got {reshard_after_forward!r}")
        for st in self._fsdp_states(recurse):
            st.reshard_after_forward = reshard_after_forward
            st._auto_reshard = False

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """``False`` keeps the all-gathered params after backward; the next forward reuses them unless an
        optimizer step or ``load_state_dict`` happened since (then it re-gathers). Local setting."""
        for st in self._fsdp_states(recurse):
            if st.group is not None:
                st.group.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Unshard ``modules`` (async) right after this module's own unshard in forward, instead of the
        default (the unit that started forward next in the previous iteration). ``[]`` disables it."""
        _check_fsdp_modules(modules, "set_modules_to_forward_prefetch")
        self._fsdp_state().forward_prefetch = [m._fsdp_state() for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Unshard ``modules`` (async) right after this module's own unshard in backward."""
        _check_fsdp_modules(modules, "set_modules_to_backward_prefetch")
        self._fsdp_state().backward_prefetch = [m._fsdp_state() for m in modules]

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Kept for API parity; the final callback always completes reduce-scatters that were launched."""
        self._fsdp_state()._is_last_backward = bool(is_last_backward)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide reduced grads by ``factor`` instead of the data-parallel world size (recursive)."""
        if factor <= 0:
            raise ValueError(f"set_gradient_divide_factor: factor={factor} must be > 0")
        for st in self._fsdp_states(True):
            if st.group is not None:
                st.group.gradient_divide_factor = float(factor)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """``False`` skips the backward all-gather of this unit (only valid if its backward does not read
        its parameters, e.g. an embedding; it must then reshard after forward)."""
        self._fsdp_state().unshard_in_backward = unshard_in_backward

    def set_post_optim_event(self, event) -> None:
        """Accepted for API parity; collectives are ordered by ``Work.wait()`` on the current stream."""
        self._fsdp_state()._post_optim_event = event

    def reset_iter_state(self) -> None:
        """Recover after an exception mid-iteration (e.g. in backward). Call it on the root.

        Waits every in-flight all-gather, reduce-scatter and all-reduce, frees every unsharded param and
        grad buffer, drops pending reductions without installing them, and resets every per-iteration
        flag, so the next step runs as on a fresh model. Sharded grads already installed by the failed
        backward are not undone: call ``optimizer.zero_grad()`` as well. Local (waits only collectives
        already issued on every rank).
        """
        self._fsdp_state()._reset_iter_state()

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """At most ``max_input_buffers`` (K >= 1, default 1) reduce-scatter inputs in flight across all
        units of the root; before a unit launches its reduce-scatter the oldest ones are waited and their
        unsharded grad buffers freed (FSDP2's ``set_reduce_scatter_max_input_buffers``). Peak gradient
        memory in backward: K + 1 unsharded units. Raises ``ValueError`` for K < 1. Local setting."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int) or max_input_buffers < 1:
            raise ValueError(
                f"set_reduce_scatter_max_input_buffers: max_input_buffers={max_input_buffers!r} must be an int >= 1"
            )
        for st in self._fsdp_states(recurse):
            st.comm.reduces.max_inflight = max_input_buffers

    def _apply(self, *args, **kwargs):
        # `.to()`, `.to_empty()`, `.float()` replace local tensors: reshard, then re-point sharded params
        # at a fresh flat buffer (torch's FSDP2 does the same via reset_sharded_param)
        for st in self._fsdp_states(True):
            if st.group is not None:
                st.group.reshard()
        ret = super()._apply(*args, **kwargs)  # type: ignore[misc]
        for st in self._fsdp_states(True):
            if st.group is not None:
                st.group.reset_sharded_storage()
        return ret

    def __deepcopy__(self, memo):
        raise RuntimeError("raggedfsdp: deepcopy of a fully_shard'ed module is not supported; deepcopy before")


def _check_fsdp_modules(modules, name: str) -> None:
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise TypeError(f"{name}: {type(m).__name__} is not a fully_shard'ed module; call fully_shard on it first")


_UNSET = object()


def set_runtime_options(module, *, early_free=_UNSET, agreement_check=_UNSET, debug=_UNSET) -> None:
    """Set the FSDP runtime's knobs (:class:`~raggedfsdp.fsdp._common.RuntimeOptions`) of every unit
    under the ``fully_shard``'ed ``module`` (before its first forward; after it the root's units share
    one options object, so any of them sets it for all). Arguments left out keep their values.

    Args:
        early_free: bool, free finished reduce-scatter inputs at each gradient (Note [early free] in
            ``raggedfsdp/fsdp/_reduce.py``; default ``True``).
        agreement_check: ``"auto"`` | ``"immediate"`` | ``"deferred"``: when the unit-agreement result
            is read (Note [unit agreement] in ``raggedfsdp/fsdp/_agreement.py``; default ``"auto"``).
        debug: bool or ``None``: check each collective's unit before it runs; ``None`` (default) follows
            ``RAGGEDFSDP_DEBUG`` / ``raggedfsdp.buffer.set_debug``.

    Every rank should set the same values. Local. Raises ``TypeError`` if ``module`` is not a
    ``fully_shard``'ed module or a value has the wrong type, ``ValueError`` for an unknown
    ``agreement_check``.
    """
    if not isinstance(module, FSDPModule):
        raise TypeError(f"set_runtime_options: {type(module).__name__} is not a fully_shard'ed module; call "
                        "fully_shard on it first")
    if early_free is not _UNSET and not isinstance(early_free, bool):
        raise TypeError(f"set_runtime_options: early_free must be a bool, got {early_free!r}")
    if agreement_check is not _UNSET and agreement_check not in AGREEMENT_CHECKS:
        raise ValueError(f"set_runtime_options: agreement_check={agreement_check!r} must be one of "
                         f"{', '.join(map(repr, AGREEMENT_CHECKS))}")
    if debug is not _UNSET and debug is not None and not isinstance(debug, bool):
        raise TypeError(f"set_runtime_options: debug must be a bool or None, got {debug!r}")
    for st in module._fsdp_states(True):
        opts = st.comm.options
        if early_free is not _UNSET:
            opts.early_free = early_free
        if agreement_check is not _UNSET:
            opts.agreement_check = agreement_check
        if debug is not _UNSET:
            opts.debug = debug
