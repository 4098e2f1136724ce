"""Distributed Muon, AdamW8bit and Shampoo vs their single-device references at world sizes 1, 2, 3, 5 (+
HSDP, 8 ranks).

Muon:
For the same gradients the sharded parameters must equal the reference **bitwise** (the owner runs
the very same bfloat16 Newton-Schulz on the very same matrix), whatever the layout: row- or
element-granular pieces with empty ranks, whole matrices on one rank, 3-D expert stacks, plain
tensors, pipelined (chunked, asynchronous) or not. Also asserted: every matrix orthogonalised
exactly once per step in the whole world (HSDP included: no replica group repeats it), the
collectives counted by CommDebugMode equal the optimizer's count (2 per step unpipelined, 0 when
every matrix is whole on one rank), and per-rank Newton-Schulz FLOPs balanced within 1.1 of the
mean on a 24-matrix model.

AdamW8bit: bit-identical to ``reference.adamw8bit_reference_step`` (hence across world sizes) on
tile-aligned uneven layouts with empty ranks, 0 collectives; fp32 state for small / 1-D tensors
decided from the global shape; a layout that cuts a tile raises a ValueError naming the parameter.

Shampoo: bit-identical to ``reference.shampoo_reference_step`` on band-aligned uneven layouts with
empty ranks (statistics and roots of each block on the rank holding it), 0 collectives; a layout
that cuts a band raises.
"""

import pytest
import torch
from _dist import run_distributed
from _spawns import SPAWNS  # ws 1-5 cases share the parity spawns (tests/dist/_spawns.py)

SHAPES = [(64, 48), (18, 40), (40, 18), (3, 16, 24), (7, 5), (33, 1)]
KINDS = ["row", "element", "whole", "row", "element", "row"]
LR, WD = 0.02, 0.1


def _check_muon(
    rank, ws, mesh, rank_in_dim, kinds, seed, *, plain_extra=True, expect_colls=None, muon_kw=None, **kw
):
    import torch.distributed as dist
    from _optim_cases import full, layout, make_param, set_grad
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.debug import CommDebugMode

    from raggedfsdp.optim import Muon
    from raggedfsdp.optim.reference import muon_reference_step

    g = torch.Generator().manual_seed(seed)
    fulls = [torch.randn(s, generator=g) for s in SHAPES]
    params = []
    for i, (f, kind) in enumerate(zip(fulls, kinds)):
        rs = layout(kind, f.shape, mesh.size(mesh.ndim - 1), seed + i)
        pls = (rs,) if mesh.ndim == 1 else (Replicate(), rs)
        params.append(make_param(f, mesh, pls, rank_in_dim))
    if plain_extra:
        params.append(torch.nn.Parameter(torch.randn(12, 20, generator=g)))
        fulls.append(params[-1].detach().clone())
    refs = [torch.nn.Parameter(f.clone()) for f in fulls]
    bufs = [torch.zeros_like(f) for f in fulls]
    opt = Muon(params, lr=LR, weight_decay=WD, **kw, **(muon_kw or {}))
    tref = torch.optim.Muon([r for r in refs if r.ndim == 2], lr=LR, weight_decay=WD, **kw)
    for step in range(3):
        grads = [torch.randn(f.shape, generator=g) for f in fulls]
        for p, r, gr in zip(params, refs, grads):
            set_grad(p, gr, rank_in_dim)
            r.grad = gr.clone()
        with CommDebugMode() as comm:
            opt.step()
        tref.step()
        for r, b, gr in zip(refs, bufs, grads):
            if r.ndim == 3:
                muon_reference_step(r.data, gr, b, lr=LR, weight_decay=WD, **kw)
        st = opt.last_step_stats
        n_coll = comm.get_total_counts()
        assert n_coll == st["collectives"], (comm.get_comm_counts(), st["collectives"])
        if expect_colls is not None:
            assert n_coll == expect_colls, comm.get_comm_counts()
        # every matrix exactly once in the whole world (HSDP: not once per replica group)
        seen = [None] * dist.get_world_size()
        dist.all_gather_object(seen, st["ns_matrices"])
        all_ns = sorted(m for lst in seen for m in lst if m[0] < len(SHAPES))
        want = sorted(
            (i, e)
            for i, f in enumerate(fulls[: len(SHAPES)])
            for e in range(f.shape[0] if f.ndim == 3 else 1)
        )
        assert all_ns == want, (all_ns, want)
    for i, (p, r) in enumerate(zip(params, refs)):
        assert torch.equal(full(p), r.detach()), (
            i,
            SHAPES[i] if i < len(SHAPES) else "plain",
            (full(p) - r.detach()).abs().max(),
        )
    assert opt.state[params[0]]["momentum_buffer"].placements == params[0].placements


