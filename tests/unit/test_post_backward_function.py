"""The units' post-backward ``autograd.Function`` (an identity on the module's inputs whose backward runs
the unit's post-backward) under ``torch.func``, against the plain identity as the oracle: ``jvp`` passes
the tangents through, ``vmap`` maps it, ``setup_context`` keeps the state for the backward, and the eager
backward gives the identity's grads and runs the post-backward once. torch's FSDP2 gives its
``RegisterPostBackwardFunction`` the same rules (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py).
"""

from __future__ import annotations

import torch

from raggedfsdp.fsdp._state import _RegisterPostBackward


class _State:
    def __init__(self):
        self.calls = 0

    def _post_backward_of_module(self):
        self.calls += 1


def test_jvp_vmap_and_eager_backward_match_the_identity():
    gen = torch.Generator().manual_seed(0)
    e = torch.randn(3, generator=gen, requires_grad=True)
    x, t = torch.randn(3, generator=gen), torch.randn(3, generator=gen)
    state = _State()

    def one(a):  # a + e requires grad outside the transform: the hook applies the Function to it
        return _RegisterPostBackward.apply(state, a + e) * 2

    def two(a):
        u, v = _RegisterPostBackward.apply(state, a + e, a * e)
        return u * v

    for f, ref in ((one, lambda a: (a + e) * 2), (two, lambda a: (a + e) * (a * e))):
        out, tan = torch.func.jvp(f, (x,), (t,))
        r_out, r_tan = torch.func.jvp(ref, (x,), (t,))
        torch.testing.assert_close(out, r_out, rtol=0, atol=0)
        torch.testing.assert_close(tan, r_tan, rtol=0, atol=0)
        xs = torch.randn(4, 3, generator=gen)
        torch.testing.assert_close(torch.func.vmap(f)(xs), torch.func.vmap(ref)(xs), rtol=0, atol=0)
    assert state.calls == 0  # forward-mode and vmap run no backward

    # eager: the same grads as the identity, and the post-backward runs once per backward
    a = x.clone().requires_grad_()
    two(a).sum().backward()
    got = (a.grad.clone(), e.grad.clone())
    a.grad = e.grad = None
    ((a + e) * (a * e)).sum().backward()
    torch.testing.assert_close(got, (a.grad, e.grad), rtol=0, atol=0)
    assert state.calls == 1
