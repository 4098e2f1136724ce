"""Hybrid model: Gated DeltaNet's chunked form against the step-by-step recurrence (float64
oracle), values and gradients; the model is independent of the chunk length; config errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from raggedfsdp.app.models import Hybrid, HybridConfig, build_model, fsdp_unit_modules
from raggedfsdp.app.models.hybrid import gated_delta_rule_chunked, gated_delta_rule_recurrent


def _inputs(B=2, T=37, H=3, Dk=5, Dv=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    d = torch.float64
    q = torch.randn(B, T, H, Dk, generator=g, dtype=d)
    k = F.normalize(torch.randn(B, T, H, Dk, generator=g, dtype=d), dim=-1)
    v = torch.randn(B, T, H, Dv, generator=g, dtype=d)
    gate = -2 * torch.rand(B, T, H, generator=g, dtype=d)  # log decay in (-2, 0]
    beta = torch.rand(B, T, H, generator=g, dtype=d)
    s0 = torch.randn(B, H, Dk, Dv, generator=g, dtype=d)
    return [x.requires_grad_() for x in (q, k, v, gate, beta, s0)]


@pytest.mark.parametrize("chunk", [1, 5, 16, 37, 64])
def test_chunked_equals_recurrent_float64(chunk):
    xs = _inputs()
    o_ref, s_ref = gated_delta_rule_recurrent(*xs[:5], state=xs[5])
    o, s = gated_delta_rule_chunked(*xs[:5], chunk_size=chunk, state=xs[5])
    assert o.dtype == torch.float64
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s, s_ref, rtol=1e-10, atol=1e-10)
    # gradients of a generic scalar through both forms
    w = torch.randn_like(o_ref)
    g_ref = torch.autograd.grad((o_ref * w).sum() + s_ref.sum(), xs)
    g_chk = torch.autograd.grad((o * w).sum() + s.sum(), xs)
    for a, b in zip(g_chk, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_recurrence_is_the_delta_rule():
    """One step by hand: S1 = a (I - b k k^T) S0 + b k v^T, o = S1^T q."""
    q, k, v, g, beta, s0 = (x.detach() for x in _inputs(B=1, T=1, H=1))
    o, s1 = gated_delta_rule_recurrent(q, k, v, g, beta, state=s0)
    kk, a, b = k[0, 0, 0], g[0, 0, 0].exp(), beta[0, 0, 0]
    want = a * (torch.eye(kk.numel(), dtype=kk.dtype) - b * torch.outer(kk, kk)) @ s0[0, 0]
    want = want + b * torch.outer(kk, v[0, 0, 0])
    torch.testing.assert_close(s1[0, 0], want)
    torch.testing.assert_close(o[0, 0, 0], want.T @ q[0, 0, 0])


def test_model_independent_of_chunk_size_and_causal():
    torch.manual_seed(0)
    tok = torch.randint(0, 256, (2, 45))
    outs = []
    for chunk in (7, 64):
        m = build_model("hybrid", "debug", chunk_size=chunk).double()
        m.init_weights(3)
        outs.append(m(tok))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-10, atol=1e-10)
    # causality: changing a later token leaves earlier logits unchanged
    tok2 = tok.clone()
    tok2[:, 30] = (tok2[:, 30] + 1) % 256
    torch.testing.assert_close(m(tok2)[:, :30], outs[1][:, :30], rtol=0, atol=1e-12)
    assert m.cfg.num_params() == sum(p.numel() for p in m.parameters())
    kinds = [layer.full_attention for layer in m.layers]
    assert kinds == [False, False, False, True]


def test_units_and_errors():
    m = Hybrid(HybridConfig.flavor("tiny"))
    assert [n for n, _ in fsdp_unit_modules(m, "superblock")] == ["layers.0-3", "layers.4-7", "root"]
    assert len(fsdp_unit_modules(m, "layer")) == 9
    with pytest.raises(ValueError, match="unknown FSDP unit 'block'"):
        fsdp_unit_modules(m, "block")
    with pytest.raises(ValueError, match="needs a hybrid model"):
        fsdp_unit_modules(build_model("llama", "debug"), "superblock")
    with pytest.raises(ValueError, match="multiple of full_attention_interval"):
        HybridConfig(n_layers=6)
    # sizes < 1 are named (n_heads=0 was a ZeroDivisionError, dim=0 one in init_weights)
    for name in ("dim", "n_heads", "n_kv_heads", "linear_num_key_heads", "full_attention_interval"):
        with pytest.raises(ValueError, match=rf"HybridConfig: {name} must be >= 1, got {name}=0"):
            HybridConfig(**{name: 0})
    with pytest.raises(ValueError, match="unknown HybridConfig field 'heads'"):
        HybridConfig.flavor("debug", heads=3)
