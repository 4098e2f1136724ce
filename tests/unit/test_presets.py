"""Shipped presets: --config NAME loads like a TOML file, overrides still win, the real-size ones
describe the same model as the planner tables, and --config list prints them."""

from __future__ import annotations

import argparse

import pytest

from raggedfsdp.app.train.config import add_config_args, load_config
from raggedfsdp.app.train.presets import PRESETS


def test_trainable_presets_load_and_override():
    cfg = load_config("hybrid-tiny", {"training.steps": "7"})
    assert (cfg.model.name, cfg.model.flavor, cfg.fsdp.unit, cfg.training.steps) == (
        "hybrid",
        "tiny",
        "superblock",
        7,
    )
    assert load_config("debug").model.flavor == "debug"
    default = load_config(None)
    tiny = load_config("llama-tiny")
    assert tiny.to_dict() == default.to_dict()  # llama-tiny is the default
    with pytest.raises(ValueError, match="not a preset"):
        load_config("no-such-preset")
    with pytest.raises(ValueError, match="planning only"):
        load_config("hybrid-27b")


def test_real_size_presets_match_planner_tables():
    from raggedfsdp.app.models import build_model_config
    from raggedfsdp.app.sizing.archs import model_units

    p = PRESETS["llama3-8b"]
    m = p.config["model"]
    ours = build_model_config(m["name"], m["flavor"]).num_params()
    assert ours == sum(u.numel for u in model_units(p.arch)) == 8_030_261_248
    for name in ("qwen3-moe-30b", "hybrid-27b"):
        assert sum(u.numel for u in model_units(PRESETS[name].arch)) > 2e10


def test_config_list(capsys):
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--config", "list"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name in PRESETS:
        assert name in out


def test_dense_layer_types_is_not_hybrid():
    """transformers 5 writes layer_types for dense Qwen3 too: only linear_attention entries make a hybrid."""
    from raggedfsdp.app.sizing.archs import layers_per_unit

    with pytest.raises(ValueError, match="needs a hybrid model"):
        layers_per_unit({"model_type": "qwen3", "layer_types": ["full_attention"] * 4}, "superblock")
    hybrid = {
        "model_type": "x",
        "layer_types": ["linear_attention", "full_attention"],
        "full_attention_interval": 2,
    }
    assert layers_per_unit(hybrid, "superblock") == 2
