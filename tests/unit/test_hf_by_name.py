"""--model.name hf:<Architecture>: a transformers model built from a config, behind our interface."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")


def test_hf_model_by_name(tmp_path):
    import json

    from raggedfsdp.app.models import build_model, build_model_config, fsdp_unit_modules
    from raggedfsdp.app.train.config import load_config

    m = build_model("hf:LlamaForCausalLM", "tiny")
    m.init_weights(3)
    a = {n: p.clone() for n, p in m.named_parameters()}
    m.init_weights(3)
    assert all(torch.equal(a[n], p) for n, p in m.named_parameters())  # seeded init
    assert [n for n, _ in fsdp_unit_modules(m, "layer")] == ["layers.0", "layers.1", "root"]
    logits = m(torch.randint(0, 256, (2, 9)))
    assert logits.shape == (2, 9, 256)
    assert m.cfg.num_params() == sum(p.numel() for p in m.parameters())
    # a config.json path, with a vocabulary override
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "vocab_size": 300,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
            }
        )
    )
    cfg = build_model_config("hf:LlamaForCausalLM", str(tmp_path), vocab_size=512)
    assert cfg.vocab_size == 512
    with pytest.raises(ValueError, match="unknown transformers architecture 'NopeForCausalLM'"):
        build_model_config("hf:NopeForCausalLM", "tiny")
    with pytest.raises(ValueError, match="accepts only"):
        build_model_config("hf:LlamaForCausalLM", "tiny", dim=8)
    with pytest.raises(ValueError, match="init_device cpu"):
        load_config(
            None, {"model.name": "hf:LlamaForCausalLM", "model.flavor": "tiny", "model.init_device": "meta"}
        )
