"""FSDP x TP (Note [FSDP x TP] in raggedfsdp/fsdp/_tp.py): ``fully_shard`` over ``mesh["dp"]`` of a Llama
whose blocks are tensor-parallel over ``mesh["tp"]`` (``raggedfsdp.app.models.apply_tp``: colwise/rowwise
linears, a
Shard(0) embedding, a Replicate norm), on 4 real gloo ranks (dp2 x tp2), against two independent references in
the same spawn: torch's own ``fully_shard`` with the same TP plan, and the single-process model on the global
batch. Checks the 2-D DTensors (placements in mesh-dim order, ``full_tensor``, ``redistribute``, state dicts),
losses and final parameters with AdamW, and activation checkpointing.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _spawns import SPAWNS  # runs in the shared per-world-size spawns (tests/dist/_spawns.py)

STEPS = 3
B, T = 4, 16  # global batch rows, sequence length


def _cfg():
    from raggedfsdp.app.models import LlamaConfig

    return LlamaConfig.flavor("debug")


def _batches(steps=STEPS):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 256, (B, T + 1), generator=g) for _ in range(steps)]


def _model():
    from raggedfsdp.app.models import Llama

    m = Llama(_cfg())
    m.init_weights(seed=3)
    return m


def _loss(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _train(model, opt, batches, rows, dp_group=None, dp=1):
    losses = []
    for tok in batches:
        loss = _loss(model, tok[rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        if dp_group is not None:
            torch.distributed.all_reduce(t, group=dp_group)
        losses.append(t.item() / dp)
    return losses


def _sharded(mesh, backend, ac=False, spf=None):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from raggedfsdp.app.models import apply_fsdp, apply_tp

    m = apply_tp(_model(), mesh["tp"])
    if ac:
        for i, blk in enumerate(m.layers):
            m.layers[i] = checkpoint_wrapper(blk)
    return apply_fsdp(m, mesh["dp"], backend=backend, shard_placement_fn=spf)


def _full(p):
    from torch.distributed.tensor import DTensor

    return p.full_tensor() if isinstance(p, DTensor) else p.detach()


def _check_layout(model, ref, mesh):
    """Placements in mesh-dim order, and every param's global value is the single-device one."""
    from torch.distributed.tensor import Replicate, Shard

    from raggedfsdp import RaggedShard

    want = {
        "layers.0.attention.wq.weight": Shard(0),
        "layers.0.attention.wo.weight": Shard(1),
        "layers.1.feed_forward.w1.weight": Shard(0),
        "layers.1.feed_forward.w2.weight": Shard(1),
        "tok_embeddings.weight": Shard(0),
        "output.weight": Shard(0),
        "norm.weight": Replicate(),
    }
    params = dict(model.named_parameters())
    for name, tp_pl in want.items():
        p = params[name]
        assert p.device_mesh.mesh_dim_names == ("dp", "tp"), (name, p.device_mesh)
        assert isinstance(p.placements[0], RaggedShard) and p.placements[1] == tp_pl, (name, p.placements)
        assert p.to_local().dim() == 1
    p = params["layers.0.attention_norm.weight"]  # a plain param in the same unit: FSDP only
    assert p.device_mesh.mesh_dim_names == ("dp",) and isinstance(p.placements[0], RaggedShard)
    refp = dict(ref.named_parameters())
    for name, p in params.items():
        assert tuple(p.shape) == tuple(refp[name].shape), name
        assert torch.equal(_full(p), refp[name].detach()), name
    # redistribute to torch's layouts and back is exact
    w = params["layers.0.feed_forward.w2.weight"]
    full = refp["layers.0.feed_forward.w2.weight"].detach()
    r = w.redistribute(w.device_mesh, [Replicate(), Replicate()])
    assert torch.equal(r.to_local(), full)
    s = w.redistribute(w.device_mesh, [Shard(0), Shard(1)])
    dp, tp = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    assert torch.equal(s.to_local(), full.chunk(2, 0)[dp].chunk(2, 1)[tp])
    assert torch.equal(s.redistribute(w.device_mesh, w.placements).to_local(), w.to_local())