Q_SHAPES = [(64, 72), (96, 64), (2, 64, 33), (64, 8), (300,), (32, 32)]  # last 3: fp32 state (small)


def _check_adamw8bit(rank, ws, mesh, rank_in_dim, seed):
    from _optim_cases import full, layout, make_param, set_grad
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.debug import CommDebugMode

    from raggedfsdp import RaggedShard
    from raggedfsdp.optim import AdamW8bit
    from raggedfsdp.optim._quant import tile_eligible
    from raggedfsdp.optim.reference import adamw8bit_reference_step

    nshard = mesh.size(mesh.ndim - 1)
    g = torch.Generator().manual_seed(seed)
    fulls = [torch.randn(s, generator=g) for s in Q_SHAPES]
    params = []
    for i, f in enumerate(fulls):
        br = 32 if tile_eligible(tuple(f.shape)) else 1
        rs = layout("row" if f.ndim > 1 else "element", f.shape, nshard, seed + i, block_rows=br)
        params.append(make_param(f, mesh, (rs,) if mesh.ndim == 1 else (Replicate(), rs), rank_in_dim))
    refs = [f.clone() for f in fulls]
    states = [{} for _ in fulls]
    kw = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.05}
    opt = AdamW8bit(params, **kw)
    for _ in range(3):
        grads = [torch.randn(f.shape, generator=g) * (i + 1) for i, f in enumerate(fulls)]
        for p, gr in zip(params, grads):
            set_grad(p, gr, rank_in_dim)
        with CommDebugMode() as comm:
            opt.step()
        assert comm.get_total_counts() == 0, comm.get_comm_counts()
        for r, gr, st in zip(refs, grads, states):
            adamw8bit_reference_step(r, gr, st, **kw)
    for i, (p, r, st) in enumerate(zip(params, refs, states)):
        assert torch.equal(full(p), r), (i, Q_SHAPES[i], (full(p) - r).abs().max())
        ost = opt.state[p]
        assert ("exp_avg_codes" in ost) == tile_eligible(Q_SHAPES[i]) == ("exp_avg_codes" in st)
        if "exp_avg_codes" in st:
            assert ost["exp_avg_codes"].dtype == torch.uint8
            assert torch.equal(full(ost["exp_avg_codes"]).view(-1), st["exp_avg_codes"].view(-1))
            assert torch.equal(full(ost["exp_avg_sq_scale"]), st["exp_avg_sq_scale"])
    # a piece that cuts a 32-row tile is refused, naming the parameter and the fix
    if nshard > 1:
        units = (1,) * (nshard - 1) + ((4 if nshard <= 3 else 8) - (nshard - 1),)  # 1152 or 576 elements
        rs = RaggedShard((0, 1), units)  # pieces of 16 or 8 rows of (64, 72): they cut 32-row tiles
        bad = make_param(fulls[0], mesh, (rs,) if mesh.ndim == 1 else (Replicate(), rs), rank_in_dim)
        try:
            AdamW8bit([bad])
        except ValueError as e:
            assert "cuts a 32x32 tile" in str(e) and "shard_placement_fn" in str(e), e
        else:
            raise AssertionError("a tile-cutting layout was accepted")


