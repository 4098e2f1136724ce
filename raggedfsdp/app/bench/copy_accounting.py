"""Count the bytes copy kernels write, e.g. around FSDP collectives (a diagnostic, not collective).

``CopyCounter`` is a ``TorchDispatchMode`` recording every copy-like kernel -- ``copy_``,
``_to_copy``, ``cat``, ``split_with_sizes_copy``, ``_chunk_cat``, ``_foreach_copy_``, ``clone`` and
torch FSDP2's ``fsdp::*`` copy ops -- by the bytes it writes (its ``out=`` / in-place destination,
else its result). gloo's reduce-scatter copies its result once inside ``Work.wait()`` (a
backend-internal copy NCCL does not make); such copies go to ``backend_bytes`` instead.

Used by ``tests/dist/test_copy_accounting.py`` and ``benchmarks/fsdp_vs_torch.py``::

    with CopyCounter() as c:
        loss.backward()
    print(c.total_bytes, dict(c.calls))
"""

from __future__ import annotations

import collections
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
COPY_OPS = {
    aten.copy_.default,
    aten._to_copy.default,
    aten.cat.default,
    aten.split_with_sizes_copy.default,
    aten._chunk_cat.default,
    aten._foreach_copy_.default,
    aten.clone.default,
}


def written_bytes(func, args, kwargs, out) -> int:
    """Bytes a copy-like kernel writes (``fsdp.all_gather_copy_in`` writes only its first result)."""

    def nbytes(ts):
        ts = ts if isinstance(ts, (list, tuple)) else [ts]
        return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))

    if kwargs and "out" in kwargs:
        return nbytes(kwargs["out"])
    if func in (aten.copy_.default, aten._foreach_copy_.default):
        return nbytes(args[0])
    if str(func.overloadpacket) == "fsdp.all_gather_copy_in":
        return nbytes(out[0])
    return nbytes(out)


def _inside_collective_wait() -> bool:
    stack = traceback.extract_stack(limit=14)[:-3]  # drop this helper and the dispatch frames
    return any(f.line and f.line.strip().endswith(".wait()") for f in stack)


class CopyCounter(TorchDispatchMode):
    """Per-op bytes (``bytes``) and call counts (``calls``) of copy kernels run under it; local."""

    def __init__(self):
        super().__init__()
        self.bytes: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self.backend_bytes = 0

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        if func in COPY_OPS or name.startswith("fsdp."):
            n = written_bytes(func, args, kwargs, out)
            if _inside_collective_wait():
                self.backend_bytes += n
            else:
                self.bytes[name] += n
                self.calls[name] += 1
        return out
