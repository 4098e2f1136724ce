"""Per-module FSDP state: forward/backward hooks, root lazy init, prefetch (mirrors torch's
``torch/distributed/fsdp/_fully_shard/_fsdp_state.py``).

Note [hook order]
    pre-forward   : (root: lazy init, finish a backward that did not end) -> cast inputs -> unshard +
                    wait -> forward prefetch: the explicit list, else the unit that started forward after
                    this one in the previous iteration (FSDP2's implicit schedule, as an async all-gather)
                    -> wrap grad-requiring inputs in ``RegisterPostBackward`` (its backward runs after the
                    module's own backward)
    post-forward  : reshard if ``reshard_after_forward`` -> record order -> hook outputs' grads
    pre-backward  : (root: queue the final callback) -> unshard + wait -> pre-set grad views ->
                    prefetch the unit that ran forward before this one (or the explicit list)
    post-backward : reshard -> make room in the root's reduce queue (complete the oldest reduce-scatter,
                    free its input) -> launch this unit's reduce-scatter
    final callback: post-backward for units whose inputs needed no grad, complete every reduction,
                    exchange used-parameter flags once, set sharded ``.grad``, reset per-iteration state.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable

from raggedfsdp.fsdp._comm import CommContext
from raggedfsdp.fsdp._common import ParamState, TrainingState, state_of
from raggedfsdp.fsdp._compile import dynamo_disable
from raggedfsdp.fsdp._init import _check_no_all_gather_extension
from raggedfsdp.fsdp._param_group import FSDPParamGroup
from raggedfsdp.fsdp._tree import cast_floating, grad_tensors, map_tensors, replace_grad_tensors

# torch's FSDP2 logger (torch/distributed/fsdp/_fully_shard/_fsdp_state.py), so ``TORCH_LOGS=fsdp`` and a
# logging config written for torch show the same debug lines (``FSDP::pre_forward (0)``, ...) for our units
logger = logging.getLogger("torch.distributed.fsdp.fully_shard")


class _RegisterPostBackward(torch.autograd.Function):
    """Identity on the module's inputs; its backward runs once the inputs' grads are computed.

    ``setup_context``, ``generate_vmap_rule`` and ``jvp`` let it run under ``torch.func`` transforms
    (``jvp`` / ``vmap`` of a unit whose inputs require grad), as torch's ``RegisterPostBackwardFunction``
    (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py): the tangents pass through unchanged."""

    generate_vmap_rule = True

    @staticmethod
    def forward(state, *inputs):
        return inputs if len(inputs) != 1 else inputs[0]

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.state = inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.state._post_backward_of_module()
        return (None,) + grads

    @staticmethod
    def jvp(ctx, state_tangent, *tangents):
        # the non-tensor state has no tangent; the module's reduce is left to the backward, if any
        return tangents if len(tangents) != 1 else tangents[0]


class FSDPState:
    """Hook state of one ``fully_shard``'ed module (one FSDP unit)."""

    def __init__(
        self,
        modules: tuple[nn.Module, ...],
        group: FSDPParamGroup | None,
        mp_policy,
        reshard_after_forward: bool | None,
    ):
        self.modules = modules
        self.group = group
        self.mp_policy = mp_policy
        self._auto_reshard = reshard_after_forward is None
        self.reshard_after_forward = True if reshard_after_forward is None else bool(reshard_after_forward)
        self.is_root: bool | None = None
        self.root: FSDPState | None = None
        self.comm: CommContext = group.comm if group is not None else CommContext()
        self.all_states: list[FSDPState] = []  # root only: every state under it, in module order
        # fully_shard([m0, m1, ...]): one unit, one all-gather and one reduce-scatter per pass (FSDP2:
        # _fsdp_state.py _register_group_forward_hooks): reshard after the last module's forward and
        # reduce after the last registered module's backward
        self._group_fwd_left: set[int] = set()
        self._group_bwd_left = 0
        self._group_bwd_uncounted = False
        self.forward_order: list[FSDPState] = []  # root only: post-forward order this iteration
        self.forward_prefetch: list[FSDPState] | None = None  # None: implicit (recorded order)
        self.backward_prefetch: list[FSDPState] | None = None
        self.unshard_in_backward = True
        self.training_state = TrainingState.IDLE
        self._final_callback_queued = False  # root only: this backward's final callback is queued
        self._is_last_backward = True  # set_is_last_backward (accepted for API parity)
        self.shared_streams: dict | None = None  # share_comm_ctx: one stream set for several roots

    # ---- root / lazy init -----------------------------------------------------------------
    def _lazy_init(self) -> None:
        if self.is_root is not None:
            return
        self.is_root = True
        self.root = self
        seen = []
        for module in self.modules:
            for sub in module.modules():
                st = state_of(sub)
                if st is not None and st not in seen:
                    seen.append(st)
        for st in seen:
            if st is self:
                continue
            if st.is_root:
                raise RuntimeError(
                    "raggedfsdp: a nested fully_shard module already ran forward as a root; run forward on "
                    "the outermost module first (or call fully_shard on the root before any forward)"
                )
            st.is_root = False
            st.root = self
        self.all_states = seen
        for st in seen:  # an extension set on a sharded param after fully_shard (every rank sets it)
            for fp in st.group.fsdp_params if st.group is not None else ():
                _check_no_all_gather_extension(fp.sharded, fp.fqn, type(st.modules[0]).__name__)
        # one shared context (streams, reduce queue, order) for the whole tree
        devices = [st.group.device for st in seen if st.group is not None]
        comm = CommContext(devices[0] if devices else None, options=self.comm.options)
        comm.post_optim_event = self.comm.post_optim_event
        comm.reduces.max_inflight = max(st.comm.reduces.max_inflight for st in seen)
        if self.shared_streams is not None:
            share_streams(comm, self.shared_streams)
        names = {}
        for module in self.modules:
            for name, sub in module.named_modules():
                st = state_of(sub)
                if st is not None and id(st) not in names:
                    names[id(st)] = name or type(sub).__name__
        modnames: dict[int, str] = {}
        for module in self.modules:
            for name, sub in module.named_modules(remove_duplicate=False):
                modnames.setdefault(id(sub), name)
        for i, st in enumerate(seen):
            st.comm = comm
            if st.group is not None:
                st.group.set_root_fqns(modnames)
                st.group.comm = comm
                st.group.unit_id, st.group.unit_name = i, names.get(id(st), "?")
                fqn = next((modnames.get(id(m), "") for m in st.modules), "")
                st.group.log_suffix = f" ({fqn})" if fqn else ""  # torch's _with_fqn labels
                comm.agreement.units.append(st.group)
        for st in seen:  # params registered over the sharded ones since fully_shard (torch's lazy-init
            if st.group is not None:  # reset_sharded_param): make them the units' sharded params
                st.group.adopt_registered_params()
        if self._auto_reshard:
            self.reshard_after_forward = False  # root: backward needs its params right away

    def _compute_device(self) -> torch.device | None:
        """The device of this root's units (the first unit with parameters), ``None`` if it has none."""
        for st in self.root.all_states if self.root is not None else (self,):
            if st.group is not None:
                return st.group.device
        return None

    # ---- forward --------------------------------------------------------------------------
    @dynamo_disable  # never traced by torch.compile (fsdp/_compile.py)
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        self._lazy_init()
        in_bw = _in_backward()
        if self.is_root and not in_bw:
            logger.debug("FSDP::root_pre_forward")
            self._begin_iteration()
            args, kwargs = _inputs_to_device(args, kwargs, self._compute_device())
        if self.mp_policy.cast_forward_inputs and self.mp_policy.param_dtype is not None:
            cast = cast_floating(self.mp_policy.param_dtype)  # any structure, as FSDP2 (fsdp/_tree.py)
            args, kwargs = map_tensors(cast, args), map_tensors(cast, kwargs)
        first_of_group = True
        if len(self.modules) > 1 and not in_bw:
            first_of_group = not self._group_fwd_left
            if first_of_group:
                self._group_fwd_left = {id(m) for m in self.modules}
        if self.group is not None:
            logger.debug("FSDP::pre_forward%s", self.group.log_suffix)
            self.group.unshard()
            self.group.wait_for_unshard()
        if not in_bw and first_of_group:
            self._forward_prefetch()
        if torch.is_grad_enabled() and self.group is not None and self.group.any_trainable:
            inputs = grad_tensors((args, kwargs))  # dataclasses / NamedTuples too (fsdp/_tree.py)
            if len(self.modules) > 1 and not in_bw:
                if inputs:
                    self._group_bwd_left += 1
                else:  # this module's backward is not observable: leave the reduce to the final callback
                    self._group_bwd_uncounted = True
            if inputs:
                outs = _RegisterPostBackward.apply(self, *inputs)
                outs = (outs,) if isinstance(outs, torch.Tensor) else outs
                args, kwargs = replace_grad_tensors((args, kwargs), iter(outs))
        return args, kwargs

    def _begin_iteration(self) -> None:
        """Root pre-forward (outside backward): wait the post-optimizer event, finish a backward that did
        not reach its final callback, read the deferred agreement checks that are ready, start the
        forward order, put every state back to ``IDLE`` and release unused sharded grads. Collective only
        when a backward must be finished."""
        event, self.comm.post_optim_event = self.comm.post_optim_event, None
        if event is not None:  # set_post_optim_event: the step ran on another stream (no host sync)
            event.wait()
        if self.comm.reduces.busy:
            self.comm.reduces.finish_backward()  # a backward that did not reach the final callback
        self.comm.agreement.check_pending()  # the last backward's unit agreement, if it was deferred (CUDA)
        self.forward_order.clear()
        self.comm.start_forward()
        for st in self.all_states:
            st.training_state = TrainingState.IDLE
            st._group_fwd_left = set()
            st._group_bwd_left, st._group_bwd_uncounted = 0, False
            if (
                st.group is not None
            ):  # after optimizer.zero_grad(set_to_none=True), in any grad mode (eval too)
                st.group.grads.release_unused_sharded()

    def _forward_prefetch(self) -> None:
        nxt = self.comm.next_to_prefetch(self)  # records the order even when the explicit list is set
        targets = self.forward_prefetch if self.forward_prefetch is not None else ([nxt] if nxt else [])
        for st in targets:
            if st.group is not None:
                st.group.unshard(async_op=True)

    @dynamo_disable  # never traced by torch.compile (fsdp/_compile.py)
    def _post_forward(self, module: nn.Module, args: Any, output: Any):
        in_bw = _in_backward()
        last_of_group = True
        if len(self.modules) > 1 and not in_bw:
            self._group_fwd_left.discard(id(module))
            last_of_group = not self._group_fwd_left
        if self.group is not None:
            logger.debug("FSDP::post_forward%s", self.group.log_suffix)
        if self.group is not None and self.reshard_after_forward and not in_bw and last_of_group:
            self.group.reshard_post_forward()
        if self.root is not None and not in_bw and last_of_group:
            self.root.forward_order.append(self)
        if self.is_root and not torch.is_grad_enabled() and not in_bw:
            for st in self.all_states:  # no backward will come: do not keep stale unsharded params
                if st.group is not None:
                    st.group.reshard()
                    st.group.drop_post_forward_slice()  # int reshard_after_forward slice
        if torch.is_grad_enabled():
            for t in grad_tensors(output):  # dataclasses / NamedTuples too, as FSDP2 (fsdp/_tree.py)
                t.register_hook(self._pre_backward)
        if self.mp_policy.output_dtype is not None:
            output = map_tensors(cast_floating(self.mp_policy.output_dtype), output)
        return output

    # ---- backward -------------------------------------------------------------------------
    @dynamo_disable  # never traced by torch.compile (fsdp/_compile.py)
    def _pre_backward(self, grad: torch.Tensor):
        root = self.root
        if root is not None and not root._final_callback_queued:
            root._final_callback_queued = True
            Variable._execution_engine.queue_callback(root._root_post_backward_final)
        if (
            self.training_state is TrainingState.PRE_BACKWARD
            and self.group is not None
            and self.group.is_unsharded
        ):
            return grad  # already ran for this unit in this backward (another output's hook)
        self.training_state = TrainingState.PRE_BACKWARD
        if self.group is not None:
            logger.debug("FSDP::pre_backward%s", self.group.log_suffix)
            self.group.comm.reduces.poll()  # free finished reduce-scatter inputs first (Note [early free])
            if self.unshard_in_backward:
                self.group.unshard()
                self.group.wait_for_unshard()
            # else (set_unshard_in_backward(False), e.g. an embedding whose backward never reads its
            # weight): no all-gather; autograd still accumulates into the unsharded grad views
            self.group.grads.prepare()
            self._backward_prefetch()
        return grad

    def _backward_prefetch(self) -> None:
        targets = self.backward_prefetch
        if targets is None:
            order = self.root.forward_order if self.root is not None else []
            targets = []
            if self in order:
                i = len(order) - 1 - order[::-1].index(self)
                if i > 0:
                    targets = [order[i - 1]]
        for st in targets:
            if st.group is not None and st.training_state is not TrainingState.POST_BACKWARD:
                st.group.unshard(async_op=True)

    @dynamo_disable  # never traced by torch.compile (fsdp/_compile.py)
    def _post_backward_of_module(self) -> None:
        if len(self.modules) > 1:
            self._group_bwd_left -= 1
            if self._group_bwd_left > 0 or self._group_bwd_uncounted:
                return  # other modules of the unit still run backward (or the final callback reduces)
        self._post_backward()

    def _post_backward(self) -> None:
        if self.group is None:
            return
        self.training_state = TrainingState.POST_BACKWARD
        logger.debug("FSDP::post_backward%s", self.group.log_suffix)
        self.group.post_backward()

    @dynamo_disable  # never traced by torch.compile (fsdp/_compile.py)
    def _root_post_backward_final(self) -> None:
        logger.debug("FSDP::root_post_backward")
        for st in self.all_states:
            g = st.group
            if g is None:
                continue
            if g.owes_post_backward(st.training_state is TrainingState.POST_BACKWARD):
                logger.debug("FSDP::post_backward%s", g.log_suffix)
                g.post_backward()
            elif g.param_state is not ParamState.SHARDED:  # e.g. prefetched, never used in backward
                g.reshard(free=g.reshard_after_backward)
        try:
            self.comm.reduces.finish_backward()  # may raise CollectiveMismatchError (Note [unit agreement])
        finally:
            self._end_backward(self.all_states)

    def _end_backward(self, states: list[FSDPState]) -> None:
        """Root: the backward is over (final callback or reset): every state back to ``IDLE``. Local."""
        for st in states:
            st.training_state = TrainingState.IDLE
            st._final_callback_queued = False
            st.forward_order.clear()

    def _reset_iter_state(self) -> None:
        """Wait all in-flight work, drop it, reshard every unit, reset every per-iteration flag. Local."""
        root = self.root or self
        states = root.all_states or [self]
        root.comm.reset()
        for st in states:
            if st.group is not None:
                st.group.reset()
        root._end_backward(states)


def share_streams(comm: CommContext, shared: dict) -> None:
    """``share_comm_ctx``: the first root to build its context records its all-gather, reduce-scatter and
    all-reduce streams in ``shared``; every later root takes them (FSDP2 shares its ``FSDPCommContext``
    between pipeline-stage roots the same way). Local."""
    if not shared:
        shared.update(ag=comm.ag_stream, rs=comm.reduces.rs_stream, ar=comm.reduces.ar_stream)
    else:
        comm.ag_stream = shared["ag"]
        comm.reduces.rs_stream, comm.reduces.ar_stream = shared["rs"], shared["ar"]


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _inputs_to_device(args: tuple, kwargs: dict, device: torch.device | None) -> tuple[tuple, dict]:
    """Root pre-forward: tensor inputs on another device are moved to the units' accelerator device, as
    FSDP2's ``_root_pre_forward`` (``torch/distributed/fsdp/_fully_shard/_fsdp_state.py``, ``_to_kwargs``)
    does. Nothing moves for a CPU (or unknown) compute device. Local."""
    if device is None or device.type == "cpu":
        return args, kwargs
    move = lambda t: t.to(device) if t.device != device else t  # noqa: E731
    return map_tensors(move, args), map_tensors(move, kwargs)
