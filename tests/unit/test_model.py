"""The LLaMA-style model: shapes, causality, GQA against an independent reference, init."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from raggedfsdp.app.models import LLAMA_FLAVORS, Llama, LlamaConfig, build_model
from raggedfsdp.app.models.llama import Attention, RMSNorm, apply_rope, precompute_rope


def _model(**overrides) -> Llama:
    m = Llama(LlamaConfig.flavor("debug", **overrides))
    m.init_weights(seed=0)
    return m


def test_forward_shape_and_param_count():
    for tie in (False, True):
        m = _model(tie_embeddings=tie)
        tokens = torch.randint(0, 256, (3, 17))  # (B, T)
        logits = m(tokens)
        assert logits.shape == (3, 17, 256)
        assert logits.dtype == torch.float32
        assert sum(p.numel() for p in m.parameters()) == m.cfg.num_params()
        assert (m.output is None) == tie
    assert isinstance(_model().layers, torch.nn.ModuleList)
    assert len(_model().layers) == LLAMA_FLAVORS["debug"].n_layers


def test_flavors_are_valid_and_named():
    assert {"debug", "tiny", "small"} <= set(LLAMA_FLAVORS)
    for name in LLAMA_FLAVORS:
        cfg = LlamaConfig.flavor(name)
        # byte-level flavors; llama3-8b (the real-size preset) has LLaMA-3's vocabulary
        assert (
            cfg.vocab_size == (128256 if name == "llama3-8b" else 256) and cfg.n_heads % cfg.n_kv_heads == 0
        )
    with pytest.raises(ValueError, match="unknown llama flavor 'huge'"):
        LlamaConfig.flavor("huge")
    with pytest.raises(ValueError, match="unknown LlamaConfig field 'dimm'"):
        LlamaConfig.flavor("tiny", dimm=3)
    with pytest.raises(ValueError, match="n_kv_heads must divide n_heads"):
        LlamaConfig(dim=32, n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="divisible by n_heads"):
        LlamaConfig(dim=30, n_heads=4, n_kv_heads=2)


@pytest.mark.parametrize(
    "fields, match",
    [
        # dim=0 passed every check and failed in init_weights (ZeroDivisionError); n_heads=0 in the first
        (dict(dim=0), r"^dim must be >= 1, got dim=0$"),
        (dict(n_heads=0), r"^n_heads must be >= 1, got n_heads=0$"),
        (dict(n_kv_heads=0), r"^n_kv_heads must be >= 1, got n_kv_heads=0$"),
        (dict(n_layers=0), r"^n_layers must be >= 1, got n_layers=0$"),
        (dict(ffn_dim=-1), r"^ffn_dim must be >= 0 \(0: 8/3 \* dim\), got ffn_dim=-1$"),
        # the user's names, not f-string debug names (self.dim=32 self.n_heads=5)
        (dict(dim=32, n_heads=5), r"^dim must be divisible by n_heads, got dim=32, n_heads=5$"),
        (
            dict(dim=32, n_heads=4, n_kv_heads=3),
            r"^n_kv_heads must divide n_heads, got n_heads=4, n_kv_heads=3$",
        ),
        (dict(dim=36, n_heads=4, n_kv_heads=2), r"even for RoPE, got dim=36, n_heads=4 \(head dim 9\)$"),
    ],
)
def test_config_sizes_are_checked_with_the_field_names(fields, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig(**fields)


def test_causal_masking_future_token_does_not_change_earlier_logits():
    torch.manual_seed(0)
    m = _model()
    tokens = torch.randint(0, 256, (2, 24))
    t = 11
    changed = tokens.clone()
    changed[:, t] = (changed[:, t] + 7) % 256
    with torch.no_grad():
        a, b = m(tokens), m(changed)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=0)
    assert not torch.allclose(a[:, t:], b[:, t:])


def _reference_attention(
    attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Plain softmax attention with the kv heads repeated (no SDPA, no enable_gqa)."""
    B, T, _ = x.shape
    H, K, E = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q = apply_rope((x @ attn.wq.weight.T).view(B, T, H, E), cos, sin).transpose(1, 2)  # (B, H, T, E)
    k = apply_rope((x @ attn.wk.weight.T).view(B, T, K, E), cos, sin).transpose(1, 2)  # (B, K, T, E)
    v = (x @ attn.wv.weight.T).view(B, T, K, E).transpose(1, 2)  # (B, K, T, E)
    k = k.repeat_interleave(H // K, dim=1)  # (B, H, T, E): query head h uses kv head h // (H/K)
    v = v.repeat_interleave(H // K, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(E)  # (B, H, T, T)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    y = scores.softmax(-1) @ v  # (B, H, T, E)
    return y.transpose(1, 2).reshape(B, T, H * E) @ attn.wo.weight.T  # (B, T, D)


@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 2), (4, 1), (4, 4), (8, 2)])
def test_gqa_matches_reference_with_repeated_kv_heads(n_heads, n_kv_heads):
    cfg = LlamaConfig(dim=64, n_layers=1, n_heads=n_heads, n_kv_heads=n_kv_heads, max_seq_len=64)
    m = Llama(cfg)
    m.init_weights(seed=3)
    attn = m.layers[0].attention
    x = torch.randn(2, 19, 64, generator=torch.Generator().manual_seed(1))
    cos, sin = precompute_rope(cfg.head_dim, 19, cfg.rope_theta)
    with torch.no_grad():
        torch.testing.assert_close(
            attn(x, cos, sin), _reference_attention(attn, x, cos, sin), rtol=1e-5, atol=1e-5
        )