def _run(rank, ws):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_group, dp = mesh["dp"].get_group(), mesh["dp"].get_local_rank()
    rows = slice(dp * B // 2, (dp + 1) * B // 2)
    batches = _batches()

    torch.manual_seed(0)
    ref = _model()
    ref0 = copy.deepcopy(ref)
    ref_losses = _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), batches, slice(None))

    theirs = _sharded(mesh, "torch")
    t_losses = _train(theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-2), batches, rows, dp_group, 2)

    # a block spec on the global shape that the TP split would cut: refused by fully_shard, naming the param
    from raggedfsdp import fully_shard
    from raggedfsdp.app.models import apply_tp

    bad = apply_tp(_model(), mesh["tp"])
    try:
        fully_shard(bad.layers[0], mesh=mesh["dp"], shard_placement_fn=lambda p: "matrix")
    except ValueError as e:
        assert "'attention.wq.weight'" in str(e) and "cut by the tensor-parallel split" in str(e), e
    else:
        raise AssertionError("a 'matrix' block cut by the TP split was accepted")

    ours = _sharded(mesh, "ragged")
    _check_layout(ours, ref0, mesh)
    o_losses = _train(ours, torch.optim.AdamW(ours.parameters(), lr=1e-2), batches, rows, dp_group, 2)
    if rank == 0:
        print("ref", ref_losses, "torch", t_losses, "ours", o_losses)
    torch.testing.assert_close(o_losses, t_losses, rtol=1e-5, atol=0)
    torch.testing.assert_close(o_losses, ref_losses, rtol=1e-4, atol=0)
    tp_ = dict(theirs.named_parameters())
    refp = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(_full(p), _full(tp_[name]), rtol=1e-5, atol=1e-6, msg=name)
        # vs single process: AdamW normalises noise-level gradients, so compare whole tensors by norm
        err = (_full(p) - refp[name].detach()).norm() / refp[name].detach().norm()
        assert err < 1e-4, (name, err.item())
    # state dicts: same keys as torch's, sharded values are 2-D DTensors; the full state dict is torch's
    sd_o, sd_t = ours.state_dict(), theirs.state_dict()
    assert sd_o.keys() == sd_t.keys()
    full = StateDictOptions(full_state_dict=True)
    fo, ft = get_model_state_dict(ours, options=full), get_model_state_dict(theirs, options=full)
    for k in ft:
        torch.testing.assert_close(fo[k], ft[k], rtol=1e-5, atol=1e-6, msg=k)

    # activation checkpointing: the same training, recomputed forward under TP
    ac = _sharded(mesh, "ragged", ac=True)
    a_losses = _train(ac, torch.optim.AdamW(ac.parameters(), lr=1e-2), batches, rows, dp_group, 2)
    torch.testing.assert_close(a_losses, o_losses, rtol=1e-6, atol=0)

    # Muon (Newton-Schulz on the full logical matrices, owners over dp x tp) and AdamW8bit (global 32x32
    # tiles kept whole by TP and FSDP boundaries): losses of the same optimizer on the single-process model
    from raggedfsdp.optim import AdamW8bit, Muon, muon_param_groups

    def muon(m):
        return Muon(muon_param_groups(m, lr=0.02, adamw_lr=1e-2), ns_dtype=torch.float32)

    for make_opt, spf in (
        (muon, None),
        (lambda m: AdamW8bit(m.parameters(), lr=1e-2), AdamW8bit.shard_placement_fn),
    ):
        single = _model()
        r_l = _train(single, make_opt(single), batches, slice(None))
        m = _sharded(mesh, "ragged", spf=spf)
        opt = make_opt(m)
        o_l = _train(m, opt, batches, rows, dp_group, 2)
        if rank == 0:
            print(type(opt).__name__, "single", r_l, "ours", o_l)
        torch.testing.assert_close(o_l, r_l, rtol=2e-5, atol=0)
    dist.barrier()


def test_fsdp_tp_parity_dp2_tp2():
    SPAWNS.check(4, "fsdp_tp")


