"""In-place random ops (``normal_``, ``uniform_``, ...) on RaggedShard DTensors.

A model's own init (``reset_parameters``, ``nn.init.*``) runs on sharded parameters after
meta-device construction. Each rank generates the *full* tensor from the default generator (all
ranks consume the same random stream, so they stay in step) and keeps its own flat piece. The
gathered result therefore equals what the same init gives on one device with the same seed: a
sharded model initialises exactly like an unsharded one. Cost: one temporary full-size tensor per
parameter during init. Not collective.

Installed by ``raggedfsdp/_torch_patches.py`` as DTensor custom op handlers; for DTensors without
a RaggedShard the handler steps aside and torch's own dispatch runs.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from raggedfsdp.placement.ragged_shard import RaggedShard

aten = torch.ops.aten

RANDOM_INPLACE_OPS = [
    aten.normal_.default,
    aten.uniform_.default,
    aten.bernoulli_.float,
    aten.exponential_.default,
    aten.log_normal_.default,
    aten.cauchy_.default,
    aten.geometric_.default,
]
RANDOM_INPLACE_OPS += [getattr(aten.random_, o) for o in aten.random_.overloads()]


def _ragged_dim(t) -> int | None:
    if not isinstance(t, DTensor):
        return None
    for i, p in enumerate(t.placements):
        if isinstance(p, RaggedShard):
            return i
    return None


def random_inplace_handler(op_call, args, kwargs):
    """DTensor custom handler: full-tensor generation, keep the local flat piece (see module doc)."""
    self = args[0]
    dim = _ragged_dim(self)
    if dim is None:
        handlers = DTensor._op_dispatcher._custom_op_handlers
        mine = handlers.pop(op_call)
        try:
            return op_call(*args, **kwargs)
        finally:
            handlers[op_call] = mine
    local = self._local_tensor
    full = torch.empty(self.shape, dtype=self.dtype, device=local.device)
    op_call(full, *args[1:], **kwargs)
    placement = self.placements[dim]
    rank = self.device_mesh.get_local_rank(dim)
    a, b = placement.flat_range(self.shape, rank)
    with torch.no_grad():
        local.view(-1).copy_(full.reshape(-1)[a:b])
    return self


def install(custom_handlers: dict) -> list:
    """Register the handler for every op in :data:`RANDOM_INPLACE_OPS`; returns the ops registered."""
    for op in RANDOM_INPLACE_OPS:
        custom_handlers[op] = random_inplace_handler
    return list(RANDOM_INPLACE_OPS)
