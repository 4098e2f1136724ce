"""``requires_grad`` changed before, at or after the lazy init (issue 25 item 2): gradients equal those
of single-process training that makes the same changes, never a silently missing ``.grad``.

Model: an inner ``fully_shard`` unit (``inner``, uneven 7 -> 10) and the root holding a second linear
(``head``, 10 -> 13) and a trainable scale, so the root unit keeps its unsharded params after
forward (the default for a root) -- the path where a first forward with frozen params left the root's
unsharded params frozen after they were unfrozen (``.grad is None`` on the root's weight, no error).
Schedules (``{step: [(names, requires_grad)]}``, applied to both models before that step's forward;
step 0 is the forward that runs the lazy init):

* ``frozen-first-forward``: every param frozen during step 0 (a forward only), then all unfrozen;
* ``root-frozen-first``: only the root's params frozen at step 0 (its backward trains ``inner``);
* ``frozen-before-lazy-init``: frozen after ``fully_shard`` and before the first forward, then unfrozen;
* ``frozen-before-fully-shard``: the root's params frozen when ``fully_shard`` runs, unfrozen at step 1;
* ``freeze-after-init``: the root's weight frozen at step 2 and unfrozen at step 3, ``inner.bias`` at 3;
* ``between-forward-and-backward`` (``BETWEEN``, applied after the forward): ``inner.lin.weight`` (a
  resharded unit: its sharded param) and ``head.weight`` (the root, kept unsharded) frozen after step
  1's forward, unfrozen before step 2's. As in plain torch, whose ``AccumulateGrad`` reads
  ``requires_grad`` when it runs, the frozen params get no ``.grad`` from that backward (so the
  pre-backward must take the change; skipping its ``refresh_requires_grad`` fails here).

Each runs with no mixed precision (vs float32 single-process training, rtol 1e-5) and with
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (vs the same single-process model whose
forward runs in bf16 from bf16 copies of the fp32 master, as FSDP does; grads compared in float32 at
bf16 tolerance, and ``.grad`` presence exactly). World sizes 2, 3 and 5 (5 gives empty pieces).
"""

from __future__ import annotations

import copy

import torch
from _spawns import SPAWNS  # runs in the shared per-world-size spawns (tests/dist/_spawns.py)
from torch import nn


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(7, 10)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()
        self.head = nn.Linear(10, 13)
        self.scale = nn.Parameter(torch.ones(13))

    def forward(self, x):
        return self.head(self.inner(x)) * self.scale


ROOT = ("head.weight", "head.bias", "scale")
ALL = ROOT + ("inner.lin.weight", "inner.lin.bias")
SCHEDULES = {
    "frozen-first-forward": {0: [(ALL, False)], 1: [(ALL, True)]},
    "root-frozen-first": {0: [(ROOT, False)], 1: [(ROOT, True)]},
    "frozen-before-lazy-init": {-1: [(ALL, False)], 1: [(ALL, True)]},
    "frozen-before-fully-shard": {-2: [(ROOT, False)], 1: [(ROOT, True)]},
    "freeze-after-init": {
        2: [(("head.weight",), False)],
        3: [(("head.weight",), True), (("inner.lin.bias",), False)],
    },
}
BETWEEN = {
    "between-forward-and-backward": {1: [(("inner.lin.weight", "head.weight"), False)]},
}
SCHEDULES["between-forward-and-backward"] = {2: [(("inner.lin.weight", "head.weight"), True)]}
FORWARD_ONLY = {"frozen-first-forward": (0,), "frozen-before-lazy-init": (0,)}
STEPS = 5


def _set_rg(model, names, rg):
    params = dict(model.named_parameters())
    for n in names:
        params[n].requires_grad_(rg)


def _ref_grads(ref, x, mp, between=()):
    """Single-process step: the loss of the global batch (the mean over ranks of the local means);
    ``between``: ``(names, requires_grad)`` changes made after the forward, before the backward."""
    if mp:  # what FSDP computes: forward and backward in bf16 from bf16 copies of the master
        low = copy.deepcopy(ref).to(torch.bfloat16)
        for p, q in zip(low.parameters(), ref.parameters()):
            p.requires_grad_(q.requires_grad)
        out = low(x.to(torch.bfloat16)).float()
        for names, rg in between:
            _set_rg(low, names, rg)
            _set_rg(ref, names, rg)
        out.square().mean().backward()
        for p, q in zip(low.parameters(), ref.parameters()):
            q.grad = None if p.grad is None else p.grad.float()
    else:
        out = ref(x)
        for names, rg in between:
            _set_rg(ref, names, rg)
        out.square().mean().backward()


def _cases(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh

    import raggedfsdp

    mesh = init_device_mesh("cpu", (ws,))
    g = torch.Generator().manual_seed(3)
    per = 2
    data = [torch.randn(per * ws, 7, generator=g) for _ in range(STEPS)]
    for mp in (False, True):
        policy = (
            raggedfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if mp
            else raggedfsdp.MixedPrecisionPolicy()
        )
        rtol, atol = (2e-2, 2e-3) if mp else (1e-5, 1e-6)
        for name, schedule in SCHEDULES.items():
            torch.manual_seed(0)
            ref = Net()
            model = copy.deepcopy(ref)
            for names, rg in schedule.get(-2, []):
                _set_rg(model, names, rg)
                _set_rg(ref, names, rg)
            raggedfsdp.fully_shard(model.inner, mesh=mesh, mp_policy=policy)
            raggedfsdp.fully_shard(model, mesh=mesh, mp_policy=policy)
            opt = torch.optim.SGD(model.parameters(), lr=0.2)
            ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2)
            for names, rg in schedule.get(-1, []):
                _set_rg(model, names, rg)
                _set_rg(ref, names, rg)
            for step in range(STEPS):
                for names, rg in schedule.get(step, []):
                    _set_rg(model, names, rg)
                    _set_rg(ref, names, rg)
                x = data[step]
                out = model(x[rank * per : (rank + 1) * per])
                if step in FORWARD_ONLY.get(name, ()):
                    assert not out.requires_grad
                    continue
                between = BETWEEN.get(name, {}).get(step, [])
                for names, rg in between:
                    _set_rg(model, names, rg)
                out.float().square().mean().backward()
                _ref_grads(ref, x, mp, between)
                for (n, p), q in zip(model.named_parameters(), ref.parameters()):
                    where = f"{name} mp={mp} ws={ws} step {step}: {n} (requires_grad={q.requires_grad})"
                    assert (p.grad is None) == (q.grad is None), (
                        f"{where}: .grad is {'None' if p.grad is None else 'set'} but the reference's is "
                        f"{'None' if q.grad is None else 'set'}"
                    )
                    if p.grad is not None:
                        torch.testing.assert_close(
                            p.grad.full_tensor(),
                            q.grad,
                            rtol=rtol,
                            atol=atol,
                            msg=lambda m, w=where: f"{w}: {m}",
                        )
                opt.step()
                ref_opt.step()
                opt.zero_grad(set_to_none=True)
                ref_opt.zero_grad(set_to_none=True)


def test_requires_grad_change_ws2():
    SPAWNS.check(2, "requires_grad_change")


def test_requires_grad_change_ws3():
    SPAWNS.check(3, "requires_grad_change")


def test_requires_grad_change_ws5():
    SPAWNS.check(5, "requires_grad_change")
