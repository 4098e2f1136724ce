"""The quantized all-gather's payload plan (``raggedfsdp/buffer/quant_gather.py``), single process.

Each rank's payload is packed from its shard, the payloads are concatenated as an all-gather would, and
the unpacked buffer must equal the independent reference: each full tensor quantized and dequantized on
its own (``block_quant``), unquantized tensors cast, padding zero. World sizes 1-5 and 8 (empty pieces),
layouts planned with the granularity ``fully_shard`` uses. A layout whose rank boundary cuts a block
raises ``ValueError``.
"""

from __future__ import annotations

import math

import pytest
import torch

from raggedfsdp.buffer import block_quant as bq
from raggedfsdp.buffer.quant_gather import PayloadPlan, QuantizedAllGatherPolicy
from raggedfsdp.planner import plan_layout

SHAPES = [(64,), (96, 64), (96,), (64, 96), (2, 32, 40), (10, 104), (3, 5), (0, 8), (128, 33)]


def _layout(shapes, ws, policy, granularity=None):
    gs = []
    for s in shapes:
        n = math.prod(s)
        g = 1 if granularity is None else granularity
        if n and policy.eligible(s) and granularity is None:
            g = math.lcm(g, policy.granularity(s))
        gs.append(g)
    return plan_layout([math.prod(s) for s in shapes], gs, ws, align=4, order="best", shapes=shapes)


@pytest.mark.parametrize("ws", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize(
    "dtype,block,pdt", [("fp8_e4m3", (32, 32), torch.bfloat16), ("int8", (1, 16), torch.float32)]
)
def test_pack_unpack_equals_reference(ws, dtype, block, pdt):
    policy = QuantizedAllGatherPolicy(dtype, block, min_numel=1024)
    lay = _layout(SHAPES, ws, policy)
    g = torch.Generator().manual_seed(ws)
    full = [
        torch.randn(s, generator=g) * 10.0 ** torch.randint(-3, 3, (), generator=g).item() for s in SHAPES
    ]
    master = torch.zeros(lay.total_size)  # the unsharded master, padding zero
    for t, o in zip(full, lay.offsets):
        master.narrow(0, o, t.numel()).copy_(t.reshape(-1))
    plan = PayloadPlan(lay, SHAPES, policy, pdt)
    S, P = lay.shard_size, plan.payload_bytes
    gathered = torch.empty(ws * P, dtype=torch.uint8)
    for r in range(ws):
        plan.pack(master.narrow(0, r * S, S), r, gathered.narrow(0, r * P, P))
    params = torch.full((lay.total_size,), float("nan"), dtype=pdt)  # fresh storage: garbage
    plan.unpack(gathered, params)
    want = torch.zeros(lay.total_size, dtype=pdt)
    n_quant = 0
    for t, o, s in zip(full, lay.offsets, SHAPES):
        if policy.eligible(s):
            n_quant += 1
            c, sc = bq.quantize(t.reshape(-1, s[-1]), block, dtype)
            t = bq.dequantize(c, sc, block, dtype, out_dtype=pdt)
        want.narrow(0, o, t.numel()).copy_(t.reshape(-1))
    assert n_quant == (4 if block == (32, 32) else 5)
    assert torch.equal(params, want)
    # the wire: one byte a quantized element, 4 a block, param_dtype for the rest, over the largest rank
    item = torch.empty((), dtype=pdt).element_size()
    per_rank = []
    for r in range(ws):
        b = 0
        for i, s in enumerate(SHAPES):
            lo, hi = lay.piece(i, r)
            n = hi - lo
            b += n + 4 * bq.num_blocks(n // s[-1], s[-1], block) if n and policy.eligible(s) else n * item
        per_rank.append(b)
    assert max(per_rank) <= P <= max(per_rank) + 3 * 16


def test_a_block_cut_by_a_rank_boundary_raises():
    policy = QuantizedAllGatherPolicy("fp8_e4m3", (32, 32))
    shapes = [(96, 64)]  # tiles of 32 rows = 2048 elements
    lay = _layout(shapes, 4, policy, granularity=1)  # element granularity: S = 1536 cuts the first tile
    assert lay.shard_size % 2048
    with pytest.raises(
        ValueError, match=r"boundary of rank 0 cuts a 32x32 block of tensor 0 .* at element 1536"
    ):
        PayloadPlan(lay, shapes, policy, torch.bfloat16)
    PayloadPlan(_layout(shapes, 4, policy), shapes, policy, torch.bfloat16)  # fully_shard's granularity: fine
