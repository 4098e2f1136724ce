"""``torch.func`` transforms through FSDP units with ``param_dtype`` set (issue 39 item 3), against
torch's own ``fully_shard`` on the same script and a single-process float64 oracle, at ws 2.

The all-gather's cast copy-in (``DBuffer.all_gather_from``) writes in place into the unit's flat buffer;
under ``torch.func.jvp`` that write raised "During a grad (vjp, jvp, grad, etc) transform, the function
provided attempted to call in-place operation (aten::copy_) that would mutate a captured Tensor".
torch's FSDP2 runs ``unshard`` / ``wait_for_unshard`` / ``reshard`` with functorch disabled
(``_disable_functorch_if_active``, torch/distributed/fsdp/_fully_shard/_fsdp_common.py); so do we
(``raggedfsdp._compat.disable_functorch_if_active``).
"""

from __future__ import annotations

import copy

import torch
from _dist import run_distributed
from torch import nn


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 3))


def _shard(fs, param_dtype):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    m = _model()
    mp = MixedPrecisionPolicy(param_dtype=param_dtype)
    fs(m[0], mp_policy=mp)
    fs(m[2], mp_policy=mp)
    fs(m, mp_policy=mp)
    return m


def _jvp_case(rank, ws):
    from torch.distributed.fsdp import fully_shard as torch_fs
    from torch.distributed.tensor import DTensor

    import raggedfsdp

    gen = torch.Generator().manual_seed(1)
    x, v = torch.randn(3, 4, generator=gen), torch.randn(3, 4, generator=gen)
    oracle = copy.deepcopy(_model()).double()
    o_out, o_tan = torch.func.jvp(lambda a: oracle(a.double()), (x,), (v,))
    for param_dtype, tol in ((torch.float64, 1e-12), (torch.bfloat16, 0.0)):
        got = {}
        for name, fs in (("torch", torch_fs), ("ours", raggedfsdp.fully_shard)):
            m = _shard(fs, param_dtype)
            out, tan = torch.func.jvp(lambda a, m=m: m(a), (x,), (v,))
            # which params are registered sharded afterwards (torch keeps the root unsharded), and a
            # normal training step still runs
            registered = [isinstance(p, DTensor) for p in m.parameters()]
            loss = m(x).float().pow(2).sum()
            loss.backward()
            got[name] = (out, tan, loss.detach(), [p.grad.full_tensor() for p in m.parameters()], registered)
        t, o = got["torch"], got["ours"]
        assert o[0].dtype == t[0].dtype == param_dtype, (o[0].dtype, t[0].dtype)
        for a, b in zip(o[:3], t[:3]):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
        assert o[4] == t[4], (o[4], t[4])
        for a, b in zip(o[3], t[3]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        if param_dtype == torch.float64:  # the float64 oracle (single process)
            torch.testing.assert_close(o[0], o_out, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(o[1], o_tan, rtol=1e-12, atol=1e-12)


def test_jvp_through_units_with_param_dtype():
    run_distributed(_jvp_case, 2)
