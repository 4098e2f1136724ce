"""RaggedShard through torch's public DTensor API at world sizes 1-5, 1-D and 2-D meshes.

Every result is compared with the same operation on the full tensor.
"""

import pytest
import torch

from _spawns import SPAWNS  # runs in the shared per-world-size spawns (tests/dist/_spawns.py)

SHAPES = [(7,), (6, 3), (4, 2, 3), (2, 3, 2, 2), (0, 3), (3, 0)]


def _layouts(shape, ws, seed, per_k=2):
    """A few (dims, local_units) for ``shape``: row, element and block granularity, with empty pieces."""
    from raggedfsdp import RaggedShard

    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(1, len(shape) + 1):
        n = 1
        for s in shape[:k]:
            n *= s
        cands = []
        for _ in range(60):
            u = tuple(int(x) for x in torch.randint(0, 4, (ws,), generator=g))
            if sum(u) and (n % sum(u) == 0):
                cands.append(u)
        if n and n % ws == 0:
            cands.append((1,) * ws)  # even, block = n/ws rows
        if not cands:
            cands.append((1,) + (0,) * (ws - 1))
        for u in cands[:per_k]:
            out.append(RaggedShard(tuple(range(k)), u))
    return out


def _expected_local(full, rs, rank):
    a, b = rs.flat_range(full.shape, rank)
    return full.reshape(-1)[a:b]


def _counts(comm):
    return {str(k).split("'")[1] if "'" in str(k) else str(k): v for k, v in comm.get_comm_counts().items()}


