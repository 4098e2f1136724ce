"""Shipped configurations: ``raggedfsdp train --config NAME`` (a TOML path works as before).

A preset is the same nested ``{section: {key: value}}`` a TOML file holds, plus, for real-size
models, the planner table (``raggedfsdp.app.sizing.archs.BUILTIN``) that ``raggedfsdp plan`` and
``raggedfsdp estimate-memory --model NAME`` use without allocating anything.
``raggedfsdp train --config list`` prints them. Command-line options override a preset's values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["PRESETS", "Preset", "format_presets", "get_preset"]


@dataclass(frozen=True)
class Preset:
    description: str
    config: dict[str, dict[str, Any]] = field(default_factory=dict)
    arch: str | None = None
    """Planner table of the real-size model (``plan`` / ``estimate-memory``), if any."""
    needs_model: str | None = None
    """The model family the preset trains (it must be registered in ``raggedfsdp.app.models.MODELS``)."""


PRESETS: dict[str, Preset] = {
    "debug": Preset(
        "seconds-long smoke run: llama debug (41k params), 20 steps",
        {
            "model": {"name": "llama", "flavor": "debug"},
            "training": {"steps": 20, "global_batch_size": 4, "seq_len": 64},
            "metrics": {"log_every": 5, "eval_batches": 1},
        },
    ),
    "llama-tiny": Preset(
        "the default: llama tiny (~0.8M params) on the stdlib sources, 600 steps, minutes on 2 CPU ranks",
        {"model": {"name": "llama", "flavor": "tiny"}},
    ),
    "hybrid-tiny": Preset(
        "hybrid tiny: 2 super-blocks of 3 Gated DeltaNet + 1 full-attention layer (~1.7M params), "
        "one FSDP unit per super-block",
        {
            "model": {"name": "hybrid", "flavor": "tiny"},
            "fsdp": {"unit": "superblock"},
            "training": {"steps": 300},
        },
        needs_model="hybrid",
    ),
    "moe-tiny": Preset(
        "MoE tiny: routed SwiGLU experts per block",
        {"model": {"name": "moe", "flavor": "moe-tiny"}, "training": {"steps": 300}},
        needs_model="moe",
    ),
    "llama3-8b": Preset(
        "LLaMA-3 8B shapes (GQA 8 KV heads, vocab 128,256) for GPU clusters: bf16, meta init, "
        "needs a tokenized --data .bin with that vocabulary",
        {
            "model": {"name": "llama", "flavor": "llama3-8b", "init_device": "meta"},
            "training": {"seq_len": 8192, "global_batch_size": 256, "steps": 1000},
            "fsdp": {"param_dtype": "bf16", "reduce_dtype": "fp32"},
            "job": {"device": "cuda"},
        },
        arch="llama3-8b",
    ),
    "qwen3-moe-30b": Preset(
        "Qwen3-30B-A3B shapes (48 layers, 128 experts, top-8): plan / estimate-memory only",
        arch="qwen3-moe-30b",
    ),
    "hybrid-27b": Preset(
        "Qwen3.x-27B-style hybrid (16 super-blocks of 3 Gated DeltaNet + 1 gated attention): "
        "plan / estimate-memory only",
        arch="hybrid-27b",
    ),
}


def get_preset(name: str) -> Preset:
    """The preset ``name``; ``ValueError`` listing the choices (and naming a missing model family)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)} or give a TOML file path")
    return PRESETS[name]


def trainable_config(name: str) -> dict[str, dict[str, Any]]:
    """The training config of preset ``name``; ``ValueError`` if it is a planning-only preset or its
    model family is not installed."""
    p = get_preset(name)
    if not p.config:
        raise ValueError(
            f"preset {name!r} describes a real-size model for planning only: use "
            f"`raggedfsdp estimate-memory --model {name}` or `raggedfsdp plan --model {p.arch}`"
        )
    if p.needs_model:
        from raggedfsdp.app.models import MODELS

        if p.needs_model not in MODELS:
            raise ValueError(
                f"preset {name!r} needs model family {p.needs_model!r}, not in this installation"
            )
    return {sec: dict(vals) for sec, vals in p.config.items()}


def format_presets() -> str:
    lines = ["presets (raggedfsdp train --config NAME; plan / estimate-memory --model NAME):"]
    for name, p in PRESETS.items():
        use = "train" if p.config else "plan"
        if p.config and p.arch:
            use = "train + plan"
        lines.append(f"  {name:<14} [{use}] {p.description}")
    return "\n".join(lines)
