"""``FSDPModule``: the methods ``fully_shard`` adds to a module (torch 2.13 FSDP2 API,
``torch/distributed/fsdp/_fully_shard/_fully_shard.py``), ``UnshardHandle``, and
:func:`set_runtime_options` (raggedfsdp's runtime knobs).

Both subclass torch's own ``torch.distributed.fsdp.FSDPModule`` / ``UnshardHandle``, so code that detects
FSDP2 modules with ``isinstance`` (trainers, pipelining schedules, ``register_fsdp_forward_method``)
sees ours too. Every public method of torch's ``FSDPModule`` is overridden here (a test fails when a
torch release adds one), so nothing falls through to torch's implementation, which reads torch's own
per-module state (Note [torch FSDPModule] in ``docs/fsdp.md``).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed.fsdp as torch_fsdp

from raggedfsdp.fsdp._common import AGREEMENT_CHECKS, FSDPDeepcopyError, FSDPTypeError, state_of
from raggedfsdp.fsdp._param_group import FSDPParamGroup
from raggedfsdp.fsdp._state import FSDPState, share_streams

# where torch's disable_fsdp_module_new_init() keeps its flag (read with a default: private,
# version-dependent)
_torch_fully_shard_mod = sys.modules.get("torch.distributed.fsdp._fully_shard._fully_shard")


class UnshardHandle(torch_fsdp.UnshardHandle):
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` completes the all-gather."""

    def __init__(self, group: FSDPParamGroup | None):
        self._group = group

    def wait(self) -> None:
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group = None


