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
- ``peak_memory``: ``raggedfsdp.app.bench.memory.PeakMemory`` (the project's shared method: CUDA allocator
  peak on GPU; CPU allocator events from ``torch.profiler`` on CPU).
"""

from __future__ import annotations

import collections
import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# The bench worker switches c10's process-wide CPU accounting on before it builds any model
# (``bench.memory.enable_cpu_allocator_accounting``; importing changes nothing): a block allocated
# before that is unknown to c10, so a buffer freed and re-grown every step would count as never freed.
from raggedfsdp.app.bench.memory import PeakMemory, storage_bytes
from raggedfsdp.fsdp import fsdp_units

aten = torch.ops.aten
_SYNC_OPS = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten.is_nonzero.default,
    aten.equal.default,
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
                self.trace.append(
                    (
                        name,
                        ti[0].numel(),
                        ti[0].dtype,
                        to[0].numel() if to else 0,
                        to[0].dtype if to else ti[0].dtype,
                    )
                )
        elif (
            func in _SYNC_OPS
            or pkt in _SYNC_PACKETS
            or (func in (aten._to_copy.default, aten.copy_.default) and _is_d2h(func, args, kwargs))
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
        return sum(u.padding_bytes for u in fsdp_units(model))
    from torch.distributed.tensor import DTensor, Shard

    total = 0
    for p in model.parameters():
        d0, m = p.shape[0], world_size
        if isinstance(p, DTensor) and p.device_mesh.ndim > 1:  # FSDP dim 0, then EP/TP Shard(0) dims
            m = p.device_mesh.size(0)
            d0 //= math.prod(
                p.device_mesh.size(j) for j, pl in enumerate(p.placements) if j and pl == Shard(0)
            )
        rows = -(-d0 // m) * m
        total += (rows - d0) * (math.prod(p.shape) // max(p.shape[0], 1)) * p.element_size()
    return total


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes this rank holds between steps: sharded parameters, their ``.grad``, optimizer state and
    the FSDP runtime's own persistent buffers (raggedfsdp: a unit's pinned sharded gradient buffer
    under offload -- otherwise the ``.grad`` views own that storage and ``zero_grad(set_to_none=True)``
    frees it, Note [sharded grad lifetime] -- and any unsharded buffer kept allocated, e.g.
    ``reshard_after_backward=False``). Distinct storages, local pieces.

    The bench's peak is this plus the step's peak above its start, so everything live at the step's
    start must be counted here, or a system that keeps a buffer across steps would be under-reported."""
    tensors = list(model.parameters()) + [p.grad for p in model.parameters()]
    for st in optimizer.state.values():
        tensors += [v for v in st.values() if isinstance(v, torch.Tensor)]
    for unit in fsdp_units(model):  # the runtime's own buffers, as it reports them
        tensors += unit.storages
    return storage_bytes(tensors)


def peak_memory(device: torch.device):
    """``raggedfsdp.app.bench.memory.PeakMemory(device)``: the shared peak-memory method (docs/memory.md)."""
    return PeakMemory(device)


def to_comm_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``, the device of the default process group's collectives (CUDA under NCCL,
    which has no CPU backend: a CPU tensor raises "No backend type associated with device type cpu";
    CPU under gloo). Every tensor the bench hands to a collective goes through here. Local."""
    return t.to(device)


def host_all_reduce(t: torch.Tensor, device: torch.device, op=None) -> torch.Tensor:
    """All-reduce a small host tensor (timings, memory, losses) on ``device``; the result on the host.
    Collective over the default group (every rank calls it with the same shape)."""
    import torch.distributed as dist

    d = to_comm_device(t, device)
    dist.all_reduce(d, op=op if op is not None else dist.ReduceOp.SUM)
    return d.cpu()


def host_all_gather(t: torch.Tensor, device: torch.device) -> list[torch.Tensor]:
    """All-gather a small host tensor on ``device``; every rank's copy on the host. Collective."""
    import torch.distributed as dist

    d = to_comm_device(t, device)
    outs = [to_comm_device(torch.zeros_like(t), device) for _ in range(dist.get_world_size())]
    dist.all_gather(outs, d)
    return [o.cpu() for o in outs]


def replay_collectives(trace, device, reps: int = 3) -> tuple[float, float]:
    """Run ``trace`` (a :class:`StepCounter` ``trace``) alone, one blocking collective after another on
    the default group with fresh buffers: the communication a step's collectives cost without any
    compute, hook or copy around them. Returns ``(wall, cpu)`` seconds, medians over ``reps``: wall is
    the slowest rank's, cpu is this process's CPU time (``time.process_time``: all its threads,
    gloo's workers included), this rank's own (the caller averages over ranks as it does the steps').
    Collective: every rank calls it with the same trace. Ops other than all-gather / reduce-scatter /
    all-reduce are skipped."""
    import statistics
    import time

    import torch.distributed as dist

    from raggedfsdp.buffer import all_gather_single, reduce_scatter_single

    bufs = [
        (
            op,
            to_comm_device(torch.zeros(n0, dtype=d0), device),
            to_comm_device(torch.zeros(n1, dtype=d1), device),
        )
        for op, n0, d0, n1, d1 in trace
    ]
    times, cpus = [], []
    for _ in range(reps):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        for op, out, inp in bufs:
            if op.startswith("_allgather_base"):
                all_gather_single(out, inp)
            elif op.startswith("_reduce_scatter_base"):
                reduce_scatter_single(out, inp)
            elif op.startswith("allreduce"):
                dist.all_reduce(out)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        cpus.append(time.process_time() - c0)
        t = host_all_reduce(
            torch.tensor([time.perf_counter() - t0], dtype=torch.float64), device, dist.ReduceOp.MAX
        )
        times.append(float(t))
    return statistics.median(times), statistics.median(cpus)
