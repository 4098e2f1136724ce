"""Per-module FSDP state: forward/backward hooks, root lazy init, prefetch (mirrors torch's
``torch/distributed/fsdp/_fully_shard/_fsdp_state.py``).

Note [hook order]
    pre-forward   : (root: lazy init) -> cast inputs -> unshard + wait -> explicit forward prefetch ->
                    wrap grad-requiring inputs in ``RegisterPostBackward`` (its backward runs after the
                    module's own backward)
    post-forward  : reshard if ``reshard_after_forward`` -> record order -> hook outputs' grads
    pre-backward  : (root: queue the final callback) -> unshard + wait -> pre-set grad views ->
                    prefetch the unit that ran forward before this one (or the explicit list)
    post-backward : reduce-scatter in place (async, one in flight) -> reshard
    final callback: post-backward for units whose inputs needed no grad, wait for the last
                    reduce-scatter, reset per-iteration state.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from raggedfsdp.fsdp._param_group import FSDPParamGroup


class _RegisterPostBackward(torch.autograd.Function):
    """Identity on the module's inputs; its backward runs once the inputs' grads are computed."""

    @staticmethod
    def forward(ctx, state, *inputs):
        ctx.state = state
        return inputs if len(inputs) != 1 else inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.state._post_backward()
        return (None,) + grads


class FSDPState:
    """Hook state of one ``fully_shard``'ed module (one FSDP unit)."""

    def __init__(self, modules: tuple[nn.Module, ...], group: FSDPParamGroup | None, mp_policy,
                 reshard_after_forward: bool | None):
        self.modules = modules
        self.group = group
        self.mp_policy = mp_policy
        self._auto_reshard = reshard_after_forward is None
        self.reshard_after_forward = True if reshard_after_forward is None else bool(reshard_after_forward)
        self.is_root: bool | None = None
        self.root: FSDPState | None = None
        self.all_states: list[FSDPState] = []  # root only: every state under it, in module order
        self.forward_order: list[FSDPState] = []  # root only: post-forward order this iteration
        self.forward_prefetch: list[FSDPState] = []
        self.backward_prefetch: list[FSDPState] | None = None
        self.unshard_in_backward = True
        self._post_backward_done = False
        self._pre_backward_done = False
        self._final_callback_queued = False

    # ---- root / lazy init -----------------------------------------------------------------
    def _lazy_init(self) -> None:
        if self.is_root is not None:
            return
        self.is_root = True
        self.root = self
        seen = []
        for module in self.modules:
            for sub in module.modules():
                st = getattr(sub, "_raggedfsdp_state", None)
                if st is not None and st not in seen:
                    seen.append(st)
        for st in seen:
            if st is self:
                continue
            if st.is_root:
                raise RuntimeError(
                    "raggedfsdp: a nested fully_shard module already ran forward as a root; run forward on the "
                    "outermost module first (or call fully_shard on the root before any forward)"
                )
            st.is_root = False
            st.root = self
        self.all_states = seen
        if self._auto_reshard:
            self.reshard_after_forward = False  # root: backward needs its params right away

    # ---- forward --------------------------------------------------------------------------
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        self._lazy_init()
        root = self.root
        if self.is_root:
            root.forward_order.clear()
            for st in root.all_states:
                st._post_backward_done = False
                st._pre_backward_done = False
                if st.group is not None:
                    st.group.finish_reduce()
        if self.mp_policy.cast_forward_inputs and self.mp_policy.param_dtype is not None:
            dt = self.mp_policy.param_dtype
            args, kwargs = tree_map(
                lambda t: t.to(dt) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, (args, kwargs)
            )
        if self.group is not None:
            self.group.unshard()
            self.group.wait_for_unshard()
        for st in self.forward_prefetch:
            if st.group is not None:
                st.group.unshard(async_op=True)
        if torch.is_grad_enabled() and self.group is not None and self.group.any_trainable:
            flat, spec = tree_flatten((args, kwargs))
            idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
            if idx:
                outs = _RegisterPostBackward.apply(self, *[flat[i] for i in idx])
                outs = (outs,) if isinstance(outs, torch.Tensor) else outs
                for i, o in zip(idx, outs):
                    flat[i] = o
                args, kwargs = tree_unflatten(flat, spec)
        return args, kwargs

    def _post_forward(self, module: nn.Module, args: Any, output: Any):
        if self.group is not None and self.reshard_after_forward and not _in_backward():
            self.group.reshard_after_forward()
        if self.root is not None and not _in_backward():
            self.root.forward_order.append(self)
        if self.is_root and not torch.is_grad_enabled() and not _in_backward():
            for st in self.all_states:  # no backward will come: do not keep stale unsharded params
                if st.group is not None:
                    st.group.reshard()
                    st.group.post_forward_buf = None  # int reshard_after_forward slice
        if torch.is_grad_enabled():
            flat, _ = tree_flatten(output)
            for t in flat:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._pre_backward)
        if self.mp_policy.output_dtype is not None:
            dt = self.mp_policy.output_dtype
            output = tree_map(
                lambda t: t.to(dt) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, output
            )
        return output

    # ---- backward -------------------------------------------------------------------------
    def _pre_backward(self, grad: torch.Tensor):
        root = self.root
        if root is not None and not root._final_callback_queued:
            root._final_callback_queued = True
            Variable._execution_engine.queue_callback(root._root_post_backward_final)
        if self._pre_backward_done and self.group is not None and self.group.is_unsharded:
            return grad
        self._pre_backward_done = True
        self._post_backward_done = False
        if self.group is not None:
            if self.unshard_in_backward:
                self.group.unshard()
                self.group.wait_for_unshard()
            # else (set_unshard_in_backward(False), e.g. an embedding whose backward never reads its
            # weight): no all-gather; autograd still accumulates into the unsharded grad views
            self.group.prepare_grads()
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
            if st.group is not None and not st._post_backward_done:
                st.group.unshard(async_op=True)

    def _post_backward(self) -> None:
        if self.group is None:
            return
        self._post_backward_done = True
        self._pre_backward_done = False
        self.group.post_backward()

    def _root_post_backward_final(self) -> None:
        for st in self.all_states:
            g = st.group
            if g is None:
                continue
            if g.is_unsharded or g.pending_unshard is not None or g.grads_pending or g.grad_buf.is_allocated:
                if not st._post_backward_done or g.is_unsharded or g.grads_pending:
                    g.post_backward()
        for st in self.all_states:
            if st.group is not None:
                st.group.finish_reduce()
            st._post_backward_done = False
            st._pre_backward_done = False
        self._final_callback_queued = False
        self.forward_order.clear()


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1
