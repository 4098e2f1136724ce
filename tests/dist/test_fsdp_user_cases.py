"""fully_shard semantics from public bug reports (issue 13): requires_grad changed after wrapping is
honoured (vs single-process AdamW), and units run by only some ranks raise a clear error naming the
units -- at the end of backward without debug mode (Note [unit agreement] in ``_agreement.py``), at the
first mismatched collective in debug mode -- instead of silently pairing up different units'
collectives; a mismatch of different-sized collectives ends the job with an error, not a hang."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from _dist import run_distributed
from _spawns import SPAWNS  # the shared per-world-size spawns (tests/dist/_spawns.py)
from _toy_models import full_params


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(16, 16)
        self.trained = nn.Linear(16, 16)
        self.out = nn.Linear(16, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.trained(torch.tanh(self.frozen(x)))))


def _requires_grad_after_wrap(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh

    import raggedfsdp

    mesh = init_device_mesh("cpu", (ws,))
    g = torch.Generator().manual_seed(3)
    data = [torch.randn(2 * ws, 16, generator=g) for _ in range(6)]
    for case in ("unfreeze-after-3-steps", "freeze-before-step-2"):
        torch.manual_seed(0)
        ref = Net()
        if case.startswith("unfreeze"):
            ref.frozen.requires_grad_(False)
        model = copy.deepcopy(ref)
        raggedfsdp.fully_shard(model.out, mesh=mesh)
        raggedfsdp.fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
        for step, x in enumerate(data):
            if case.startswith("unfreeze") and step == 3:
                ref.frozen.requires_grad_(True)
                model.frozen.requires_grad_(True)
            if case.startswith("freeze") and step == 1:
                ref.frozen.requires_grad_(False)
                model.frozen.requires_grad_(False)
            per = x.shape[0] // ws
            model(x[rank * per : (rank + 1) * per]).square().mean().backward()
            ref(x).square().mean().backward()
            for (n, p), q in zip(model.named_parameters(), ref.parameters()):
                assert (p.grad is None) == (q.grad is None), f"{case} step {step}: {n} grad presence differs"
            opt.step()
            opt.zero_grad()
            ref_opt.step()
            ref_opt.zero_grad()
        got = full_params(model)
        for n, p in ref.named_parameters():
            torch.testing.assert_close(
                got[n], p.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{case} {n}: {m}"
            )


def test_requires_grad_changed_after_fully_shard_is_honoured():
    SPAWNS.check(3, "user_requires_grad_after_wrap")


class Routed(nn.Module):
    """Samples go to branch A or B by the sign of x[:, 0]; a branch with no sample is skipped."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(4, 4)
        self.A = nn.Linear(4, 4)
        self.B = nn.Linear(4, 4)

    def forward(self, x):
        h = self.trunk(x)
        out = torch.zeros_like(h)
        ia, ib = (x[:, 0] > 0).nonzero().flatten(), (x[:, 0] <= 0).nonzero().flatten()
        if ia.numel():
            out = out.index_add(0, ia, self.A(h[ia]))
        if ib.numel():
            out = out.index_add(0, ib, self.B(h[ib]))
        return out


def _units_some_ranks_run(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh

    import raggedfsdp
    from raggedfsdp.buffer import set_debug

    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    model = Routed()
    raggedfsdp.fully_shard(model.A, mesh=mesh)
    raggedfsdp.fully_shard(model.B, mesh=mesh)
    raggedfsdp.fully_shard(model, mesh=mesh)
    x = torch.randn(4, 4).abs() * (1 if rank == 0 else -1)  # rank 0: all to A, rank 1: all to B
    set_debug(True)
    try:
        with pytest.raises(RuntimeError, match=r"collective mismatch .* FSDP unit '(A|B)'"):
            model(x).sum().backward()
    finally:
        set_debug(False)
    model.reset_iter_state()
    dist.barrier()


def test_unit_run_by_some_ranks_only_raises_in_debug_mode():
    SPAWNS.check(2, "user_units_some_ranks_debug")


def _units_some_ranks_run_no_debug(rank, ws):
    """Rank 0 routes every sample to A, rank 1 to B: the same-sized all-gathers / reduce-scatters of A and
    B pair up. The used-flag all-reduce must catch it before any .grad is set; after reset_iter_state a
    correct iteration (both branches on every rank) matches single-process training."""
    from torch.distributed.device_mesh import init_device_mesh

    import raggedfsdp
    from raggedfsdp.fsdp._common import CollectiveMismatchError

    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    ref = Routed()
    model = copy.deepcopy(ref)
    raggedfsdp.fully_shard(model.A, mesh=mesh)
    raggedfsdp.fully_shard(model.B, mesh=mesh)
    raggedfsdp.fully_shard(model, mesh=mesh)
    mine = "A" if rank == 0 else "B"
    x = torch.randn(4, 4).abs() * (1 if rank == 0 else -1)
    with pytest.raises(
        CollectiveMismatchError,
        match=rf"counts differ: .*'{mine}'.*This rank \(rank {rank}\) issued: .*"
        rf"reduce-scatter of '{mine}'",
    ) as ei:
        model(x).sum().backward()
    other = "B" if rank == 0 else "A"
    assert f"of '{other}'" not in str(ei.value).split("issued:")[1], str(
        ei.value
    )  # names what *this* rank ran
    assert all(p.grad is None for p in model.parameters()), (
        "gradients of a mismatched backward were installed"
    )
    model.reset_iter_state()
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(ws * 4, 4, generator=g)  # mixed signs: every rank runs both branches
    xs[::2, 0] = xs[::2, 0].abs()
    xs[1::2, 0] = -xs[1::2, 0].abs()
    model(xs[rank * 4 : (rank + 1) * 4]).square().mean().backward()
    ref(xs).square().mean().backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(
            p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}"
        )


