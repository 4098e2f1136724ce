"""Single-process checks of raggedfsdp.optim: references vs torch.optim.Muon, the 8-bit quantizer vs a
brute-force oracle, owner balance on LLaMA-3-8B layouts, param groups, state bytes, errors."""

import math

import pytest
import torch

import raggedfsdp  # noqa: F401
from raggedfsdp.optim import AdamW8bit, Muon, muon_param_groups
from raggedfsdp.optim._muon_plan import assign_owners, balance, split_matrices
from raggedfsdp.optim._newton_schulz import matrices_of
from raggedfsdp.optim._quant import _code_book, dequantize_tiles, quantize_tiles, tile_eligible
from raggedfsdp.optim.reference import adamw8bit_reference_step, muon_reference_step


@pytest.mark.parametrize("shape", [(32, 16), (16, 40), (9, 9)])
@pytest.mark.parametrize("kw", [{}, {"nesterov": False, "adjust_lr_fn": "match_rms_adamw", "momentum": 0.9}])
def test_muon_reference_and_plain_tensor_muon_equal_torch_muon(shape, kw):
    torch.manual_seed(0)
    w = torch.randn(shape)
    pt, po = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    pr, buf = w.clone(), torch.zeros(shape)
    tt, to = torch.optim.Muon([pt], lr=0.05, **kw), Muon([po], lr=0.05, **kw)
    for _ in range(3):
        g = torch.randn(shape)
        pt.grad, po.grad = g.clone(), g.clone()
        tt.step()
        to.step()
        muon_reference_step(pr, g, buf, lr=0.05, **kw)
    assert torch.equal(po.detach(), pt.detach()) and torch.equal(pr, pt.detach())
    assert torch.equal(to.state[po]["momentum_buffer"], tt.state[pt]["momentum_buffer"])
    assert to.last_step_stats["ns_calls"] == 1 and to.last_step_stats["collectives"] == 0


def test_muon_expert_stack_is_per_expert():
    torch.manual_seed(1)
    w, g = torch.randn(3, 8, 12), torch.randn(3, 8, 12)
    p = w.clone()
    muon_reference_step(p, g, torch.zeros_like(w), lr=0.1)
    for e in range(3):
        pe = torch.nn.Parameter(w[e].clone())
        pe.grad = g[e].clone()
        torch.optim.Muon([pe], lr=0.1).step()
        assert torch.equal(p[e], pe.detach())
    assert matrices_of((3, 8, 12)) == [(0, 96, 8, 12), (96, 96, 8, 12), (192, 96, 8, 12)]


def test_quantizer_matches_brute_force_per_tile():
    torch.manual_seed(2)
    x = torch.randn(64, 40) * torch.logspace(-4, 1, 40)  # wide dynamic range, partial edge tiles
    for signed in (True, False):
        v = x if signed else x.abs()
        codes, scales = quantize_tiles(v, (32, 16), signed)
        book = _code_book(signed)[0]
        assert scales.shape == (2, 3) and codes.dtype == torch.uint8
        for i in range(2):
            for j in range(3):
                tile = v[32 * i : 32 * i + 32, 16 * j : 16 * j + 16]
                s = tile.abs().max()
                assert scales[i, j] == s
                want = (tile.reshape(-1, 1) / s - book).abs().argmin(1).view(tile.shape)
                got = codes[32 * i : 32 * i + 32, 16 * j : 16 * j + 16].long()
                # nearest code (ties may go either way): same distance as the brute-force choice
                assert torch.equal((book[got] - tile / s).abs(), (book[want] - tile / s).abs())
        back = dequantize_tiles(codes, scales, (32, 16), signed)
        rel = ((back - v).abs() / v.abs().clamp_min(1e-30))[v.abs() > 1e-6 * scales.max()]
        assert rel.median() < 0.03


def test_eligibility_and_policy_use_the_global_shape():
    assert tile_eligible((64, 64)) and not tile_eligible((64, 63)[:1])
    assert not tile_eligible((8, 1024)) and not tile_eligible((33, 512)) and tile_eligible((2, 64, 33))
    assert not tile_eligible((63, 64))  # numel 4032 < 4096
    fn = AdamW8bit.shard_placement_fn
    assert fn(torch.empty(64, 64)) == "tile:32x32" and fn(torch.empty(64)) is None
    assert fn(torch.empty(8, 1024)) is None


def _llama_matrices(ws, policy):
    from raggedfsdp.app.sizing.archs import model_units
    from raggedfsdp.app.sizing.modelplan import plan_model

    mats = []
    for up in plan_model(model_units("llama3-8b"), ws, policy=policy).units:
        lay = up.layout
        for i, (name, shape) in enumerate(zip(lay.names, lay.shapes)):
            if len(shape) == 2 and "embed" not in name and "lm_head" not in name:
                mats += split_matrices(
                    len(mats), matrices_of(tuple(shape)), [lay.piece(i, r) for r in range(ws)]
                )
    return mats


