"""Tensor-subclass all-gather extensions (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``), against
torch's own ``fully_shard`` on the same script, at ws 2.

torch's FSDP2 calls the extension around its all-gather; raggedfsdp's all-gather runs in place on the
unit's flat buffer and does not. It used to ignore the extension silently (torch's
``test_fully_shard_extensions.py`` then hung in a multi-thread test). Now every rank raises
``NotImplementedError`` naming the parameter and the alternatives: at ``fully_shard`` time for a subclass
parameter, at the first forward (lazy init) for an extension set on a sharded parameter afterwards.
"""

from __future__ import annotations

import time

import pytest
import torch
from _dist import run_distributed
from torch import nn
from torch.testing._internal.two_tensor import TwoTensor


class _ExtTwoTensor(TwoTensor):
    """torch's test's ``TwoTensor`` with its v1 extension: all-gather both halves, rebuild a TwoTensor."""

    def fsdp_pre_all_gather(self, mesh):
        return (self.a, self.b), None

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        if out is not None:
            return None
        a, b = all_gather_outputs
        return _ExtTwoTensor(a, b), (a, b)


def _model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8, bias=False), nn.ReLU(), nn.Linear(8, 4, bias=False))
    m[0].weight = nn.Parameter(_ExtTwoTensor(m[0].weight.detach(), m[0].weight.detach().clone()))
    return m


def _extension_case(rank, ws):
    from torch.distributed.fsdp import fully_shard as torch_fs

    import raggedfsdp

    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(rank))
    # torch accepts the subclass parameter and trains through its extension
    m = _model()
    torch_fs(m)
    m(x).sum().backward()
    assert m[0].weight.grad is not None
    # ours: a clear error on every rank at fully_shard time, before any collective
    m = _model()
    t0 = time.monotonic()
    with pytest.raises(
        NotImplementedError,
        match=r"'0\.weight' of Sequential is a _ExtTwoTensor that defines "
        r"fsdp_pre_all_gather / fsdp_post_all_gather.*torch\.distributed\.fsdp\.fully_shard",
    ):
        raggedfsdp.fully_shard(m)
    assert time.monotonic() - t0 < 10.0
    assert not isinstance(m[0].weight, torch.distributed.tensor.DTensor)  # nothing was sharded

    # an extension set on the sharded parameters' local tensors after fully_shard (torch's
    # test_all_gather_extensions_monkey_patch): torch runs it; ours raises at the first forward
    def pre(self, mesh, outer_size, outer_stride, module, mp_policy):
        ran.append(True)
        return (self.to(torch.bfloat16),), None

    @torch.no_grad()
    def post(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (t,) = all_gather_outputs
        if out is not None:
            out.copy_(t)
            return None
        up = t.to(param_dtype)
        return up, (t, up)

    for name, fs in (("torch", torch_fs), ("ours", raggedfsdp.fully_shard)):
        ran = []
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 8, bias=False), nn.ReLU(), nn.Linear(8, 4, bias=False))
        fs(m[0])
        fs(m)
        local = m[0].weight._local_tensor
        local.fsdp_pre_all_gather = pre.__get__(local)
        local.fsdp_post_all_gather = post.__get__(local)
        if name == "torch":
            m(x).sum().backward()
            assert ran
        else:
            with pytest.raises(
                NotImplementedError, match=r"'weight' of (FSDP)?Linear is a Tensor that defines"
            ):
                m(x)


def test_all_gather_extension_raises_on_every_rank_where_torch_runs_it():
    run_distributed(_extension_case, 2, timeout=120.0)
