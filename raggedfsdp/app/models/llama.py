"""A small LLaMA-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP.

Shape legend (used in comments and names below):
    B batch, T sequence length, D model dim, H query heads, K key/value heads (H % K == 0),
    E head dim (D // H), F MLP hidden dim, V vocab size.

Structure (what FSDP sees):
    Llama
      tok_embeddings  nn.Embedding(V, D)
      layers          nn.ModuleList of TransformerBlock  <- one ``fully_shard`` per block
      norm            RMSNorm(D)
      output          nn.Linear(D, V, bias=False)         (absent when the embedding is tied)
    The root ``fully_shard`` then owns the embedding, the final norm and the output projection.

Embedding tying: ``tie_embeddings=False`` by default. Untied is what LLaMA does and it keeps every
parameter owned by exactly one module, which is the simple case for FSDP. With ``True`` the output
projection reuses ``tok_embeddings.weight`` (fewer parameters, the usual choice for tiny models);
both uses sit in the root FSDP group, so sharding stays valid.

Initialisation is a separate step, ``init_weights(seed)``, so the model can be built on the meta
device, sharded, materialised with ``to_empty`` and then initialised. Every parameter is drawn
from its own generator, seeded from ``seed`` and the parameter's name, as a full (global) tensor:
the result does not depend on module construction order, on the device or on sharding. For DTensor
parameters the full tensor is distributed with ``distribute_tensor`` (each rank keeps its shard).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

# the shared blocks live in models/layers.py; re-exported here (``from raggedfsdp.app.models.llama import
# Attention, RMSNorm, ...`` keeps working)
from raggedfsdp.app.models.layers import (
    Attention,
    FeedForward,
    RMSNorm,
    apply_rope,
    fill_,
    param_seed,
    precompute_rope,
    swiglu_hidden_dim,
    with_overrides,
)

__all__ = [
    "LLAMA_FLAVORS",
    "Attention",
    "FeedForward",
    "Llama",
    "LlamaConfig",
    "RMSNorm",
    "TransformerBlock",
    "apply_rope",
    "precompute_rope",
]


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Model hyperparameters. Named sizes live in ``LLAMA_FLAVORS``; see ``LlamaConfig.flavor``."""

    dim: int = 128
    """Model (residual stream) width D."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Query heads H; the head dim is ``dim // n_heads``."""
    n_kv_heads: int = 2
    """Key/value heads K for grouped-query attention; must divide ``n_heads`` (K == H: plain MHA)."""
    vocab_size: int = 256
    """V; 256 for the byte-level tokenizer used by ``raggedfsdp train``."""
    ffn_dim: int = 0
    """SwiGLU hidden width F; 0 means the LLaMA rule 8/3 * D rounded up to ``multiple_of``."""
    multiple_of: int = 32
    """Rounding for the default ``ffn_dim``."""
    max_seq_len: int = 1024
    """Length of the precomputed RoPE table (longest sequence the model accepts)."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """Reuse the input embedding as the output projection (see the module docstring)."""

    def __post_init__(self) -> None:
        # sizes first: dim=0 passed the divisibility checks and failed in init_weights (ZeroDivisionError),
        # n_heads=0 failed in the first of them
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "max_seq_len", "multiple_of"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {name}={getattr(self, name)}")
        if self.ffn_dim < 0:
            raise ValueError(f"ffn_dim must be >= 0 (0: 8/3 * dim), got ffn_dim={self.ffn_dim}")
        if self.dim % self.n_heads != 0:
            raise ValueError(f"dim must be divisible by n_heads, got dim={self.dim}, n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_kv_heads must divide n_heads, got n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}"
            )
        if (self.dim // self.n_heads) % 2 != 0:
            raise ValueError(
                f"head dim (dim / n_heads) must be even for RoPE, got dim={self.dim}, n_heads={self.n_heads} "
                f"(head dim {self.dim // self.n_heads})"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        """The SwiGLU hidden width F actually used."""
        return swiglu_hidden_dim(self.dim, self.ffn_dim, self.multiple_of)

    @classmethod
    def flavor(cls, name: str, **overrides) -> LlamaConfig:
        """The named size ``name`` with some fields replaced, e.g. ``flavor("tiny", n_layers=2)``."""
        if name not in LLAMA_FLAVORS:
            raise ValueError(f"unknown llama flavor {name!r}; choose one of {sorted(LLAMA_FLAVORS)}")
        return with_overrides(LLAMA_FLAVORS[name], overrides, cls)

    def num_params(self) -> int:
        """Parameter count (the tied output projection counted once)."""
        d, f, e = self.dim, self.hidden_dim, self.head_dim
        attn = d * self.n_heads * e + 2 * d * self.n_kv_heads * e + self.n_heads * e * d
        block = attn + 3 * d * f + 2 * d
        emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return self.n_layers * block + emb + d

    def to_dict(self) -> dict:
        return asdict(self)


LLAMA_FLAVORS: dict[str, LlamaConfig] = {
    # Unit tests and smoke runs: a few thousand parameters, uneven-ish shapes.
    "debug": LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=256),
    # The `raggedfsdp train` default: trains in a few minutes on 2 CPU ranks.
    "tiny": LlamaConfig(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=512),
    "small": LlamaConfig(dim=256, n_layers=6, n_heads=8, n_kv_heads=4, max_seq_len=1024),
    "base": LlamaConfig(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, max_seq_len=2048),
    # LLaMA-3 8B shapes (the `llama3-8b` preset; GPU clusters, tokenized data with this vocabulary).
    "llama3-8b": LlamaConfig(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        vocab_size=128256,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
}


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.hidden_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)  # (B, T, D)
        return h + self.feed_forward(self.ffn_norm(h))  # (B, T, D)


class Llama(nn.Module):
    """Decoder-only LM. ``forward(tokens (B, T) int64) -> logits (B, T, V)``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)  # (V, D)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # RoPE tables are buffers (moved with the module, never sharded: FSDP only manages
        # parameters). Non-persistent: they are recomputed, not checkpointed.
        cos, sin = precompute_rope(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)  # (max_seq_len, E/2)
        self.register_buffer("rope_sin", sin, persistent=False)  # (max_seq_len, E/2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        T = tokens.shape[1]  # tokens: (B, T)
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len={self.cfg.max_seq_len}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]  # (T, E/2)
        h = self.tok_embeddings(tokens)  # (B, T, D)
        for layer in self.layers:
            h = layer(h, cos, sin)  # (B, T, D)
        h = self.norm(h)  # (B, T, D)
        if self.output is None:
            return F.linear(h, self.tok_embeddings.weight)  # (B, T, V)
        return self.output(h)  # (B, T, V)

    # -- initialisation ----------------------------------------------------------------------

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Deterministic init from ``seed``; works after ``to_empty`` and on sharded (DTensor) params.

        - embedding: N(0, 1), or N(0, 1/sqrt(D)) when tied (it then also makes the logits);
        - linear weights: N(0, 1/sqrt(fan_in)); ``wo`` and ``w2``, which write into the residual
          stream, are further scaled by 1/sqrt(2 * n_layers);
        - output projection: N(0, 1/D), so the initial logits are small and the first loss is
          about ln(V);
        - RMSNorm gains: 1. The RoPE buffers are recomputed.
        """
        cos, sin = precompute_rope(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        depth_scale = 1.0 / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                fill_(p, lambda shape: torch.ones(shape))
                continue
            if name == "tok_embeddings.weight":
                # Tied: the same matrix makes the logits, so keep it at the output scale.
                std = 1.0 / math.sqrt(self.cfg.dim) if self.cfg.tie_embeddings else 1.0
            elif name == "output.weight":
                std = 1.0 / self.cfg.dim  # small logits at init: the first loss is about ln(V)
            else:
                std = 1.0 / math.sqrt(p.shape[1])
                if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
                    std *= depth_scale
            gen = torch.Generator().manual_seed(param_seed(seed, name))
            fill_(p, lambda shape, std=std, gen=gen: torch.randn(shape, generator=gen) * std)
