"""Random ops (``normal_``, ``uniform_``, ``rand_like``, ...) on RaggedShard DTensors.

torch's C++ DTensor dispatch runs random ops without sharding propagation: each rank fills its
local piece from its own generator (on CPU meshes DTensor warns its random ops "may not have
complete support"). On a flat ragged piece that gives every rank the SAME leading numbers. A
model's own init (``reset_parameters``, ``nn.init.*``) runs on sharded parameters after meta-device
construction, so instead each rank generates the *full* tensor from the default generator (all
ranks consume the same random stream, so they stay in step) and keeps its own flat piece. The
gathered result therefore equals what the same init gives on one device with the same seed: a
sharded model initialises exactly like an unsharded one. Not collective.

Memory: on CPU, for in-place fills of a DTensor whose only non-Replicate placement is one
RaggedShard (every FSDP parameter), the full tensor is generated in chunks of ``CHUNK_ELEMS``
(a multiple of 16, the last chunk never shorter than 16) and only the overlap with the local flat
piece is kept: transient memory is one chunk, not the whole tensor. CPU generators consume one
draw per element in order (``normal_`` transforms 16-element blocks and recomputes the tail), so
chunked generation is bit-equal to one-shot generation (``tests/unit/test_ragged_random.py``).
Other cases (CUDA's offset-based Philox, ``*_like`` ops, Shard(d) compositions) still generate the
full tensor once. Works for RaggedShard composed with Replicate / Shard(d >= len(dims)).

Installed by ``raggedfsdp/placement/_patches.py`` as DTensor custom op handlers
(``DTensor._op_dispatcher._custom_op_handlers``, torch/distributed/tensor/_dispatch.py); for
DTensors without a RaggedShard the handler steps aside (``_patches.dispatch_without_handler``: left
out of torch's dispatch of that call, on that thread only) and torch's own dispatch runs. Random ops
whose parameters are DTensors (e.g. ``bernoulli_(p_dtensor)``) raise ``RuntimeError``.
"""

from __future__ import annotations


import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from raggedfsdp.placement._patches import dispatch_without_handler
from raggedfsdp.placement._redistribute import has_ragged, local_piece_of_full, ragged_mesh_dim

aten = torch.ops.aten


def _ops(pairs):
    out = []
    for name, ov in pairs:
        packet = getattr(aten, name, None)
        if packet is not None and ov in packet.overloads():
            out.append(getattr(packet, ov))
    return out


RANDOM_INPLACE_OPS = _ops(
    [
        ("normal_", "default"),
        ("uniform_", "default"),
        ("bernoulli_", "float"),
        ("exponential_", "default"),
        ("log_normal_", "default"),
        ("cauchy_", "default"),
        ("geometric_", "default"),
        ("random_", "default"),
        ("random_", "from"),
        ("random_", "to"),
    ]
)
RANDOM_LIKE_OPS = _ops(
    [
        ("rand_like", "default"),
        ("randn_like", "default"),
        ("randint_like", "default"),
        ("randint_like", "low_dtype"),
    ]
)

CHUNK_ELEMS = 1 << 20  # elements per generated chunk on the chunked CPU path (multiple of 16)


def _chunks(n: int, chunk: int):
    """``[start, end)`` chunks of ``[0, n)``: multiples of ``chunk``, the last one at least 16 long."""
    starts = list(range(0, n, chunk)) or [0]
    if len(starts) > 1 and n - starts[-1] < 16:
        starts.pop()
    return [(a, starts[i + 1] if i + 1 < len(starts) else n) for i, a in enumerate(starts)]


def _chunked_fill(op_call, self, args, kwargs) -> bool:
    """CPU, one RaggedShard and otherwise Replicate: generate chunk by chunk, keep the local range."""
    spec, local = self._spec, self._local_tensor
    i = ragged_mesh_dim(spec.placements)
    if local.device.type != "cpu" or i is None:
        return False
    if any(not p.is_replicate() for j, p in enumerate(spec.placements) if j != i):
        return False
    rank = spec.mesh.get_local_rank(i) if spec.mesh.ndim > 1 else spec.mesh.get_local_rank()
    a, b = spec.placements[i].flat_range(spec.shape, rank)
    flat = local.view(-1)
    with torch.no_grad():
        for c0, c1 in _chunks(spec.shape.numel(), CHUNK_ELEMS):
            tmp = torch.empty(c1 - c0, dtype=self.dtype)
            op_call(tmp, *args[1:], **kwargs)  # consumes the generator exactly as the full tensor would
            lo, hi = max(a, c0), min(b, c1)
            if lo < hi:
                flat[lo - a : hi - a].copy_(tmp[lo - c0 : hi - c0])
    return True


def _is_ragged(t) -> bool:
    return isinstance(t, DTensor) and has_ragged(t._spec.placements)


def random_inplace_handler(op_call, args, kwargs):
    """DTensor custom handler: full-tensor generation, keep the local flat piece (see module doc)."""
    self = args[0]
    if not _is_ragged(self):
        return dispatch_without_handler(op_call, args, kwargs)
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
    if _chunked_fill(op_call, self, args, kwargs):
        return self
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
            raise RuntimeError(
                f"raggedfsdp: torch now has a DTensor custom handler for {op}; port placement/_random.py"
            )
        custom_handlers[op] = random_inplace_handler
    return ops
