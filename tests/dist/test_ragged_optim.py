"""FSDP-runtime contract: RaggedShard params as views into a flat buffer, stepped by stock torch.optim.

Every check compares against the same operation on full (unsharded) tensors.
"""

import pytest
import torch

from _spawns import SPAWNS  # runs in the shared per-world-size spawns (tests/dist/_spawns.py)

SHAPES = [(6, 3), (5,), (4, 2, 3), (2, 1, 2, 3), (1, 7)]


def _units(n_rows: int, ws: int, seed: int) -> tuple[int, ...]:
    """Uneven units (with zeros) whose sum divides n_rows."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(100):
        u = tuple(int(x) for x in torch.randint(0, 3, (ws,), generator=g))
        if sum(u) and n_rows % sum(u) == 0:
            return u
    return tuple([n_rows] + [0] * (ws - 1))


def _build(mesh, placements_fn, fulls, grads, rank_fn):
    """Flat param/grad buffers + DTensor params whose locals are views into them (like the FSDP runtime)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    pls = [placements_fn(i, f) for i, f in enumerate(fulls)]
    pieces, gpieces = [], []
    for pl, f, g in zip(pls, fulls, grads):
        rs = pl[-1]
        r = rank_fn()
        pieces.append(rs.shard_full(f, r))
        gpieces.append(rs.shard_full(g, r))
    buf, gbuf = torch.cat(pieces), torch.cat(gpieces)
    params, off = [], 0
    for pl, f, pc in zip(pls, fulls, pieces):
        n = pc.numel()
        spec = DTensorSpec(mesh, pl, TensorMeta(f.shape, f.stride(), f.dtype))
        p = torch.nn.Parameter(DTensor(buf[off : off + n], spec, requires_grad=True))
        p.grad = DTensor(gbuf[off : off + n], spec, requires_grad=False)
        params.append(p)
        off += n
    return buf, gbuf, params


def _check_step(params, buf, fulls, grads, make_opt, steps=2):
    from torch.distributed.tensor.debug import CommDebugMode

    ref = [torch.nn.Parameter(f.clone()) for f in fulls]
    for r, g in zip(ref, grads):
        r.grad = g.clone()
    opt, ropt = make_opt(params), make_opt(ref)
    ptrs = [p._local_tensor.data_ptr() for p in params]
    for _ in range(steps):
        with CommDebugMode() as comm:
            opt.step()
        assert comm.get_total_counts() == 0, comm.get_comm_counts()
        ropt.step()
    off = 0
    for p, r, ptr in zip(params, ref, ptrs):
        n = p._local_tensor.numel()
        assert p._local_tensor.data_ptr() == ptr, "optimizer replaced the local tensor"
        assert torch.equal(buf[off : off + n], p._local_tensor), "update did not land in the flat buffer"
        torch.testing.assert_close(p.full_tensor(), r.detach(), atol=1e-6, rtol=1e-5)
        off += n
    return ref


def _optim_cases(rank, ws, mesh, placements_fn, rank_fn):
    from torch.distributed.tensor.debug import CommDebugMode

    torch.manual_seed(1234)
    fulls = [torch.randn(s) for s in SHAPES]
    grads = [torch.randn(s) for s in SHAPES]
    buf, gbuf, params = _build(mesh, placements_fn, fulls, grads, rank_fn)
    for p, f in zip(params, fulls):
        assert torch.equal(p.full_tensor(), f)
        assert p.grad.placements == p.placements
    # clip_grad_norm_: true global norm, in-place clipping of the grad buffer, one all-reduce
    ref = [torch.nn.Parameter(f.clone()) for f in fulls]
    for r, g in zip(ref, grads):
        r.grad = g.clone()
    for norm_type in (2.0, 1.0):
        with CommDebugMode() as comm:
            total = torch.nn.utils.clip_grad_norm_(params, 0.5, norm_type=norm_type)
            total_full = total.full_tensor()
        rtotal = torch.nn.utils.clip_grad_norm_(ref, 0.5, norm_type=norm_type)
        torch.testing.assert_close(total_full, rtotal)
        assert comm.get_total_counts() <= 1, comm.get_comm_counts()
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.grad.full_tensor(), r.grad)
    grads = [r.grad.clone() for r in ref]
    for kw in (dict(foreach=True), dict(foreach=False)):
        _check_step(
            params,
            buf,
            [p.full_tensor() for p in params],
            grads,
            lambda ps, kw=kw: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1, **kw),
        )
        _check_step(
            params,
            buf,
            [p.full_tensor() for p in params],
            grads,
            lambda ps, kw=kw: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, **kw),
        )
    # optimizer state placements follow the params
    opt = torch.optim.AdamW(params, lr=0.01)
    opt.step()
    st = opt.state[params[0]]
    assert st["exp_avg"].placements == params[0].placements


def _optim_1d(rank, ws):
    import raggedfsdp  # noqa: F401
    from raggedfsdp import RaggedShard
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ws,))

    def pl(i, f):
        if i % 2 == 0:
            return (RaggedShard((0,), _units(f.shape[0], ws, i)),)
        dims = tuple(range(f.dim()))
        return (RaggedShard(dims, _units(f.numel(), ws, i)),)

    _optim_cases(rank, ws, mesh, pl, lambda: rank)


def _optim_hsdp(rank, ws):
    import raggedfsdp  # noqa: F401
    from raggedfsdp import RaggedShard
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate

    mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("rep", "shard"))
    s = ws // 2

    def pl(i, f):
        return (Replicate(), RaggedShard((0,), _units(f.shape[0], s, i + 7)))

    _optim_cases(rank, ws, mesh, pl, lambda: mesh.get_local_rank(1))


@pytest.mark.parametrize("ws", [1, 3])
def test_optim_1d(ws):
    SPAWNS.check(ws, "ragged_optim_1d")


def test_optim_hsdp_2x2():
    SPAWNS.check(4, "ragged_optim_hsdp")
