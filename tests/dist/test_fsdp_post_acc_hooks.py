"""Post-accumulate-grad hooks on sharded params run once per backward with the reduced ``.grad``, as in
torch's FSDP2 (``_fsdp_collectives.py``: it calls them after each reduce): the optimizer-in-backward
pattern (one SGD per parameter stepped from its hook, ``.grad`` dropped there) trains exactly like a
plain SGD step, under raggedfsdp and under torch's ``fully_shard``, ws 3."""

from __future__ import annotations

import copy

import torch

from _spawns import SPAWNS  # runs in the shared per-world-size spawns (tests/dist/_spawns.py)
from _toy_models import ToyLM, batches, full_params, lm_loss, shard_model


def _case(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import raggedfsdp

    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    init = ToyLM()
    data = batches(3, 2 * ws)
    per = 2

    def train(fs, in_backward):
        model = shard_model(copy.deepcopy(init), fs, mesh)
        calls = {"n": 0}
        if in_backward:
            opts = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}

            def hook(p):
                calls["n"] += 1
                opts[p].step()
                p.grad = None  # optimizer in backward: the gradient is consumed here

            for p in model.parameters():
                p.register_post_accumulate_grad_hook(hook)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for tok, tgt in data:
            lm_loss(model, tok[rank * per : (rank + 1) * per], tgt[rank * per : (rank + 1) * per]).backward()
            if not in_backward:
                opt.step()
                opt.zero_grad(set_to_none=True)
        return full_params(model), calls["n"], model

    ours_ref, _, _ = train(raggedfsdp.fully_shard, False)
    ours, n_ours, model = train(raggedfsdp.fully_shard, True)
    torch_hooks, n_torch, _ = train(torch_fully_shard, True)
    n_params = len(list(model.parameters()))
    assert n_ours == n_params * len(data) == n_torch, (n_ours, n_torch, n_params)
    assert all(p.grad is None for p in model.parameters())
    for k in ours_ref:
        torch.testing.assert_close(ours[k], ours_ref[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")
        torch.testing.assert_close(
            ours[k], torch_hooks[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}"
        )


def test_post_accumulate_grad_hooks_optimizer_in_backward():
    SPAWNS.check(3, "post_acc_hooks")