S_SHAPES = [(24, 20), (2, 12, 10), (5, 8), (30,)]  # band rows (block 8): 8, 6, 5; a vector gets AdamW
S_HP = {"lr": 0.01, "betas": (0.9, 0.99), "weight_decay": 0.05, "block_size": 8, "precondition_frequency": 2}


def _check_shampoo(rank, ws, mesh, rank_in_dim, seed):
    """Shampoo == its reference bitwise on band-aligned uneven layouts (empty ranks), 0 collectives,
    state laid out per band; a band-cutting layout raises naming the parameter and the fix."""
    from _optim_cases import full, layout, make_param, set_grad
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.debug import CommDebugMode

    from raggedfsdp import RaggedShard
    from raggedfsdp.optim import Shampoo
    from raggedfsdp.optim._shampoo_math import band_geometry
    from raggedfsdp.optim.reference import shampoo_reference_step

    nshard = mesh.size(mesh.ndim - 1)
    g = torch.Generator().manual_seed(seed)
    fulls = [torch.randn(s, generator=g) for s in S_SHAPES]
    params = []
    for i, f in enumerate(fulls):
        br = band_geometry(tuple(f.shape), 8)[0] if f.ndim > 1 else 1
        rs = layout("row" if f.ndim > 1 else "element", f.shape, nshard, seed + i, block_rows=br)
        params.append(make_param(f, mesh, (rs,) if mesh.ndim == 1 else (Replicate(), rs), rank_in_dim))
    refs, states = [f.clone() for f in fulls], [{} for _ in fulls]
    opt = Shampoo(params, **S_HP)
    for _ in range(5):  # roots at steps 2 and 4
        grads = [torch.randn(f.shape, generator=g) for f in fulls]
        for p, gr in zip(params, grads):
            set_grad(p, gr, rank_in_dim)
        with CommDebugMode() as comm:
            opt.step()
        assert comm.get_total_counts() == 0, comm.get_comm_counts()
        for r, gr, st in zip(refs, grads, states):
            shampoo_reference_step(r, gr, st, **S_HP)
    for i, (p, r, st) in enumerate(zip(params, refs, states)):
        assert torch.equal(full(p), r), ("shampoo", i, S_SHAPES[i], (full(p) - r).abs().max())
        if "L" in st:
            assert torch.equal(full(opt.state[p]["R_root"]), st["R_root"])
    if nshard > 1:  # pieces of 4 rows cut the 8-row bands of (24, 20)
        units = (1,) * (nshard - 1) + (6 - (nshard - 1),)
        bad = make_param(
            fulls[0],
            mesh,
            ((RaggedShard((0,), units),) if mesh.ndim == 1 else (Replicate(), RaggedShard((0,), units))),
            rank_in_dim,
        )
        try:
            Shampoo([bad], block_size=8)
        except ValueError as e:
            assert "cuts a 8-row Shampoo band" in str(e) and "shard_placement_fn" in str(e), e
        else:
            raise AssertionError("a band-cutting layout was accepted")


def _muon_1d(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh

    import raggedfsdp  # noqa: F401

    mesh = init_device_mesh("cpu", (ws,))
    _check_muon(
        rank, ws, mesh, rank, KINDS, 0, expect_colls=0 if ws == 1 else 2, muon_kw={"pipeline_chunks": 1}
    )
    _check_muon(rank, ws, mesh, rank, KINDS[::-1], 1, nesterov=False, adjust_lr_fn="match_rms_adamw")
    # every matrix whole on one rank: no communication at all when locality is absolute, and
    # (ws > 1) whole matrices moved to balance the Newton-Schulz load by default: still exact
    _check_muon(
        rank, ws, mesh, rank, ["whole"] * len(SHAPES), 2, expect_colls=0, muon_kw={"balance_slack": None}
    )
    _check_muon(rank, ws, mesh, rank, ["whole"] * len(SHAPES), 2)
    _check_adamw8bit(rank, ws, mesh, rank, 4)
    _check_shampoo(rank, ws, mesh, rank, 12)
    if ws == 3:
        _check_grad_accumulation(rank, ws)


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 40))