@pytest.mark.parametrize("policy", [None, "matrix"])
def test_owner_balance_on_llama3_8b_at_4_ranks(policy):
    mats = _llama_matrices(4, policy)
    owners, loads = assign_owners(mats, 4)
    assert balance(loads) <= 1.1, (policy, balance(loads))
    # most whole-on-one-rank matrices are computed where they lie (no communication)
    kept = sum(m.whole_on is not None and o in m.whole_on for m, o in zip(mats, owners))
    whole = sum(m.whole_on is not None for m in mats)
    assert kept >= 0.75 * whole, (kept, whole)
    strict, _ = assign_owners(mats, 4, balance_slack=None)
    assert all(m.whole_on is None or o in m.whole_on for m, o in zip(mats, strict))


def test_muon_param_groups_on_llama():
    from raggedfsdp.app.models import build_model

    model = build_model("llama", "debug")
    groups = muon_param_groups(model)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for p in groups[0]["params"]}
    adamw = {names[id(p)] for p in groups[1]["params"]}
    assert groups[0]["algorithm"] == "muon" and groups[1]["algorithm"] == "adamw"
    assert all(n.startswith("layers.") and n.endswith("weight") and "norm" not in n for n in muon), muon
    assert "tok_embeddings.weight" in adamw and "output.weight" in adamw and "norm.weight" in adamw
    assert len(muon) + len(adamw) == len(names)
    Muon(groups).step()  # no grads: a no-op


def test_bad_input_raises_clearly():
    with pytest.raises(ValueError, match="muon_param_groups"):
        Muon([torch.nn.Parameter(torch.randn(5))])
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        Muon([torch.nn.Parameter(torch.randn(5, 5))], adjust_lr_fn="spectral")
    with pytest.raises(ValueError, match="block"):
        AdamW8bit([torch.nn.Parameter(torch.randn(5, 5))], block=(0, 32))
    with pytest.raises(ValueError, match="betas"):
        AdamW8bit([torch.nn.Parameter(torch.randn(5, 5))], betas=(0.9, 1.0))


def test_adamw8bit_state_bytes_quarter_of_adamw_and_tracks_fp32_adamw():
    torch.manual_seed(3)
    w = torch.randn(256, 128) * 0.1
    target = torch.randn(256, 128) * 0.1
    p8, p32 = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    o8, o32 = AdamW8bit([p8], lr=1e-2), torch.optim.AdamW([p32], lr=1e-2)
    for _ in range(50):
        for p, o in ((p8, o8), (p32, o32)):
            o.zero_grad()
            ((p - target) ** 2).sum().backward()
            o.step()
    per_param = o8.state_bytes() / w.numel()
    assert abs(per_param - (2 + 8 / 1024)) < 1e-9
    assert per_param <= 0.26 * 8  # torch AdamW: 8 bytes (two fp32 moments)
    l8, l32 = ((p8 - target) ** 2).sum().item(), ((p32 - target) ** 2).sum().item()
    l0 = ((w - target) ** 2).sum().item()
    assert l8 < 0.5 * l0 and abs(l8 - l32) < 0.05 * l0, (l0, l8, l32)


def test_adamw8bit_state_dict_round_trip_continues_exactly():
    torch.manual_seed(4)
    shapes = [(64, 96), (7,)]
    ps = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    refs, states = [p.detach().clone() for p in ps], [{}, {}]
    opt = AdamW8bit(ps, lr=1e-2)
    grads = [[torch.randn(s) for s in shapes] for _ in range(4)]
    for k in range(4):
        if k == 2:
            sd = opt.state_dict()
            ps = [torch.nn.Parameter(p.detach().clone()) for p in ps]
            opt = AdamW8bit(ps, lr=1e-2)
            opt.load_state_dict(sd)
            assert opt.state[ps[0]]["exp_avg_codes"].dtype == torch.uint8
        for p, g in zip(ps, grads[k]):
            p.grad = g.clone()
        opt.step()
        for r, g, st in zip(refs, grads[k], states):
            adamw8bit_reference_step(r, g, st, lr=1e-2)
    assert all(torch.equal(p.detach(), r) for p, r in zip(ps, refs))
    assert math.isclose(opt.state[ps[0]]["step"].item(), 4)


