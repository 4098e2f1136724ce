"""Random ops (``normal_``, ``uniform_``, ``rand_like``, ...) on RaggedShard DTensors.

torch's C++ DTensor dispatch runs random ops without sharding propagation: each rank fills its
local piece from its own generator (on CPU meshes DTensor warns its random ops "may not have
complete support"). On a flat ragged piece that gives every rank the SAME leading numbers. A
model's own init (``reset_parameters``, ``nn.init.*``) runs on sharded parameters after meta-device
construction, so instead each rank generates the *full* tensor from the default generator (all
ranks consume the same random stream, so they stay in step) and keeps its own flat piece. The
gathered result therefore equals what the same init gives on one device with the same seed: a
sharded model initialises exactly like an unsharded one. Cost: one temporary full-size tensor per
call. Not collective. Works for RaggedShard composed with Replicate / Shard(d >= len(dims)).

Installed by ``raggedfsdp/_torch_patches.py`` as DTensor custom op handlers
(``DTensor._op_dispatcher._custom_op_handlers``, torch/distributed/tensor/_dispatch.py); for
DTensors without a RaggedShard the handler steps aside (removes itself for the nested call, under
a lock) and torch's own dispatch runs. Random ops whose parameters are DTensors (e.g.
``bernoulli_(p_dtensor)``) raise ``RuntimeError``.
"""

from __future__ import annotations

import threading

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from raggedfsdp.placement._redistribute import has_ragged, local_piece_of_full

aten = torch.ops.aten


def _ops(pairs):
    out = []
    for name, ov in pairs:
        packet = getattr(aten, name, None)
        if packet is not None and ov in packet.overloads():
            out.append(getattr(packet, ov))
    return out


RANDOM_INPLACE_OPS = _ops([
    ("normal_", "default"), ("uniform_", "default"), ("bernoulli_", "float"), ("exponential_", "default"),
    ("log_normal_", "default"), ("cauchy_", "default"), ("geometric_", "default"), ("random_", "default"),
    ("random_", "from"), ("random_", "to"),
])
RANDOM_LIKE_OPS = _ops([("rand_like", "default"), ("randn_like", "default"), ("randint_like", "default"),
                        ("randint_like", "low_dtype")])

_LOCK = threading.RLock()


def _is_ragged(t) -> bool:
    return isinstance(t, DTensor) and has_ragged(t._spec.placements)


def random_inplace_handler(op_call, args, kwargs):
    """DTensor custom handler: full-tensor generation, keep the local flat piece (see module doc)."""
    self = args[0]
    if not _is_ragged(self):
        handlers = DTensor._op_dispatcher._custom_op_handlers
        with _LOCK:
            mine = handlers.pop(op_call)
            try:
                return op_call(*args, **kwargs)
            finally:
                handlers[op_call] = mine
    if any(p.is_partial() for p in self._spec.placements):
        raise RuntimeError(
            f"RaggedShard: {op_call} is not supported on RaggedShard DTensors with a Partial placement "
            f"{self._spec.placements}: a random fill of pending-sum values is ill-defined; redistribute first"
        )
    if any(isinstance(a, DTensor) for a in (*args[1:], *kwargs.values())):
        raise RuntimeError(
            f"RaggedShard: {op_call} is not supported on RaggedShard DTensors: random ops with DTensor "
            "parameters are not supported; pass plain numbers or convert the DTensor first"
        )
    spec = self._spec
    local = self._local_tensor
    if op_call in RANDOM_LIKE_OPS:
        kw = dict(kwargs)
        dtype = kw.pop("dtype", None) or self.dtype
        device = kw.pop("device", None) or local.device
        for k in ("layout", "pin_memory", "memory_format"):
            kw.pop(k, None)
        full = op_call(torch.empty(spec.shape, dtype=dtype, device=device), *args[1:], **kw)
        piece = local_piece_of_full(full, spec.mesh, spec.placements)
        meta = TensorMeta(spec.shape, spec.tensor_meta.stride, piece.dtype)
        return DTensor(piece, DTensorSpec(spec.mesh, spec.placements, tensor_meta=meta), requires_grad=False)
    full = torch.empty(spec.shape, dtype=self.dtype, device=local.device)
    op_call(full, *args[1:], **kwargs)
    with torch.no_grad():
        local.view(-1).copy_(local_piece_of_full(full, spec.mesh, spec.placements))
    return self


def install(custom_handlers: dict) -> list:
    """Register the handler for the random ops; returns the ops registered. Idempotent.

    Raises ``RuntimeError`` if torch already has its own handler for one of them (an upgrade
    that would otherwise be silently shadowed).
    """
    ops = [*RANDOM_INPLACE_OPS, *RANDOM_LIKE_OPS]
    for op in ops:
        cur = custom_handlers.get(op)
        if cur is not None and cur is not random_inplace_handler:
            raise RuntimeError(f"raggedfsdp: torch now has a DTensor custom handler for {op}; port placement/_random.py")
        custom_handlers[op] = random_inplace_handler
    return ops
