"""bf16-wire, fp32-accumulate reduce-scatter (``FSDPModule.set_reduce_scatter_wire_dtype``) against a float64
oracle: the gradients of one backward of the same model and global batch, computed in float64 on one
process.

* fp32 params: the bf16-wire reduce-scatter's gradients are closer to the oracle than a plain bf16
  reduce-scatter's (``reduce_dtype=torch.bfloat16``, every partial sum rounded to bf16), and the fp32
  reduce-scatter's are closer still;
* bf16 params, ``reduce_dtype`` fp32: the gradients are bf16 values, so the bf16 wire loses nothing: the
  result equals the fp32 reduce-scatter's up to the order of the fp32 sum;
* wire bytes: the all-to-all moves half the bytes of the fp32 reduce-scatter (counted by
  ``count_wire_bytes``; on gloo raggedfsdp issues that reduce-scatter as an all-reduce of the same buffer).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _dist import run_distributed

D = 96


def _net():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(D, 4 * D),
        nn.GELU(),
        nn.Linear(4 * D, D),
        nn.LayerNorm(D),
        nn.Linear(D, 4 * D),
        nn.GELU(),
        nn.Linear(4 * D, 7),
    )


def _data(batch):
    g = torch.Generator().manual_seed(3)
    return torch.randn(batch, D, generator=g) * 3, torch.randint(0, 7, (batch,), generator=g)


def _grads(rank, ws, mesh, pdt, rdt, wire):
    from raggedfsdp import MixedPrecisionPolicy, fully_shard
    from raggedfsdp.buffer.wire import count_wire_bytes

    model = _net()
    mp = MixedPrecisionPolicy(param_dtype=pdt, reduce_dtype=rdt)
    for i in (0, 2, 4, 6):
        fully_shard(model[i], mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    if wire is not None:
        model.set_reduce_scatter_wire_dtype(wire)
    x, y = _data(8 * ws)
    per = x.shape[0] // ws
    loss = F.cross_entropy(model(x[rank * per : (rank + 1) * per]).float(), y[rank * per : (rank + 1) * per])
    with count_wire_bytes() as w:
        loss.backward()
    return {n: p.grad.full_tensor().double() for n, p in model.named_parameters()}, w


def _err(g, ref):
    num = sum(float((g[n] - ref[n]).pow(2).sum()) for n in ref)
    return (num / sum(float(ref[n].pow(2).sum()) for n in ref)) ** 0.5


def _case(rank, ws, out_q):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ws,))
    oracle = copy.deepcopy(_net()).double()
    x, y = _data(8 * ws)
    F.cross_entropy(oracle(x.double()), y).backward()
    ref = {n: p.grad for n, p in oracle.named_parameters()}

    g32, w32 = _grads(rank, ws, mesh, None, None, None)
    g16, _ = _grads(rank, ws, mesh, None, torch.bfloat16, None)
    gw, ww = _grads(rank, ws, mesh, None, None, torch.bfloat16)
    e32, e16, ew = _err(g32, ref), _err(g16, ref), _err(gw, ref)
    assert e32 < ew < 0.85 * e16, (e32, ew, e16)
    # the all-to-alls (one per unit) move half the bytes of the fp32 reduce-scatters; both runs also
    # all-reduce the same small used-parameter flags, and all-gather the same params
    assert ww.calls["all_to_all"] == 5 and ww.reduce_scatter == 0, ww.by_op
    assert 2 * ww.all_to_all == w32.reduce_scatter, (ww.by_op, w32.by_op)
    assert ww.all_reduce == w32.all_reduce and ww.all_gather == w32.all_gather, (ww.by_op, w32.by_op)

    # bf16 params, fp32 reduce: the bf16 wire is exact, only the fp32 summation order differs
    a, _ = _grads(rank, ws, mesh, torch.bfloat16, torch.float32, None)
    b, _ = _grads(rank, ws, mesh, torch.bfloat16, torch.float32, torch.bfloat16)
    for n in a:
        torch.testing.assert_close(b[n], a[n], rtol=1e-6, atol=1e-9)
    if rank == 0:
        out_q.put((ws, e32, ew, e16))


@pytest.mark.parametrize("ws", [3, 4])
def test_bf16_wire_reduce_scatter_vs_float64_oracle(ws):
    import torch.multiprocessing as mp

    q = mp.get_context("spawn").Queue()
    run_distributed(_case, ws, q)
    print("ws, relative error of fp32 RS, bf16-wire RS, bf16 RS:", q.get(timeout=60))


def test_bad_wire_dtype():
    from raggedfsdp.fsdp._module import FSDPModule

    with pytest.raises(TypeError, match="dtype=torch.float32 must be None, torch.bfloat16 or torch.float16"):
        FSDPModule.set_reduce_scatter_wire_dtype(object.__new__(FSDPModule), torch.float32)