def test_rope_scores_depend_only_on_relative_position():
    E = 16
    cos, sin = precompute_rope(E, 64, 10000.0)
    g = torch.Generator().manual_seed(0)
    q0, k0 = torch.randn(E, generator=g), torch.randn(E, generator=g)

    def score(i: int, j: int) -> torch.Tensor:
        q = q0.expand(1, 64, 1, E)
        k = k0.expand(1, 64, 1, E)
        return (apply_rope(q, cos, sin)[0, i, 0] * apply_rope(k, cos, sin)[0, j, 0]).sum()

    torch.testing.assert_close(score(5, 2), score(40, 37))
    torch.testing.assert_close(score(9, 9), (q0 * k0).sum(), rtol=1e-5, atol=1e-5)


def test_rmsnorm_unit_rms():
    norm = RMSNorm(32)
    norm.weight.data.fill_(1.0)
    y = norm(torch.randn(4, 32) * 5)
    torch.testing.assert_close(y.pow(2).mean(-1), torch.ones(4), rtol=1e-4, atol=1e-4)


def test_init_is_deterministic_and_seeded():
    a, b, c = _model(), _model(), Llama(LlamaConfig.flavor("debug"))
    c.init_weights(seed=1)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name


def test_meta_init_to_empty_matches_eager_init():
    eager = _model()
    with torch.device("meta"):
        meta = build_model("llama", "debug")
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    meta.init_weights(seed=0)
    for (name, p), q in zip(eager.named_parameters(), meta.parameters()):
        assert torch.equal(p, q), name
    torch.testing.assert_close(meta.rope_cos, eager.rope_cos)
    tokens = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(meta(tokens), eager(tokens))


def test_initial_loss_is_about_ln_vocab():
    m = _model()
    tokens = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss = F.cross_entropy(m(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    assert abs(loss.item() - math.log(256)) < 0.1


def test_bf16_forward_backward():
    m = _model().to(torch.bfloat16)
    logits = m(torch.randint(0, 256, (2, 16)))
    assert logits.dtype == torch.bfloat16
    logits.float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


def test_too_long_sequence_is_a_clear_error():
    m = _model()
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        m(torch.zeros(1, m.cfg.max_seq_len + 1, dtype=torch.long))
