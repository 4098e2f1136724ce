"""Opt-in accounting of the quantized all-gather's local work: quantize (pack) and dequantize (unpack).

:func:`account_quant_time` records, while it is active on this rank, the seconds and the number of
calls of every :meth:`~raggedfsdp.buffer.quant_gather.PayloadPlan.pack` (each rank quantizing its
shard of the sharded master into its payload; cached once per optimizer step per unit) and
:meth:`~raggedfsdp.buffer.quant_gather.PayloadPlan.unpack` (dequantizing the gathered payloads into
the unsharded params; once per gather of a quantized unit) that raggedfsdp's units run. Only
``fully_shard(..., all_gather_policy=QuantizedAllGatherPolicy(...))`` units are seen; without the
policy the counts stay 0.

Timing: on CPU ``time.perf_counter`` around each call (the kernels run synchronously). On CUDA two
CUDA events on the stream the work is issued on, bracketing its kernels (their GPU time; other
streams' kernels running at the same time are not subtracted), read with one
``torch.cuda.synchronize`` when the ``with`` block exits -- the only host sync it adds, and only
while active. Inactive (the default), each pack / unpack costs one global read: no sync, no event.

Measure it in a separate step from timed steps (``raggedfsdp bench`` does: ``quantize_seconds`` /
``dequantize_seconds``). Local (no collective); every rank counts its own calls. Not thread-safe
(one accounting at a time per process; nesting raises).

Example::

    with account_quant_time() as qt:
        loss = model(x).sum()
        loss.backward()
    print(qt.quantize_seconds, qt.quantize_calls, qt.dequantize_seconds, qt.dequantize_calls)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

_ACTIVE: list = [None]  # the QuantTime being recorded into, or None (the default: nothing recorded)


class QuantTime:
    """The record of :func:`account_quant_time` on this rank.

    Attributes: ``quantize_seconds`` / ``dequantize_seconds`` (float seconds, read after the ``with``
    block: CUDA times are resolved on exit), ``quantize_calls`` / ``dequantize_calls`` (ints: payloads
    built, gathered payloads dequantized), ``quantize_bytes`` / ``dequantize_bytes`` (payload bytes
    written / gathered bytes read).
    """

    def __init__(self):
        self.quantize_seconds = self.dequantize_seconds = 0.0
        self.quantize_calls = self.dequantize_calls = 0
        self.quantize_bytes = self.dequantize_bytes = 0
        self._events: list[tuple[str, object, object]] = []  # CUDA: (kind, start, end)

    def as_dict(self) -> dict:
        """``{"quantize_seconds", "dequantize_seconds", "quantize_calls", "dequantize_calls"}``."""
        return dict(
            quantize_seconds=self.quantize_seconds,
            dequantize_seconds=self.dequantize_seconds,
            quantize_calls=self.quantize_calls,
            dequantize_calls=self.dequantize_calls,
        )

    def _resolve(self) -> None:
        if self._events:
            torch.cuda.synchronize()
            for kind, a, b in self._events:
                s = a.elapsed_time(b) / 1e3  # ms -> s
                setattr(self, f"{kind}_seconds", getattr(self, f"{kind}_seconds") + s)
            self._events.clear()


def active() -> QuantTime | None:
    """The :class:`QuantTime` being recorded into, or ``None`` (accounting off)."""
    return _ACTIVE[0]


@contextlib.contextmanager
def timed(acc: QuantTime, kind: str, device: torch.device, nbytes: int) -> Iterator[None]:
    """Record the work issued in the block into ``acc`` as one ``kind`` (``"quantize"`` or
    ``"dequantize"``) call on ``device``'s current stream. Called only when :func:`active` is not None."""
    setattr(acc, f"{kind}_calls", getattr(acc, f"{kind}_calls") + 1)
    setattr(acc, f"{kind}_bytes", getattr(acc, f"{kind}_bytes") + nbytes)
    if device.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        yield
        b.record()
        acc._events.append((kind, a, b))
        return
    t0 = time.perf_counter()
    yield
    setattr(acc, f"{kind}_seconds", getattr(acc, f"{kind}_seconds") + time.perf_counter() - t0)


@contextlib.contextmanager
def account_quant_time() -> Iterator[QuantTime]:
    """Account the quantized all-gather's quantize / dequantize seconds and calls in the ``with`` block
    (module docstring). Local. Raises ``RuntimeError`` when already active (nesting)."""
    if _ACTIVE[0] is not None:
        raise RuntimeError(
            "account_quant_time: already active in this process; nesting is not supported -- "
            "leave the outer `with account_quant_time()` block first"
        )
    acc = QuantTime()
    _ACTIVE[0] = acc
    try:
        yield acc
    finally:
        _ACTIVE[0] = None
        acc._resolve()


__all__ = ["QuantTime", "account_quant_time", "active"]