def test_fast_encoder_equals_bucketize_nearest_code():
    from raggedfsdp.optim._quant import encode

    torch.manual_seed(5)
    for signed in (True, False):
        book, mids = _code_book(signed)
        edge = torch.cat(
            [mids, torch.nextafter(mids, torch.tensor(2.0)), torch.nextafter(mids, torch.tensor(-2.0)), book]
        )
        x = torch.cat([torch.rand(50000) * 2 - 1, edge]).clamp(-1 if signed else 0, 1)
        x = x * torch.logspace(-9, 0, x.numel())[torch.randperm(x.numel())]
        assert torch.equal(encode(x, signed), torch.bucketize(x, mids).to(torch.uint8))


def _hsdp_matrices(model, reps, shards):
    from raggedfsdp.app.sizing.archs import model_units
    from raggedfsdp.app.sizing.modelplan import plan_model

    holders = tuple(tuple(r * shards + s for r in range(reps)) for s in range(shards))
    mats = []
    for up in plan_model(model_units(model), shards).units:
        lay = up.layout
        for i, (name, shape) in enumerate(zip(lay.names, lay.shapes)):
            if len(shape) == 2 and "embed" not in name and "lm_head" not in name:
                mats += split_matrices(
                    len(mats), matrices_of(tuple(shape)), [lay.piece(i, r) for r in range(shards)], holders
                )
    return mats


@pytest.mark.parametrize("reps,shards", [(1, 4), (2, 2), (2, 4), (4, 4), (4, 8)])
def test_world_plan_runs_each_newton_schulz_once_balanced(reps, shards):
    """HSDP (reps x shards) plan for LLaMA-3-8B's 224 matrices: exactly one owner per matrix in the
    world, per-rank NS FLOPs max/mean <= 1.1, every holder of every part receives its rows, and every
    message a rank sends is one its peer expects (pairwise-consistent lists, built independently)."""
    from raggedfsdp.optim._muon_plan import chunk_of, plan_exchange
    from raggedfsdp.optim._newton_schulz import ns_flops

    ws = reps * shards
    replica = tuple(w // shards for w in range(ws))
    mats = _hsdp_matrices("llama3-8b", reps, shards)
    owners, loads = assign_owners(mats, ws)
    chunk, n = chunk_of(mats, owners, 4)
    plans = [plan_exchange(mats, owners, chunk, n, replica, w) for w in range(ws)]
    done = [0] * len(mats)
    flops = [0] * ws
    for w, ex in enumerate(plans):
        for e in ex:
            for j in e.mine:
                done[j] += 1
                flops[w] += ns_flops(mats[j].rows, mats[j].cols)
    assert done == [1] * len(mats)
    assert flops == loads and balance(flops) <= 1.1, balance(flops)
    for c in range(n):
        for a in range(ws):
            for b in range(ws):
                assert plans[a][c].gather_send[b] == plans[b][c].gather_recv[a]
                assert plans[a][c].scatter_send[b] == plans[b][c].scatter_recv[a]
    # each rank ends with every row of every part it holds: from the owner, or its own result
    for j, m in enumerate(mats):
        for holders, lo, hi in m.parts:
            for h in holders:
                got = [
                    (lo2, hi2) for e in plans[h] for lst in e.scatter_recv for jj, lo2, hi2 in lst if jj == j
                ]
                assert got == ([] if h == owners[j] else [(lo, hi)]), (j, h, got)
    # whole matrices mostly stay where they lie (no gather), on one of the piece's holders
    whole = [j for j, m in enumerate(mats) if m.whole_on is not None]
    assert sum(owners[j] in mats[j].whole_on for j in whole) >= 0.5 * len(whole)


@pytest.mark.slow  # torch.compile (inductor, C++ build): ~30 s idle, minutes on a loaded 2-core box
def test_compiled_newton_schulz_matches_eager_closely():
    """Muon(compile_ns=True) runs Newton-Schulz through torch.compile: same maths, last-bit differences
    only (fp32: 1e-5; the default bf16: within 4 bf16 ulps of the ~1-magnitude entries)."""
    from raggedfsdp.optim._newton_schulz import compiled_newton_schulz, newton_schulz

    torch.manual_seed(4)
    g = torch.randn(24, 40)
    for dtype, atol in ((torch.float32, 1e-5), (torch.bfloat16, 0.032)):
        a, b = compiled_newton_schulz()(g, dtype=dtype), newton_schulz(g, dtype=dtype)
        assert a.dtype == b.dtype == dtype
        torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=0)
    p = torch.nn.Parameter(torch.randn(24, 40))
    p.grad = g
    opt = Muon([p], lr=0.05, compile_ns=True)
    assert opt._ns is compiled_newton_schulz()
    opt.step()
    assert opt.last_step_stats["ns_calls"] == 1
