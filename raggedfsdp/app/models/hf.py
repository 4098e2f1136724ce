"""Hugging Face ``transformers`` causal LMs trained by name: ``--model.name hf:<Architecture>``.

``--model.name hf:LlamaForCausalLM --model.flavor path/to/config.json`` (or a folder with one, or
``tiny`` for a small built-in config of that architecture) builds the model from its config alone
(random init, no weights downloaded) and wraps it so the training job sees our interface:
``forward(tokens) -> logits``, ``layers`` (the decoder layers, one FSDP unit each; the root unit owns
the embedding, final norm and head), ``init_weights(seed)`` and a config with ``num_params()``.
Needs ``transformers`` (``pip install 'raggedfsdp[hf]'``). Weights from a safetensors folder:
``--model.init_from`` (LLaMA names, see ``raggedfsdp.app.checkpoint.hf``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["HF_PREFIX", "HFCausalLM", "HFModelConfig"]

HF_PREFIX = "hf:"

# Small configs for smoke runs (``--model.flavor tiny``), byte vocabulary.
_TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


@dataclass(frozen=True)
class HFModelConfig:
    """An architecture name and its ``config.json`` dict."""

    architecture: str
    hf: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def flavor(cls, architecture: str, flavor: str, **overrides) -> HFModelConfig:
        if flavor == "tiny":
            hf = dict(_TINY)
        else:
            p = Path(flavor).expanduser()
            p = p / "config.json" if p.is_dir() else p
            try:
                hf = json.loads(p.read_text())
            except (OSError, ValueError) as e:
                raise ValueError(
                    f"--model.flavor {flavor!r} for hf:{architecture}: give 'tiny' or a readable HF "
                    f"config.json ({e})"
                ) from None
        allowed = {"vocab_size"}
        bad = set(overrides) - allowed
        if bad:
            raise ValueError(
                f"hf:{architecture} accepts only {sorted(allowed)} as model overrides, got {sorted(bad)}; "
                "edit the config.json instead"
            )
        hf.update(overrides)
        cfg = cls(architecture, hf)
        cfg.hf_config()  # unknown architecture / bad config: raise now
        return cfg

    def hf_config(self):
        try:
            import transformers
        except ImportError as e:
            raise ValueError("--model.name hf:...: needs transformers (pip install 'raggedfsdp[hf]')") from e
        model_cls = getattr(transformers, self.architecture, None)
        if model_cls is None or not hasattr(model_cls, "config_class"):
            raise ValueError(
                f"unknown transformers architecture {self.architecture!r} (e.g. LlamaForCausalLM)"
            )
        return model_cls.config_class(**{k: v for k, v in self.hf.items() if k != "architectures"})

    @property
    def max_seq_len(self) -> int:
        return int(self.hf.get("max_position_embeddings", 2048))

    @property
    def vocab_size(self) -> int:
        return int(self.hf["vocab_size"])

    @property
    def tie_embeddings(self) -> bool:
        return bool(self.hf.get("tie_word_embeddings", False))

    def num_params(self) -> int:
        with torch.device("meta"):
            m = HFCausalLM(self)
        return sum(p.numel() for p in m.parameters())

    def flops_per_token(self, seq_len: int) -> float:
        """``6 N`` (N without the input embedding unless tied) + ``12 L D T`` (PaLM)."""
        n = self.num_params()
        if not self.tie_embeddings:
            n -= self.vocab_size * int(self.hf["hidden_size"])
        layers, dim = int(self.hf["num_hidden_layers"]), int(self.hf["hidden_size"])
        return 6.0 * n + 12.0 * layers * dim * seq_len

    def to_dict(self) -> dict:
        return {"architecture": self.architecture, **self.hf}


class HFCausalLM(nn.Module):
    """A ``transformers`` causal LM behind our model interface (see the module docstring)."""

    def __init__(self, cfg: HFModelConfig) -> None:
        super().__init__()
        import transformers

        self.cfg = cfg
        self.hf = getattr(transformers, cfg.architecture)(cfg.hf_config())

    @property
    def layers(self) -> nn.ModuleList:
        inner = getattr(self.hf, "model", None) or getattr(self.hf, "transformer", None)
        layers = getattr(inner, "layers", None) or getattr(inner, "h", None)
        if not isinstance(layers, nn.ModuleList):
            raise ValueError(
                f"{self.cfg.architecture}: no decoder-layer ModuleList found (model.layers / transformer.h)"
            )
        return layers

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=tokens, use_cache=False).logits

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Re-initialise with the architecture's own ``_init_weights``, seeded (plain tensors only:
        use ``--model.init_device cpu`` for hf models)."""
        torch.manual_seed(seed)
        self.hf.apply(self.hf._init_weights)
        if self.cfg.tie_embeddings and hasattr(self.hf, "tie_weights"):
            self.hf.tie_weights()
