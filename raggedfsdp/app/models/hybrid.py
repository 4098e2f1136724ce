"""A hybrid decoder: super-blocks of Gated DeltaNet linear-attention layers + one full-attention layer.

Shape legend: B batch, T sequence, D model dim, Hk / Hv linear-attention key / value heads
(``Hv % Hk == 0``; query/key heads are repeated to ``Hv``), Dk / Dv their head dims, C chunk length,
V vocab.

Structure (Qwen3-Next-style, parameter names as in ``raggedfsdp.app.sizing.archs._gated_deltanet`` so
that ``raggedfsdp plan --model hybrid-27b`` describes the same tensors):

    Hybrid
      tok_embeddings  nn.Embedding(V, D)
      layers          nn.ModuleList; layer i is full attention when (i + 1) % interval == 0,
                      otherwise a Gated DeltaNet layer. Every layer has a SwiGLU MLP.
      norm, output    as in ``Llama``

A *super-block* is ``full_attention_interval`` consecutive layers (by default 3 linear + 1 full).
FSDP can wrap per layer or per super-block (``apply_fsdp(..., unit="superblock")``); which is
better is measured by :func:`raggedfsdp.app.models.wrap_bench.compare_wrap_units`.

Gated DeltaNet (Yang, Kautz, Hatamizadeh, "Gated Delta Networks", ICLR 2025, eq. 10), per head,
with the state ``S`` of shape (Dk, Dv)::

    S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T,     o_t = S_t^T q_t

``a_t = exp(g_t)``, ``g_t = -exp(A_log) * softplus(a_proj + dt_bias)`` (a data-dependent decay in
(0, 1)), ``b_t = sigmoid(b_proj)``; ``q``, ``k`` pass a short causal depthwise conv + SiLU and are
L2-normalised, ``q`` is scaled by ``Dk ** -0.5``. The output is ``RMSNorm(o) * silu(z)`` projected
back to D. :func:`gated_delta_rule_recurrent` is the step-by-step reference;
:func:`gated_delta_rule_chunked` computes the same thing chunk by chunk (the WY / UT-transform form
used by the paper and ``flash-linear-attention``): within a chunk the delta-rule corrections are one
unit-lower-triangular solve and the outputs are matrix products, so it runs at matmul speed.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from raggedfsdp.app.models.layers import (
    Attention,
    FeedForward,
    RMSNorm,
    fill_,
    param_seed,
    precompute_rope,
    swiglu_hidden_dim,
    with_overrides,
)

__all__ = [
    "HYBRID_FLAVORS",
    "GatedDeltaNet",
    "Hybrid",
    "HybridConfig",
    "gated_delta_rule_chunked",
    "gated_delta_rule_recurrent",
]


@dataclass(frozen=True, kw_only=True)
class HybridConfig:
    """Hybrid model hyperparameters. Named sizes live in ``HYBRID_FLAVORS``."""

    dim: int = 128
    n_layers: int = 4
    """Number of layers; a multiple of ``full_attention_interval``."""
    n_heads: int = 4
    """Full-attention query heads."""
    n_kv_heads: int = 2
    """Full-attention key/value heads (GQA)."""
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 32
    linear_value_head_dim: int = 32
    linear_conv_kernel_dim: int = 4
    full_attention_interval: int = 4
    """Layers per super-block; the last layer of each is full attention."""
    chunk_size: int = 64
    """Gated DeltaNet chunk length C (a speed knob: the result does not depend on it)."""
    vocab_size: int = 256
    ffn_dim: int = 0
    """SwiGLU hidden width; 0 means 8/3 * D rounded up to ``multiple_of``."""
    multiple_of: int = 32
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        # sizes first: 0 heads failed in the checks below (ZeroDivisionError), dim=0 in init_weights
        for name in (
            "dim",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_conv_kernel_dim",
            "full_attention_interval",
            "chunk_size",
            "vocab_size",
            "max_seq_len",
            "multiple_of",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"HybridConfig: {name} must be >= 1, got {name}={getattr(self, name)}")
        if self.ffn_dim < 0:
            raise ValueError(f"HybridConfig: ffn_dim must be >= 0 (0: 8/3 * dim), got ffn_dim={self.ffn_dim}")
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(
                f"HybridConfig: dim={self.dim}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads} must "
                "give an even head dim and n_kv_heads dividing n_heads"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"HybridConfig: linear_num_value_heads={self.linear_num_value_heads} must be a multiple of "
                f"linear_num_key_heads={self.linear_num_key_heads}"
            )
        if self.n_layers % self.full_attention_interval:
            raise ValueError(
                f"HybridConfig: n_layers={self.n_layers} must be a positive multiple of "
                f"full_attention_interval={self.full_attention_interval} (whole super-blocks)"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        return swiglu_hidden_dim(self.dim, self.ffn_dim, self.multiple_of)

    @property
    def superblock_size(self) -> int:
        return self.full_attention_interval

    def is_full_attention(self, i: int) -> bool:
        return (i + 1) % self.full_attention_interval == 0

    @classmethod
    def flavor(cls, name: str, **overrides) -> HybridConfig:
        if name not in HYBRID_FLAVORS:
            raise ValueError(f"unknown hybrid flavor {name!r}; choose one of {sorted(HYBRID_FLAVORS)}")
        return with_overrides(HYBRID_FLAVORS[name], overrides, cls)

    def num_params(self) -> int:
        d, f = self.dim, self.hidden_dim
        e, nh, nkv = self.head_dim, self.n_heads, self.n_kv_heads
        key = self.linear_num_key_heads * self.linear_key_head_dim
        val = self.linear_num_value_heads * self.linear_value_head_dim
        attn = 2 * d * nh * e + 2 * d * nkv * e
        lin = (
            d * (2 * key + 2 * val)
            + d * 2 * self.linear_num_value_heads
            + (2 * key + val) * self.linear_conv_kernel_dim
            + 2 * self.linear_num_value_heads
            + self.linear_value_head_dim
            + val * d
        )
        mlp_norms = 3 * d * f + 2 * d
        n_full = self.n_layers // self.full_attention_interval
        blocks = n_full * attn + (self.n_layers - n_full) * lin + self.n_layers * mlp_norms
        return blocks + self.vocab_size * d * (1 if self.tie_embeddings else 2) + d

    def to_dict(self) -> dict:
        return asdict(self)


HYBRID_FLAVORS: dict[str, HybridConfig] = {
    # 1 super-block, uneven shapes: unit tests.
    "debug": HybridConfig(
        dim=32,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        ffn_dim=96,
        chunk_size=16,
        max_seq_len=256,
    ),
    # 2 super-blocks: `raggedfsdp train --config hybrid-tiny`.
    "tiny": HybridConfig(dim=128, n_layers=8, max_seq_len=512),
    "small": HybridConfig(
        dim=256,
        n_layers=8,
        n_heads=8,
        n_kv_heads=4,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        max_seq_len=1024,
    ),
}


# -- the gated delta rule -----------------------------------------------------------------------


def gated_delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: the recurrence one time step at a time.

    Args:
        q, k: (B, T, H, Dk); v: (B, T, H, Dv); g: (B, T, H) log-decay (<= 0); beta: (B, T, H) in (0, 1).
        state: initial (B, H, Dk, Dv), default zeros.

    Returns:
        ``(o (B, T, H, Dv), final state (B, H, Dk, Dv))`` in the dtype of ``q``.
    """
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    S = q.new_zeros(B, H, Dk, Dv) if state is None else state
    out = []
    for t in range(T):
        kt, vt, qt = k[:, t], v[:, t], q[:, t]  # (B, H, Dk), (B, H, Dv), (B, H, Dk)
        a = g[:, t].exp()[..., None, None]  # (B, H, 1, 1)
        b = beta[:, t][..., None]  # (B, H, 1)
        S = a * S
        u = b * (vt - torch.einsum("bhkv,bhk->bhv", S, kt))  # delta-rule correction (B, H, Dv)
        S = S + kt[..., :, None] * u[..., None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", S, qt))
    return torch.stack(out, dim=1), S


def gated_delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule chunk by chunk; same arguments and result as the recurrent reference.

    Per chunk (rows = time, ``G_t = exp(cumsum g)`` within the chunk, ``S0`` the state entering it):
    the corrections ``U`` solve ``(I + diag(b) A) U = diag(b) (V - diag(G) K S0)`` with
    ``A_tj = (G_t / G_j) k_t.k_j`` for ``j < t`` (unit lower triangular); then
    ``O = diag(G) Q S0 + (M * Q K^T) U`` with ``M_tj = G_t / G_j`` for ``j <= t`` and
    ``S_C = G_C S0 + K^T diag(G_C / G) U``. Decay ratios are formed as ``exp(gamma_t - gamma_j)``
    on the causal triangle only, so they never overflow. Computed in fp32 at least.
    """
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    dtype = q.dtype
    work = torch.promote_types(dtype, torch.float32)
    q, k, v, g, beta = (x.to(work).transpose(1, 2) for x in (q, k, v, g, beta))  # (B, H, T, ...)
    C = max(1, min(chunk_size, T))
    pad = (-T) % C
    if pad:  # zero keys/values/betas and zero log-decay: padded steps leave the state unchanged
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (T + pad) // C
    q, k, v = (x.reshape(B, H, n, C, -1) for x in (q, k, v))  # (B, H, n, C, D*)
    g, beta = (x.reshape(B, H, n, C) for x in (g, beta))
    gamma = g.cumsum(-1)  # (B, H, n, C)
    diff = gamma[..., :, None] - gamma[..., None, :]  # (B, H, n, C, C): gamma_t - gamma_j
    incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    strict = incl.clone().fill_diagonal_(False)
    decay_incl = torch.where(incl, diff, -math.inf).exp()  # M
    decay_strict = torch.where(strict, diff, -math.inf).exp()
    kk = k @ k.transpose(-1, -2)  # (B, H, n, C, C)
    eye = torch.eye(C, dtype=work, device=q.device)
    lower = eye + beta[..., :, None] * decay_strict * kk  # I + diag(b) A
    G = gamma.exp()  # (B, H, n, C)
    rhs_v = beta[..., None] * v  # (B, H, n, C, Dv)
    rhs_k = (beta * G)[..., None] * k  # (B, H, n, C, Dk)
    sol = torch.linalg.solve_triangular(lower, torch.cat([rhs_v, rhs_k], -1), upper=False, unitriangular=True)
    w_v, w_k = sol[..., :Dv], sol[..., Dv:]  # U = w_v - w_k S0
    attn = decay_incl * (q @ k.transpose(-1, -2))  # (B, H, n, C, C)
    tail = (gamma[..., -1:] - gamma).exp()  # G_C / G_t (B, H, n, C)
    S = q.new_zeros(B, H, Dk, Dv) if state is None else state.to(work)
    outs = []
    for i in range(n):
        u = w_v[:, :, i] - w_k[:, :, i] @ S  # (B, H, C, Dv)
        outs.append(G[:, :, i, :, None] * (q[:, :, i] @ S) + attn[:, :, i] @ u)
        S = G[:, :, i, -1, None, None] * S + (k[:, :, i] * tail[:, :, i, :, None]).transpose(-1, -2) @ u
    o = torch.stack(outs, 2).reshape(B, H, n * C, Dv)[:, :, :T].transpose(1, 2)  # (B, T, H, Dv)
    return o.to(dtype), S.to(dtype)


# -- layers -------------------------------------------------------------------------------------


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer: (B, T, D) -> (B, T, D)."""

    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        self.nk, self.nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.chunk_size = cfg.chunk_size
        key, val = self.nk * self.dk, self.nv * self.dv
        self.key_dim, self.value_dim = key, val
        self.in_proj_qkvz = nn.Linear(cfg.dim, 2 * key + 2 * val, bias=False)  # D -> q, k, v, z
        self.in_proj_ba = nn.Linear(cfg.dim, 2 * self.nv, bias=False)  # D -> b, a (per value head)
        conv_ch = 2 * key + val
        self.conv1d = nn.Conv1d(
            conv_ch,
            conv_ch,
            cfg.linear_conv_kernel_dim,
            groups=conv_ch,
            bias=False,
            padding=cfg.linear_conv_kernel_dim - 1,
        )  # weight (2*key + val, 1, kernel): causal depthwise conv over q, k, v
        self.dt_bias = nn.Parameter(torch.empty(self.nv))
        self.A_log = nn.Parameter(torch.empty(self.nv))
        self.norm = RMSNorm(self.dv, cfg.norm_eps)
        self.out_proj = nn.Linear(val, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos=None, sin=None) -> torch.Tensor:
        B, T, _ = x.shape
        key, val = self.key_dim, self.value_dim
        qkvz = self.in_proj_qkvz(x)  # (B, T, 2key + 2val)
        qkv, z = qkvz[..., : 2 * key + val], qkvz[..., 2 * key + val :]
        qkv = F.silu(self.conv1d(qkv.transpose(1, 2))[..., :T]).transpose(1, 2)  # causal conv
        q, k, v = qkv.split([key, key, val], dim=-1)
        q = q.reshape(B, T, self.nk, self.dk)
        k = k.reshape(B, T, self.nk, self.dk)
        v = v.reshape(B, T, self.nv, self.dv)
        rep = self.nv // self.nk
        if rep > 1:
            q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)  # (B, T, Hv, Dk)
        work = torch.promote_types(x.dtype, torch.float32)  # the recurrence runs in fp32 at least
        q = F.normalize(q.to(work), dim=-1) * self.dk**-0.5
        k = F.normalize(k.to(work), dim=-1)
        b, a = self.in_proj_ba(x).to(work).chunk(2, dim=-1)  # (B, T, Hv) each
        beta = b.sigmoid()
        g = -self.A_log.to(work).exp() * F.softplus(a + self.dt_bias.to(work))  # log-decay <= 0
        o, _ = gated_delta_rule_chunked(q, k, v.to(work), g, beta, chunk_size=self.chunk_size)
        o = self.norm(o.to(x.dtype)) * F.silu(z.reshape(B, T, self.nv, self.dv))  # (B, T, Hv, Dv)
        return self.out_proj(o.reshape(B, T, val))


