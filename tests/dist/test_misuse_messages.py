"""Misuse errors as torch's own ``fully_shard`` words them (torch's
test/distributed/_composable/fsdp/test_fully_shard_state.py matches these regexes; benchmarks/torch_suite.md):
for each misuse, run it with torch's ``fully_shard`` and with ours on the same module and check that ours
raises an exception of torch's type whose message contains torch's sentence (ours then adds the module
and the fix). Fake process group, rank 0 of 4 (no collective runs).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield 4
    dist.destroy_process_group()


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.b(self.a(x).relu())


def _reapply(fs):
    m = MLP()
    fs(m)
    fs(m)


def _container(fs):
    fs(nn.ModuleList([MLP(), MLP()]))


def _dict_container(fs):
    fs(nn.ModuleDict({"1": MLP(), "2": MLP()}))


def _deepcopy(fs):
    m = MLP()
    fs(m)
    copy.deepcopy(m)


def _mesh_3d(fs):
    from torch.distributed.device_mesh import init_device_mesh

    fs(MLP(), mesh=init_device_mesh("cpu", (4, 1, 1)))


def _mesh_2d_without_names(fs):
    from torch.distributed.device_mesh import init_device_mesh

    fs(MLP(), mesh=init_device_mesh("cpu", (2, 2)))


def _scalar_param(fs):
    m = MLP()
    m.register_parameter("scalar_p", nn.Parameter(torch.tensor(1.0)))
    fs(m)


def _channels_last(fs):
    fs(nn.Conv2d(8, 8, 3).to(memory_format=torch.channels_last))


def _meta_forward(fs):
    with torch.device("meta"):
        m = nn.Sequential(MLP(), MLP())
    fs(m[0])
    fs(m[1])
    fs(m)
    m(torch.randn(4, 8))


# torch's first sentence (its message then names the module, mesh or shapes, which print differently)
_SENTENCE = re.compile(
    r"^.*?(?:forward|once\.|serialization\.|DeviceMesh|specified|equal to 1\.|yet|meta device: \[[^]]*\])",
    re.S,
)
_MISUSES = [_reapply, _container, _dict_container, _deepcopy]
_MISUSES += [_mesh_3d, _mesh_2d_without_names, _scalar_param, _channels_last, _meta_forward]


@pytest.mark.parametrize("misuse", _MISUSES, ids=lambda f: f.__name__)
def test_misuse_raises_torch_type_and_sentence(fake_world, misuse):
    from torch.distributed.fsdp import fully_shard as torch_fs

    import raggedfsdp

    with pytest.raises(Exception) as theirs:
        misuse(torch_fs)
    with pytest.raises(Exception) as ours:
        misuse(raggedfsdp.fully_shard)
    assert isinstance(ours.value, type(theirs.value)), (type(ours.value), type(theirs.value))
    sentence = _SENTENCE.match(str(theirs.value)).group(0)
    assert sentence in str(ours.value), (sentence, str(ours.value))
