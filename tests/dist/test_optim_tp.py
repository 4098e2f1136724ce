"""Optimizers on FSDP x TP parameters (Note [FSDP x TP]): 2-D DTensors ``(RaggedShard, Shard(d)|Replicate)``
on
a dp2 x tp2 gloo mesh, uneven ragged pieces of the TP-local tensors (empty ones included), against the
single-device optimizers on the full tensors with the same gradients:

* ``raggedfsdp.optim.Muon``: Newton-Schulz on the FULL logical matrix of each TP-sharded weight (colwise,
  rowwise, an expert stack split over experts), owners over all 4 ranks, once per matrix; bitwise equal to
  ``torch.optim.Muon`` (2-D) and the single-device reference (3-D);
* ``AdamW8bit``: global 32x32 tiles, whole in every TP-local block and ragged piece; bitwise equal to its
  single-device reference; a TP split that cuts a tile is refused;
* ``torch.optim.AdamW`` (foreach): bitwise equal, 0 collectives.
"""

from __future__ import annotations

import torch
from _spawns import SPAWNS  # runs in the shared per-world-size spawns (tests/dist/_spawns.py)
from _optim_cases import layout

LR, WD = 0.02, 0.1


def _dt(full, mesh, rs, tp_pl):
    from torch.distributed.tensor import distribute_tensor

    return torch.nn.Parameter(distribute_tensor(full, mesh, [rs, tp_pl]))


def _grad(p, g):
    from torch.distributed.tensor import distribute_tensor

    p.grad = distribute_tensor(g, p.device_mesh, list(p.placements))


def _local_shape(shape, pl, n=2):
    s = list(shape)
    if pl.is_shard():
        s[pl.dim] //= n
    return tuple(s)


def _run(rank, ws):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.debug import CommDebugMode

    from raggedfsdp.optim import AdamW8bit, Muon
    from raggedfsdp.optim.reference import adamw8bit_reference_step, muon_reference_step

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    g = torch.Generator().manual_seed(0)

    # ---- Muon ----
    cases = [
        ((64, 72), Shard(0), "row"),
        ((48, 64), Shard(1), "element"),
        ((4, 16, 24), Shard(0), "row"),
        ((40, 24), Replicate(), "whole"),
        ((32, 40), Shard(1), "whole"),
    ]
    fulls = [torch.randn(s, generator=g) for s, _, _ in cases]
    params = [
        _dt(f, mesh, layout(kind, _local_shape(s, pl), 2, 7 + i), pl)
        for i, (f, (s, pl, kind)) in enumerate(zip(fulls, cases))
    ]
    refs = [torch.nn.Parameter(f.clone()) for f in fulls]
    bufs = [torch.zeros_like(f) for f in fulls]
    opt = Muon(params, lr=LR, weight_decay=WD)
    tref = torch.optim.Muon([r for r in refs if r.ndim == 2], lr=LR, weight_decay=WD)
    for _ in range(2):
        grads = [torch.randn(f.shape, generator=g) for f in fulls]
        for p, r, gr in zip(params, refs, grads):
            _grad(p, gr)
            r.grad = gr.clone()
        opt.step()
        tref.step()
        for r, b, gr in zip(refs, bufs, grads):
            if r.ndim == 3:
                muon_reference_step(r.data, gr, b, lr=LR, weight_decay=WD)
        # every matrix orthogonalised exactly once in the dp x tp world (the Replicate one too)
        seen = [None] * ws
        dist.all_gather_object(seen, opt.last_step_stats["ns_matrices"])
        ns = sorted(m for lst in seen for m in lst)
        want = sorted((i, e) for i, f in enumerate(fulls) for e in range(f.shape[0] if f.ndim == 3 else 1))
        assert ns == want, (ns, want)
        owners = {r for r, lst in enumerate(seen) for m in lst if m[0] != 3}
        assert len(owners) >= 3, owners  # balanced over dp x tp, not just the dp group
    for i, (p, r) in enumerate(zip(params, refs)):
        assert p.placements == params[i].placements
        assert torch.equal(p.full_tensor(), r.detach()), (i, cases[i], (p.full_tensor() - r).abs().max())
    assert opt.state[params[1]]["momentum_buffer"].placements == params[1].placements

    # ---- AdamW8bit: global tiles, whole in each TP-local block ----
    qcases = [((64, 64), Shard(0)), ((64, 128), Shard(1)), ((2, 64, 32), Shard(0)), ((300,), Shard(0))]
    qf = [torch.randn(s, generator=g) for s, _ in qcases]
    qp = []
    for i, (f, (s, pl)) in enumerate(zip(qf, qcases)):
        ls = _local_shape(s, pl)
        rs = layout("row", ls, 2, 3 + i, block_rows=32) if len(s) > 1 else layout("element", ls, 2, 3)
        qp.append(_dt(f, mesh, rs, pl))
    qr = [f.clone() for f in qf]
    states = [{} for _ in qf]
    kw = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.05}
    q = AdamW8bit(qp, **kw)
    for _ in range(2):
        grads = [torch.randn(f.shape, generator=g) for f in qf]
        for p, gr in zip(qp, grads):
            _grad(p, gr)
        with CommDebugMode() as comm:
            q.step()
        assert comm.get_total_counts() == 0, comm.get_comm_counts()
        for r, gr, st in zip(qr, grads, states):
            adamw8bit_reference_step(r, gr, st, **kw)
    for i, (p, r, st) in enumerate(zip(qp, qr, states)):
        assert torch.equal(p.full_tensor(), r), (i, qcases[i], (p.full_tensor() - r).abs().max())
        if "exp_avg_codes" in st:
            ost = q.state[p]
            assert torch.equal(ost["exp_avg_codes"].full_tensor().view(-1), st["exp_avg_codes"].view(-1)), i
            assert torch.equal(ost["exp_avg_sq_scale"].full_tensor(), st["exp_avg_sq_scale"]), i
    # a rowwise split into 48-column blocks cuts 32x32 tiles: refused
    bad = _dt(torch.randn(64, 96), mesh, layout("row", (64, 48), 2, 1, block_rows=32), Shard(1))
    try:
        AdamW8bit([bad])
    except ValueError as e:
        assert "cuts a 32x32 tile" in str(e) and "tensor-parallel" in str(e), e
    else:
        raise AssertionError("a TP split cutting tiles was accepted")

    # ---- torch AdamW (foreach): element-wise, local, bitwise ----
    ap = [
        _dt(f.clone(), mesh, layout("element", _local_shape(s, pl), 2, 11 + i), pl)
        for i, (f, (s, pl, _)) in enumerate(zip(fulls, cases))
    ]
    ar = [torch.nn.Parameter(f.clone()) for f in fulls]
    ao, aro = torch.optim.AdamW(ap, lr=1e-2, foreach=True), torch.optim.AdamW(ar, lr=1e-2, foreach=True)
    for _ in range(2):
        for p, r in zip(ap, ar):
            gr = torch.randn(r.shape, generator=g)
            _grad(p, gr)
            r.grad = gr
        with CommDebugMode() as comm:
            ao.step()
        assert comm.get_total_counts() == 0, comm.get_comm_counts()
        aro.step()
    for p, r in zip(ap, ar):
        assert torch.equal(p.full_tensor(), r.detach())


def test_optimizers_on_fsdp_tp_dtensors():
    SPAWNS.check(4, "optim_tp")
