"""Every op a user calls on torch's ``Shard(0)`` parameter runs on a RaggedShard parameter (issue 39 item 2).

Each op of :data:`OPS` runs on a RaggedShard DTensor (uneven ``local_units`` with zeros: empty
pieces) and on torch's own ``Shard(0)`` DTensor of the same full tensor (``distribute_tensor``,
fully_shard's parameter placement). The ``full_tensor()`` results are compared with each other and
with the op on the plain full tensor in one process (the independent reference; torch's ``Shard(0)``
raises for a few views of unevenly sharded tensors, where only the plain reference is compared).
Placement kinds (sharded / partial / replicate) are compared where the case says so. Ops with a
local rule must make no implicit redistribution; the others are counted.

RNG (``placement/_random.py``): every rank draws the full tensor from the default generator and
keeps its piece, so ``normal_`` / ``uniform_`` / ``trunc_normal_`` with a fixed seed equal the
single-device result exactly, and the generators stay in step (``trunc_normal_``'s ``while
mask.any()`` reads the global ``any``: a RaggedPartial). torch's ``Shard(0)`` on CPU draws each
rank's piece from its own generator, so only distribution properties are compared with it.
"""

from __future__ import annotations

import pytest
import torch
from _dist import run_distributed

UNITS = {3: (2, 0, 3), 5: (1, 0, 2, 0, 2)}  # 5 rows; zeros: empty pieces on some ranks


def _kind(placements) -> str:
    from raggedfsdp import RaggedShard

    (p,) = placements
    if isinstance(p, RaggedShard) or p.is_shard():
        return "shard"
    return "partial" if p.is_partial() else "replicate"


