"""``account_quant_time`` (raggedfsdp/buffer/quant_time.py): the quantized all-gather's quantize and
dequantize seconds and calls, opt-in.

References, independent of the accounting:

* quantize calls: the units' own payload counters (``QuantizedGather.quantizations``, one per unit per
  step) and the number of quantized units;
* dequantize calls: the all-gathers ``count_wire_bytes`` sees (every unit is quantized, so every
  all-gather of a step is a quantized unit's; at ws 1 no collective: the units' gathers, forward +
  backward re-gathers, counted by a wrapper of ``QuantizedGather.gather``);
* without the policy: the same step's all-gathers happen and the accounting records exactly 0;
* off (outside the ``with``): ``quant_time.timed`` is never entered (patched to raise), the record of
  a finished block does not move, and the step dispatches no host-syncing op (``StepCounter``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _dist import run_distributed


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64)) for _ in range(2)]
        )
        self.out = nn.Linear(64, 64)  # 4096 elements: quantized too

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return self.out(x)


def _build(mesh, policy):
    from raggedfsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = Net()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for b in model.blocks:
        fully_shard(b, mesh=mesh, mp_policy=mp, all_gather_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=mp, all_gather_policy=policy)
    return model


def _step(model, x):
    F.mse_loss(model(x).float(), torch.zeros(x.shape[0], 64)).backward()


def _case(rank, ws):
    import warnings

    from torch.distributed.device_mesh import init_device_mesh

    from raggedfsdp import QuantizedAllGatherPolicy
    from raggedfsdp.app.bench.measure import StepCounter
    from raggedfsdp.buffer import quant_gather, quant_time
    from raggedfsdp.buffer.quant_time import account_quant_time
    from raggedfsdp.buffer.wire import count_wire_bytes

    warnings.simplefilter("ignore")  # padding warnings of the tiny units
    mesh = init_device_mesh("cpu", (ws,))
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))
    gathers = [0]
    orig_gather = quant_gather.QuantizedGather.gather

    def counting_gather(self, *a, **k):
        gathers[0] += 1
        return orig_gather(self, *a, **k)

    quant_gather.QuantizedGather.gather = counting_gather
    for dtype in ("fp8_e4m3", "int8"):
        model = _build(mesh, QuantizedAllGatherPolicy(dtype))
        units = [*model.blocks, model]
        qgs = [u._raggedfsdp_state.group.quant_gather for u in units]
        assert all(q is not None for q in qgs)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(2):  # the second step: payloads rebuilt after the optimizer step
            before = [q.quantizations for q in qgs]
            gathers[0] = 0
            with count_wire_bytes() as w, account_quant_time() as qt:
                _step(model, x)
            opt.step()
            opt.zero_grad()
            built = sum(q.quantizations - b for q, b in zip(qgs, before))
            assert qt.quantize_calls == built == len(units), (qt.quantize_calls, built)
            want = w.calls["all_gather"] if ws > 1 else gathers[0]
            assert qt.dequantize_calls == want == gathers[0], (qt.dequantize_calls, want, gathers[0])
            assert qt.dequantize_calls > len(units)  # the backward re-gathers of the resharded blocks
            assert qt.quantize_seconds > 0 and qt.dequantize_seconds > 0, qt.as_dict()
            assert qt.quantize_bytes == sum(q.plan(torch.bfloat16).payload_bytes for q in qgs)
        # off: nothing recorded, the accounting's code not entered, no host-syncing op
        assert quant_time.active() is None
        kept = qt.as_dict()

        def refuse(*a, **k):
            raise AssertionError("quant_time.timed entered with accounting off")

        timed, quant_time.timed = quant_time.timed, refuse
        try:
            with StepCounter() as sc:
                _step(model, x)
        finally:
            quant_time.timed = timed
        opt.zero_grad()
        assert qt.as_dict() == kept
        assert sc.host_syncs == 0, dict(sc.sync_ops)
        with account_quant_time(), pytest.raises(RuntimeError, match="nesting"):
            with account_quant_time():
                pass
        assert quant_time.active() is None
    # without the policy: the same step gathers, and the accounting records exactly 0
    plain = _build(mesh, None)
    with count_wire_bytes() as w, account_quant_time() as qt:
        _step(plain, x)
    assert ws == 1 or w.calls["all_gather"] > 0
    assert qt.as_dict() == dict(
        quantize_seconds=0.0, dequantize_seconds=0.0, quantize_calls=0, dequantize_calls=0
    )
    quant_gather.QuantizedGather.gather = orig_gather


@pytest.mark.parametrize("ws", [1, 3])
def test_quant_time_counts_every_quantize_and_dequantize(ws):
    run_distributed(_case, ws)
