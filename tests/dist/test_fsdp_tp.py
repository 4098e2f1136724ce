"""FSDP x TP (Note [FSDP x TP] in raggedfsdp/fsdp/_tp.py): ``fully_shard`` over ``mesh["dp"]`` of a Llama
whose blocks are tensor-parallel over ``mesh["tp"]`` (``raggedfsdp.models.apply_tp``: colwise/rowwise linears, a
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
from _dist import run_distributed

STEPS = 3
B, T = 4, 16  # global batch rows, sequence length


def _cfg():
    from raggedfsdp.models import LlamaConfig

    return LlamaConfig.flavor("debug")


def _batches(steps=STEPS):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 256, (B, T + 1), generator=g) for _ in range(steps)]


def _model():
    from raggedfsdp.models import Llama

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


def _sharded(mesh, backend, ac=False):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from raggedfsdp.models import apply_fsdp, apply_tp

    m = apply_tp(_model(), mesh["tp"])
    if ac:
        for i, blk in enumerate(m.layers):
            m.layers[i] = checkpoint_wrapper(blk)
    return apply_fsdp(m, mesh["dp"], backend=backend)


def _full(p):
    from torch.distributed.tensor import DTensor

    return p.full_tensor() if isinstance(p, DTensor) else p.detach()


def _check_layout(model, ref, mesh):
    """Placements in mesh-dim order, and every param's global value is the single-device one."""
    from torch.distributed.tensor import Replicate, Shard

    from raggedfsdp import RaggedShard

    want = {
        "layers.0.attention.wq.weight": Shard(0), "layers.0.attention.wo.weight": Shard(1),
        "layers.1.feed_forward.w1.weight": Shard(0), "layers.1.feed_forward.w2.weight": Shard(1),
        "tok_embeddings.weight": Shard(0), "output.weight": Shard(0), "norm.weight": Replicate(),
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
    dist.barrier()


def test_fsdp_tp_parity_dp2_tp2():
    run_distributed(_run, 4)


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
    # the default is one row of the TP-local tensor (FSDP2's Shard(0) of the local tensor)
    assert granularity_for_local((32, 64), (32, 32), None) == (32, (0,))
