"""``raggedfsdp convert --to safetensors`` of a MoE checkpoint: transformers' ``MixtralForCausalLM`` loads it
and gives our logits (fused and separate experts); configs Mixtral cannot express fail naming the field."""

from __future__ import annotations

import pytest
import torch

from raggedfsdp.app.models import build_model


@pytest.mark.parametrize("experts", ["separate", "fused"])
def test_convert_moe_checkpoint_to_mixtral(tmp_path, experts):
    import torch.distributed.checkpoint as dcp

    from raggedfsdp.app.cli import main

    MixtralForCausalLM = pytest.importorskip("transformers").MixtralForCausalLM

    model = build_model("moe", "debug", experts=experts, n_shared_experts=0)
    model.init_weights(11)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "step-1"), no_dist=True)
    (tmp_path / "config.json").write_text(
        '{"model": {"name": "moe"}, "resolved": {"model": ' + _cfg_json(model.cfg) + "}}"
    )
    # a plain dcp.save has no manifest.json: --no-verify (a raggedfsdp train save is verified)
    argv = ["convert", str(tmp_path / "step-1"), "--to", "safetensors", str(tmp_path / "hf"), "--no-verify"]
    assert main(argv) == 0
    hf = MixtralForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tok = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tok).logits, model(tok), rtol=1e-5, atol=1e-6)


def _cfg_json(cfg) -> str:
    import dataclasses
    import json

    return json.dumps(dataclasses.asdict(cfg))


def test_convert_moe_with_shared_expert_fails_naming_the_field(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    from raggedfsdp.app.cli import main

    model = build_model("moe", "debug")  # one shared expert: not a Mixtral
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "step-1"), no_dist=True)
    rc = main(
        [
            "convert",
            str(tmp_path / "step-1"),
            "--to",
            "safetensors",
            str(tmp_path / "hf"),
            "--model-config",
            "moe:debug",
            "--no-verify",
        ]
    )
    assert rc == 2 and "n_shared_experts=1" in capsys.readouterr().err
