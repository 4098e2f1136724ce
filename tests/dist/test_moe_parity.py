"""FSDP parity of the MoE model: raggedfsdp.fully_shard and torch's fully_shard vs single-process
training, world size 3, with experts that some ranks (and one that no rank) route tokens to.

Reference: one process, the same init, the gradient of ``mean over ranks r of (CE_r + aux_r)``
(each rank's load-balancing loss is over its own tokens, as in data-parallel training), AdamW.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _spawns import SPAWNS  # runs in the shared per-world-size spawns (tests/dist/_spawns.py)
from _toy_models import full_params

STEPS = 3
WS = 3


def _loss(model, tok):
    logits = model(tok[:, :-1])
    ce = F.cross_entropy(logits.flatten(0, 1), tok[:, 1:].flatten())
    return ce, model.aux_loss


def _build(layout):
    from raggedfsdp.app.models import build_model

    # top-1 of 8 experts with 3 tokens per rank: each rank routes to at most 3 experts
    m = build_model("moe", "debug", experts=layout, top_k=1, n_shared_experts=0, aux_loss_coef=0.1)
    m.init_weights(7)
    return m


def _data(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 256, (WS, 1, 4), generator=g)  # (rank, batch 1, 3 tokens + 1 target)


def _moe_parity(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import raggedfsdp
    from raggedfsdp.app.models import apply_fsdp

    mesh = init_device_mesh("cpu", (ws,))
    for layout in ("separate", "fused"):
        ref = _build(layout)
        ref_opt = torch.optim.SGD(
            ref.parameters(), lr=0.1, momentum=0.9
        )  # Adam amplifies fp noise in ~0 grads
        ref_losses, used_by = [], []
        for s in range(STEPS):
            data = _data(s)
            total = 0.0
            used = []
            for r in range(ws):
                ce, aux = _loss(ref, data[r])
                ((ce + aux) / ws).backward()
                total += ce.item() / ws
                used.append(set(ref.expert_counts[-1].nonzero().flatten().tolist()))
            ref_opt.step()
            ref_opt.zero_grad()
            ref_losses.append(total)
            used_by.append(used)
        # the routing really leaves experts out: some used by only part of the ranks, some by none
        assert any(set.union(*u) - set.intersection(*u) for u in used_by), used_by
        assert any(len(set.union(*u)) < 8 for u in used_by), used_by
        want = full_params(ref)

        for name, shard in (("ragged", raggedfsdp.fully_shard), ("torch", torch_fully_shard)):
            model = _build(layout)
            if name == "ragged":
                apply_fsdp(model, mesh, backend="ragged")
            else:
                for block in model.layers:
                    shard(block, mesh=mesh)
                shard(model, mesh=mesh, reshard_after_forward=False)
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            losses = []
            for s in range(STEPS):
                ce, aux = _loss(model, _data(s)[rank])
                (ce + aux).backward()
                opt.step()
                opt.zero_grad()
                t = ce.detach().clone()
                torch.distributed.all_reduce(t)
                losses.append(t.item() / ws)
            for i, (a, b) in enumerate(zip(losses, ref_losses)):
                assert abs(a - b) < 1e-5, f"{layout}/{name}: step {i} loss {a} != reference {b}"
            got = full_params(model)
            for k, v in want.items():
                torch.testing.assert_close(
                    got[k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k, w=f"{layout}/{name}": f"{w} {k}: {m}"
                )


def test_moe_fsdp_parity_ws3_unrouted_experts():
    SPAWNS.check(WS, "moe_parity")
