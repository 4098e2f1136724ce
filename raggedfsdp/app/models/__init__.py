"""Models trained by ``raggedfsdp train`` and the helper that shards them.

Registry: ``MODELS[name] = (config class, model class)``; ``build_model(name, flavor, **overrides)``
returns an un-initialised model (call ``init_weights(seed)`` after ``to_empty`` if built on meta).
"""

from __future__ import annotations

from raggedfsdp.app.models.hf import HF_PREFIX, HFCausalLM, HFModelConfig
from raggedfsdp.app.models.hybrid import HYBRID_FLAVORS, Hybrid, HybridConfig
from raggedfsdp.app.models.llama import LLAMA_FLAVORS, Llama, LlamaConfig
from raggedfsdp.app.models.moe import MOE_FLAVORS, MoE, MoEConfig
from raggedfsdp.app.models.parallelize import (
    FSDP_UNITS,
    apply_compile,
    apply_ep,
    apply_fsdp,
    apply_tp,
    fsdp_unit_modules,
    make_mp_policy,
    parse_dtype,
)

MODELS: dict[str, tuple[type, type]] = {
    "llama": (LlamaConfig, Llama),
    "moe": (MoEConfig, MoE),
    "hybrid": (HybridConfig, Hybrid),
}


def aux_loss(model):
    """The auxiliary loss of ``model``'s last forward (0-d, in the graph; e.g. MoE load balancing), or
    None."""
    return getattr(model, "aux_loss", None)


def build_model_config(name: str, flavor: str, **overrides) -> LlamaConfig | HybridConfig:
    """The config of model ``name`` in size ``flavor`` with ``overrides`` applied."""
    if name.startswith(HF_PREFIX):  # a transformers architecture by name (models/hf.py)
        return HFModelConfig.flavor(name[len(HF_PREFIX) :], flavor, **overrides)
    if name not in MODELS:
        raise ValueError(
            f"unknown model {name!r}; choose one of {sorted(MODELS)} or hf:<transformers architecture>"
        )
    cfg_cls, _ = MODELS[name]
    return cfg_cls.flavor(flavor, **overrides)


def build_model(name: str, flavor: str, **overrides) -> Llama | Hybrid:
    """Build (not initialise) model ``name`` in size ``flavor``; honours the current default device."""
    cfg = build_model_config(name, flavor, **overrides)
    if isinstance(cfg, HFModelConfig):
        return HFCausalLM(cfg)
    return MODELS[name][1](cfg)


__all__ = [
    "FSDP_UNITS",
    "HYBRID_FLAVORS",
    "LLAMA_FLAVORS",
    "MODELS",
    "MOE_FLAVORS",
    "Hybrid",
    "HybridConfig",
    "Llama",
    "LlamaConfig",
    "MoE",
    "MoEConfig",
    "apply_compile",
    "apply_ep",
    "apply_fsdp",
    "apply_tp",
    "aux_loss",
    "build_model",
    "build_model_config",
    "fsdp_unit_modules",
    "make_mp_policy",
    "parse_dtype",
]