class HybridLayer(nn.Module):
    """Pre-norm layer: x + mixer(norm(x)), then + mlp(norm(.)); the mixer is full or linear attention."""

    def __init__(self, cfg: HybridConfig, full_attention: bool) -> None:
        super().__init__()
        self.full_attention = full_attention
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if full_attention:
            self.attention = Attention(cfg)  # type: ignore[arg-type]  (same fields as LlamaConfig)
        else:
            self.linear_attn = GatedDeltaNet(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.hidden_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        mixer = self.attention if self.full_attention else self.linear_attn
        h = x + mixer(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Hybrid(nn.Module):
    """Decoder-only hybrid LM. ``forward(tokens (B, T) int64) -> logits (B, T, V)``."""

    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(HybridLayer(cfg, cfg.is_full_attention(i)) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = precompute_rope(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def superblock_size(self) -> int:
        return self.cfg.full_attention_interval

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        T = tokens.shape[1]
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len={self.cfg.max_seq_len}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        h = self.norm(h)
        if self.output is None:
            return F.linear(h, self.tok_embeddings.weight)
        return self.output(h)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Deterministic, sharding-independent init (as ``Llama.init_weights``), plus:
        ``A_log = log(U[1, 16])``, ``dt_bias`` = inverse softplus of a log-uniform step in
        [1e-3, 0.1] (Mamba-2 / Gated DeltaNet defaults), conv weights N(0, 1/kernel)."""
        cos, sin = precompute_rope(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        depth_scale = 1.0 / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            gen = torch.Generator().manual_seed(param_seed(seed, name))
            if name.endswith("norm.weight"):
                fill_(p, lambda shape: torch.ones(shape))
            elif name.endswith("A_log"):
                fill_(p, lambda shape, gen=gen: torch.empty(shape).uniform_(1, 16, generator=gen).log())
            elif name.endswith("dt_bias"):

                def dt(shape, gen=gen):
                    lo, hi = math.log(1e-3), math.log(0.1)
                    step = (torch.rand(shape, generator=gen) * (hi - lo) + lo).exp()
                    return step + torch.log(-torch.expm1(-step))  # softplus^-1(step)

                fill_(p, dt)
            else:
                if name == "tok_embeddings.weight":
                    std = 1.0 / math.sqrt(self.cfg.dim) if self.cfg.tie_embeddings else 1.0
                elif name == "output.weight":
                    std = 1.0 / self.cfg.dim
                elif name.endswith("conv1d.weight"):
                    std = 1.0 / math.sqrt(p.shape[-1])
                else:
                    std = 1.0 / math.sqrt(p.shape[1])
                    if name.endswith(("attention.wo.weight", "feed_forward.w2.weight", "out_proj.weight")):
                        std *= depth_scale
                fill_(p, lambda shape, std=std, gen=gen: torch.randn(shape, generator=gen) * std)
