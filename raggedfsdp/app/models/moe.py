"""A LLaMA-style mixture-of-experts decoder: the dense model's attention, with a routed SwiGLU MoE FFN.

Shape legend (as in ``llama.py``): B batch, T sequence length, N = B*T tokens, D model dim,
X routed experts, k experts per token (top-k), F expert hidden dim, V vocab size.

Structure (what FSDP sees)::

    MoE
      tok_embeddings  nn.Embedding(V, D)
      layers          nn.ModuleList of MoEBlock            <- one ``fully_shard`` per block
        attention_norm, attention (llama.Attention), ffn_norm,
        feed_forward  MoEFeedForward (or a dense llama.FeedForward for the first ``n_dense_layers``)
          router      nn.Linear(D, X)                      router logits
          experts     SeparateExperts: X x FeedForward(D, F) (3 small nn.Linear each: the FSDP2 worst
                      case, many small tensors) or FusedExperts: w1, w3 (X, D, F) and w2 (X, F, D)
          shared_expert  FeedForward(D, n_shared_experts * F) or None
      norm, output

Routing (per token, in fp32 or wider): ``router="softmax"`` (Mixtral / Qwen-MoE / OLMoE): scores =
softmax(logits) over the X experts, the top-k scores are the weights, renormalised to sum 1 when
``route_norm``; ``router="sigmoid"`` (DeepSeek-V3): scores = sigmoid(logits), top-k by score, weights
renormalised to sum 1 when ``route_norm``. Weights are then scaled by ``route_scale``.
No capacity limit and no token dropping: every token reaches its k experts.

Auxiliary load-balancing loss (Switch Transformer, Fedus et al. 2021, eq. 4; GShard), per MoE layer
over the tokens of the local micro-batch: ``X * sum_e f_e * P_e`` with ``f_e`` the fraction of the
N*k token->expert assignments that go to expert e and ``P_e`` the mean routing probability of e
(softmax scores; for sigmoid the scores normalised per token, as DeepSeek-V3's sequence-wise loss).
It is 1 for perfectly uniform routing. ``model.aux_loss`` (0-d, in the autograd graph) holds
``aux_loss_coef * sum over MoE layers`` of the last forward; the trainer adds it to the LM loss and
logs it (``aux_loss`` in metrics.jsonl). ``model.expert_counts`` holds the tokens per expert of
every MoE layer of the last forward, (n_moe_layers, X) int64, detached.

Dispatch (plain torch): flatten the N*k assignments, ``argsort`` them by expert (stable), gather the
token rows with ``index_select``, run each expert on its contiguous slice, multiply by the routing
weights and ``index_add_`` (scatter-add) back into token order. Every expert runs every step, even on
zero tokens, so each expert parameter always has a gradient (zeros when it got no token): FSDP's
reduce-scatter then sees the same tensors on every rank whatever the routing (torch's FSDP2 job
fails otherwise, see benchmarks/README.md). The per-expert split sizes are read on the host (one
device-to-host sync per MoE layer, as in any dispatch without grouped GEMM).

Initialisation (``init_weights(seed)``): as the dense model; each expert matrix is drawn from a
generator seeded by its *separate-layout* name (``layers.L.feed_forward.experts.E.w1.weight``), so
fused and separate experts start from the same numbers (the fused ``w1[e]`` is ``experts.e.w1.weight.T``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from raggedfsdp.app.models._ep import ep_dispatch_combine
from raggedfsdp.app.models.layers import (
    Attention,
    FeedForward,
    RMSNorm,
    fill_,
    param_seed,
    precompute_rope,
    with_overrides,
)
from raggedfsdp.app.models.llama import LlamaConfig

__all__ = [
    "MOE_FLAVORS",
    "FusedExperts",
    "MoE",
    "MoEBlock",
    "MoEConfig",
    "MoEFeedForward",
    "SeparateExperts",
    "swiglu_experts",
]

ROUTERS = ("softmax", "sigmoid")
EXPERT_LAYOUTS = ("fused", "separate")


@dataclass(frozen=True, kw_only=True)
class MoEConfig(LlamaConfig):
    """``LlamaConfig`` plus the MoE fields. Named sizes live in ``MOE_FLAVORS`` (see ``MoEConfig.flavor``)."""

    n_experts: int = 16
    """Routed experts per MoE layer (X)."""
    top_k: int = 2
    """Experts per token (k <= X)."""
    expert_dim: int = 128
    """Hidden width F of each routed SwiGLU expert."""
    n_shared_experts: int = 0
    """Shared experts (always active, DeepSeek-style), fused into one SwiGLU of width n * F; 0: none."""
    router: str = "softmax"
    """``"softmax"`` or ``"sigmoid"`` scores (see the module docstring)."""
    route_norm: bool = True
    """Renormalise the top-k weights of a token to sum 1."""
    route_scale: float = 1.0
    """Multiplier of the routing weights (DeepSeek-V3's ``routed_scaling_factor``)."""
    aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss added to the LM loss (0: reported, no gradient)."""
    experts: str = "separate"
    """Expert storage: ``"separate"`` (X modules of 3 ``nn.Linear``) or ``"fused"`` ((X, D, F) stacks)."""
    n_dense_layers: int = 0
    """The first blocks use a dense SwiGLU (width ``hidden_dim``) instead of the MoE (DeepSeek: 3)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_experts < 1:
            raise ValueError(f"n_experts must be >= 1, got {self.n_experts}")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k must be in [1, n_experts={self.n_experts}], got {self.top_k}")
        if self.expert_dim < 1:
            raise ValueError(f"expert_dim must be >= 1, got {self.expert_dim}")
        if self.n_shared_experts < 0:
            raise ValueError(f"n_shared_experts must be >= 0, got {self.n_shared_experts}")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {self.router!r}")
        if self.experts not in EXPERT_LAYOUTS:
            raise ValueError(f"experts must be one of {EXPERT_LAYOUTS}, got {self.experts!r}")
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ValueError(
                f"n_dense_layers must be in [0, n_layers={self.n_layers}], got {self.n_dense_layers}"
            )
        if self.aux_loss_coef < 0:
            raise ValueError(f"aux_loss_coef must be >= 0, got {self.aux_loss_coef}")

    @classmethod
    def flavor(cls, name: str, **overrides) -> MoEConfig:
        """The named size (``"moe-tiny"``; the dense names ``"tiny"`` etc. mean ``"moe-tiny"``) with
        overrides."""
        key = name if name in MOE_FLAVORS else f"moe-{name}"
        if key not in MOE_FLAVORS:
            raise ValueError(f"unknown moe flavor {name!r}; choose one of {sorted(MOE_FLAVORS)}")
        return with_overrides(MOE_FLAVORS[key], overrides, cls)

    def num_params(self) -> int:
        """Total parameter count (all experts)."""
        d, e = self.dim, self.head_dim
        attn = d * self.n_heads * e + 2 * d * self.n_kv_heads * e + self.n_heads * e * d
        moe = d * self.n_experts + 3 * d * self.expert_dim * (self.n_experts + self.n_shared_experts)
        dense = 3 * d * self.hidden_dim
        n_moe = self.n_layers - self.n_dense_layers
        blocks = self.n_layers * (attn + 2 * d) + n_moe * moe + self.n_dense_layers * dense
        emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return blocks + emb + d

    def num_active_params(self) -> int:
        """Parameters a token uses (top-k of the routed experts)."""
        inactive = 3 * self.dim * self.expert_dim * (self.n_experts - self.top_k)
        return self.num_params() - (self.n_layers - self.n_dense_layers) * inactive


MOE_FLAVORS: dict[str, MoEConfig] = {
    # Unit tests: a few thousand parameters, 8 experts, a shared expert.
    "moe-debug": MoEConfig(
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=96,
        max_seq_len=256,
        n_experts=8,
        top_k=2,
        expert_dim=24,
        n_shared_experts=1,
    ),
    # `raggedfsdp train --model.name moe`: trains in minutes on 2 CPU ranks.
    "moe-tiny": MoEConfig(
        dim=128, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=512, n_experts=16, top_k=2, expert_dim=64
    ),
    # The MoE benchmark shape: 4 blocks, d=256, 16 small experts per block, top-2.
    "moe-small": MoEConfig(
        dim=256, n_layers=4, n_heads=8, n_kv_heads=4, max_seq_len=1024, n_experts=16, top_k=2, expert_dim=128
    ),
    # Real shapes, for planning / memory estimates on the meta device (public configs).
    "mixtral-8x7b": MoEConfig(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=32000,
        max_seq_len=4096,
        rope_theta=1e6,
        n_experts=8,
        top_k=2,
        expert_dim=14336,
        experts="fused",
    ),
    "olmoe-1b-7b": MoEConfig(
        dim=2048,
        n_layers=16,
        n_heads=16,
        n_kv_heads=16,
        vocab_size=50304,
        max_seq_len=4096,
        n_experts=64,
        top_k=8,
        expert_dim=1024,
        route_norm=False,
    ),
}


class SeparateExperts(nn.ModuleList):
    """``n`` independent SwiGLU experts, ``self[e]`` a ``llama.FeedForward(dim, hidden)``."""

    def __init__(self, n: int, dim: int, hidden: int) -> None:
        super().__init__(FeedForward(dim, hidden) for _ in range(n))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x (sum(counts), D) sorted by expert, counts[e] rows for expert e -> (sum(counts), D)."""
        parts = x.split(counts)
        return torch.cat([ffn(xe) for ffn, xe in zip(self, parts)])


class FusedExperts(nn.Module):
    """``n`` SwiGLU experts stored as 3-D stacks: w1, w3 (n, D, F) and w2 (n, F, D); y = (silu(x w1) * x w3)
    w2.

    Expert parallel (``parallelize.apply_ep``): the stacks are ``Shard(0)`` DTensors on the 1-D
    ``ep_mesh``, this rank holding experts ``[r*n/ep, (r+1)*n/ep)`` whole, and ``forward`` sends each row
    to the rank owning its expert and back (``_ep.ep_dispatch_combine``); same inputs, same outputs.
    """

    def __init__(self, n: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, dim, hidden))  # gate
        self.w3 = nn.Parameter(torch.empty(n, dim, hidden))  # up
        self.w2 = nn.Parameter(torch.empty(n, hidden, dim))  # down
        self.ep_mesh = None  # a 1-D DeviceMesh once expert-parallel

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """As ``SeparateExperts.forward`` (``counts`` over all n experts, EP or not)."""
        w1, w3, w2 = (_local(w) for w in (self.w1, self.w3, self.w2))
        if self.ep_mesh is None:
            return swiglu_experts(x, counts, w1, w3, w2)
        return ep_dispatch_combine(
            x, counts, self.ep_mesh.get_group(), lambda xl, c: swiglu_experts(xl, c, w1, w3, w2)
        )


def _local(w: torch.Tensor) -> torch.Tensor:
    """The local (this rank's experts) tensor of an expert stack, differentiable."""
    from torch.distributed.tensor import DTensor

    return w.to_local() if isinstance(w, DTensor) else w


def swiglu_experts(
    x: torch.Tensor, counts: list[int], w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """x (sum(counts), D) sorted by expert through stacked experts w1, w3 (n, D, F), w2 (n, F, D).

    ``unbind`` (not ``w[e]``) so backward stacks the grads once.
    """
    parts = x.split(counts)
    ys = [
        (F.silu(xe @ a) * (xe @ c)) @ b
        for xe, a, c, b in zip(parts, w1.unbind(0), w3.unbind(0), w2.unbind(0))
    ]
    return torch.cat(ys)


class MoEFeedForward(nn.Module):
    """Router + routed experts (+ shared expert). ``forward(x (B, T, D)) -> (B, T, D)``; see the module
    docstring.

    After each forward: ``self.aux_loss`` (0-d fp32, unweighted) and ``self.counts`` ((X,) int64).
    """

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.router_kind, self.route_norm, self.route_scale = cfg.router, cfg.route_norm, cfg.route_scale
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)  # D -> X
        cls = FusedExperts if cfg.experts == "fused" else SeparateExperts
        self.experts = cls(cfg.n_experts, cfg.dim, cfg.expert_dim)
        self.shared_expert = (
            FeedForward(cfg.dim, cfg.n_shared_experts * cfg.expert_dim) if cfg.n_shared_experts else None
        )
        self.aux_loss: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, D) -> (weights (N, k), expert ids (N, k) int64, scores (N, X)); fp32 (fp64 for fp64 x)."""
        logits = self.router(x)  # (N, X)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        scores = logits.softmax(-1) if self.router_kind == "softmax" else logits.sigmoid()
        weights, idx = scores.topk(self.top_k, dim=-1)  # (N, k)
        if self.route_norm:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights * self.route_scale, idx, scores

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        xf = x.reshape(B * T, D)  # (N, D)
        weights, idx, scores = self.route(xf)
        flat = idx.flatten()  # (N*k,) expert of each assignment, token-major
        counts = torch.bincount(flat, minlength=self.n_experts)  # (X,)
        # load-balancing loss: X * sum_e f_e * P_e
        probs = scores if self.router_kind == "softmax" else scores / scores.sum(-1, keepdim=True)
        frac = counts.to(probs.dtype) / flat.numel()
        self.aux_loss = self.n_experts * (frac * probs.mean(0)).sum()
        self.counts = counts.detach()
        order = flat.argsort(stable=True)  # assignments grouped by expert
        token = order // self.top_k  # (N*k,) source token of each sorted assignment
        ys = self.experts(xf.index_select(0, token), counts.tolist())  # (N*k, D), host sync
        ys = ys * weights.flatten().index_select(0, order).unsqueeze(-1).to(ys.dtype)
        out = torch.zeros_like(xf).index_add_(
            0, token, ys.to(xf.dtype)
        )  # back to token order (ys: bf16 under autocast)
        if self.shared_expert is not None:
            out = out + self.shared_expert(xf)
        return out.view(B, T, D)


class MoEBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + moe(norm(.)) (a dense SwiGLU when ``dense``)."""

    def __init__(self, cfg: MoEConfig, dense: bool = False) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.hidden_dim) if dense else MoEFeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)  # (B, T, D)
        return h + self.feed_forward(self.ffn_norm(h))  # (B, T, D)


