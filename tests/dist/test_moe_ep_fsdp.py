"""FSDP beside expert parallelism (torchtitan's layout), dp 2 x ep 2 on 4 real gloo ranks.

Experts: ``apply_ep(model, world["ep"])`` (each EP rank holds 4 of 8 experts whole), then
``apply_fsdp(model, world["dp", "ep"] flattened, experts_mesh=world["dp"])``: the expert stacks are
sharded again over dp (their own FSDP unit per block, gradient divided by the whole world), every
other parameter over all 4 ranks.

References: (1) one process, the same init, the gradient of ``mean over ranks r of (CE_r + aux_r)``,
the same optimizer on plain tensors; (2) torch's ``fully_shard`` with the same EP model and mesh.
Optimizers: AdamW (losses and final parameters vs both references), Muon (fp32 Newton-Schulz, vs the
single-process Muon; every expert matrix orthogonalised exactly once per step, on one rank, owners
balanced over all 4 ranks), AdamW8bit (32x32 tiles from ``AdamW8bit.shard_placement_fn``, vs the
single-process AdamW8bit). First-step gradients (full_tensor) equal the single process's (rel 1e-5);
parameters after 3 steps atol 1e-4 (5e-4 8-bit: lr 1e-2; Adam turns fp noise in ~0 gradients into
sign flips of size ~lr*1e-3, or flips an 8-bit code).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _dist import run_distributed
from _toy_models import full_params

STEPS = 3
WS = 4


def _build():
    from raggedfsdp.models import build_model

    m = build_model("moe", "debug", experts="fused", n_experts=8, top_k=2, n_shared_experts=1,
                    expert_dim=32, aux_loss_coef=0.1)
    m.init_weights(5)
    return m


def _data(step):
    return torch.randint(0, 256, (WS, 2, 6), generator=torch.Generator().manual_seed(100 + step))


def _loss(model, tok):
    logits = model(tok[:, :-1])
    ce = F.cross_entropy(logits.flatten(0, 1), tok[:, 1:].flatten())
    return ce, model.aux_loss


def _optimizer(name, model):
    from raggedfsdp.optim import AdamW8bit, Muon, muon_param_groups

    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2)
    if name == "muon":
        return Muon(muon_param_groups(model, lr=0.02, adamw_lr=1e-2), ns_dtype=torch.float32)
    return AdamW8bit(model.parameters(), lr=1e-2)


def _reference(opt_name):
    ref = _build()
    opt = _optimizer(opt_name, ref)
    losses = []
    for s in range(STEPS):
        data, total = _data(s), 0.0
        for r in range(WS):
            ce, aux = _loss(ref, data[r])
            ((ce + aux) / WS).backward()
            total += ce.item() / WS
        if s == 0:
            grads0 = {n: p.grad.clone() for n, p in ref.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, full_params(ref), grads0


def _sharded(rank, backend, opt_name, world):
    import torch.distributed as dist

    from raggedfsdp.models import apply_ep, apply_fsdp
    from raggedfsdp.optim import AdamW8bit

    model = apply_ep(_build(), world["ep"])
    pfn = AdamW8bit.shard_placement_fn if opt_name == "adamw8bit" else None
    apply_fsdp(model, world["dp", "ep"]._flatten("dp_ep"), backend=backend, experts_mesh=world["dp"],
               shard_placement_fn=pfn)
    opt = _optimizer(opt_name, model)
    losses, ns = [], []
    for s in range(STEPS):
        ce, aux = _loss(model, _data(s)[rank])
        (ce + aux).backward()
        if s == 0:
            grads0 = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        t = ce.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / WS)
        if opt_name == "muon":
            ns.append(opt.last_step_stats)
    return model, losses, ns, grads0


def _check_muon_once_per_expert(model, stats, world):
    """Every (layer, stack, expert) matrix orthogonalised exactly once per step over all ranks; balanced."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from raggedfsdp.optim import muon_param_groups

    muon_params = muon_param_groups(model)[0]["params"]
    expert_idx = {i for i, p in enumerate(muon_params) if p.ndim == 3}
    assert len(expert_idx) == 3 * len(model.moe_layers()), expert_idx
    for st in stats:
        mine = [(i, j) for i, j in st["ns_matrices"] if i in expert_idx]
        allm = [None] * WS
        dist.all_gather_object(allm, (mine, st["ns_calls"]))
        flat = [m for ms, _ in allm for m in ms]
        assert len(flat) == len(set(flat)), "an expert matrix was orthogonalised twice"
        want = {(i, j) for i in expert_idx for j in range(8)}  # 8 experts per stack, owners over all 4 ranks
        assert set(flat) == want, sorted(want - set(flat))
        calls = [c for _, c in allm]
        assert max(calls) - min(calls) <= max(1, 0.25 * max(calls)), calls  # owners balanced over all ranks
    p = next(p for p in muon_params if p.ndim == 3)
    assert isinstance(p, DTensor) and p.device_mesh.ndim == 2, p.placements


def _ep_fsdp(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh

    world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    for opt_name in ("adamw", "muon", "adamw8bit"):
        ref_losses, want, want_g = _reference(opt_name)
        backends = ("ragged", "torch") if opt_name == "adamw" else ("ragged",)
        for backend in backends:
            tag = f"{opt_name}/{backend}"
            model, losses, ns, grads = _sharded(rank, backend, opt_name, world)
            for k, v in want_g.items():  # first-step gradients: the EP sum and the FSDP average are right
                torch.testing.assert_close(grads[k], v, rtol=1e-5, atol=1e-7, msg=lambda m, k=k, tag=tag: f"{tag} grad {k}: {m}")
            for i, (a, b) in enumerate(zip(losses, ref_losses)):
                assert abs(a - b) <= 1e-5 * abs(b), f"{tag}: step {i} loss {a} != single process {b}"
            got = full_params(model)
            atol = 5e-4 if opt_name == "adamw8bit" else 1e-4  # an 8-bit code flipped by fp noise
            for k, v in want.items():
                torch.testing.assert_close(got[k], v, rtol=1e-5, atol=atol, msg=lambda m, k=k, tag=tag: f"{tag} {k}: {m}")
            if opt_name == "muon":
                _check_muon_once_per_expert(model, ns, world)


@pytest.mark.slow
def test_moe_ep_fsdp_dp2xep2_vs_single_process_and_torch():
    run_distributed(_ep_fsdp, WS)
