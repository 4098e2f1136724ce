"""fully_shard features against single-process references: frozen + trainable params in one unit,
params unused on some steps, a module called twice, activation checkpointing, zero-numel params,
tied params, meta-device init, ZeRO-1/2, explicit prefetch, gradient divide factor; and bad input."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from _spawns import SPAWNS  # runs in the shared per-world-size spawns (tests/dist/_spawns.py)
from _toy_models import DIM, VOCAB, Block, batches, full_params


class FeatureLM(nn.Module):
    def __init__(self, freeze=False, unused=False, twice=False, zero_numel=False, tie=False, ac=False):
        super().__init__()
        self.opts = dict(unused=unused, twice=twice, zero_numel=zero_numel, ac=ac)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block() for _ in range(3)])
        self.extra = nn.Linear(DIM, DIM)  # used only on odd steps when `unused`
        self.empty = nn.Parameter(torch.zeros(0, 5))
        self.head = nn.Linear(DIM, VOCAB)
        if tie:
            self.head.weight = self.emb.weight
        if freeze:
            for p in self.layers[0].norm.parameters():
                p.requires_grad_(False)
            self.layers[1].up.bias.requires_grad_(False)

    def forward(self, tokens, step=0):
        x = self.emb(tokens)
        for i, layer in enumerate(self.layers):
            reps = 2 if (self.opts["twice"] and i == 1) else 1
            for _ in range(reps):
                x = checkpoint(layer, x, use_reentrant=False) if self.opts["ac"] else layer(x)
        if self.opts["unused"] and step % 2 == 1:
            x = x + self.extra(x)
        if self.opts["zero_numel"]:
            x = x + self.empty.sum()
        return self.head(x)


def _loss(model, tok, tgt, step):
    return F.cross_entropy(model(tok, step).flatten(0, 1), tgt.flatten())


def _run(model, data, rank, ws, sharded):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step, (tok, tgt) in enumerate(data):
        if sharded:
            per = tok.shape[0] // ws
            tok, tgt = tok[rank * per : (rank + 1) * per], tgt[rank * per : (rank + 1) * per]
        loss = _loss(model, tok, tgt, step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach()
        if sharded and ws > 1:
            dist.all_reduce(loss)
            loss /= ws
        losses.append(loss.item())
    return losses


def _shard(model, mesh, **kw):
    from raggedfsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def _check(case, ref, model, data, rank, ws):
    ref_losses = _run(ref, data, 0, 1, sharded=False)
    losses = _run(model, data, rank, ws, sharded=True)
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= 1e-5 * abs(b), f"{case}: step {i} loss {a} != reference {b}"
    got = full_params(model)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(got[n], p.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{case} {n}: {m}")


CASES = {
    "frozen+trainable": dict(freeze=True),
    "unused-on-odd-steps": dict(unused=True),
    "called-twice": dict(twice=True),
    "activation-checkpointing": dict(ac=True),
    "zero-numel": dict(zero_numel=True),
    "tied-within-unit": dict(tie=True),
}


def _features(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ws,))
    data = batches(4, 2 * ws)
    for case, opts in CASES.items():
        torch.manual_seed(0)
        ref = FeatureLM(**opts)
        model = _shard(copy.deepcopy(ref), mesh)
        _check(case, ref, model, data, rank, ws)
    for stage in (1, 2):
        torch.manual_seed(0)
        ref = FeatureLM()
        model = _shard(copy.deepcopy(ref), mesh, zero_stage=stage)
        _check(f"zero_stage={stage}", ref, model, data, rank, ws)
    # CPUOffloadPolicy (on a CPU mesh storage and compute share the device: semantics only)
    from raggedfsdp import CPUOffloadPolicy

    torch.manual_seed(0)
    ref = FeatureLM()
    model = _shard(copy.deepcopy(ref), mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    _check("cpu-offload", ref, model, data, rank, ws)
    # block policy (the paper's orig_param_policy): whole matrices never straddle ranks
    torch.manual_seed(0)
    ref = FeatureLM()
    model = _shard(copy.deepcopy(ref), mesh, shard_placement_fn=lambda p: "matrix" if p.ndim == 2 else None)
    for n, p in model.named_parameters():
        units = p.placements[-1].local_units
        if p.ndim == 2 and p.numel() > 0:
            assert sum(u > 0 for u in units) == 1, f"{n}: matrix split over ranks {units}"
            assert p.to_local().numel() in (0, p.numel())
    _check("block-policy-matrix", ref, model, data, rank, ws)
    # set_unshard_in_backward(False) on a unit whose backward does not read its weight (embedding)
    torch.manual_seed(0)
    ref = FeatureLM()
    model = copy.deepcopy(ref)
    from raggedfsdp import fully_shard

    fully_shard(model.emb, mesh=mesh)
    model = _shard(model, mesh)
    model.emb.set_unshard_in_backward(False)
    _check("unshard_in_backward=False", ref, model, data, rank, ws)
    # explicit prefetch lists (forward: next block; backward: previous block)
    torch.manual_seed(0)
    ref = FeatureLM()
    model = _shard(copy.deepcopy(ref), mesh)
    layers = list(model.layers)
    for a, b in zip(layers, layers[1:]):
        a.set_modules_to_forward_prefetch([b])
        b.set_modules_to_backward_prefetch([a])
    _check("explicit-prefetch", ref, model, data, rank, ws)


@pytest.mark.parametrize("ws", [3])
def test_features_match_single_process(ws):
    SPAWNS.check(ws, "features")


def _meta_init(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ws,))
    with torch.device("meta"):
        model = FeatureLM()
    _shard(model, mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding, nn.LayerNorm)):
            m.reset_parameters()
    init = full_params(model)
    for n, p in init.items():
        assert p.device.type == "cpu" and torch.isfinite(p).all(), n
    ref = FeatureLM()
    ref.load_state_dict({**ref.state_dict(), **init})
    _check("meta-init", ref, model, batches(3, 2 * ws), rank, ws)
    # load_state_dict of plain full tensors (an unsharded checkpoint) works as on an unsharded model
    torch.manual_seed(1)
    other = FeatureLM()
    missing, unexpected = model.load_state_dict(other.state_dict())
    assert not missing and not unexpected
    got = full_params(model)
    for n, p in other.named_parameters():
        assert torch.equal(got[n], p.detach()), n
    _check("after-load-full-sd", other, model, batches(2, 2 * ws), rank, ws)


def test_meta_device_init_then_model_init():
    """Meta-device build -> fully_shard -> to_empty -> model's own init, then train with parity."""
    SPAWNS.check(2, "meta_init")


