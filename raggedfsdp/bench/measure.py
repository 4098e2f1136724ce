"""What ``raggedfsdp bench`` counts besides time: collectives, host syncs, padding, state and peak memory.

All of it is local to the calling rank (no collective); the bench gathers the per-rank results.

- ``StepCounter``: a ``TorchDispatchMode`` counting every ``c10d`` collective dispatched under it
  (number and bytes: the larger of its input / output, i.e. the unsharded size of an all-gather or
  reduce-scatter) and the ops that force a device-to-host sync (``aten._local_scalar_dense``, i.e.
  ``.item()``, ``nonzero``, ``masked_select``, ``unique``, device-to-CPU copies). A ``.tolist()``
  does not dispatch and is not seen (the MoE model's one per MoE layer, the same for both systems).
  On CUDA the bench also counts the syncs ``torch.cuda.set_sync_debug_mode`` reports.
- ``padding_bytes``: bytes of padding in the collective buffers of each system's layout.
- ``state_bytes``: persistent bytes of this rank's sharded params and optimizer state.
- ``peak_memory``: ``raggedfsdp.fsdp.memory.PeakMemory`` (the project's shared method: CUDA allocator
  peak on GPU; CPU allocator events from ``torch.profiler`` on CPU).
"""

from __future__ import annotations

import collections
import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_SYNC_OPS = {
    aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
    aten.is_nonzero.default, aten.equal.default,
}
_SYNC_PACKETS = {"aten._unique2", "aten.unique_consecutive", "aten.unique_dim"}


def _tensors(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensors(y)]
    return []


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


class StepCounter(TorchDispatchMode):
    """Collectives (``calls``/``bytes`` per c10d op) and host syncs (``host_syncs``) dispatched under it."""

    def __init__(self):
        super().__init__()
        self.calls: collections.Counter = collections.Counter()
        self.bytes: collections.Counter = collections.Counter()
        self.host_syncs = 0
        self.sync_ops: collections.Counter = collections.Counter()
        # (op, numel / dtype of its first and second tensor argument): c10d ops take (output, input)
        self.trace: list[tuple[str, int, torch.dtype, int, torch.dtype]] = []

    @property
    def collectives(self) -> int:
        return sum(self.calls.values())

    @property
    def collective_bytes(self) -> int:
        return sum(self.bytes.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        pkt = str(func.overloadpacket)
        if pkt.startswith("c10d.") and "barrier" not in pkt and "monitored" not in pkt:
            ins = _nbytes(_tensors(args[0]) if args else [])
            outs = _nbytes(_tensors(args[1]) if len(args) > 1 else [])
            name = pkt.removeprefix("c10d.")
            self.calls[name] += 1
            self.bytes[name] += max(ins, outs)
            ti, to = _tensors(args[0]) if args else [], _tensors(args[1]) if len(args) > 1 else []
            if len(ti) == 1 and len(to) <= 1:
                self.trace.append((name, ti[0].numel(), ti[0].dtype, to[0].numel() if to else 0,
                                   to[0].dtype if to else ti[0].dtype))
        elif func in _SYNC_OPS or pkt in _SYNC_PACKETS or (
            func in (aten._to_copy.default, aten.copy_.default) and _is_d2h(func, args, kwargs)
        ):
            self.host_syncs += 1
            self.sync_ops[pkt] += 1
        return out


def _is_d2h(func, args, kwargs) -> bool:
    src = args[1] if func is aten.copy_.default else args[0]
    if not isinstance(src, torch.Tensor) or src.device.type == "cpu":
        return False
    if func is aten.copy_.default:
        return args[0].device.type == "cpu"
    dev = (kwargs or {}).get("device")
    return dev is not None and torch.device(dev).type == "cpu"


def padding_bytes(model: torch.nn.Module, backend: str, world_size: int) -> int:
    """Padding bytes in the sharded collective buffers of ``model`` (summed over its FSDP units).

    raggedfsdp: each unit's planned layout padding (elements) times the element size. torch's
    FSDP2 pads every parameter on dim 0 to a multiple of the world size (``ceil(d0/ws)*ws`` rows).
    """
    if backend == "ragged":
        total, seen = 0, set()
        for m in model.modules():
            st = getattr(m, "_raggedfsdp_state", None)
            g = getattr(st, "group", None)
            if g is None or id(g) in seen:
                continue
            seen.add(id(g))
            elem = torch.empty((), dtype=getattr(g, "orig_dtype", torch.float32)).element_size()
            total += int(g.layout.padding) * elem
        return total
    total = 0
    for p in model.parameters():
        d0 = p.shape[0]
        rows = -(-d0 // world_size) * world_size
        total += (rows - d0) * (math.prod(p.shape) // max(d0, 1)) * p.element_size()
    return total


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's sharded parameters plus optimizer state (distinct storages, local pieces)."""
    tensors = list(model.parameters())
    for st in optimizer.state.values():
        tensors += [v for v in st.values() if isinstance(v, torch.Tensor)]
    try:
        from raggedfsdp.fsdp.memory import storage_bytes
    except ImportError:
        storage_bytes = _storage_bytes
    return storage_bytes(tensors)


def _storage_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        t = getattr(t, "_local_tensor", t)
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            st = t.untyped_storage()
            if st.nbytes():
                seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def peak_memory(device: torch.device):
    """``raggedfsdp.fsdp.memory.PeakMemory(device)``: the shared peak-memory method (docs/memory.md)."""
    from raggedfsdp.fsdp.memory import PeakMemory

    return PeakMemory(device)


def replay_collectives(trace, device, reps: int = 3) -> float:
    """Median wall seconds of running ``trace`` (a :class:`StepCounter` ``trace``) alone, one blocking
    collective after another on the default group with fresh buffers: the communication a step's
    collectives cost without any compute, hook or copy around them. Collective: every rank calls it
    with the same trace. Ops other than all-gather / reduce-scatter / all-reduce are skipped."""
    import statistics
    import time

    import torch.distributed as dist

    from raggedfsdp.buffer.dbuffer import _all_gather_single, _reduce_scatter_single

    bufs = [(op, torch.zeros(n0, dtype=d0, device=device), torch.zeros(n1, dtype=d1, device=device))
            for op, n0, d0, n1, d1 in trace]
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        for op, out, inp in bufs:
            if op.startswith("_allgather_base"):
                _all_gather_single(out, inp)
            elif op.startswith("_reduce_scatter_base"):
                _reduce_scatter_single(out, inp)
            elif op.startswith("allreduce"):
                dist.all_reduce(out)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t))
    return statistics.median(times)

