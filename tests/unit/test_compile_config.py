"""``--compile true`` compiles each block in place before fully_shard (models.apply_compile), locally."""

from __future__ import annotations

import pytest
import torch

from raggedfsdp.app.models import apply_compile, build_model
from raggedfsdp.app.train.config import TrainConfig, add_config_args, load_config, overrides_from_args


def parse_config(argv: list[str]) -> TrainConfig:
    import argparse

    parser = argparse.ArgumentParser()
    add_config_args(parser)
    args = parser.parse_args(argv)
    return load_config(args.config, overrides_from_args(args))


def test_compile_flag_sets_training_compile():
    assert TrainConfig().training.compile is False
    assert parse_config(["--compile", "true"]).training.compile is True
    assert parse_config(["--training.compile", "false"]).training.compile is False


def test_apply_compile_compiles_every_block_in_place_and_keeps_names():
    model = build_model("llama", "debug")
    model.init_weights(0)
    names = [n for n, _ in model.named_parameters()]
    apply_compile(model, backend="eager")
    assert [n for n, _ in model.named_parameters()] == names  # compiled in place, not wrapped
    assert all(b._compiled_call_impl is not None for b in model.layers)
    assert model._compiled_call_impl is None  # only the blocks
    tok = torch.randint(0, 256, (2, 9))
    torch._dynamo.reset()
    out = model(tok)
    ref = build_model("llama", "debug")
    ref.load_state_dict(model.state_dict())
    torch.testing.assert_close(out, ref(tok))


def test_apply_compile_needs_layers():
    with pytest.raises(ValueError, match="model.layers"):
        apply_compile(torch.nn.Linear(2, 2))
