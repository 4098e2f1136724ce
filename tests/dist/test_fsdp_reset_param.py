"""A parameter registered over a sharded one between ``fully_shard`` and the first forward (torch's
test_fully_shard_init.py ``test_reset_sharded_param_in_lazy_init``; issue 39 item 8): torch's FSDP2 adopts
it at lazy init (``FSDPParam.reset_sharded_param``); raggedfsdp did not (it raised "still on the meta
device").
Same script with torch's ``fully_shard`` and ours at ws 2 and 3, against a single-process model:

* meta-device init, ``to_empty`` of the inner units only, then the root's ``weight_norm`` replaced by
  ``nn.Parameter(norm(layer1.weight, dim=1) + norm(layer2.weight, dim=1))`` (a DTensor computed from the
  sharded params);
* CPU init, the root's param replaced by a plain full tensor (torch 2.13 fails there: its
  ``reset_sharded_param`` reads ``new_param._local_tensor``; raggedfsdp reshards the tensor);

then forward + backward: loss and full gradients equal the single-process model's (and torch's).
"""

from __future__ import annotations

import pytest
import torch
from _dist import run_distributed
from torch import nn


class MyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = nn.Linear(3, 3, bias=False)
        self.layer2 = nn.Linear(3, 3, bias=False)
        self.weight_norm = nn.Parameter(torch.empty(3))

    def forward(self, inp):
        return self.layer2(self.layer1(inp)).sum() + (self.weight_norm * self.weight_norm).sum()


def _run(fs, meta: bool):
    from torch.distributed.tensor import DTensor

    if meta:
        with torch.device("meta"):
            model = MyModel()
    else:
        model = MyModel()
    fs(model.layer1)
    fs(model.layer2)
    fs(model)
    if meta:
        model.layer1.to_empty(device="cpu")
        model.layer2.to_empty(device="cpu")
    with torch.no_grad():
        model.layer1.weight.fill_(0.3)
        model.layer2.weight.fill_(-0.2)
        if meta:  # torch's test: a DTensor computed from the sharded params
            w = torch.linalg.norm(model.layer1.weight, dim=1) + torch.linalg.norm(model.layer2.weight, dim=1)
        else:  # a plain full tensor
            w = torch.tensor([0.5, -1.0, 2.0])
    model.weight_norm = nn.Parameter(w)
    loss = model(torch.arange(9.0).view(3, 3))
    loss.backward()
    full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
    return loss.detach(), {n: (full(p).detach(), full(p.grad)) for n, p in model.named_parameters()}


def _reference(meta: bool):
    model = MyModel()
    with torch.no_grad():
        model.layer1.weight.fill_(0.3)
        model.layer2.weight.fill_(-0.2)
        w = (
            torch.linalg.norm(model.layer1.weight, dim=1) + torch.linalg.norm(model.layer2.weight, dim=1)
            if meta
            else torch.tensor([0.5, -1.0, 2.0])
        )
    model.weight_norm = nn.Parameter(w)
    loss = model(torch.arange(9.0).view(3, 3))
    loss.backward()
    return loss.detach(), {n: (p.detach(), p.grad) for n, p in model.named_parameters()}


def _case(rank, ws):
    from torch.distributed.fsdp import fully_shard as torch_fs

    import raggedfsdp

    for meta in (True, False):
        ref = _reference(meta)
        if meta:
            runs = [_run(torch_fs, meta), _run(raggedfsdp.fully_shard, meta)]
        else:  # torch 2.13 reads new_param._local_tensor: a plain tensor fails there; ours reshards it
            with pytest.raises(AttributeError, match="_local_tensor"):
                _run(torch_fs, meta)
            runs = [_run(raggedfsdp.fully_shard, meta)]
        for got in runs:
            torch.testing.assert_close(got[0], ref[0])
            assert got[1].keys() == ref[1].keys()
            for n in ref[1]:
                torch.testing.assert_close(
                    got[1][n], ref[1][n], msg=lambda m, n=n, meta=meta: f"{meta} {n}: {m}"
                )


@pytest.mark.parametrize("ws", [2, 3])
def test_param_registered_before_first_forward(ws):
    run_distributed(_case, ws)