def _rep(mesh, t):
    """``t`` replicated on ``mesh`` (plain ``t`` for the single-process reference, ``mesh`` None)."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    return t if mesh is None else distribute_tensor(t, mesh, [Replicate()])


# name -> (fn(x, mesh), compare placement kinds with torch's Shard(0), has a local rule)
OPS = {
    "clone": (lambda x, m: x.clone(), True, True),
    "mul_add_": (lambda x, m: x.clone().mul_(3).add_(1), True, True),
    "copy_": (lambda x, m: x.clone().copy_(x * 2), True, True),
    "zero_": (lambda x, m: x.clone().zero_(), True, True),
    "fill_": (lambda x, m: x.clone().fill_(2.5), True, True),
    "new_zeros": (lambda x, m: x.new_zeros(x.shape), True, True),
    "new_full": (lambda x, m: x.new_full(x.shape, 4.0), True, True),
    "new_zeros_other_shape": (lambda x, m: x.new_zeros((3, 2)), True, True),
    "view": (lambda x, m: x.view(5, 2, 2), True, True),
    "view_flat": (lambda x, m: x.view(-1), False, True),  # torch: "Cannot flatten unevenly sharded"
    "reshape": (lambda x, m: x.reshape(10, 2), False, True),
    "flatten": (lambda x, m: x.flatten(), False, True),
    "unsqueeze": (lambda x, m: x.unsqueeze(0), True, True),
    "norm": (lambda x, m: torch.linalg.norm(x), True, True),
    "norm_dim0": (lambda x, m: torch.linalg.norm(x, dim=0), True, True),
    "norm_dim1": (lambda x, m: torch.linalg.norm(x, dim=1), True, True),
    "norm_inf_dim1": (lambda x, m: torch.linalg.vector_norm(x, float("inf"), dim=1), True, True),
    "sum": (lambda x, m: x.sum(), True, True),
    "sum0": (lambda x, m: x.sum(0), True, True),
    "sum1": (lambda x, m: x.sum(1, keepdim=True), True, True),
    "mean": (lambda x, m: x.mean(), False, True),  # torch: Replicate (uneven avg); ours a RaggedPartial
    "mean0": (lambda x, m: x.mean(0), False, True),
    "mean1": (lambda x, m: x.mean(1), True, True),
    "max": (lambda x, m: x.max(), True, True),
    "min": (lambda x, m: x.min(), True, True),
    "amax1": (lambda x, m: x.amax(1), True, True),
    "amin0": (lambda x, m: x.amin(0, keepdim=True), True, True),
    "max_dim1": (lambda x, m: x.max(1).values, True, True),
    "max_dim1_indices": (lambda x, m: x.max(1).indices, True, True),
    "min_dim0": (lambda x, m: x.min(0).values, True, False),  # indices over the ragged rows: replicate
    "any": (lambda x, m: (x > 11).any(), True, True),
    "all": (lambda x, m: (x > -100).all(), True, True),
    "any1": (lambda x, m: (x > 3).any(1), True, True),
    "all0": (lambda x, m: (x > -6).all(0), True, True),
    "t": (lambda x, m: x.t(), True, False),
    "transpose": (lambda x, m: x.transpose(0, 1), True, False),
    "select_row": (lambda x, m: x[0], True, False),
    "select_col": (lambda x, m: x[:, 1], True, False),
    "slice": (lambda x, m: x[1:4], True, False),
    "cat": (lambda x, m: torch.cat([x, x]), True, False),
    "matmul": (lambda x, m: x @ _rep(m, torch.arange(12.0).reshape(4, 3)), True, False),
    "broadcast_add": (lambda x, m: x + _rep(m, torch.arange(4.0)), True, False),
    "permute_contiguous": (lambda x, m: x.t().contiguous(), True, False),
}


def _run_table(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from raggedfsdp import RaggedShard, implicit_redistribution_count, strict_ops

    mesh = init_device_mesh("cpu", (ws,))
    full = torch.arange(20.0).reshape(5, 4) - 7
    rs = RaggedShard((0,), UNITS[ws])
    x = distribute_tensor(full, mesh, [rs])
    s0 = distribute_tensor(full, mesh, [Shard(0)])
    assert x.to_local().numel() == rs.local_numel((5, 4), rank)
    failures = []
    for name, (fn, same_kind, local) in OPS.items():
        ref = fn(full, None)
        before = implicit_redistribution_count()
        if local:
            with strict_ops():  # a local rule: no implicit redistribution
                out = fn(x, mesh)
            assert implicit_redistribution_count() == before, name
        else:
            out = fn(x, mesh)
            assert implicit_redistribution_count() > before, name
        got = out.full_tensor() if isinstance(out, DTensor) else out
        if got.shape != ref.shape or not torch.allclose(got.double(), ref.double()):
            failures.append(f"{name}: RaggedShard gave {got} for {ref}")
        try:
            theirs = fn(s0, mesh)
        except RuntimeError as e:  # torch's own Shard(0) refuses a few uneven views
            assert not same_kind and "unevenly sharded" in str(e), (name, e)
            continue
        if not torch.allclose(theirs.full_tensor().double(), got.double()):
            failures.append(f"{name}: RaggedShard {got} != torch Shard(0) {theirs.full_tensor()}")
        if same_kind and _kind(out.placements) != _kind(theirs.placements):
            failures.append(f"{name}: placement {out.placements} vs torch Shard(0) {theirs.placements}")
    assert not failures, "\n".join(failures)

    # new_empty: shape and placement (values undefined)
    e = x.new_empty(x.shape)
    assert e.shape == x.shape and e.placements == x.placements and e.to_local().shape == x.to_local().shape
    e = x.new_empty((3, 2))
    assert e.shape == (3, 2) and _kind(e.placements) == "replicate"

    # .item() / bool() of a reduction read the global value on every rank (torch's Shard(0) reads
    # the local one, see the module docstring)
    assert bool((x > 11).any()) and x.max().item() == 12.0 and x.min().item() == -7.0
    assert abs(x.mean().item() - 2.5) < 1e-6 and not bool((x > 100).any())

    # views alias the parameter: an in-place write through a view reaches it
    y = x.clone()
    y.view(-1).mul_(2)
    assert torch.equal(y.full_tensor(), full * 2)

    # a view op that had to redistribute returns a copy, as for torch's own DTensors (Shard(0) p[0])
    y = x.clone()
    y[0].fill_(100.0)
    assert torch.equal(y.full_tensor(), full)


def _run_rng(rank, ws):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from raggedfsdp import RaggedShard, implicit_redistribution_count

    mesh = init_device_mesh("cpu", (ws,))
    shape = (50, 8)
    rs = RaggedShard((0,), (3, 0, 2) if ws == 3 else (1, 0, 2, 0, 2))
    before = implicit_redistribution_count()
    for name, init in (
        ("normal_", lambda t: t.normal_(0.5, 2.0)),
        ("uniform_", lambda t: t.uniform_(-1.0, 3.0)),
        # p > 0.3: the normal_ + resample-where-outside branch, several loop rounds
        ("trunc_normal_wide", lambda t: torch.nn.init.trunc_normal_(t, 0.0, 1.0, -0.6, 0.6)),
        # p <= 0.3: the uniform_ + rejection branch with `pending.any()`
        ("trunc_normal_narrow", lambda t: torch.nn.init.trunc_normal_(t, 0.0, 1.0, -0.1, 0.15)),
        ("trunc_normal_std", lambda t: torch.nn.init.trunc_normal_(t, std=0.02, a=-0.04, b=0.04)),
        ("kaiming_uniform_", lambda t: torch.nn.init.kaiming_uniform_(t, a=5**0.5)),
    ):
        torch.manual_seed(1234)
        ref = init(torch.empty(shape))
        after_ref = torch.rand(3)
        torch.manual_seed(1234)
        p = distribute_tensor(torch.zeros(shape), mesh, [rs])
        init(p)
        after = torch.rand(3)
        assert torch.equal(p.full_tensor(), ref), name  # exactly the single-device init
        assert torch.equal(after, after_ref), name  # the generator consumed the same draws
        gathered = [torch.empty(3) for _ in range(ws)]
        dist.all_gather(gathered, after)
        assert all(torch.equal(g, after) for g in gathered), name  # ranks stay in step
        # torch's Shard(0): per-rank draws; distribution properties only
        torch.manual_seed(1234)
        q = distribute_tensor(torch.zeros(shape), mesh, [Shard(0)])
        init(q)
        if name.startswith("trunc"):
            lo, hi = ref.min().item(), ref.max().item()
            a, b = {"trunc_normal_wide": (-0.6, 0.6), "trunc_normal_narrow": (-0.1, 0.15)}.get(
                name, (-0.04, 0.04)
            )
            for t in (p.full_tensor(), q.full_tensor()):
                assert a <= t.min().item() and t.max().item() <= b, (name, lo, hi)
    assert implicit_redistribution_count() == before  # random init is local


def _run_train_step(rank, ws):
    """A normal FSDP step (forward, backward, clip_grad_norm_, AdamW) makes no implicit redistribution."""
    from torch.distributed.device_mesh import init_device_mesh

    from raggedfsdp import fully_shard, implicit_redistribution_count, strict_ops

    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    for p in model.parameters():  # the re-init after meta-device construction, on sharded params
        torch.nn.init.trunc_normal_(p, std=0.5, a=-1.0, b=1.0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    implicit_redistribution_count(reset=True)
    with strict_ops():
        for _ in range(2):
            model(x).square().mean().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    assert implicit_redistribution_count() == 0


@pytest.mark.parametrize("ws", [3, 5])
def test_ops_match_torch_shard0(ws):
    run_distributed(_run_table, ws)


@pytest.mark.parametrize("ws", [3, 5])
def test_random_init_matches_single_device(ws):
    run_distributed(_run_rng, ws)


def test_training_step_has_no_implicit_redistribution():
    run_distributed(_run_train_step, 3)