def test_unit_run_by_some_ranks_only_raises_naming_the_unit():
    SPAWNS.check(2, "user_units_some_ranks")


class RoutedUneven(Routed):
    def __init__(self):
        super().__init__()
        self.B = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))  # B's all-gather is larger than A's


def _different_sized_mismatch(rank, ws, outdir):
    import os

    from torch.distributed.device_mesh import init_device_mesh

    import raggedfsdp

    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    model = RoutedUneven()
    raggedfsdp.fully_shard(model.A, mesh=mesh)
    raggedfsdp.fully_shard(model.B, mesh=mesh)
    raggedfsdp.fully_shard(model, mesh=mesh)
    x = torch.randn(4, 4).abs() * (1 if rank == 0 else -1)
    try:
        model(x).sum().backward()
    except Exception as e:
        with open(os.path.join(outdir, f"rank{rank}.txt"), "w") as f:
            f.write(f"{type(e).__name__}: {e}")
        raise
    raise AssertionError("a mismatch of different-sized collectives completed")


def test_unit_mismatch_of_different_sized_collectives_errors_not_hangs(tmp_path):
    """gloo aborts the rank with the smaller buffer ("collective mismatch" in its size check); the peer's
    wait raises CollectiveError naming its unit and its sequence; the job ends well within the timeout."""
    import time

    t0 = time.monotonic()
    with pytest.raises(AssertionError) as ei:
        run_distributed(_different_sized_mismatch, 2, str(tmp_path), timeout=100)
    assert time.monotonic() - t0 < 90, "the mismatch was not detected before the timeout"
    reports = [p.read_text() for p in sorted(tmp_path.glob("rank*.txt"))]
    msg = str(ei.value) + "\n".join(reports)
    assert "TimeoutError" not in str(ei.value), msg
    assert any(
        r.startswith("CollectiveError")
        and re.search(r"all-gather of FSDP unit '(A|B)'", r)
        and "this rank issued since the last check: all-gather of" in r
        for r in reports
    ), msg


class Ordered(nn.Module):
    """Both branches run on every rank, in an order chosen per rank: same units, same sizes, different
    issue order, so every local parameter gets a gradient (nothing to learn from the used flags)."""

    def __init__(self):
        super().__init__()
        self.A = nn.Linear(4, 4)
        self.B = nn.Linear(4, 4)
        self.a_first = True

    def forward(self, x):
        return self.B(self.A(x)) if self.a_first else self.A(self.B(x))


def _order_mismatch(rank, ws):
    """Immediate check (CPU default): the backward raises before any .grad is set. Deferred check (what
    CUDA uses when every local param got a grad, to keep the step free of host syncs): the backward
    completes, and the next forward raises, saying the check was one step late."""
    from torch.distributed.device_mesh import init_device_mesh

    import raggedfsdp
    from raggedfsdp.fsdp import set_runtime_options
    from raggedfsdp.fsdp._common import CollectiveMismatchError

    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    model = Ordered()
    raggedfsdp.fully_shard(model.A, mesh=mesh)
    raggedfsdp.fully_shard(model.B, mesh=mesh)
    raggedfsdp.fully_shard(model, mesh=mesh)
    model.a_first = rank == 0
    x = torch.randn(2, 4)
    with pytest.raises(CollectiveMismatchError, match="before any gradient was set"):
        model(x).sum().backward()
    model.reset_iter_state()
    assert model._raggedfsdp_state.comm.options.agreement_check == "auto"
    set_runtime_options(model, agreement_check="deferred")
    model(x).sum().backward()  # completes: the check is read at the next forward
    assert all(p.grad is not None for p in model.parameters())
    with pytest.raises(CollectiveMismatchError, match="deferred check .* already used the wrong gradients"):
        model(x)
    model.reset_iter_state()
    model.a_first = True  # agreeing ranks: the deferred check passes silently
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    model(x)
    dist.barrier()


def test_unit_order_mismatch_immediate_and_deferred_check():
    SPAWNS.check(2, "user_order_mismatch")
