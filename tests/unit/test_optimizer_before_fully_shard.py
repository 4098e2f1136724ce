"""An optimizer built before ``fully_shard`` (issue 41 item 7): its parameters are the tensors that
``fully_shard`` replaced with sharded DTensors, which never get a gradient, so its steps trained
nothing, without a word (0 of 4 parameters changed; torch's ``fully_shard`` is the same). Now its first
``step()`` raises a ``ValueError`` naming the optimizer, a replaced parameter and the fix; an optimizer
built after ``fully_shard`` trains as before. One gloo rank in this process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _step(model, opt):
    model(torch.randn(3, 4)).square().sum().backward()
    opt.step()
    opt.zero_grad()


def test_optimizer_built_before_fully_shard_is_refused_at_its_first_step(one_rank):
    from raggedfsdp import fully_shard

    model = _model()
    early = torch.optim.AdamW(model.parameters(), lr=0.1)
    fully_shard(model[0])
    fully_shard(model)
    with pytest.raises(ValueError) as e:
        _step(model, early)
    assert str(e.value) == (
        "AdamW.step(): 4 of its parameters were replaced by fully_shard (e.g. 'weight' of Linear) after the "
        "optimizer was built; they get no gradients, so the step would change nothing: build the optimizer "
        "after fully_shard, from model.parameters() (the sharded DTensors)"
    )

    # built after fully_shard: trains (every parameter changes), and stays checked once
    before = [p.full_tensor().clone() for p in model.parameters()]
    late = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(2):
        _step(model, late)
    assert all(not torch.equal(b, p.full_tensor()) for b, p in zip(before, model.parameters()))

    # a replaced parameter added later is found at the next step
    stale = next(iter(early.param_groups[0]["params"]))
    late.add_param_group({"params": [stale]})
    with pytest.raises(ValueError, match=r"AdamW.step\(\): 1 of its parameters were replaced by fully_shard"):
        _step(model, late)


def test_a_plain_optimizer_of_other_tensors_is_untouched(one_rank):
    from raggedfsdp import fully_shard

    fully_shard(_model())  # the hooks are registered
    w = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=1.0)
    w.grad = torch.ones(3)
    opt.step()
    assert torch.equal(w.detach(), torch.zeros(3))
