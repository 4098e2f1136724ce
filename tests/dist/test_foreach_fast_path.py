"""The element-wise ``_foreach_*`` fast path for DTensors (raggedfsdp/placement/_foreach.py): RaggedShard
params, and torch's ``fully_shard``'s Shard(0) params (what a tensor-parallel user's DTensors are).

Reference: torch's own DTensor dispatch of the same ops on the same tensors (the handler removed).
Optimizer steps (each after ``clip_grad_norm_``: ``_foreach_norm`` and ``_foreach_mul_`` by a replicated
scalar) with the fast path must be bitwise equal to steps without it, on every rank; anything
the fast path does not cover must reach torch's dispatch. The handler is installed by hand here (it is
on by default on every torch; RAGGEDFSDP_FOREACH_FAST_PATH=0 turns it off). Three gloo ranks
give uneven RaggedShard pieces, empty ones included (the 3-element biases).
"""

from __future__ import annotations

import torch
from _dist import run_distributed
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 3)) for _ in range(2))
        self.head = nn.Linear(3, 5)

    def forward(self, x):
        for b in self.blocks:
            x = torch.cat([b(x), x[:, 3:]], dim=1)
        return self.head(x[:, :3])


def _handlers():
    from torch.distributed.tensor import DTensor

    return DTensor._op_dispatcher._custom_op_handlers


def _build(backend, mesh):
    if backend == "ragged":
        from raggedfsdp import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    m = Net()
    for b in m.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def _steps(model, make_opt, fast: bool, n=3):
    from raggedfsdp.placement import _foreach

    h = _handlers()
    (_foreach.install if fast else _foreach.uninstall)(h)
    try:
        opt = make_opt(model.parameters())
        norms = []  # clip_grad_norm_'s total norms: _foreach_norm, then _foreach_mul_ by a replicated scalar
        before = _foreach.fast_path_counts()
        for i in range(n):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(i))
            model(x).pow(2).sum().backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05).full_tensor())  # clips
            opt.step()
            opt.zero_grad()
        after = _foreach.fast_path_counts()
    finally:
        _foreach.uninstall(h)
    params = {k: v.to_local().clone() for k, v in model.state_dict().items()}
    state = [
        {k: (v.to_local() if hasattr(v, "to_local") else v).clone() for k, v in s.items()}
        for s in opt.state.values()
    ]
    state.append({"clip_norms": torch.stack(norms)})
    return params, state, (after[0] - before[0], after[1] - before[1])


OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, foreach=True),
    "adam_amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True, foreach=True),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True, foreach=True),
}


def _case(rank, ws):
    import os

    from torch.distributed.device_mesh import init_device_mesh

    os.environ["RAGGEDFSDP_FOREACH_FAST_PATH"] = "1"  # install() honours it on any torch
    mesh = init_device_mesh("cpu", (ws,))
    out = {}
    for name, make in OPTIMIZERS.items():
        for backend in ("ragged", "torch"):
            fast = _steps(_build(backend, mesh), make, True)  # the same seeded init each time
            slow = _steps(_build(backend, mesh), make, False)
            same_p = all(torch.equal(fast[0][k], slow[0][k]) for k in slow[0])
            same_s = all(
                torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k]))
                for a, b in zip(fast[1], slow[1])
                for k in b
            )
            out[f"{name}/{backend}"] = dict(
                same_params=same_p, same_state=same_s, fast_counts=fast[2], slow_counts=slow[2]
            )
    # out of place: values and specs as torch's dispatch gives them
    from raggedfsdp.placement import _foreach

    m = _build("ragged", mesh)
    ps = [p for p in m.parameters()]
    ref = torch._foreach_sqrt([p.abs() for p in ps])
    _foreach.install(_handlers())
    try:
        got = torch._foreach_sqrt([p.abs() for p in ps])
        half = torch._foreach_mul([p.detach() for p in ps], 0.5)
    finally:
        _foreach.uninstall(_handlers())
    out["out_of_place"] = dict(
        equal=all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(got, ref)),
        specs=all(a._spec == b._spec for a, b in zip(got, ref)),
        mul=all(torch.equal(h.to_local(), p.detach().to_local() * 0.5) for h, p in zip(half, ps)),
    )
    # a mismatched operand (another layout) is torch's business, with or without the handler
    from torch.distributed.tensor import Replicate

    a = [ps[0].detach().clone()]
    b = [ps[0].detach().redistribute(mesh, [Replicate()])]
    errors = []
    for fast in (False, True):
        (_foreach.install if fast else _foreach.uninstall)(_handlers())
        try:
            torch._foreach_add_(a, b)
            errors.append(None)
        except Exception as e:  # noqa: BLE001 (the same outcome either way is the point)
            errors.append(type(e).__name__)
        finally:
            _foreach.uninstall(_handlers())
    out["mismatched"] = errors
    # _foreach_clamp_max is element-wise, not the _foreach_max reduction (the op guard once took it for one)
    # (torch 2.11 has no DTensor strategy for it at all: nothing to check there)
    out["clamp_max"] = True
    if torch.ops.aten._foreach_clamp_max.Scalar in _foreach.supported_ops():
        clamped = torch._foreach_clamp_max([p.detach() for p in ps], 0.01)
        out["clamp_max"] = all(
            torch.equal(c.to_local(), p.detach().to_local().clamp_max(0.01)) for c, p in zip(clamped, ps)
        )
    bad = []
    for opt in OPTIMIZERS:
        r = out[f"{opt}/ragged"]
        if not (
            r["same_params"] and r["same_state"] and r["fast_counts"][0] > 0 and r["slow_counts"] == (0, 0)
        ):
            bad.append((f"{opt}/ragged: fast path not bitwise torch's dispatch, or not taken", r))
        r = out[f"{opt}/torch"]  # torch's Shard(0) params (uneven at 3 ranks) take the fast path too
        if not (
            r["same_params"] and r["same_state"] and r["fast_counts"][0] > 0 and r["slow_counts"] == (0, 0)
        ):
            bad.append((f"{opt}/torch: fast path on torch's Shard params not bitwise its dispatch", r))
    if out["out_of_place"] != dict(equal=True, specs=True, mul=True):
        bad.append(("out of place", out["out_of_place"]))
    if not out["clamp_max"]:
        bad.append(("_foreach_clamp_max", out["clamp_max"]))
    if errors[0] != errors[1]:
        bad.append(("a mismatched operand behaves differently with the handler", errors))
    assert not bad, f"rank {rank}: {bad}"


def test_foreach_fast_path_is_torch_dispatch_bitwise_at_three_ranks():
    run_distributed(_case, 3)
