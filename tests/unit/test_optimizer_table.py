"""The one optimizer table (``raggedfsdp/app/train/optimizer_table.py``): every reader lists every
name, and the bytes per parameter the estimator counts are the optimizers' real state."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from raggedfsdp.app.sizing.memory_estimate import RECIPES
from raggedfsdp.app.train.config import load_config
from raggedfsdp.app.train.optimizer_table import OPTIMIZER_TABLE
from raggedfsdp.app.train.optimizers import build_optimizer, shard_placement_fn_for


@pytest.mark.parametrize("name", list(OPTIMIZER_TABLE))
def test_state_bytes_are_what_the_optimizer_keeps(name):
    """One step on a 256x256 matrix (full 32x32 tiles and 128x128 Shampoo blocks): the tensors in
    ``optimizer.state`` (besides scalars) hold ``state_bytes`` per parameter, within 1%."""
    torch.manual_seed(0)
    m = nn.Linear(256, 256, bias=False)
    o = SimpleNamespace(name=name, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    opt = build_optimizer(o, m)
    m(torch.randn(4, 256)).sum().backward()
    opt.step()
    held = sum(
        t.numel() * t.element_size()
        for st in opt.state.values()
        for t in st.values()
        if torch.is_tensor(t) and t.numel() > 1
    )
    assert held / m.weight.numel() == pytest.approx(OPTIMIZER_TABLE[name].state_bytes, rel=0.01)
    # the estimator's recipe of the same name: bf16 params + grads + fp32 master + that state
    recipe = RECIPES["mixed" if name == "adamw" else name]
    assert recipe.total == pytest.approx(2 + 2 + 4 + held / m.weight.numel(), rel=0.01)


@pytest.mark.parametrize("name", list(OPTIMIZER_TABLE))
def test_every_reader_knows_every_name(name, capsys):
    cfg = load_config(None, {"optimizer.name": name})
    assert cfg.optimizer.name == name  # the config's check accepts it
    layout = OPTIMIZER_TABLE[name].layout
    spf = shard_placement_fn_for(name)
    assert (spf is None) == (layout is None)
    from raggedfsdp.app.cli import main

    with pytest.raises(SystemExit):
        main(["estimate-memory", "--help"])
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert name in out.split("--recipe", 1)[1] and "--optim" in out


def test_an_unknown_name_is_refused_with_the_list():
    with pytest.raises(ValueError, match="shampoo"):
        load_config(None, {"optimizer.name": "lion"})