def _cases_1d(rank, ws, light=False):
    import raggedfsdp  # noqa: F401
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    shapes = [SHAPES[i] for i in (1, 2, 3, 4)] if light else SHAPES
    for si, shape in enumerate(shapes):
        full = torch.randn(shape)
        layouts = _layouts(shape, ws, si, per_k=1 if light else 2)
        for rs in layouts:
            d = distribute_tensor(full, mesh, [rs])
            exp = _expected_local(full, rs, rank)
            assert d.placements == (rs,) and d.shape == full.shape
            assert d.to_local().dim() == 1 and d.to_local().is_contiguous()
            assert torch.equal(d.to_local(), exp), (rs, shape)
            assert torch.equal(d.full_tensor(), full)
            f = DTensor.from_local(exp.clone(), mesh, [rs], shape=full.shape, stride=full.stride())
            assert torch.equal(f.full_tensor(), full)
            # to / from Replicate, Shard(d), Partial
            targets = [Replicate()] + [Shard(i) for i in range(len(shape))]
            for t in targets:
                e = d.redistribute(mesh, [t])
                assert e.placements == (t,)
                assert torch.equal(e.full_tensor(), full), (rs, t)
                if t.is_partial():
                    continue
                ref = distribute_tensor(full, mesh, [t])
                assert torch.equal(e.to_local(), ref.to_local()), (rs, t, shape, e.to_local(), ref.to_local())
                back = ref.redistribute(mesh, [rs])
                assert torch.equal(back.to_local(), exp), (t, rs)
                if isinstance(t, Shard) and t.dim == 0:  # interval-like: one all_to_all each way
                    with CommDebugMode() as comm:
                        ref.redistribute(mesh, [rs])
                    if ws > 1:
                        assert _counts(comm) == {"c10d.alltoall_base_": 1}, _counts(comm)
            # ragged -> ragged with other dims / units: ONE all_to_all_single
            for rs2 in layouts:
                with CommDebugMode() as comm:
                    e = d.redistribute(mesh, [rs2])
                assert torch.equal(e.to_local(), _expected_local(full, rs2, rank)), (rs, rs2)
                if ws > 1 and rs2 != rs:
                    assert _counts(comm) == {"c10d.alltoall_base_": 1}, _counts(comm)
            # Partial -> RaggedShard: one padded reduce-scatter of the summed values
            if full.numel():
                part = DTensor.from_local(
                    full * (rank + 1), mesh, [Partial()], shape=full.shape, stride=full.stride()
                )
                with CommDebugMode() as comm:
                    r = part.redistribute(mesh, [rs])
                tot = full * (ws * (ws + 1) // 2)
                torch.testing.assert_close(r.to_local(), _expected_local(tot, rs, rank))
                if ws > 1:
                    assert _counts(comm) == {"c10d._reduce_scatter_base_": 1}, _counts(comm)
            # pointwise on the same layout stays local and ragged
            other = distribute_tensor(full * 3 + 1, mesh, [rs])
            with CommDebugMode() as comm:
                s = d * other + 2.0
                s.add_(other)
            assert comm.get_total_counts() == 0 and s.placements == (rs,)
            assert torch.equal(s.full_tensor(), full * (full * 3 + 1) + 2.0 + (full * 3 + 1))
            # full reductions
            if full.numel():
                torch.testing.assert_close(d.sum().full_tensor(), full.sum())
                torch.testing.assert_close(
                    torch.linalg.vector_norm(d, 3).full_tensor(), torch.linalg.vector_norm(full, 3)
                )
        # different ragged layouts in one op: redistributed, result still correct
        if len(layouts) > 1:
            a = distribute_tensor(full, mesh, [layouts[0]])
            b = distribute_tensor(full * 2, mesh, [layouts[-1]])
            assert torch.equal((a + b).full_tensor(), full * 3)
    _autograd(rank, ws, mesh)
    if ws == 2:
        _errors(rank, ws, mesh)


def _errors(rank, ws, mesh):
    """Bad input raises ValueError naming the argument; ops without a local rule redistribute (strict
    mode raises naming the op)."""
    from raggedfsdp import RaggedShard
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    full = torch.arange(12.0).reshape(4, 3)
    rs = RaggedShard((0,), (1, 3))
    d = distribute_tensor(full, mesh, [rs])
    with pytest.raises(ValueError, match=r"pass shape=<global shape> and stride="):
        DTensor.from_local(d.to_local(), mesh, [rs])
    with pytest.raises(ValueError, match=r"local_tensor must be 1-D with \d+ elements"):
        DTensor.from_local(torch.zeros(5), mesh, [rs], shape=full.shape, stride=full.stride())
    with pytest.raises(ValueError, match=r"local_units=\(1, 1, 1\) has 3 entries but mesh dim 0"):
        distribute_tensor(full, mesh, [RaggedShard((0,), (1, 1, 1))])
    with pytest.raises(ValueError, match=r"sum\(local_units\)=3 must divide the number of rows N=4"):
        distribute_tensor(full, mesh, [RaggedShard((0,), (1, 2))])
    with pytest.raises(ValueError, match=r"has 3 entries but mesh dim 0"):
        d.redistribute(mesh, [RaggedShard((0, 1), (1, 1, 1))])
    rep = distribute_tensor(torch.ones(3), mesh, [Replicate()])
    mat = distribute_tensor(torch.ones(3, 3), mesh, [Replicate()])
    idx = distribute_tensor(torch.tensor([0, 1]), mesh, [Replicate()])
    # ops without a local rule run, redistributed like Shard(0) (docs/raggedshard.md "Ops"); strict
    # mode raises naming the op; the local ones (view, mean, sum(0), amax) run in strict mode
    from raggedfsdp import RaggedShardOpError, strict_ops

    cases = {
        "aten.t.default": (lambda x, r, m, i: x.t(), False),
        "aten.view.default": (lambda x, r, m, i: x.view(12), True),
        "aten.permute.default": (lambda x, r, m, i: x.permute(1, 0), False),
        "aten.slice.Tensor": (lambda x, r, m, i: x[1:3], False),
        "aten.select.int": (lambda x, r, m, i: x[1], False),
        "aten.mm.default": (lambda x, r, m, i: x @ m, False),
        "aten.mean.default": (lambda x, r, m, i: x.mean(), True),
        "aten.sum.dim_IntList": (lambda x, r, m, i: x.sum(0), True),
        "aten.add.Tensor": (lambda x, r, m, i: x + r, False),  # broadcasting
        "aten.amax.default": (lambda x, r, m, i: x.amax(), True),
        "aten.transpose.int": (lambda x, r, m, i: x.transpose(0, 1), False),
        "aten.index.Tensor": (lambda x, r, m, i: x[i], False),
    }
    for name, (fn, local) in cases.items():
        want = fn(full, torch.ones(3), torch.ones(3, 3), torch.tensor([0, 1]))
        torch.testing.assert_close(fn(d, rep, mat, idx).full_tensor(), want, msg=name)
        with strict_ops():
            if local:
                torch.testing.assert_close(fn(d, rep, mat, idx).full_tensor(), want, msg=name)
            else:
                with pytest.raises(
                    RaggedShardOpError, match=name.replace(".", r"\.") + " implicitly redistributes"
                ):
                    fn(d, rep, mat, idx)
    # compute_local_shape_and_global_offset: exact box for row pieces, ValueError for non-boxes
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset as clsgo

    assert clsgo((4, 3), mesh, [rs]) == (((1, 3), (0, 0)) if rank == 0 else ((3, 3), (1, 0)))
    with pytest.raises(ValueError, match="is not a rectangle"):  # 1 row + 1 element / 2 boxes each
        clsgo((4, 3), mesh, [RaggedShard((0, 1), (4, 8))])
    aligned = RaggedShard((0, 1), (3, 9))  # element granularity that happens to be row-aligned
    assert clsgo((4, 3), mesh, [aligned]) == (((1, 3), (0, 0)) if rank == 0 else ((3, 3), (1, 0)))
    # the supported counterparts still work
    assert torch.equal(d.redistribute(mesh, [Shard(0)]).t().full_tensor(), full.t())


def _autograd(rank, ws, mesh):
    from raggedfsdp import RaggedShard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    full = torch.randn(6, 4)
    w = torch.randn(6, 4)
    rs = RaggedShard(
        (0,),
        (2,) + (1,) * (ws - 1) if 6 % (ws + 1) == 0 else (1,) * ws if 6 % ws == 0 else (6,) + (0,) * (ws - 1),
    )
    rs2 = RaggedShard((0, 1), (0,) * (ws - 1) + (1,))
    x = distribute_tensor(full, mesh, [rs]).requires_grad_()
    for tgt in ([Replicate()], [Shard(1)], [rs2], [Shard(0)]):
        x.grad = None
        y = x.redistribute(mesh, tgt) * 2
        (y.full_tensor() * w).sum().backward()
        assert x.grad.placements == (rs,), x.grad.placements
        torch.testing.assert_close(x.grad.full_tensor(), 2 * w)


@pytest.mark.parametrize("ws", [1, 2, 3, 5])
def test_redistribute_1d(ws):
    SPAWNS.check(ws, "redistribute_1d", ws > 3)


def _cases_2d(rank, ws):
    import raggedfsdp  # noqa: F401
    from raggedfsdp import RaggedShard
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    _cases_1d(rank, ws, True)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    torch.manual_seed(1)
    for shape in [(6, 4), (4, 3, 2), (2, 2, 5)]:
        full = torch.randn(shape)
        rsa = RaggedShard((0,), (1, 2) if shape[0] % 3 == 0 else (1, 1))
        rsb = RaggedShard(tuple(range(len(shape) - 1)), (0, 1) if len(shape) > 2 else (3, 0))
        combos = [
            (Replicate(), rsa),
            (rsa, Replicate()),
            (Shard(1), rsa),
            (rsa, Shard(len(shape) - 1)),
            (Replicate(), rsb),
            (Partial(), rsa),
            (rsb, Shard(len(shape) - 1)),
            # FSDP x TP: RaggedShard on the TP-local tensor of a Shard on a dim the ragged rows span
            (Shard(0), rsb),
            (rsb, Shard(0)),
        ] + ([(Shard(0), rsa), (rsa, Shard(0))] if shape[0] // 2 % sum(rsa.local_units) == 0 else [])
        for pl in combos:
            d = distribute_tensor(full, mesh, list(pl))
            assert d.placements == pl
            assert d.to_local().dim() == 1
            torch.testing.assert_close(d.full_tensor(), full)
            # the ragged piece is the ragged slice of the non-ragged local tensor
            i = [j for j, p in enumerate(pl) if isinstance(p, RaggedShard)][0]
            base_pl = [Replicate() if j == i else p for j, p in enumerate(pl)]
            base = distribute_tensor(full, mesh, base_pl).to_local()
            exp = pl[i].shard_full(base, mesh.get_local_rank(i))
            assert torch.equal(d.to_local(), exp), pl
            f = DTensor.from_local(exp, mesh, list(pl), shape=full.shape, stride=full.stride())
            torch.testing.assert_close(f.full_tensor(), full)
            for pl2 in combos + [
                (Replicate(), Replicate()),
                (Shard(0), Replicate()),
                (Replicate(), Shard(1)),
            ]:
                if pl2[0].is_partial() or pl2 == pl:
                    continue
                e = d.redistribute(mesh, list(pl2))
                ref = distribute_tensor(full, mesh, list(pl2))
                torch.testing.assert_close(e.to_local(), ref.to_local(), msg=f"{pl} -> {pl2}")
            # random init draws the full tensor on every rank: equals single-device init, same seed
            if pl[0].is_partial():
                with pytest.raises(RuntimeError, match="Partial placement"):
                    d.normal_()
                continue
            torch.manual_seed(123 + len(shape))
            want = torch.empty(shape).normal_()
            torch.manual_seed(123 + len(shape))
            d2 = distribute_tensor(torch.zeros(shape), mesh, list(pl))
            d2.normal_()
            assert torch.equal(d2.full_tensor(), want), pl
            torch.manual_seed(7)
            want = torch.rand(shape)
            torch.manual_seed(7)
            r = torch.rand_like(d2)
            assert r.placements == pl and torch.equal(r.full_tensor(), want), pl
            # pointwise + AdamW-style in-place on 2-D layouts stay local
            s = d * 2 + d
            assert s.placements == pl
            torch.testing.assert_close(s.full_tensor(), full * 3)
        with pytest.raises(ValueError, match="uneven parts"):  # the TP-local shapes would differ
            distribute_tensor(torch.randn(5, 4), mesh, [Shard(0), RaggedShard((0,), (1, 1))])
        with pytest.raises(ValueError, match="at most one RaggedShard"):
            distribute_tensor(full, mesh, [rsa, rsa])


def test_redistribute_2d_and_4_ranks():
    SPAWNS.check(4, "redistribute_2d")
