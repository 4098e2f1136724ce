"""``FSDPModule.set_reduce_scatter_unused_params(True)`` against torch's own ``fully_shard`` on the same
script, at ws 2: a parameter no rank used in backward gets a zero ``.grad`` (torch reduce-scatters a zero
gradient for it, ``FSDPParamGroup.post_backward``); without the setting it keeps ``grad=None`` in both.
Cases: torch's ``test_reduce_scatter_unused_dtensor_param`` (EP-sharded DTensor params on a (dp=1, ep=2)
mesh) and plain parameters on a 1-D dp=2 mesh.
"""

from __future__ import annotations

import torch
from _dist import run_distributed
from torch import nn


class _TwoExpertParams(nn.Module):
    def __init__(self, ep_mesh) -> None:
        from torch.distributed.tensor import Shard, distribute_tensor

        super().__init__()
        torch.manual_seed(0)
        self.used = nn.Parameter(distribute_tensor(torch.randn(8, 4), ep_mesh, [Shard(0)]))
        self.unused = nn.Parameter(distribute_tensor(torch.randn(8, 4), ep_mesh, [Shard(0)]))

    def forward(self, x):
        return self.used.to_local().float().sum() + (x.float().sum() * 0)


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x).sum()


def _grads(m):
    return {n: None if p.grad is None else p.grad.full_tensor() for n, p in m.named_parameters()}


def _case(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fs

    import raggedfsdp

    ep = init_device_mesh("cpu", (1, ws), mesh_dim_names=("dp", "ep"))
    dp = init_device_mesh("cpu", (ws,), mesh_dim_names=("dp",))
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
    for build, mesh in ((lambda: _TwoExpertParams(ep["ep"]), ep["dp"]), (_Plain, dp)):
        for flag in (True, False):
            got = {}
            for name, fs in (("torch", torch_fs), ("ours", raggedfsdp.fully_shard)):
                m = build()
                fs(m, mesh=mesh, reshard_after_forward=True)
                m.set_reduce_scatter_unused_params(flag)
                for _ in range(2):  # the second backward accumulates (zeros stay zeros)
                    m(x).backward()
                got[name] = _grads(m)
            t, o = got["torch"], got["ours"]
            assert [n for n, g in o.items() if g is None] == [n for n, g in t.items() if g is None], (
                flag,
                t,
                o,
            )
            assert any(g is None for g in t.values()) != flag
            for n in t:
                if t[n] is not None:
                    torch.testing.assert_close(o[n], t[n], rtol=1e-6, atol=1e-6)
                    if n.startswith("unused"):
                        assert not o[n].any()


def test_reduce_scatter_unused_params_matches_torch():
    run_distributed(_case, 2, timeout=120.0)
