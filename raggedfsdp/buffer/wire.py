"""Wire bytes of the collectives issued in a region: all-gather, reduce-scatter, all-reduce, all-to-all.

:func:`count_wire_bytes` counts every ``c10d`` collective dispatched while it is active, whoever issues
it (raggedfsdp's units, torch's ``fully_shard``, user code), so one measure serves both systems of a
comparison. A collective's bytes are its *size*: the larger of its input and output in bytes (the
unsharded buffer of an all-gather or reduce-scatter, the buffer of an all-reduce), the convention of
NCCL's ``busbw`` tables; what one rank of a ring sends is ``(m - 1) / m`` of it (an all-reduce: twice
that). Divide by the number of steps the region ran for a per-step figure.

On gloo raggedfsdp issues a unit's reduce-scatter as an all-reduce of the same buffer (Note on
``DBuffer.reduce_scatter_``, ``consume_input``); it is counted under ``all_reduce`` there (NCCL: under
``reduce_scatter``). Local (no collective); every rank counts its own calls.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_KINDS = (
    ("allgather", "all_gather"),
    ("reduce_scatter", "reduce_scatter"),
    ("allreduce", "all_reduce"),
    ("alltoall", "all_to_all"),
)


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensors(y)]
    return []


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


class WireBytes:
    """The counts of :func:`count_wire_bytes`: bytes and calls per kind of collective.

    Attributes: ``all_gather``, ``reduce_scatter``, ``all_reduce``, ``all_to_all``, ``other`` (bytes,
    ints); ``calls`` (a ``Counter`` by kind); ``by_op`` (bytes by c10d op name, e.g. ``_allgather_base_``).
    """

    def __init__(self):
        self.bytes: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self.by_op: collections.Counter = collections.Counter()

    def __getattr__(self, kind: str) -> int:
        if kind in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "other"):
            return self.bytes[kind]
        raise AttributeError(kind)

    def add(self, op: str, nbytes: int) -> None:
        kind = next((k for key, k in _KINDS if key in op), "other")
        self.bytes[kind] += nbytes
        self.calls[kind] += 1
        self.by_op[op] += nbytes

    def as_dict(self) -> dict[str, int]:
        """``{"all_gather_wire_bytes": ..., "reduce_scatter_wire_bytes": ..., "all_reduce_wire_bytes": ...}``
        (the bench's JSON keys)."""
        return {f"{k}_wire_bytes": self.bytes[k] for k in ("all_gather", "reduce_scatter", "all_reduce")}


class _Mode(TorchDispatchMode):
    def __init__(self, out: WireBytes):
        super().__init__()
        self.out = out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        res = func(*args, **(kwargs or {}))
        pkt = str(func.overloadpacket)
        if pkt.startswith("c10d.") and "barrier" not in pkt and "monitored" not in pkt:
            ins = _nbytes(_tensors(args[0])) if args else 0
            outs = _nbytes(_tensors(args[1])) if len(args) > 1 else 0
            self.out.add(pkt.removeprefix("c10d."), max(ins, outs))
        return res


@contextlib.contextmanager
def count_wire_bytes() -> Iterator[WireBytes]:
    """Count the bytes of every collective dispatched in the ``with`` block on this rank.

    Example: ``with count_wire_bytes() as w: train_step()`` then ``w.all_gather`` (bytes) or
    ``w.as_dict()["all_gather_wire_bytes"]``. Local; adds a Python call per dispatched op while active
    (measure it in a separate step from timings).
    """
    out = WireBytes()
    with _Mode(out):
        yield out


__all__ = ["WireBytes", "count_wire_bytes"]
