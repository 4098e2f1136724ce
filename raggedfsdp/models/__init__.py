"""Models trained by ``raggedfsdp train`` and the helper that shards them.

Registry: ``MODELS[name] = (config class, model class)``; ``build_model(name, flavor, **overrides)``
returns an un-initialised model (call ``init_weights(seed)`` after ``to_empty`` if built on meta).
"""

from __future__ import annotations

from raggedfsdp.models.llama import LLAMA_FLAVORS, Llama, LlamaConfig
from raggedfsdp.models.moe import MOE_FLAVORS, MoE, MoEConfig
from raggedfsdp.models.parallelize import apply_fsdp, make_mp_policy

MODELS: dict[str, tuple[type, type]] = {"llama": (LlamaConfig, Llama), "moe": (MoEConfig, MoE)}


def aux_loss(model):
    """The auxiliary loss of ``model``'s last forward (0-d, in the graph; e.g. MoE load balancing), or None."""
    return getattr(model, "aux_loss", None)


def build_model_config(name: str, flavor: str, **overrides) -> LlamaConfig:
    """The config of model ``name`` in size ``flavor`` with ``overrides`` applied."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
    cfg_cls, _ = MODELS[name]
    return cfg_cls.flavor(flavor, **overrides)


def build_model(name: str, flavor: str, **overrides) -> Llama:
    """Build (not initialise) model ``name`` in size ``flavor``; honours the current default device."""
    _, model_cls = MODELS[name]
    return model_cls(build_model_config(name, flavor, **overrides))


__all__ = [
    "LLAMA_FLAVORS",
    "MODELS",
    "MOE_FLAVORS",
    "Llama",
    "LlamaConfig",
    "MoE",
    "MoEConfig",
    "apply_fsdp",
    "aux_loss",
    "build_model",
    "build_model_config",
    "make_mp_policy",
]