def _check_grad_accumulation(rank, ws, k=3):
    """k micro-batches (loss / k) then one step == one batch of k times the size, for Muon and
    AdamW8bit on a fully_shard-ed MLP (tile layout from AdamW8bit.shard_placement_fn), and both
    track the single-device run (torch.optim.Muon + AdamW / the 8-bit reference)."""
    from raggedfsdp import fully_shard
    from raggedfsdp.optim import AdamW8bit, Muon, muon_param_groups

    g = torch.Generator().manual_seed(9)
    xs, ys = torch.randn(2, 6 * k, 64, generator=g), torch.randn(2, 6 * k, 40, generator=g)
    mine = slice(rank * 2 * k, (rank + 1) * 2 * k) if ws == 3 else slice(None)

    def make(name, sharded):
        model = _mlp()
        if sharded:
            pfn = AdamW8bit.shard_placement_fn if name == "adamw8bit" else None
            for lin in (model[0], model[2]):
                fully_shard(lin, shard_placement_fn=pfn)
            fully_shard(model, shard_placement_fn=pfn)
        if name == "muon":
            return model, Muon(muon_param_groups(model, lr=0.02, adamw_lr=1e-2), ns_dtype=torch.float32)
        return model, AdamW8bit(model.parameters(), lr=1e-2)

    for name in ("muon", "adamw8bit"):
        (ma, oa), (mb, ob) = make(name, True), make(name, True)
        for step in range(2):
            x, y = xs[step][mine], ys[step][mine]
            for xc, yc in zip(x.chunk(k), y.chunk(k)):
                ((ma(xc) - yc) ** 2).mean().div(k).backward()
            ((mb(x) - y) ** 2).mean().backward()
            oa.step(), ob.step()
            oa.zero_grad(), ob.zero_grad()
        for (n, pa), pb in zip(ma.named_parameters(), mb.parameters()):
            torch.testing.assert_close(
                pa.full_tensor(), pb.full_tensor(), atol=2e-5, rtol=0, msg=f"{name} {n}"
            )
        mr, _ = make(name, False)
        if name == "muon":
            ts = [
                torch.optim.Muon([mr[0].weight, mr[2].weight], lr=0.02),
                torch.optim.AdamW([mr[0].bias, mr[2].bias], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0),
            ]
        for step in range(2):
            ((mr(xs[step]) - ys[step]) ** 2).mean().backward()
            if name == "muon":
                [t.step() for t in ts]
            else:
                from raggedfsdp.optim.reference import adamw8bit_reference_step

                mr._st = getattr(mr, "_st", [{} for _ in mr.parameters()])
                for p, st in zip(mr.parameters(), mr._st):
                    adamw8bit_reference_step(p.data, p.grad, st, lr=1e-2)
            mr.zero_grad()
        for (n, pa), pr in zip(ma.named_parameters(), mr.parameters()):
            # bf16 Newton-Schulz (torch) vs fp32 here; 8-bit codes may flip on reduce-order noise
            torch.testing.assert_close(pa.full_tensor(), pr.detach(), atol=2e-3, rtol=0, msg=f"{name} {n}")


@pytest.mark.parametrize("ws", [1, 2, pytest.param(3, marks=pytest.mark.core), 5])
def test_optimizers_match_references_at_world_sizes(ws):
    SPAWNS.check(ws, "muon_1d")


