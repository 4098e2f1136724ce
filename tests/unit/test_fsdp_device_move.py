"""A module built on the CPU and sharded over an accelerator mesh (issue 21 item 1), without a GPU.

FSDP2 moves the managed parameters and the buffers to the mesh's device before sharding
(``_fsdp_init.py: _move_states_to_device``) and moves the root's tensor inputs to it
(``_fsdp_state.py: _root_pre_forward``). raggedfsdp used to raise ``ValueError: parameters are on
['cpu'] but the mesh is on 'cuda'``. Here the device choice runs against a mocked CUDA mesh, and the
move itself against the meta device standing in for the accelerator.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from raggedfsdp.fsdp import _init, _state
from raggedfsdp.fsdp._init import (
    _device_of,
    _managed_params,
    _mesh_device,
    _move_states_to_device,
    _states_to_move,
)

CUDA_MESH = SimpleNamespace(device_type="cuda")
CPU_MESH = SimpleNamespace(device_type="cpu")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)  # buffers: running_mean / running_var / num_batches_tracked
        self.inner = nn.Linear(4, 4)
        self.register_buffer("table", torch.arange(3.0), persistent=False)


def test_cuda_mesh_device_is_the_current_cuda_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert _mesh_device(CUDA_MESH) == torch.device("cuda", 3)
    assert _mesh_device(CPU_MESH) == torch.device("cpu")


def test_cpu_params_on_a_cuda_mesh_are_moved_not_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    net = Net()
    net.inner._raggedfsdp_state = object()  # a nested unit: its states are its own fully_shard's business
    params = _managed_params([net], set())
    target, move_p, move_b = _states_to_move([net], params, CUDA_MESH)
    assert target == torch.device("cuda", 0)
    assert {id(p) for p in move_p} == {
        id(p) for p in (net.a.weight, net.a.bias, net.norm.weight, net.norm.bias)
    }
    assert sorted(n for _, n in move_b) == ["num_batches_tracked", "running_mean", "running_var", "table"]
    # CPU offload: the parameters stay on the CPU (the sharded master lives there); buffers still move
    target, move_p, move_b = _states_to_move([net], params, CUDA_MESH, offload=True)
    assert target is not None and move_p == [] and len(move_b) == 4
    assert _states_to_move([net], params, CPU_MESH) == (None, [], [])
    # without the move the device check refuses the module (what used to happen inside fully_shard)
    with pytest.raises(ValueError, match="mesh is on 'cuda'"):
        _device_of(params, CUDA_MESH)


def test_move_moves_params_grads_and_buffers(monkeypatch):
    # meta stands in for cuda (CPU -> meta cannot keep the Parameter object; CPU -> CUDA does, via .data)
    monkeypatch.setattr(_init, "_mesh_device", lambda mesh: torch.device("meta"))
    net = Net()
    net.a.weight.grad = torch.ones_like(net.a.weight)
    params = _managed_params([net], set())
    _move_states_to_device([net], params, CUDA_MESH)
    assert [p for p, _, _ in params] == list(net.parameters())  # the list fully_shard shards is updated
    assert net.a.weight.grad.device.type == "meta" and net.a.weight.requires_grad
    assert all(p.device.type == "meta" for p in net.parameters())
    assert all(b.device.type == "meta" for b in net.buffers())
    assert _device_of(_managed_params([net], set()), CUDA_MESH) == torch.device("meta")  # all-meta unit


def test_root_inputs_move_to_the_compute_device():
    x, ids = torch.randn(2, 4), torch.tensor([1, 2])
    args, kwargs = _state._inputs_to_device((x, 3), {"ids": ids, "n": None}, torch.device("meta"))
    assert args[0].device.type == "meta" and args[1] == 3
    assert kwargs["ids"].device.type == "meta" and kwargs["ids"].dtype == torch.int64 and kwargs["n"] is None
    args, kwargs = _state._inputs_to_device((x,), {}, torch.device("cpu"))
    assert args[0] is x
