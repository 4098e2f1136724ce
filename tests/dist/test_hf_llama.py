"""A HF transformers LlamaForCausalLM (small config, no weights downloaded) trains under
raggedfsdp.fully_shard with the same losses as under torch's fully_shard and as unsharded, and the same
first-step gradients as unsharded (under both)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from _spawns import SPAWNS  # runs in the shared per-world-size spawns (tests/dist/_spawns.py)

transformers = pytest.importorskip("transformers")


def _build():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=67,
        hidden_size=24,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def _train(model, data, rank, ws, sharded):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, first_grads = [], {}
    for tok in data:
        if sharded:
            per = tok.shape[0] // ws
            tok = tok[rank * per : (rank + 1) * per]
        loss = model(input_ids=tok, labels=tok).loss
        loss.backward()
        if not first_grads:  # AdamW's step hides a gradient scale: compare the first gradients too
            for n, p in model.named_parameters():
                first_grads[n] = p.grad.full_tensor() if sharded else p.grad.clone()
        opt.step()
        opt.zero_grad()
        loss = loss.detach()
        if sharded and ws > 1:
            dist.all_reduce(loss)
            loss /= ws
        losses.append(loss.item())
    return losses, first_grads


def _hf(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import raggedfsdp

    mesh = init_device_mesh("cpu", (ws,))
    g = torch.Generator().manual_seed(3)
    data = [torch.randint(0, 67, (2 * ws, 12), generator=g) for _ in range(4)]
    base = _build()
    ref_losses, ref_grads = _train(copy.deepcopy(base), data, 0, 1, sharded=False)
    out = {}
    for name, fs in (("ragged", raggedfsdp.fully_shard), ("torch", torch_fully_shard)):
        model = copy.deepcopy(base)
        for layer in model.model.layers:
            fs(layer, mesh=mesh)
        fs(model, mesh=mesh)
        out[name], grads = _train(model, data, rank, ws, sharded=True)
        for n, g in ref_grads.items():
            torch.testing.assert_close(
                grads[n], g, rtol=1e-4, atol=1e-6, msg=lambda m, n=n, name=name: f"{name} first grad {n}: {m}"
            )
    for i, (a, b, c) in enumerate(zip(out["ragged"], out["torch"], ref_losses)):
        # every rank sees equal-length sequences, so the mean of per-rank means is the global mean
        assert abs(a - b) <= 1e-5 * abs(b), f"step {i}: ragged {a} vs torch fully_shard {b}"
        assert abs(a - c) <= 1e-5 * abs(c), f"step {i}: ragged {a} vs unsharded {c}"
    assert ref_losses[-1] < ref_losses[0]


@pytest.mark.parametrize("ws", [3])
def test_hf_llama_matches_torch_fully_shard(ws):
    SPAWNS.check(ws, "hf_llama")
