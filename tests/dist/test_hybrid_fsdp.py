"""Hybrid model under FSDP, wrapped per layer and per super-block: training equals single-process
training (fp32: first-step gradients, per-step loss and final params; SGD with momentum, which
unlike Adam is sensitive to a mis-scaled gradient), under ours and under torch's fully_shard."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _spawns import SPAWNS  # runs in the shared per-world-size spawns (tests/dist/_spawns.py)

STEPS = 2


def _data(ws, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (2 * ws, 21), generator=g) for _ in range(STEPS)]


def _run(model, data, rank, ws):
    import torch.distributed as dist

    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    losses, grads = [], None
    for tok in data:
        if ws:
            tok = tok[rank * 2 : rank * 2 + 2]
        loss = F.cross_entropy(model(tok[:, :-1]).flatten(0, 1), tok[:, 1:].flatten())
        loss.backward()
        if grads is None:
            grads = _full(model, grad=True)
        opt.step()
        opt.zero_grad()
        val = loss.detach()
        if ws:
            dist.all_reduce(val)
            val /= ws
        losses.append(val.item())
    return losses, grads


def _full(model, grad=False):
    from torch.distributed.tensor import DTensor

    out = {}
    for n, p in model.named_parameters():
        t = p.grad if grad else p
        out[n] = (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
    return out


def _parity(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh

    from raggedfsdp.app.models import apply_fsdp, build_model

    data = _data(ws)
    ref = build_model("hybrid", "debug")
    ref.init_weights(0)
    # the reference sees the whole global batch; each rank's loss is the mean over its slice
    ref_losses, ref_grads = _run(ref, data, rank, 0)
    ref_params = _full(ref)
    mesh = init_device_mesh("cpu", (ws,))
    cases = (
        [("ragged", "layer"), ("ragged", "superblock"), ("torch", "superblock")]
        if ws == 3
        else [("ragged", "superblock")]
    )
    for backend, unit in cases:
        model = build_model("hybrid", "debug")
        model.init_weights(0)
        apply_fsdp(model, mesh, backend=backend, unit=unit)
        losses, grads = _run(model, data, rank, ws)
        what = f"{backend}/{unit} ws={ws}"
        for n, g in ref_grads.items():
            torch.testing.assert_close(
                grads[n], g, rtol=1e-5, atol=1e-7, msg=lambda m, w=what, n=n: f"{w} grad {n}: {m}"
            )
        for i, (a, b) in enumerate(zip(losses, ref_losses)):
            assert abs(a - b) <= 1e-5 * abs(b), f"{what} step {i}: {a} vs {b}"
        got = _full(model)
        for n, p in ref_params.items():
            torch.testing.assert_close(
                got[n], p, rtol=1e-5, atol=1e-6, msg=lambda m, w=what, n=n: f"{w} {n}: {m}"
            )


def _hf_parity(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh

    from raggedfsdp.app.models import apply_fsdp, build_model

    data = [t % 256 for t in _data(ws)]
    ref = build_model("hf:LlamaForCausalLM", "tiny")
    ref.init_weights(0)
    ref_losses, ref_grads = _run(ref, data, rank, 0)
    model = build_model("hf:LlamaForCausalLM", "tiny")
    model.init_weights(0)
    apply_fsdp(model, init_device_mesh("cpu", (ws,)), backend="ragged")
    losses, grads = _run(model, data, rank, ws)
    for n, g in ref_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-5, atol=1e-6)
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= 1e-5 * abs(b)


def _all(rank, ws):
    _parity(rank, ws)
    if ws == 3:
        _hf_parity(rank, ws)


@pytest.mark.parametrize("ws", [3, pytest.param(5, marks=pytest.mark.slow)])
def test_hybrid_fsdp_parity_layer_and_superblock(ws):
    """ws=3 also trains an HF LlamaForCausalLM built by name (hf:LlamaForCausalLM) the same way."""
    SPAWNS.check(ws, "hybrid")