def _muon_hsdp(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh

    import raggedfsdp  # noqa: F401

    mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("rep", "shard"))
    # owners over all 4 ranks: 2 world collectives per step unpipelined (gather, then scatter to both
    # replicas)
    _check_muon(
        rank, ws, mesh, mesh.get_local_rank(1), KINDS, 3, expect_colls=2, muon_kw={"pipeline_chunks": 1}
    )
    _check_muon(rank, ws, mesh, mesh.get_local_rank(1), KINDS[::-1], 8)
    _check_world_balance(rank, ws, mesh)
    _check_adamw8bit(rank, ws, mesh, mesh.get_local_rank(1), 6)
    _check_shampoo(rank, ws, mesh, mesh.get_local_rank(1), 14)


def _check_world_balance(rank, ws, mesh):
    """24 matrices (row pieces, HSDP): Newton-Schulz FLOPs per rank within 1.1 of the world mean
    and NS calls counted per rank sum to the matrix count (a replica group repeating NS doubles it)."""
    import torch.distributed as dist
    from _optim_cases import layout, make_param, set_grad
    from torch.distributed.tensor import Replicate

    from raggedfsdp.optim import Muon
    from raggedfsdp.optim._muon_plan import balance

    nshard = mesh.size(mesh.ndim - 1)
    g = torch.Generator().manual_seed(17)
    shapes = [(32, 24)] * 12 + [(16, 40)] * 8 + [(48, 32)] * 4
    fulls = [torch.randn(sh, generator=g) for sh in shapes]
    pls = [(layout("row", f.shape, nshard, 40 + i),) for i, f in enumerate(fulls)]
    params = [
        make_param(f, mesh, pl if mesh.ndim == 1 else (Replicate(),) + pl, mesh.get_local_rank(mesh.ndim - 1))
        for f, pl in zip(fulls, pls)
    ]
    opt = Muon(params, lr=LR)
    for p, f in zip(params, fulls):
        set_grad(p, torch.randn(f.shape, generator=g), mesh.get_local_rank(mesh.ndim - 1))
    opt.step()
    st = opt.last_step_stats
    stats = [None] * ws
    dist.all_gather_object(stats, (st["ns_calls"], st["ns_flops"]))
    assert sum(c for c, _ in stats) == len(shapes), stats
    flops = [f for _, f in stats]
    assert balance(flops) <= 1.1, flops
    ((_, _, _, _, loads),) = opt._plans.values()  # the plan's loads are what each rank did
    assert loads == flops, (loads, flops)


def test_optimizers_hsdp_2x2():
    SPAWNS.check(4, "muon_hsdp")


def _muon_tiny_on_8(rank, ws):
    """(18, D) on 8 ranks: most ranks hold nothing (dion#74 hung here); element pieces too."""
    from _optim_cases import full, make_param, set_grad
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import raggedfsdp  # noqa: F401
    from raggedfsdp import RaggedShard
    from raggedfsdp.optim import Muon

    mesh = init_device_mesh("cpu", (ws,))
    g = torch.Generator().manual_seed(5)
    fulls = [torch.randn(18, 24, generator=g), torch.randn(18, 24, generator=g)]
    pls = [RaggedShard((0,), (1, 1, 1) + (0,) * (ws - 3)), RaggedShard((0, 1), (0,) * (ws - 1) + (1,))]
    params = [make_param(f, mesh, (pl,), rank) for f, pl in zip(fulls, pls)]
    refs = [torch.nn.Parameter(f.clone()) for f in fulls]
    opt, tref = Muon(params, lr=LR), torch.optim.Muon(refs, lr=LR)
    for _ in range(2):
        grads = [torch.randn(18, 24, generator=g) for _ in fulls]
        for p, r, gr in zip(params, refs, grads):
            set_grad(p, gr, rank)
            r.grad = gr.clone()
        opt.step()
        tref.step()
    assert isinstance(params[0], DTensor)
    for p, r in zip(params, refs):
        assert torch.equal(full(p), r.detach())


def test_muon_tiny_matrix_on_8_ranks():
    run_distributed(_muon_tiny_on_8, 8)
