"""Misuse errors as torch's own ``fully_shard`` words them (torch's
test/distributed/_composable/fsdp/test_fully_shard_state.py matches these regexes; benchmarks/torch_suite.md):
for each misuse, run it with torch's ``fully_shard`` and with ours on the same module and check that ours
raises an exception of torch's type whose message contains torch's sentence (ours then adds the module
and the fix). Fake process group, rank 0 of 2 (no collective runs).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch.distributed as dist
from torch import nn


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield 2
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


# torch's first sentence (its message then names the module, which prints differently)
_SENTENCE = re.compile(r"^.*?(?:forward|once\.|serialization\.)")


@pytest.mark.parametrize(
    "misuse", [_reapply, _container, _dict_container, _deepcopy], ids=lambda f: f.__name__
)
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
