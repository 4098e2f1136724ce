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


def _no_warmup_jvp_case(rank, ws):
    """torch's ``test_no_warmup_jvp_reshard_after_forward_false``: an encoder output computed outside the
    transform (so it requires grad) feeds a decoder unit inside ``torch.func.jvp``; the unit's post-backward
    ``autograd.Function`` runs under functorch and needs ``setup_context`` and a ``jvp`` rule."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fs

    import raggedfsdp

    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("fsdp",))
    got = {}
    for name, fs in (("torch", torch_fs), ("ours", raggedfsdp.fully_shard)):
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        torch.manual_seed(0)
        enc, dec = nn.Linear(16, 24, bias=False), nn.Linear(24, 8, bias=False)
        for module in (enc, dec):
            fs(module, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(16, generator=gen, dtype=torch.bfloat16)
        primal = torch.randn(8, generator=gen, dtype=torch.bfloat16, requires_grad=True)
        tangent = torch.randn(8, generator=gen, dtype=torch.bfloat16)
        e = enc(x)
        assert e.requires_grad
        out, tan = torch.func.jvp(lambda unused: dec(e), (primal,), (tangent,))
        # a non-zero tangent through the unit (inside the transform its input reports requires_grad=False,
        # so the post-backward Function is not applied: tests/unit/test_post_backward_function.py)
        out2, tan2 = torch.func.jvp(lambda a: dec(a + e), (torch.zeros_like(e),), (e.detach() * 0.5,))
        assert tan2.abs().sum() > 0
        # the eager backward still runs the unit's post-backward (grads reduced) afterwards
        dec(enc(x)).float().sum().backward()
        got[name] = (out, tan, out2, tan2, enc.weight.grad.full_tensor(), dec.weight.grad.full_tensor())
    t, o = got["torch"], got["ours"]
    assert o[0].dtype == t[0].dtype == torch.bfloat16
    torch.testing.assert_close(o[1], torch.zeros_like(o[0]), rtol=0, atol=0)
    for a, b in zip(o, t):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_no_warmup_jvp_reshard_after_forward_false():
    run_distributed(_no_warmup_jvp_case, 2)
