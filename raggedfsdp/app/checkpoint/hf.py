"""Hugging Face in and out: DCP training checkpoints <-> safetensors folders for the LLaMA model.

``raggedfsdp convert CKPT --to safetensors OUT_DIR`` writes ``OUT_DIR/model.safetensors`` with
Hugging Face parameter names and a ``config.json`` (``LlamaForCausalLM``), so that
``transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)`` gives the same logits as our model.
``--to torch OUT.pt`` writes a plain ``torch.save`` state dict with our names. No process group is
needed: the DCP checkpoint is read in one process (``dcp.load(..., no_dist=True)``), model keys
only (the optimizer state is never read).

The other way, :func:`load_hf_weights` loads a safetensors folder into a model that may already be
sharded by ``fully_shard`` (``--model.init_from PATH``): the state dict is renamed to HF names and
loaded with DCP's ``HuggingFaceStorageReader``, which reads each rank's own pieces by slice
(``safe_open(...).get_slice``), so no rank ever holds a full copy of a sharded parameter.

Name map (ours -> HF; our RoPE uses HF's "rotate half" layout, so no q/k permutation is needed)::

    tok_embeddings.weight                 model.embed_tokens.weight
    layers.N.attention.w{q,k,v,o}.weight  model.layers.N.self_attn.{q,k,v,o}_proj.weight
    layers.N.feed_forward.w1/w3/w2        model.layers.N.mlp.gate_proj/up_proj/down_proj
    layers.N.attention_norm / ffn_norm    model.layers.N.input_layernorm / post_attention_layernorm
    norm.weight, output.weight            model.norm.weight, lm_head.weight (absent when tied)
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "find_run_config",
    "hf_config",
    "hf_to_ours",
    "llama_config_from_hf",
    "load_hf_weights",
    "ours_to_hf",
    "read_dcp_model",
    "write_safetensors",
]

_LAYER_MAP = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_MAP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")


def ours_to_hf(name: str) -> str:
    """HF name of our LLaMA parameter ``name``; ``KeyError`` for a name without a counterpart."""
    if name in _TOP_MAP:
        return _TOP_MAP[name]
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _LAYER_MAP:
        return f"model.layers.{m.group(1)}.{_LAYER_MAP[m.group(2)]}"
    raise KeyError(f"parameter {name!r} has no Hugging Face LLaMA counterpart")


def hf_to_ours(name: str) -> str:
    inv_top = {v: k for k, v in _TOP_MAP.items()}
    if name in inv_top:
        return inv_top[name]
    m = re.match(r"^model\.layers\.(\d+)\.(.+)$", name)
    inv = {v: k for k, v in _LAYER_MAP.items()}
    if m and m.group(2) in inv:
        return f"layers.{m.group(1)}.{inv[m.group(2)]}"
    raise KeyError(f"Hugging Face parameter {name!r} has no counterpart in raggedfsdp's LLaMA model")


def hf_config(cfg) -> dict[str, Any]:
    """``config.json`` of ``LlamaForCausalLM`` for our ``LlamaConfig`` (transformers 4.45+ and 5.x keys)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.hidden_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def llama_config_from_hf(hf: dict[str, Any]):
    """Our ``LlamaConfig`` from a HF LLaMA ``config.json`` dict; ``ValueError`` for what we cannot express."""
    from raggedfsdp.app.models import LlamaConfig

    if hf.get("model_type", "llama") != "llama":
        raise ValueError(f"config.json has model_type={hf.get('model_type')!r}; only 'llama' is supported")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ValueError(f"config.json sets {key}=true; raggedfsdp's LLaMA has no biases")
    d, nh = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    if int(hf.get("head_dim") or d // nh) != d // nh:
        raise ValueError(
            f"config.json head_dim={hf['head_dim']} != hidden_size / num_attention_heads = {d // nh}"
        )
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling:
        raise ValueError(f"config.json uses RoPE scaling {scaling!r}; raggedfsdp's LLaMA has plain RoPE only")
    return LlamaConfig(
        dim=d,
        n_layers=int(hf["num_hidden_layers"]),
        n_heads=nh,
        n_kv_heads=int(hf.get("num_key_value_heads") or nh),
        vocab_size=int(hf["vocab_size"]),
        ffn_dim=int(hf["intermediate_size"]),
        max_seq_len=int(hf.get("max_position_embeddings", 2048)),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def find_run_config(ckpt: Path) -> Path | None:
    """The run's ``config.json`` (written by ``raggedfsdp train``) above a checkpoint folder."""
    for parent in [ckpt, *ckpt.parents][:4]:
        p = parent / "config.json"
        if p.is_file():
            try:
                if "resolved" in json.loads(p.read_text()):
                    return p
            except ValueError:
                continue
    return None


def resolve_step_dir(path: str | os.PathLike) -> Path:
    """A DCP folder (has ``.metadata``), or a folder of ``step-N`` folders (the newest). ``ValueError``."""
    p = Path(path)
    if (p / ".metadata").is_file():
        return p
    if p.is_dir():
        steps = sorted(
            (int(m.group(1)), c)
            for c in p.iterdir()
            if (m := re.match(r"^step-(\d+)$", c.name)) and c.is_dir()
        )
        if steps:
            return steps[-1][1]
        raise ValueError(
            f"{str(p)!r} is neither a DCP checkpoint (no .metadata) nor a folder of step-N checkpoints"
        )
    raise ValueError(f"checkpoint {str(p)!r} does not exist")


def read_dcp_model(step_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Full (unsharded) model tensors of a DCP training checkpoint, in one process, our names.

    Reads only the ``model.*`` entries (shapes and dtypes from the checkpoint's metadata).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(str(step_dir)).read_metadata()
    template = {
        key.removeprefix("model."): torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in meta.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata)
    }
    if not template:
        raise ValueError(f"{str(step_dir)!r} holds no model.* tensors: not a raggedfsdp training checkpoint")
    sd = {"model": template}
    import warnings

    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.load(sd, checkpoint_id=str(step_dir), no_dist=True)
    return sd["model"]


def write_safetensors(out_dir: str | os.PathLike, state: dict[str, torch.Tensor], cfg) -> Path:
    """``OUT_DIR/model.safetensors`` (HF names) + ``config.json``; returns the folder."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in state.items():
        if name == "output.weight" and cfg.tie_embeddings:
            continue
        tensors[ours_to_hf(name)] = t.detach().contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    umask = os.umask(0)  # safetensors writes 0600; follow the umask like every other file we write
    os.umask(umask)
    os.chmod(out / "model.safetensors", 0o666 & ~umask)
    (out / "config.json").write_text(json.dumps(hf_config(cfg), indent=2) + "\n")
    return out


def load_hf_weights(model: torch.nn.Module, path: str | os.PathLike) -> None:
    """Load a HF safetensors folder into our LLaMA ``model`` (plain or sharded by ``fully_shard``).

    Collective when ``model`` is sharded (every rank calls it; each reads its own pieces only).

    Raises:
        ValueError: a folder without ``*.safetensors``, or tensors missing / of another shape.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    p = Path(path)
    if not p.is_dir() or not any(p.glob("*.safetensors")):
        raise ValueError(f"--model.init_from {str(p)!r}: not a folder with *.safetensors files")
    reader = HuggingFaceStorageReader(str(p))
    available = reader.read_metadata().state_dict_metadata
    sd = get_model_state_dict(model, options=StateDictOptions(strict=True))
    tied = getattr(getattr(model, "cfg", None), "tie_embeddings", False)
    hf_sd = {}
    for name, t in sd.items():
        if name == "output.weight" and tied:
            continue
        hf = ours_to_hf(name)
        if hf not in available:
            raise ValueError(f"--model.init_from {str(p)!r}: tensor {hf!r} (our {name!r}) is missing")
        if tuple(available[hf].size) != tuple(t.shape):
            raise ValueError(
                f"--model.init_from {str(p)!r}: {hf!r} has shape {tuple(available[hf].size)}, the model "
                f"expects {tuple(t.shape)} (model config differs from the checkpoint's config.json)"
            )
        hf_sd[hf] = t
    dcp.load(hf_sd, storage_reader=reader, no_dist=not dist.is_initialized())
    set_model_state_dict(model, {hf_to_ours(k): v for k, v in hf_sd.items()})
