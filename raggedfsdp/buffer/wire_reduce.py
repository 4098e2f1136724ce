"""Low-precision-wire, fp32-accumulate reduce-scatter: an all-to-all of bf16 pieces plus a local fp32 sum.

Note [bf16-wire reduce-scatter]
    A reduce-scatter in ``reduce_dtype`` fp32 moves 4 bytes a gradient element; one in bf16 moves 2 but
    rounds every partial sum of the ring (or tree) to bf16, so its error grows with the number of ranks.
    Opted in per unit (``FSDPModule.set_reduce_scatter_wire_dtype(torch.bfloat16)``), the unit's
    unsharded gradients (``(m*S,)``; the ``reduce_dtype`` accumulator or the ``param_dtype`` grads) are
    cast once to the wire dtype, exchanged with one ``all_to_all_single`` (rank ``k`` receives every
    rank's ``k``-th ``(S,)`` piece: ``m*S`` wire elements, as a reduce-scatter's input) and summed on the
    receiving rank in ``reduce_dtype`` (``torch.sum(..., dtype=)``: one rounding of each rank's value to
    the wire dtype, no rounding of partial sums to it). With ``param_dtype`` bf16 and ``reduce_dtype``
    fp32 -- the common mixed-precision setting -- the gradients *are* bf16 values, so the cast is exact
    and the result is the fp32 reduce-scatter's up to summation order, at half its bytes.

    Sources: VeOmni (all-to-all of bf16 gradient pieces, fp32 sum), NCCL 2.27's symmetric-memory
    kernels with fp32 accumulation of bf16 inputs, Megatron-LM's ``--grad-reduce-in-bf16`` discussion.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from raggedfsdp._release import handoff, hold_until_released, use_count
from raggedfsdp.buffer.streams import CommHandle, current_stream, on_stream, wait_stream

WIRE_DTYPES = (torch.bfloat16, torch.float16)


def reduce_scatter_wire(
    bufs, group, *, out, op=dist.ReduceOp.SUM, stream=None, wire_dtype=torch.bfloat16
) -> tuple[CommHandle, object]:
    """Reduce-scatter ``bufs``' unsharded grads into ``out`` (a ``(S,)`` :class:`DBuffer`, any float dtype)
    with ``wire_dtype`` on the wire and the sum in ``out``'s dtype (Note [bf16-wire reduce-scatter]).

    Same contract as :meth:`raggedfsdp.buffer.UnitBuffers.reduce_grads`: returns ``(handle, input)``;
    ``input`` (the DBuffer the collective read) stays allocated until ``handle`` is waited, then the
    caller frees it. ``handle.wait(stream)`` completes the local sum into ``out`` (on ``stream``) the first
    time. ``op``: ``SUM`` or ``AVG`` (sum, then one division by the group size in ``out``'s dtype).
    Collective over ``group`` (every rank of it must call it, in the same order). One rank: delegates to
    ``reduce_grads`` (a local copy).
    """
    if bufs.grad_layout.world_size == 1:
        return bufs.reduce_grads(group, out=out, op=op, stream=stream)
    if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        raise ValueError(f"reduce_scatter_wire: op={op} must be ReduceOp.SUM or ReduceOp.AVG")
    if bufs.acc is not None and bufs.acc.is_allocated:
        inp = bufs.acc
        if bufs.grads.is_allocated:
            inp.data.add_(bufs.grads.data)
            bufs.grads.free()
    else:
        inp = bufs.grads
    m, S = bufs.grad_layout.world_size, bufs.grad_layout.shard_size
    wait_stream(stream, current_stream(bufs.device))
    with on_stream(stream), torch.no_grad():
        send = inp.data if inp.data.dtype == wire_dtype else inp.data.to(wire_dtype)
        recv = torch.empty_like(send)
        bases = use_count(send), use_count(recv)
        work = dist.all_to_all_single(*handoff(recv, send), group=group, async_op=True)
        hold_until_released(send, bases[0])  # Note [gloo release]
        hold_until_released(recv, bases[1])
    divisor = m if op == dist.ReduceOp.AVG else None
    return _SumHandle(work, [inp, out], stream, recv.view(m, S), out.data, divisor), inp


class _SumHandle(CommHandle):
    """The all-to-all in flight; the first ``wait()`` sums the received ``(m, S)`` pieces into ``out``."""

    def __init__(self, work, buffers, stream, recv, out, divisor):
        super().__init__(work, buffers, stream, "bf16-wire reduce-scatter")
        self._recv, self._out, self._divisor = recv, out, divisor

    def wait(self, stream=None) -> None:
        super().wait(stream)
        if self._recv is not None:
            with (
                on_stream(stream if stream is not None else current_stream(self._out.device)),
                torch.no_grad(),
            ):
                torch.sum(self._recv, dim=0, dtype=self._out.dtype, out=self._out)
                if self._divisor is not None:
                    self._out.div_(self._divisor)
            self._recv = None


__all__ = ["WIRE_DTYPES", "reduce_scatter_wire"]
