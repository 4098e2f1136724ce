"""Expert parallelism (``apply_ep``, models/_ep.py) against the single-process MoE, real gloo.

Reference: one process holding every expert runs each rank's micro-batch in turn; the objective is
``sum over ranks r of (CE_r + aux_r)``. On the EP model every rank runs its own micro-batch; a
non-expert gradient summed over all ranks, and an expert gradient (already summed over the EP group by
the backward all-to-all) summed over the dp dim, must equal the reference's. Forward: each rank's logits,
aux loss and expert counts equal the reference's for that rank's tokens (fp32, rel 1e-5).

Routing cases, each asserted to really happen: random tokens (top-2); few tokens with top-1 (EP ranks
receive nothing from some peers: empty all-to-all pieces, and experts with no token at all); a zero
router (every token of every rank to one expert: one EP rank receives everything, the others nothing).
Meshes: ep 4 and dp 2 x ep 2 on 4 ranks, ep 3 on 3 ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _dist import run_distributed
from _spawns import SLOW  # the slow 4-rank cases share one spawn (tests/dist/_spawns.py)

CASES = ("random", "sparse", "one_expert")


def _build(n_experts, case):
    from raggedfsdp.app.models import build_model

    top_k = 2 if case == "random" else 1
    m = build_model(
        "moe",
        "debug",
        experts="fused",
        n_experts=n_experts,
        top_k=top_k,
        n_shared_experts=1,
        aux_loss_coef=0.1,
    )
    m.init_weights(5)
    if case == "one_expert":
        for ff in m.moe_layers():
            torch.nn.init.zeros_(ff.router.weight)  # uniform scores: topk picks the same expert everywhere
    return m


def _data(case, ws, step=0):
    g = torch.Generator().manual_seed(10 * step + CASES.index(case))
    shape = (1, 4) if case == "sparse" else (2, 6)  # (batch, 3 or 5 tokens + 1 target) per rank
    return torch.randint(0, 256, (ws, *shape), generator=g)


def _loss(model, tok):
    logits = model(tok[:, :-1])
    return logits, F.cross_entropy(logits.flatten(0, 1), tok[:, 1:].flatten()) + model.aux_loss


def _check_routing(case, counts, n_experts, ep):
    """counts (ws, n_moe_layers, X): the routing of the reference really exercises ``case``."""
    L = n_experts // ep
    per_owner = counts.view(*counts.shape[:2], ep, L).sum(-1)  # rows rank r sends to EP rank j, per layer
    if case == "sparse":
        assert (per_owner == 0).any() and (per_owner > 0).any(), per_owner  # empty and full pieces
        assert (counts.sum(0) == 0).any(), counts  # an expert no rank routes to
    if case == "one_expert":
        tot = counts.sum(0)  # (layers, X)
        assert ((tot > 0).sum(-1) == 1).all(), tot  # every token of every rank to one expert


def _ep_parity(rank, ws, n_experts, meshes):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from raggedfsdp.app.models import apply_ep, build_model

    for dp, ep in meshes:
        mesh = init_device_mesh("cpu", (dp, ep), mesh_dim_names=("dp", "ep"))
        for case in CASES:
            tag = f"dp{dp}xep{ep}/{case}"
            data = _data(case, ws)
            ref = _build(n_experts, case)
            ref_out, ref_counts, total = [], [], 0
            for r in range(ws):
                logits, loss = _loss(ref, data[r])
                ref_out.append((logits.detach(), ref.aux_loss.detach()))
                ref_counts.append(ref.expert_counts)
                total = total + loss
            total.backward()
            _check_routing(case, torch.stack(ref_counts), n_experts, ep)

            model = apply_ep(_build(n_experts, case), mesh["ep"])
            logits, loss = _loss(model, data[rank])
            loss.backward()
            torch.testing.assert_close(
                logits, ref_out[rank][0], rtol=1e-5, atol=1e-6, msg=lambda m, tag=tag: f"{tag}: {m}"
            )
            torch.testing.assert_close(model.aux_loss, ref_out[rank][1], rtol=1e-5, atol=1e-7)
            assert torch.equal(model.expert_counts, ref_counts[rank]), tag
            want = dict(ref.named_parameters())
            for name, p in model.named_parameters():
                g = p.grad
                if isinstance(p, DTensor):  # an expert stack: this EP rank's experts, summed over EP
                    assert p.placements[0].is_shard(0) and p.to_local().shape[0] == n_experts // ep, name
                    g = g.to_local().clone()
                    dist.all_reduce(g, group=mesh["dp"].get_group())
                    n = n_experts // ep
                    r_ep = mesh["ep"].get_local_rank()
                    w = want[name].grad[r_ep * n : (r_ep + 1) * n]
                else:
                    g = g.clone()
                    dist.all_reduce(g)
                    w = want[name].grad
                torch.testing.assert_close(
                    g, w, rtol=1e-5, atol=1e-6, msg=lambda m, k=name, tag=tag: f"{tag} {k}: {m}"
                )

    # bad input, before any collective
    with pytest.raises(ValueError, match="experts='fused'"):
        apply_ep(build_model("moe", "debug", experts="separate", n_experts=n_experts), mesh["ep"])
    with pytest.raises(ValueError, match="not divisible by the EP size"):
        apply_ep(build_model("moe", "debug", experts="fused", n_experts=n_experts + 1), mesh["ep"])
    with pytest.raises(TypeError, match="1-D DeviceMesh"):
        apply_ep(build_model("moe", "debug", experts="fused", n_experts=n_experts), mesh)


@pytest.mark.slow
def test_moe_ep_parity_ws4_ep4_and_dp2xep2():
    SLOW.check(4, "moe_ep")


def _ep_parity_ws4(rank, ws):
    _ep_parity(rank, ws, 8, [(1, 4), (2, 2)])


def test_moe_ep_parity_ws3_ep3():
    run_distributed(_ep_parity, 3, 6, [(1, 3)])


def test_group_by_expert_matches_brute_force():
    from raggedfsdp.app.models._ep import _group_by_expert

    g = torch.Generator().manual_seed(0)
    for ep, L in ((1, 1), (2, 3), (3, 2), (4, 4)):
        for _ in range(5):
            recv = torch.randint(0, 4, (ep, L), generator=g) * torch.randint(0, 2, (ep, L), generator=g)
            # rows labelled (source, expert) in receive order; expert-major order by brute force
            labels = [(s, e) for s in range(ep) for e in range(L) for _ in range(int(recv[s, e]))]
            want = sorted(range(len(labels)), key=lambda i: (labels[i][1], labels[i][0], i))
            assert _group_by_expert(recv).tolist() == want, (recv, ep, L)