class MoE(nn.Module):
    """Decoder-only MoE LM. ``forward(tokens (B, T) int64) -> logits (B, T, V)``; then ``aux_loss``."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(MoEBlock(cfg, dense=i < cfg.n_dense_layers) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = precompute_rope(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.aux_loss: torch.Tensor | None = None
        self.expert_counts: torch.Tensor | None = None

    def moe_layers(self) -> list[MoEFeedForward]:
        return [b.feed_forward for b in self.layers if isinstance(b.feed_forward, MoEFeedForward)]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        T = tokens.shape[1]
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len={self.cfg.max_seq_len}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        h = self.tok_embeddings(tokens)  # (B, T, D)
        for layer in self.layers:
            h = layer(h, cos, sin)
        h = self.norm(h)
        logits = F.linear(h, self.tok_embeddings.weight) if self.output is None else self.output(h)
        moes = self.moe_layers()
        if moes:
            self.aux_loss = self.cfg.aux_loss_coef * torch.stack([m.aux_loss for m in moes]).sum()
            self.expert_counts = torch.stack([m.counts for m in moes])
        else:
            self.aux_loss = torch.zeros((), device=logits.device)
        return logits  # (B, T, V)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """As ``Llama.init_weights``; the router N(0, 1/sqrt(D)); expert ``w2`` scaled by 1/sqrt(2
        n_layers)."""
        cfg = self.cfg
        cos, sin = precompute_rope(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        depth_scale = 1.0 / math.sqrt(2 * cfg.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                fill_(p, lambda shape: torch.ones(shape))
                continue
            if name == "tok_embeddings.weight":
                std = 1.0 / math.sqrt(cfg.dim) if cfg.tie_embeddings else 1.0
            elif name == "output.weight":
                std = 1.0 / cfg.dim
            elif p.ndim == 3:  # fused experts: expert e as its separate twin, transposed
                prefix, w = name.rsplit(".", 1)  # "layers.L.feed_forward.experts", "w1"
                std = (
                    1.0 / math.sqrt(p.shape[1]) * (depth_scale if w == "w2" else 1.0)
                )  # fan_in: D, or F for w2
                seeds = [param_seed(seed, f"{prefix}.{e}.{w}.weight") for e in range(p.shape[0])]
                fill_(
                    p,
                    lambda shape, std=std, seeds=seeds: torch.stack(
                        [
                            torch.randn(shape[2], shape[1], generator=torch.Generator().manual_seed(s)).T
                            * std
                            for s in seeds
                        ]
                    ),
                )
                continue
            else:
                std = 1.0 / math.sqrt(p.shape[1])
                if name.endswith(("attention.wo.weight", ".w2.weight")):
                    std *= depth_scale
            gen = torch.Generator().manual_seed(param_seed(seed, name))
            fill_(p, lambda shape, std=std, gen=gen: torch.randn(shape, generator=gen) * std)
