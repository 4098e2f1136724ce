"""The MoE model against a naive per-token float64 reference: routing, top-k, weights, aux loss,
shared expert; fused and separate experts equal; gradients reach every expert; configs and flavors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from raggedfsdp.app.models import MOE_FLAVORS, MoE, MoEConfig, aux_loss, build_model
from raggedfsdp.app.models.moe import MoEFeedForward


def _expert_mats(ff: MoEFeedForward, e: int):
    """(w1 (D, F), w3 (D, F), w2 (F, D)) of expert ``e`` in float64, whatever the storage."""
    ex = ff.experts
    if hasattr(ex, "w1"):
        return ex.w1[e].double(), ex.w3[e].double(), ex.w2[e].double()
    m = ex[e]
    return m.w1.weight.T.double(), m.w3.weight.T.double(), m.w2.weight.T.double()


def _naive_moe(ff: MoEFeedForward, cfg: MoEConfig, x: torch.Tensor):
    """Per-token float64 loop: score every expert, pick the k best, mix their SwiGLU outputs."""
    X, k = cfg.n_experts, cfg.top_k
    xd = x.reshape(-1, x.shape[-1]).double()
    wr = ff.router.weight.double()  # (X, D)
    out = torch.zeros_like(xd)
    counts = torch.zeros(X, dtype=torch.float64)
    prob_sum = torch.zeros(X, dtype=torch.float64)
    for n in range(xd.shape[0]):
        logits = wr @ xd[n]  # (X,)
        s = torch.softmax(logits, 0) if cfg.router == "softmax" else torch.sigmoid(logits)
        chosen = sorted(range(X), key=lambda e: -float(s[e].detach()))[:k]
        w = torch.stack([s[e] for e in chosen])
        if cfg.route_norm:
            w = w / w.sum()
        w = w * cfg.route_scale
        for we, e in zip(w, chosen):
            w1, w3, w2 = _expert_mats(ff, e)
            out[n] += we * ((F.silu(xd[n] @ w1) * (xd[n] @ w3)) @ w2)
            counts[e] += 1
        prob_sum += s if cfg.router == "softmax" else s / s.sum()
        if ff.shared_expert is not None:
            se = ff.shared_expert
            out[n] += se.w2.weight.double() @ (
                F.silu(se.w1.weight.double() @ xd[n]) * (se.w3.weight.double() @ xd[n])
            )
    N = xd.shape[0]
    aux = X * ((counts / (N * k)) * (prob_sum / N)).sum()
    return out.view(x.shape), aux, counts


CASES = [
    dict(router="softmax", route_norm=True, n_shared_experts=1, experts="separate"),
    dict(router="softmax", route_norm=False, n_shared_experts=0, experts="fused", top_k=3),
    dict(router="sigmoid", route_norm=True, n_shared_experts=1, experts="fused", route_scale=2.5),
    dict(router="sigmoid", route_norm=False, n_shared_experts=0, experts="separate", top_k=1),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_moe_layer_matches_naive_float64_reference(case):
    cfg = MoEConfig.flavor("moe-debug", **case)
    torch.manual_seed(0)
    model = MoE(cfg).double()
    model.init_weights(3)
    ff = model.layers[0].feed_forward
    x = torch.randn(3, 7, cfg.dim, dtype=torch.float64)
    y = ff(x)
    ref, ref_aux, ref_counts = _naive_moe(ff, cfg, x)
    torch.testing.assert_close(y, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ff.aux_loss.double(), ref_aux, rtol=1e-6, atol=1e-7)
    assert ff.counts.tolist() == ref_counts.long().tolist()
    # gradient of the layer (incl. router, through the routing weights and the aux loss) vs the reference
    g = torch.randn_like(y)
    params = [p for p in ff.parameters()]
    got = torch.autograd.grad((y * g).sum() + ff.aux_loss, params, allow_unused=False)
    want = torch.autograd.grad((ref * g).sum() + ref_aux, params, allow_unused=True)  # unrouted: None
    for p, a, b in zip(params, got, want):
        b = torch.zeros_like(p) if b is None else b
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


def test_fused_and_separate_experts_are_the_same_model():
    torch.manual_seed(0)
    tok = torch.randint(0, 256, (2, 20))
    outs, grads = {}, {}
    for layout in ("separate", "fused"):
        m = build_model("moe", "debug", experts=layout)
        m.init_weights(5)
        logits = m(tok)
        (F.cross_entropy(logits.flatten(0, 1), tok.flatten()) + m.aux_loss).backward()
        outs[layout] = (logits.detach(), m.aux_loss.detach(), m.expert_counts)
        ex = m.layers[1].feed_forward.experts
        grads[layout] = (
            torch.stack([ex[e].w1.weight.grad.T for e in range(len(ex))])
            if layout == "separate"
            else ex.w1.grad
        )
    torch.testing.assert_close(outs["separate"][0], outs["fused"][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs["separate"][1], outs["fused"][1])
    assert torch.equal(outs["separate"][2], outs["fused"][2])
    torch.testing.assert_close(grads["separate"], grads["fused"], rtol=1e-4, atol=1e-6)


def test_unrouted_experts_get_zero_grads_and_params_count():
    cfg = MoEConfig.flavor("moe-debug", top_k=1, n_dense_layers=1)
    m = MoE(cfg)
    m.init_weights(0)
    assert sum(p.numel() for p in m.parameters()) == cfg.num_params()
    assert cfg.num_active_params() < cfg.num_params()
    logits = m(torch.randint(0, 256, (1, 3)))  # 3 tokens, top-1: at most 3 of 8 experts are used
    (logits.sum() + aux_loss(m)).backward()
    assert m.expert_counts.shape == (1, 8) and int(m.expert_counts.sum()) == 3
    ex = m.layers[1].feed_forward.experts
    unused = [e for e in range(8) if m.expert_counts[0, e] == 0]
    assert unused
    for e in range(8):
        g = ex[e].w1.weight.grad
        assert g is not None  # every expert has a gradient, also with 0 tokens (FSDP needs it on every rank)
        assert (g.abs().sum() == 0) == (e in unused)


def test_moe_config_errors_and_flavors():
    assert {"moe-debug", "moe-tiny", "moe-small", "mixtral-8x7b", "olmoe-1b-7b"} <= set(MOE_FLAVORS)
    assert MoEConfig.flavor("tiny") == MOE_FLAVORS["moe-tiny"]
    with torch.device("meta"):  # real shapes build on meta (for planning)
        m = build_model("moe", "mixtral-8x7b", n_layers=1)
    assert m.layers[0].feed_forward.experts.w1.shape == (8, 4096, 14336)
    assert abs(MOE_FLAVORS["mixtral-8x7b"].num_params() / 1e9 - 46.7) < 0.1
    for bad, match in [
        (dict(top_k=9), "top_k must be in"),
        (dict(router="relu"), "router must be one of"),
        (dict(experts="packed"), "experts must be one of"),
        (dict(n_dense_layers=3), "n_dense_layers must be in"),
    ]:
        with pytest.raises(ValueError, match=match):
            MoEConfig.flavor("moe-debug", **bad)
    with pytest.raises(ValueError, match="unknown moe flavor 'huge'"):
        MoEConfig.flavor("huge")
    with pytest.raises(ValueError, match="unknown MoEConfig field 'n_expert'"):
        MoEConfig.flavor("debug", n_expert=2)
