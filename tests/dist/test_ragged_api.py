"""RaggedShard through torch's own DTensor API, with torch's names imported BEFORE raggedfsdp.

This module imports torch's names first, as user scripts do; the spawned ranks are fresh
interpreters that import only this module, and each asserts that raggedfsdp is not loaded before
it imports it. Everything is compared with the same operation on full tensors in one process.
Covers: distribute_tensor / from_local / the factories (zeros, ones, empty, full, rand, randn) /
redistribute / full_tensor / DCP through the pre-bound names, empty pieces included; inf-norm
``clip_grad_norm_`` (issue 13 item 4); torch's own ``fully_shard`` before and after the patches.
"""

import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.tensor as dtensor_pkg
from _dist import run_distributed
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import (
    DTensor,
    Replicate,
    Shard,
    _api,
    distribute_tensor,
    empty,
    full,
    ones,
    rand,
    randn,
    zeros,
)
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.debug import CommDebugMode

INF = float("inf")


def _torch_fsdp_run(seed=0):
    """Two SGD steps of torch's own fully_shard; returns the full params and losses."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    ref = [p.detach().clone() for p in model.parameters()]
    torch_fully_shard(model[0])
    torch_fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(dist.get_rank()))
    losses = []
    for _ in range(2):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return [p.full_tensor() for p in model.parameters()], losses, ref


def _torch_fsdp_reference(ref, ws):
    """Single-process reference of :func:`_torch_fsdp_run`: mean of every rank's gradient."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    with torch.no_grad():
        for p, r in zip(model.parameters(), ref):
            p.copy_(r)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs = [torch.randn(4, 6, generator=torch.Generator().manual_seed(r)) for r in range(ws)]
    for _ in range(2):
        sum(model(x).square().mean() for x in xs).div(ws).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


