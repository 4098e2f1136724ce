"""Count the collectives that reach the process group, at the c10d op (``c10d._reduce_scatter_base_``,
``c10d.allreduce_``, ...): the calls the backend runs, whatever Python function issued them.

``with CollectiveLog() as log: ...`` records ``(op name, numel of the tensors it was given)`` per call,
e.g. ``("_reduce_scatter_base", 2 * 120)`` (output + input). A ``TorchDispatchMode``: every
``torch.distributed`` collective dispatches through one of these ops on gloo and NCCL alike.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _numel(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel()
    if isinstance(x, (list, tuple)):
        return sum(map(_numel, x))
    return 0


class CollectiveLog(TorchDispatchMode):
    """The c10d ops dispatched inside the block, in order (barriers left out)."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        pkt = str(func.overloadpacket)
        if pkt.startswith("c10d.") and "barrier" not in pkt:
            self.calls.append((pkt.removeprefix("c10d.").strip("_"), _numel(args)))
        return func(*args, **(kwargs or {}))

    def count(self, name: str) -> int:
        return sum(n == name for n, _ in self.calls)

    def sizes(self, name: str) -> list[int]:
        return [s for n, s in self.calls if n == name]
