"""Frozen parameters hold no gradient storage (issue 13 item 1), checked for correctness: a LoRA-style
unit (frozen base + trainable adapters) trained with AdamW at ws 3 and 5 vs single-process training,
with ``requires_grad`` changed between steps (the gradient layout follows) and within a no-sync
accumulation window, ``zero_grad(set_to_none=False)`` grads kept across a layout change, and a
``reduce_dtype`` accumulator. The layouts are checked to cover what can go wrong: a trainable param
split over ranks, empty pieces, a gradient shard ``Sg`` smaller than the parameter shard ``S``, the
trainable pieces spread evenly (their own segment of the buffer, issue 39 item 5), and, once every
param is unfrozen, a grad layout of every tensor of the segmented unit with non-contiguous grad
segments. Memory is measured in
``test_fsdp_memory.py::test_frozen_base_holds_no_gradient_memory``.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from _spawns import SPAWNS  # runs in the shared per-world-size spawns (tests/dist/_spawns.py)
from _toy_models import full_params

FROZEN = ("base.weight", "base.bias", "norm.bias")


class LoraNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.base = nn.Linear(24, 24)
        self.a = nn.Linear(24, 4, bias=False)
        self.b = nn.Linear(4, 24, bias=False)
        self.norm = nn.LayerNorm(24)
        self.gate = nn.Linear(24, 8, bias=False)
        self.out = nn.Linear(24, 3)

    def forward(self, x):
        h = torch.tanh(self.norm(self.base(x) + self.b(self.a(x))))
        return self.out(h) + self.gate(h).sum(-1, keepdim=True)


def _set_rg(model, names, rg):
    params = dict(model.named_parameters())
    for n in names:
        params[n].requires_grad_(rg)


def _check_layout(group, ws, rank, all_trainable=False):
    """The root unit's grad layout is compacted and exercises split / empty pieces; its trainable pieces
    are spread evenly (their own segment, issue 39 item 5). ``all_trainable`` (after unfreezing every
    param of a segmented unit): a grad layout of every tensor with non-contiguous grad segments."""
    from raggedfsdp.planner import GradLayout, segment_share

    gl = group.bufs.grad_layout
    assert isinstance(gl, GradLayout), "a unit with frozen params must use a compacted grad layout"
    assert group.layout.segments is not None and len(group.layout.segments) == 2, group.layout
    spans = [len(gl.segments(i)) for i in gl.members]
    if all_trainable:
        assert len(gl.members) == len(group.fsdp_params)
        assert any(gl.contiguous_offset(i) is None for i in gl.members), "no non-contiguous grad segments"
        return
    assert gl.shard_size < group.layout.shard_size, (gl.shard_size, group.layout.shard_size)
    assert max(spans) >= 2, "no trainable param split over ranks: the case is not covered"
    assert any(gl.piece(i, r)[0] == gl.piece(i, r)[1] for i in gl.members for r in range(ws)), (
        "no empty piece"
    )
    share = segment_share(group.layout, gl.members)
    assert max(share) * ws <= 1.25 * sum(share), share
    sg = group.bufs.sharded_grads
    assert sg is None or sg.data.numel() == gl.shard_size
    for fp in group.fsdp_params:  # every sharded .grad is its param's own local piece and placement
        g = fp.sharded.grad
        if g is not None:
            assert (
                g.placements == fp.sharded.placements
                and g._local_tensor.shape == fp.sharded._local_tensor.shape
            )


def _frozen_cases(rank, ws, mesh_shape=None):
    """Also run by test_fsdp_parity's HSDP test on a (2, 2) mesh (``mesh_shape``), where the micro-batches
    defer the replicate all-reduce (``set_requires_all_reduce``) instead of the whole sync."""
    from torch.distributed.device_mesh import init_device_mesh

    import raggedfsdp

    hsdp = mesh_shape is not None
    names = ("replicate", "shard") if mesh_shape is not None and len(mesh_shape) == 2 else None
    mesh = init_device_mesh("cpu", mesh_shape or (ws,), mesh_dim_names=names)
    g = torch.Generator().manual_seed(5)
    data = [torch.randn(2 * ws, 24, generator=g) for _ in range(10)]
    per = 2
    # (name, steps, schedule {step or (step, micro-batch): [(names, requires_grad)]}, zero_grad set_to_none,
    #  micro-batches, reduce_dtype)
    cases = [
        ("lora", 3, {}, True, 1, None),
        (
            "change-between-steps",
            6,
            {
                2: [(["base.bias"], True)],
                3: [(["a.weight"], False)],
                4: [(FROZEN + ("a.weight",), True)],
                5: [(["base.weight"], False)],
            },
            False,
            1,
            None,
        ),
        (
            "accumulate, freeze / unfreeze mid-window",
            3,
            {(0, 1): [(["base.bias"], True)], (1, 1): [(["a.weight"], False)], 2: [(["a.weight"], True)]},
            True,
            2,
            torch.float64,
        ),
    ]
    if hsdp:
        cases = cases[:1] + cases[2:]
    elif ws == 5:
        cases = cases[:2]  # the accumulation case runs at ws 3 and under HSDP (keeps the suite fast)
    for name, n_steps, schedule, set_to_none, micro, reduce_dtype in cases:
        torch.manual_seed(0)
        ref = LoraNet()
        _set_rg(ref, FROZEN, False)
        model = copy.deepcopy(ref)
        mp = raggedfsdp.MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
        raggedfsdp.fully_shard(model.out, mesh=mesh, mp_policy=mp)
        raggedfsdp.fully_shard(model, mesh=mesh, mp_policy=mp)
        group = model._raggedfsdp_state.group
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
        for step in range(n_steps):
            for mb in range(micro):
                for names, rg in schedule.get(step if mb == 0 else (step, mb), []):
                    _set_rg(ref, names, rg)
                    _set_rg(model, names, rg)
                x = data[step * micro + mb]
                if micro > 1 and hsdp:
                    model.set_requires_all_reduce(mb == micro - 1)
                elif micro > 1:
                    model.set_requires_gradient_sync(mb == micro - 1)
                model(x[rank * per : (rank + 1) * per]).square().mean().backward()
                ref(x).square().mean().backward()
            if name == "lora" and step == 0 and not hsdp:
                _check_layout(group, ws, rank)
            if name == "change-between-steps" and step == 4:
                _check_layout(group, ws, rank, all_trainable=True)
            for (n, p), q in zip(model.named_parameters(), ref.parameters()):
                where = f"{name} ws={ws} step {step}: {n}"
                assert (p.grad is None) == (q.grad is None), f"{where}: grad presence differs"
                if p.grad is not None:
                    got = p.grad.full_tensor()
                    torch.testing.assert_close(
                        got, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m, w=where: f"{w}: {m}"
                    )
            if not set_to_none and step in (1, 4):
                continue  # accumulate into the kept sharded grads across the next layout change
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=set_to_none)
        got = full_params(model)
        for n, p in ref.named_parameters():
            torch.testing.assert_close(
                got[n], p.detach(), rtol=1e-5, atol=1e-6, msg=lambda m, w=f"{name} {n}": f"{w}: {m}"
            )


def test_frozen_params_parity_ws3():
    SPAWNS.check(3, "frozen")


def test_frozen_params_parity_ws5():
    SPAWNS.check(5, "frozen")
