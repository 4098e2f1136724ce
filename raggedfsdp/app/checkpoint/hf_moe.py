"""Hugging Face export of the MoE model as ``MixtralForCausalLM`` (safetensors + ``config.json``).

Our MoE with ``router="softmax"``, ``route_norm=True``, ``route_scale=1``, no shared expert and no dense
layers is Mixtral's block: softmax over the router logits, top-k, weights renormalised to sum 1, SwiGLU
experts ``w2(silu(w1 x) * w3 x)``; attention, norms, RoPE ("rotate half") as the LLaMA export
(``checkpoint/hf.py``). Tensors are written in the Hub's Mixtral layout, which transformers 4.x loads
as is and 5.x converts to its fused ``gate_up_proj``: per expert ``E``

    layers.N.feed_forward.router.weight (X, D)         model.layers.N.block_sparse_moe.gate.weight
    experts.w1 (X, D, F)[E].T / experts.E.w1.weight     ...block_sparse_moe.experts.E.w1.weight (F, D)
    experts.w3 ... / experts.E.w3.weight                ...block_sparse_moe.experts.E.w3.weight (F, D)
    experts.w2 (X, F, D)[E].T / experts.E.w2.weight     ...block_sparse_moe.experts.E.w2.weight (D, F)

An expert-parallel checkpoint needs nothing special: DCP stores the global expert stacks, and
``read_dcp_model`` reads them whole in one process. The aux loss is a training term, not part of the
logits. Tested against ``transformers``' own ``MixtralForCausalLM`` (tests/dist/test_moe_ep_checkpoint.py).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from raggedfsdp.app.checkpoint.hf import _LAYER_MAP, _TOP_MAP

__all__ = ["check_mixtral_compatible", "moe_hf_config", "moe_to_hf", "write_moe_safetensors"]

_EXPERT_RE = re.compile(r"^layers\.(\d+)\.feed_forward\.experts\.(?:(\d+)\.)?(w[123])(?:\.weight)?$")


def check_mixtral_compatible(cfg) -> None:
    """``ValueError`` naming the first field of ``cfg`` (a ``MoEConfig``) that Mixtral cannot express."""
    bad = [
        ("n_shared_experts", cfg.n_shared_experts, 0),
        ("router", cfg.router, "softmax"),
        ("route_norm", cfg.route_norm, True),
        ("route_scale", cfg.route_scale, 1.0),
        ("n_dense_layers", cfg.n_dense_layers, 0),
        ("tie_embeddings", cfg.tie_embeddings, False),
    ]
    for key, got, want in bad:
        if got != want:
            raise ValueError(
                f"the MoE has {key}={got!r}; the Hugging Face export (MixtralForCausalLM) needs "
                f"{key}={want!r}; use --to torch for this model"
            )


def moe_hf_config(cfg) -> dict[str, Any]:
    """``config.json`` of ``MixtralForCausalLM`` for our ``MoEConfig`` (checked compatible)."""
    check_mixtral_compatible(cfg)
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.expert_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "num_local_experts": cfg.n_experts,
        "num_experts_per_tok": cfg.top_k,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "sliding_window": None,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
        "router_aux_loss_coef": cfg.aux_loss_coef,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def moe_to_hf(state: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """Our full MoE state dict (fused or separate experts) -> Mixtral's Hub names and shapes.

    Raises:
        ValueError: ``cfg`` not expressible (see :func:`check_mixtral_compatible`).
        KeyError: a parameter without a Mixtral counterpart.
    """
    check_mixtral_compatible(cfg)
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name in _TOP_MAP:
            out[_TOP_MAP[name]] = t
            continue
        m = _EXPERT_RE.match(name)
        if m is not None:
            layer, e, w = m.groups()
            pre = f"model.layers.{layer}.block_sparse_moe.experts"
            if e is not None:  # separate: nn.Linear weights already (out, in)
                out[f"{pre}.{e}.{w}.weight"] = t
            else:  # fused (X, in, out) stack: expert e's weight is its transpose
                for j in range(t.shape[0]):
                    out[f"{pre}.{j}.{w}.weight"] = t[j].T
            continue
        lm = re.match(r"^layers\.(\d+)\.(.+)$", name)
        if lm and lm.group(2) == "feed_forward.router.weight":
            out[f"model.layers.{lm.group(1)}.block_sparse_moe.gate.weight"] = t
        elif lm and lm.group(2) in _LAYER_MAP and not lm.group(2).startswith("feed_forward."):
            out[f"model.layers.{lm.group(1)}.{_LAYER_MAP[lm.group(2)]}"] = t
        else:
            raise KeyError(f"parameter {name!r} has no Hugging Face Mixtral counterpart")
    return {k: v.detach().contiguous() for k, v in out.items()}


def write_moe_safetensors(out_dir: str | os.PathLike, state: dict[str, torch.Tensor], cfg) -> Path:
    """``OUT_DIR/model.safetensors`` (Mixtral names) + ``config.json``; returns the folder."""
    from safetensors.torch import save_file

    tensors = moe_to_hf(state, cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(moe_hf_config(cfg), indent=2) + "\n")
    return out