class FSDPModule(torch_fsdp.FSDPModule):
    """Mixin swapped into a ``fully_shard``'ed module's class: ``FSDP<Cls>(FSDPModule, Cls)``, named as
    torch names its own (``type(m).__module__`` is ``raggedfsdp.fsdp``). A subclass of torch's
    ``FSDPModule``; its ``__new__`` (indexing into a sharded ``ModuleList`` builds the original class)
    finds the original class at MRO index 3: ``[FSDP<Cls>, this, torch FSDPModule, Cls, ...]``."""

    _orig_cls_mro_index: int = 3  # read by torch >= 2.13's FSDPModule.__new__ (not relied on: see below)

    def __new__(cls, *args, **kwargs):
        # Indexing into e.g. a fully_shard'ed ModuleList builds the original class, not the FSDP one (as
        # torch's __new__). Found by position after torch's FSDPModule, not by a torch-version-dependent
        # index attribute (older torch hard-codes MRO index 2, which is torch's FSDPModule here).
        mro = cls.__mro__
        orig = mro[mro.index(torch_fsdp.FSDPModule) + 1]
        self = orig.__new__(orig, *args, **kwargs)
        if getattr(_torch_fully_shard_mod, "_enable_fsdp_module_new_init", True):
            self.__init__(*args, **kwargs)
        return self

    def _fsdp_state(self) -> FSDPState:
        return self._raggedfsdp_state  # type: ignore[attr-defined]

    def _get_fsdp_state(self) -> FSDPState:
        """This unit's ``FSDPState`` (torch's name; what ``fully_shard.state(module)`` returns). Its
        ``_pre_forward(module, args, kwargs)`` / ``_post_forward(module, args, output)`` have torch's
        signatures, so torch's ``register_fsdp_forward_method`` works on raggedfsdp modules."""
        return self._raggedfsdp_state  # type: ignore[attr-defined]

    def _fsdp_states(self, recurse: bool) -> list[FSDPState]:
        if not recurse:
            return [self._fsdp_state()]
        out = []
        for m in self.modules():  # type: ignore[attr-defined]
            st = state_of(m)
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

    def set_nonfinite_grad_probe(self, probe: list | None, *, recurse: bool = True) -> None:
        """raggedfsdp extension. Before each reduce-scatter of a unit, append ``(unit name, flag)`` to
        ``probe``: ``flag`` is a 0-d bool tensor on the unit's device, True when this rank's own
        (unreduced) gradients of the unit hold a NaN/Inf. After the reduce-scatter every rank's shard
        is non-finite when any rank's input was, so only this flag names the rank at fault. Costs
        one read of the unit's unsharded gradients, no host sync; ``None`` turns it off. Local.
        Idea: Megatron-LM's per-rank ``check_for_nan_in_grad`` before its gradient reduction."""
        for st in self._fsdp_states(recurse):
            if st.group is not None:
                st.group.nonfinite_probe = probe

    def set_reduce_scatter_wire_dtype(self, dtype: torch.dtype | None, *, recurse: bool = True) -> None:
        """raggedfsdp extension. ``torch.bfloat16`` (or ``torch.float16``): reduce-scatter this unit's
        gradients as an all-to-all of ``dtype`` pieces summed locally in ``reduce_dtype`` (half the bytes
        of an fp32 reduce-scatter; with ``param_dtype`` bf16 the same values up to summation order, and
        far closer to them than a bf16 reduce-scatter). ``None`` (the default): a plain reduce-scatter in
        ``reduce_dtype``. Note [bf16-wire reduce-scatter] in ``raggedfsdp/buffer/wire_reduce.py``. Local
        setting (every rank of a unit's group must set the same value). Raises ``TypeError`` for another
        value."""
        from raggedfsdp.buffer.wire_reduce import WIRE_DTYPES

        if dtype is not None and dtype not in WIRE_DTYPES:
            raise FSDPTypeError(
                f"set_reduce_scatter_wire_dtype: dtype={dtype!r} must be None, torch.bfloat16 or "
                "torch.float16"
            )
        for st in self._fsdp_states(recurse):
            if st.group is not None:
                st.group.rs_wire_dtype = dtype

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
            raise FSDPTypeError(f"set_reshard_after_forward: expects a bool, got {reshard_after_forward!r}")
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
        """``event`` (a ``torch.cuda.Event`` / ``torch.Event`` recorded after an optimizer step that ran on
        another stream) is waited once, by the current stream, at the root's next pre-forward, before any
        all-gather reads the parameters (each all-gather's stream waits the current stream); FSDP2 waits
        it in ``_root_pre_forward`` (``torch/distributed/fsdp/_fully_shard/_fsdp_state.py``). Set it on
        the root (any unit of the root after its first forward). Local; no host sync."""
        self._fsdp_state().comm.post_optim_event = event

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad``; with ``set_to_none`` it also frees the sharded gradient storage of
        every unit under this module that no ``.grad`` views any more, at once rather than at the next
        root forward (``optimizer.zero_grad`` cannot be seen: that storage is then freed at the next
        root forward, in any grad mode). Local."""
        super().zero_grad(set_to_none)  # type: ignore[misc]
        if set_to_none:
            for st in self._fsdp_states(True):
                if st.group is not None:
                    st.group.grads.release_unused_sharded()

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
        if (
            isinstance(max_input_buffers, bool)
            or not isinstance(max_input_buffers, int)
            or max_input_buffers < 1
        ):
            raise ValueError(
                f"set_reduce_scatter_max_input_buffers: max_input_buffers={max_input_buffers!r} must be an "
                f"int >= 1"
            )
        for st in self._fsdp_states(recurse):
            st.comm.reduces.max_inflight = max_input_buffers

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated in torch: use :meth:`set_gradient_divide_factor`."""
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted for API parity. raggedfsdp reduce-scatters with ``AVG`` (or ``SUM`` plus one in-place
        scale with a custom divide factor); the reduced gradients are the same up to rounding either way."""
        self._fsdp_state()._force_sum_reduction = bool(enable)

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """With ``True``, every trainable parameter of the unit gets a ``.grad`` after a backward that
        reduces its gradients: zeros for a parameter no rank used, as torch's FSDP2 (which reduce-scatters
        a zero gradient for it). With ``False`` (the default) such a parameter keeps ``grad=None``; whether
        a parameter was used is decided over all ranks either way. raggedfsdp always reduce-scatters a
        unit's whole flat gradient buffer (zeros where this rank did not use a parameter), so ranks with
        different control flow never issue mismatched collectives with either setting. Local (every rank
        should set the same value)."""
        for st in self._fsdp_states(recurse):
            st._reduce_scatter_unused_params = bool(reduce_scatter_unused_params)
            if st.group is not None:
                st.group.reduce_scatter_unused_params = bool(reduce_scatter_unused_params)

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """Accepted for API parity (a CUDA stream-allocation choice of torch's): raggedfsdp's pre-forward
        all-gather is issued on the all-gather stream and waited on the compute stream either way."""
        for st in self._fsdp_states(True):
            st._unshard_async_op = bool(async_op)

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Only ``False`` (the default) is supported: the unsharded buffers are the collectives' own
        input/output (no staging buffers to allocate from the process group). Raises
        ``NotImplementedError`` for ``True``."""
        if enable:
            _unsupported(
                "set_allocate_memory_from_process_group_for_comm(True)",
                "raggedfsdp's all-gather and reduce-scatter run in place on the unit's flat buffers",
            )

    def set_custom_all_gather(self, comm) -> None:
        """Not supported (raises ``NotImplementedError``): the all-gather runs in place on the flat buffer."""
        _unsupported("set_custom_all_gather", "the all-gather runs in place on the unit's flat buffer")

    def set_custom_reduce_scatter(self, comm) -> None:
        """Not supported (raises ``NotImplementedError``): the reduce-scatter runs in place on the flat
        buffer."""
        _unsupported(
            "set_custom_reduce_scatter", "the reduce-scatter runs in place on the unit's flat buffer"
        )

    def set_all_reduce_hook(self, hook, *, stream=None) -> None:
        """``hook(reduce_output)`` runs on this unit's reduced gradient shard, in place, after the
        reduce-scatter (HSDP: after the replicate all-reduce) and before the gradients are divided and
        installed, as torch's (``torch/distributed/fsdp/_fully_shard/_fully_shard.py``). ``reduce_output``
        is this rank's 1-D flat shard of the unit's gradients in ``reduce_dtype`` (padding included; its
        size is raggedfsdp's layout, not torch's). With ``stream`` (not allowed with HSDP, as torch) it
        runs on that stream, ordered after the reduction and before the install. Local setting; every
        rank should set it. Raises ``ValueError`` for ``stream`` with HSDP, ``TypeError`` for a
        non-callable ``hook``."""
        if hook is not None and not callable(hook):
            raise TypeError(f"set_all_reduce_hook: hook must be callable, got {type(hook).__name__}")
        g = self._fsdp_state().group
        if g is None:
            return
        if stream is not None and g.is_hsdp:
            raise ValueError("set_all_reduce_hook: stream cannot be set when using native HSDP")
        g.all_reduce_hook, g.all_reduce_hook_stream = hook, stream

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Only ``False`` is supported (raises ``NotImplementedError`` for ``True``)."""
        if enable:
            _unsupported(
                "set_separate_reduce_scatter_group(True)", "all collectives of a unit use its mesh's group"
            )

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Not supported (raises ``NotImplementedError``): no symmetric-memory all-gather yet."""
        _unsupported("set_symm_mem_for_comm", "no symmetric-memory all-gather yet")

    # torch 2.15 added these three to FSDPModule; without them here torch's code would run on our state.
    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """Not supported (``NotImplementedError``; torch 2.15 API): unsharded storage is freed."""
        _unsupported("set_keep_unsharded_storage", "the unsharded flat buffer's storage is freed at reshard")

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """Not supported (``NotImplementedError``; torch 2.15 API): backward finalizes itself."""
        _unsupported("set_manual_backward_finalization", "the final backward callback finalizes")

    def finalize_backward(self, *, async_op: bool = False) -> None:
        """Not supported (``NotImplementedError``; torch 2.15 API): backward finalizes itself."""
        _unsupported("finalize_backward", "the final backward callback finalizes")

    def _apply(self, *args, **kwargs):
        # `.to()`, `.to_empty()`, `.float()` replace local tensors: reshard, then re-point sharded params
        # at a fresh flat buffer (torch's FSDP2 does the same via reset_sharded_param)
        for st in self._fsdp_states(True):
            if st.group is not None:
                st.group.reshard()
        ret = super(torch_fsdp.FSDPModule, self)._apply(*args, **kwargs)  # type: ignore[misc]  # skip torch's
        for st in self._fsdp_states(True):
            if st.group is not None:
                st.group.reset_sharded_storage()
        return ret

    def __deepcopy__(self, memo):
        raise FSDPDeepcopyError(
            "FSDP does not support deepcopy. Please use state dict for serialization. "
            "raggedfsdp: deepcopy of a fully_shard'ed module is not supported; deepcopy before fully_shard, "
            "or copy through a state dict"
        )


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Let several ``fully_shard`` roots (e.g. the model chunks of pipeline stages) use one set of
    all-gather / reduce-scatter / all-reduce streams, as torch's ``share_comm_ctx``
    (``torch/distributed/fsdp/_fully_shard/_fully_shard.py``), so memory is not fragmented across
    per-root streams. Call it after ``fully_shard`` (before or after the first forward). Only the
    streams are shared: each root keeps its own in-flight reductions and agreement checks. Local.
    Raises ``ValueError`` (also ``TypeError``) for a module that raggedfsdp did not shard."""
    if len(modules) == 0:
        return
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise FSDPTypeError(
                f"share_comm_ctx: expects a list of raggedfsdp FSDPModules, got {type(m).__name__}; call "
                "raggedfsdp.fully_shard on it first"
            )
    shared: dict = {}
    for m in modules:
        for st in m._fsdp_states(True):
            st.shared_streams = shared
    for m in modules:  # roots already initialised by a forward: share now
        st = m._fsdp_state()
        if st.is_root:
            share_streams(st.comm, shared)


def _unsupported(what: str, why: str) -> None:
    raise NotImplementedError(
        f"raggedfsdp: FSDPModule.{what} is not supported ({why}); use torch.distributed.fsdp.fully_shard "
        "for this module if you need it (docs/fsdp.md, 'Not yet matched from FSDP2')"
    )


def _check_fsdp_modules(modules, name: str) -> None:
    for m in modules:
        if not isinstance(m, FSDPModule):  # also ValueError, as torch's _assert_all_fsdp_modules
            raise FSDPTypeError(
                f"{name}: expects raggedfsdp FSDPModules, got {type(m).__name__}; call "
                "raggedfsdp.fully_shard on it first"
            )


_UNSET = object()


def set_runtime_options(module, *, early_free=_UNSET, agreement_check=_UNSET, debug=_UNSET) -> None:
    """Set the FSDP runtime's knobs (:class:`~raggedfsdp.fsdp._common.RuntimeOptions`) of every unit
    under the ``fully_shard``'ed ``module`` (before its first forward; after it the root's units share
    one options object, so any of them sets it for all). Arguments left out keep their values.

    Args:
        early_free: bool, free finished reduce-scatter inputs at the gradient hooks (Note [early free] in
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
        raise TypeError(
            f"set_runtime_options: {type(module).__name__} is not a fully_shard'ed module; call "
            "fully_shard on it first"
        )
    if early_free is not _UNSET and not isinstance(early_free, bool):
        raise TypeError(f"set_runtime_options: early_free must be a bool, got {early_free!r}")
    if agreement_check is not _UNSET and agreement_check not in AGREEMENT_CHECKS:
        raise ValueError(
            f"set_runtime_options: agreement_check={agreement_check!r} must be one of "
            f"{', '.join(map(repr, AGREEMENT_CHECKS))}"
        )
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