def _divide_factor(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    ref = FeatureLM()
    model = _shard(copy.deepcopy(ref), mesh)
    model.set_gradient_divide_factor(1.0)  # sum of per-rank mean losses
    tok, tgt = batches(1, 2 * ws)[0]
    per = 2
    _loss(model, tok[rank * per : (rank + 1) * per], tgt[rank * per : (rank + 1) * per], 0).backward()
    ref_total = sum(
        _loss(ref, tok[r * per : (r + 1) * per], tgt[r * per : (r + 1) * per], 0) for r in range(ws)
    )
    ref_total.backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is None:  # unused param: no grad on any rank, as in single-process training
            assert p.grad is None, n
            continue
        torch.testing.assert_close(
            p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}"
        )


def test_gradient_divide_factor():
    SPAWNS.check(3, "divide_factor")


def _bad_input(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh

    from raggedfsdp import fully_shard

    mesh = init_device_mesh("cpu", (ws,))
    m = FeatureLM()
    fully_shard(m.layers[0], mesh=mesh)
    with pytest.raises(ValueError, match="already fully_shard"):
        fully_shard(m.layers[0], mesh=mesh)
    # tied across units: the inner unit owns it, the root must not shard it again
    t = FeatureLM()
    t.layers[1].up.weight = nn.Parameter(torch.randn(7, 13))
    t.extra2 = nn.Linear(13, 7)
    t.extra2.weight = t.layers[1].up.weight
    fully_shard(t.layers[1], mesh=mesh)
    with pytest.raises(ValueError, match="up.weight"):
        fully_shard(t, mesh=mesh)

    # a module shared by two parents, each its own unit: the error names both FQNs and the owner unit
    class ParentA(nn.Module):
        def __init__(self, s):
            super().__init__()
            self.proj = s

    class ParentB(nn.Module):
        def __init__(self, s):
            super().__init__()
            self.lin = s

    shared = nn.Linear(4, 4)
    root = nn.Module()
    root.a, root.b = ParentA(shared), ParentB(shared)
    fully_shard(root.a, mesh=mesh)
    with pytest.raises(
        ValueError,
        match=r"'lin.weight' of ParentB is the same parameter as 'proj.weight' of the "
        r"fully_shard unit ParentA",
    ):
        fully_shard(root.b, mesh=mesh)
    mixed = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).double())
    with pytest.raises(ValueError, match="one dtype"):
        fully_shard(mixed, mesh=mesh)
    with pytest.raises(ValueError, match="reshard_after_forward=3 must be a positive divisor"):
        fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=3)
    with pytest.raises(TypeError, match="reshard_after_forward"):
        fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward="yes")
    with pytest.raises(TypeError, match="shard_placement_fn"):
        fully_shard(nn.Linear(4, 4), mesh=mesh, shard_placement_fn=lambda p: True)
    with pytest.raises(TypeError, match="shard_placement_fn must be a callable"):
        fully_shard(nn.Linear(4, 4), mesh=mesh, shard_placement_fn="row")  # a spec, not a function
    with pytest.raises(ValueError, match="meta device"):
        fully_shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4, device="meta")), mesh=mesh)
    meta = fully_shard(nn.Linear(4, 4, device="meta"), mesh=mesh)
    with pytest.raises(RuntimeError, match="to_empty"):
        meta(torch.ones(1, 4))
    with pytest.raises(ValueError, match="zero_stage"):
        fully_shard(nn.Linear(4, 4), mesh=mesh, zero_stage=4)
    # zero_stage=True was ZeRO-1 (True == 1); a dict mp_policy an AttributeError ('dict' ... 'param_dtype')
    for bad in (True, 3.0, "3"):
        with pytest.raises(
            TypeError, match=r"zero_stage must be an int \(1, 2 or 3\), got (bool|float|str) "
        ):
            fully_shard(nn.Linear(4, 4), mesh=mesh, zero_stage=bad)
    with pytest.raises(
        TypeError,
        match=r"mp_policy must be a MixedPrecisionPolicy, got dict; pass raggedfsdp.MixedPrecisionPolicy\(",
    ):
        fully_shard(nn.Linear(4, 4), mesh=mesh, mp_policy={"param_dtype": torch.bfloat16})
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy

    fully_shard(nn.Linear(4, 4), mesh=mesh, mp_policy=TorchMixedPrecisionPolicy(param_dtype=torch.float32))
    with pytest.raises(ValueError, match="ModuleList"):
        fully_shard(nn.ModuleList([nn.Linear(2, 2)]), mesh=mesh)
    with pytest.raises(ValueError, match="0-dimensional"):
        mod = nn.Module()
        mod.s = nn.Parameter(torch.tensor(1.0))
        fully_shard(mod, mesh=mesh)
    from torch.distributed.device_mesh import DeviceMesh

    sub = DeviceMesh("cpu", [0])  # a mesh that rank 1 is not part of
    if rank == 1:
        with pytest.raises(ValueError, match="not part of mesh"):
            fully_shard(nn.Linear(2, 2), mesh=sub)
    with pytest.raises(ValueError, match="mesh must be 1-D"):
        fully_shard(nn.Linear(2, 2), mesh=init_device_mesh("cpu", (ws, 1, 1)))


def test_bad_input_raises_clear_errors():
    SPAWNS.check(2, "bad_input")


def _int_reshard(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ws,))
    data = batches(3, 2 * ws)
    for k in (2, 1, 4):
        torch.manual_seed(0)
        ref = FeatureLM(twice=True)
        model = _shard(copy.deepcopy(ref), mesh, reshard_after_forward=k)
        _check(f"reshard_after_forward={k}", ref, model, data, rank, ws)


def test_int_reshard_after_forward():
    """int reshard_after_forward=k: keep a 1/k slice after forward, re-gather within groups of k ranks."""
    SPAWNS.check(4, "int_reshard")