def test_block_cut_by_tp_raises():
    """A block spec defined on the global shape that a TP boundary would cut is refused, naming the param."""
    from raggedfsdp.planner import granularity_for_local

    # colwise (64, 32) -> (32, 32): 32x32 tiles fit, 64-row tiles are cut
    assert granularity_for_local((64, 32), (32, 32), "tile:32x32") == (32 * 32, (0,))
    with pytest.raises(ValueError, match=r"'w'.*cut by the tensor-parallel split of dim 0"):
        granularity_for_local((128, 32), (64, 32), "tile:128x32", name="w")
    # rowwise (32, 64) -> (32, 32): tile width must divide the local width; a whole row cannot fit
    assert granularity_for_local((32, 64), (32, 32), "tile:8x32") == (8 * 32, (0,))
    with pytest.raises(ValueError, match="tile width 128 does not divide 64"):
        granularity_for_local((32, 128), (32, 64), "tile:8x128", name="w")
    with pytest.raises(ValueError, match="a row spans the whole split dim"):
        granularity_for_local((32, 64), (32, 32), "row", name="w")
    # rows:K / matrix / slice on an expert stack (E, d, h) split over experts
    assert granularity_for_local((8, 4, 6), (4, 4, 6), "slice") == (24, (0,))
    assert granularity_for_local((64, 8), (32, 8), "rows:16")[0] == 16 * 8
    with pytest.raises(ValueError, match="crosses a part boundary"):
        granularity_for_local((64, 8), (32, 8), "rows:64", name="w")
    with pytest.raises(ValueError, match="cut by"):
        granularity_for_local((8, 4, 6), (4, 4, 6), "matrix", name="experts")
    # the default (issue 22) is element granularity of the TP-local tensor: never cut by a TP split
    assert granularity_for_local((32, 64), (32, 32), None) == (1, (0, 1))
    assert granularity_for_local((8, 4, 6), (4, 4, 6), None) == (1, (0, 1, 2))


def _hsdp_tp_fake(rank, ws):
    """HSDP x TP on a fake 8-rank group (replicate 2 x shard 2 x tp 2): layouts, one step through every
    code path, and this rank's persistent bytes (params + grads + AdamW state) next to torch's
    fully_shard with the same TP plan. Values are meaningless on the fake group; shapes are not."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    from raggedfsdp import RaggedShard
    from raggedfsdp.app.models import apply_fsdp, apply_tp

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    out = {}
    for backend in ("ragged", "torch"):
        m = apply_fsdp(apply_tp(_model(), mesh["tp"]), mesh["dp_replicate", "dp_shard"], backend=backend)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        tok = _batches(1)[0][:1]
        _loss(m, tok).backward()
        opt.step()
        if backend == "ragged":
            w = m.layers[0].attention.wo.weight
            assert w.device_mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "tp")
            assert w.placements[0] == Replicate() and isinstance(w.placements[1], RaggedShard)
            assert w.placements[2] == Shard(1), w.placements
            assert m.norm.weight.placements[2] == Replicate()
            assert w.grad.placements == w.placements
            # the ragged piece is one of the dp_shard pieces of the TP-local (32, 16) block
            rs = w.placements[1]
            assert w.to_local().numel() == rs.local_numel((32, 16), mesh["dp_shard"].get_local_rank())
        nbytes = 0
        for p in m.parameters():
            for t in (p, p.grad, *opt.state[p].values()):
                if t is not None and t.dim() > 0:
                    nbytes += t.to_local().numel() * t.element_size()
        out[backend] = nbytes
    return out


def test_hsdp_tp_layouts_on_fake_8_ranks():
    from _memory import run_fake_rank

    full = sum(p.numel() for p in _model().parameters()) * 4 * 4  # param + grad + 2 states, fp32
    for rank in (0, 5):
        got = run_fake_rank(_hsdp_tp_fake, 8, rank)
        print(
            f"HSDP x TP rank {rank}: persistent bytes ours {got['ragged']}, torch {got['torch']}, even "
            f"{full / 4:.0f}"
        )
        # each of the 4 (shard x tp) pieces holds a quarter, plus at most the planner's alignment padding
        assert got["ragged"] <= full / 4 * 1.03, (got, full)
        assert got["ragged"] <= got["torch"] * 1.01, got
