"""The blocks the model families share: RMSNorm, RoPE, grouped-query attention, the SwiGLU MLP, and
the per-parameter init and config helpers.

``models/llama.py`` builds its ``TransformerBlock`` from these; ``models/moe.py`` (its attention and
dense layers) and ``models/hybrid.py`` (its full-attention layers and every MLP) use the same classes,
so one parameter name means one computation in every family (the Hugging Face mapping,
``checkpoint/hf.py``, relies on it). Shape legend: ``models/llama.py``.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import fields, replace
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "Attention",
    "FeedForward",
    "RMSNorm",
    "apply_rope",
    "fill_",
    "param_seed",
    "precompute_rope",
    "swiglu_hidden_dim",
    "with_overrides",
]

_C = TypeVar("_C")


def swiglu_hidden_dim(dim: int, ffn_dim: int, multiple_of: int) -> int:
    """The SwiGLU hidden width F: ``ffn_dim`` when set (> 0), else LLaMA's ``8 D / 3`` rounded up to a
    multiple of ``multiple_of``."""
    if ffn_dim > 0:
        return ffn_dim
    return multiple_of * math.ceil(int(8 * dim / 3) / multiple_of)


def with_overrides(cfg: _C, overrides: dict[str, Any], cls: type | None = None) -> _C:
    """``cfg`` (a frozen config dataclass) with ``overrides`` replaced; a key that is not a field of
    ``cls`` (default: ``type(cfg)``) is a ``ValueError`` naming the valid fields."""
    cls = cls or type(cfg)
    valid = {f.name for f in fields(cls)}
    for key in overrides:
        if key not in valid:
            raise ValueError(f"unknown {cls.__name__} field {key!r}; valid fields: {sorted(valid)}")
    return replace(cfg, **overrides)


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned gain, computed in fp32 and cast back to the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))  # (D,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., D) -> (..., D)
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


def precompute_rope(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, both (max_seq_len, head_dim // 2), fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))  # (E/2,)
    pos = torch.arange(max_seq_len, dtype=torch.float64)  # (T,)
    angles = torch.outer(pos, inv_freq)  # (T, E/2)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + E/2]) of ``x`` (B, T, heads, E) by the angles in cos/sin (T, E/2).

    This is the "rotate half" layout of Hugging Face transformers' LLaMA (``rotate_half``), so HF
    checkpoints map onto this model by parameter name alone, without permuting the q/k rows
    (Meta's original interleaved pairs (x[2i], x[2i+1]) would need that permutation).
    """
    x32 = x.float()
    x0, x1 = x32.chunk(2, dim=-1)  # each (B, T, h, E/2)
    cos = cos[None, :, None, :]  # (1, T, 1, E/2)
    sin = sin[None, :, None, :]
    return torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).type_as(x)  # (B, T, h, E)


class Attention(nn.Module):
    """Causal grouped-query self-attention: H query heads share K key/value heads."""

    def __init__(self, cfg) -> None:  # any config with dim, n_heads, n_kv_heads, head_dim
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)  # D -> H*E
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)  # D -> K*E
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)  # D -> K*E
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)  # H*E -> D

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape  # (B, T, D)
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)  # (B, T, H, E)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)  # (B, T, K, E)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)  # (B, T, K, E)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, E), (B, K, T, E), (B, K, T, E)
        # enable_gqa: query head h attends with kv head h // (H // K), without materialising copies.
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads
        )  # (B, H, T, E)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, H*E)
        return self.wo(y)  # (B, T, D)


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)  # D -> F (gate)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)  # D -> F (up)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)  # F -> D (down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, D) -> (B, T, D)
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # via (B, T, F)


def param_seed(seed: int, name: str) -> int:
    """The seed of parameter ``name``'s own generator: a function of the run's ``seed`` and the name only,
    so an init does not depend on construction order, device or sharding."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def fill_(p: torch.Tensor, make_full) -> None:
    """Copy ``make_full(global_shape)`` (a CPU fp32 tensor) into ``p``; DTensors keep their shard."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    full = make_full(tuple(p.shape))
    if isinstance(p, DTensor):
        full = distribute_tensor(full.to(p.device, p.dtype), p.device_mesh, p.placements)
        p.copy_(full)
    else:
        p.copy_(full.to(p.device, p.dtype))