def _api_cases(rank, ws, units, path):
    assert "raggedfsdp" not in sys.modules, "the rank must start with torch's names only"
    mesh = init_device_mesh("cpu", (ws,))
    # 1. torch's own fully_shard with raggedfsdp imported but no RaggedShard made: no patch applied
    import raggedfsdp
    from raggedfsdp.placement import _patches as tp

    plain, plain_losses, ref0 = _torch_fsdp_run()
    assert not tp.is_applied(), "import raggedfsdp or torch's fully_shard applied the patches"
    for a, b in zip(plain, _torch_fsdp_reference(ref0, ws)):
        torch.testing.assert_close(a, b)

    # 2. the first RaggedShard installs the patches; the names bound above now handle it
    RaggedShard = raggedfsdp.RaggedShard
    n = 2 * sum(units)
    full_t = torch.arange(n * 4, dtype=torch.float32).reshape(n, 4)
    rs = RaggedShard((0,), units)
    assert tp.is_applied()
    a, b = rs.flat_range(full_t.shape, rank)
    dt = distribute_tensor(full_t, mesh, [rs])
    assert dt._local_tensor.shape == (b - a,) and torch.equal(dt.to_local(), full_t.reshape(-1)[a:b])
    assert torch.equal(dt.full_tensor(), full_t)
    s0 = dt.redistribute(mesh, [Shard(0)])
    assert torch.equal(s0.full_tensor(), full_t)
    back = s0.redistribute(mesh, [rs])
    assert torch.equal(back.to_local(), dt.to_local())
    for from_local in (
        DTensor.from_local,
        getattr(_api, "from_local", DTensor.from_local),
    ):  # alias since 2.13
        fl = from_local(dt.to_local(), mesh, [rs], shape=full_t.shape, stride=full_t.stride())
        assert torch.equal(fl.full_tensor(), full_t)
        with pytest.raises(ValueError, match="pass shape=<global shape>"):
            from_local(dt.to_local(), mesh, [rs])
    # torch's local-shape function: one N-D box of whole rows
    shape, off = compute_local_shape_and_global_offset(full_t.shape, mesh, [rs])
    assert (tuple(shape), tuple(off)) == (((b - a) // 4, 4), (a // 4, 0))

    # 3. the factories: the local tensor is this rank's flat piece, never the full shape
    el = RaggedShard((0, 1), units)  # element granularity
    for pl in (rs, el):
        pa, pb = pl.flat_range(full_t.shape, rank)
        for fn, kw, expect in (
            (zeros, {}, 0.0),
            (ones, {}, 1.0),
            (empty, {}, None),
            (full, {"fill_value": 2.5}, 2.5),
        ):
            if fn is full:
                t = fn((n, 4), 2.5, device_mesh=mesh, placements=[pl], requires_grad=True)
            else:
                t = fn(n, 4, device_mesh=mesh, placements=[pl], dtype=torch.float64)
            assert t.shape == (n, 4) and t.placements == (pl,), fn
            assert t._local_tensor.shape == (pb - pa,), (fn, t._local_tensor.shape)
            if expect is not None:
                assert torch.equal(t.full_tensor(), torch.full((n, 4), expect, dtype=t.dtype)), fn
        assert t.requires_grad and t.dtype == torch.float32
        for fn in (rand, randn):
            torch.manual_seed(7)
            t = fn(n, 4, device_mesh=mesh, placements=[pl])
            torch.manual_seed(7)
            want = torch.rand(n, 4) if fn is rand else torch.randn(n, 4)
            assert t._local_tensor.shape == (pb - pa,)
            assert torch.equal(t.full_tensor(), want), fn
    with pytest.raises(ValueError, match="local_units"):
        zeros(n, 4, device_mesh=mesh, placements=[RaggedShard((0,), (1,) * (ws + 1))])

    # 4. views stay local (a RaggedShard view); ops without a local rule redistribute like Shard(0)
    # (tests/dist/test_ragged_ops.py); pointwise ops stay local and keep RS (is_shard() pricing)
    with CommDebugMode() as comm:
        flat = dt.view(-1)
    assert comm.get_total_counts() == 0 and isinstance(flat.placements[0], RaggedShard)
    assert torch.equal(flat.full_tensor(), full_t.view(-1))
    assert torch.equal(dt.t().full_tensor(), full_t.t())
    with CommDebugMode() as comm:
        y = dt * 2 + dt
    assert comm.get_total_counts() == 0 and y.placements == (rs,)
    assert torch.equal(y.full_tensor(), 3 * full_t)
    from torch.distributed.tensor._collective_utils import redistribute_cost

    assert redistribute_cost(dt._spec, dt.redistribute(mesh, [Replicate()])._spec) > 0

    # 5. DCP through torch's names: save ragged, load as Replicate and as another ragged layout
    dcp.save({"w": dt}, checkpoint_id=path)
    rep = distribute_tensor(torch.zeros_like(full_t), mesh, [Replicate()])
    other = distribute_tensor(torch.zeros_like(full_t), mesh, [RaggedShard((0, 1), tuple(reversed(units)))])
    dcp.load({"w": rep}, checkpoint_id=path)
    dcp.load({"w": other}, checkpoint_id=path)
    assert torch.equal(rep.to_local(), full_t) and torch.equal(other.full_tensor(), full_t)

    # 6. issue 13.4: inf-norm clipping = global max-abs, empty pieces contribute 0
    g = torch.Generator().manual_seed(3)
    shapes = [(n, 3), (n,), (n, 2, 2)]
    fulls = [torch.randn(s, generator=g) for s in shapes]
    grads = [torch.randn(s, generator=g) for s in shapes]
    grads[1][-1] = -9.0  # the max-abs lives on the last non-empty piece
    pls = [
        RaggedShard((0,), units),
        RaggedShard((0,), (sum(units),) + (0,) * (ws - 1)),
        RaggedShard((0, 1, 2), units),
    ]
    for norm_type in (INF, 3.0):
        params = []
        for f, gr, pl in zip(fulls, grads, pls):
            p = torch.nn.Parameter(distribute_tensor(f, mesh, [pl]))
            p.grad = distribute_tensor(gr, mesh, [pl])
            params.append(p)
        ref = [torch.nn.Parameter(f.clone()) for f in fulls]
        for r, gr in zip(ref, grads):
            r.grad = gr.clone()
        total = torch.nn.utils.clip_grad_norm_(params, 0.5, norm_type=norm_type)
        rtotal = torch.nn.utils.clip_grad_norm_(ref, 0.5, norm_type=norm_type)
        torch.testing.assert_close(total.full_tensor(), rtotal)
        for p, r in zip(params, ref):
            torch.testing.assert_close(p.grad.full_tensor(), r.grad)
    gds = [distribute_tensor(gr, mesh, [pl]) for gr, pl in zip(grads, pls)]
    for got, gr in zip(torch._foreach_norm(gds, INF), grads):
        torch.testing.assert_close(got.full_tensor(), gr.abs().max())
    for ord in (INF, -INF):
        for gd, gr in zip(gds, grads):
            torch.testing.assert_close(
                torch.linalg.vector_norm(gd, ord).full_tensor(), torch.linalg.vector_norm(gr, ord)
            )
        kd = torch.linalg.vector_norm(gds[0], ord, dim=(0, 1), keepdim=True)
        torch.testing.assert_close(
            kd.full_tensor(), torch.linalg.vector_norm(grads[0], ord, dim=(0, 1), keepdim=True)
        )

    # 7. torch's own fully_shard still runs (and gives the same result) with the patches applied
    after, after_losses, _ = _torch_fsdp_run()
    for a1, a2 in zip(plain + plain_losses, after + after_losses):
        assert torch.equal(a1, a2)


@pytest.mark.parametrize("ws, units", [(3, (2, 0, 1)), (5, (1, 0, 2, 0, 3))])
def test_torch_api_with_torch_names_imported_first(ws, units, tmp_path):
    run_distributed(_api_cases, ws, units, str(tmp_path / "ckpt"))


def test_module_imports_no_raggedfsdp_at_top():
    """This module's own top level must not import raggedfsdp (the ranks rely on that order)."""
    import ast
    import pathlib

    tree = ast.parse(pathlib.Path(__file__).read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in top if isinstance(n, ast.ImportFrom)]
    assert not [m for m in names if m and m.startswith("raggedfsdp")]
    assert dtensor_pkg.distribute_tensor is distribute_tensor
