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


# ---- misuses whose torch message starts with a parameter name, so the key sentence is searched ---------
# (torch's test_fully_shard_training.py / test_fully_shard_dtensor.py match these; benchmarks/torch_suite.md)


def _tied_in_two_units(fs):
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_embeddings, self.output = nn.Embedding(17, 16), nn.Linear(16, 17, bias=False)
            self.output.weight = self.tok_embeddings.weight

        def forward(self, ids):
            return self.output(self.tok_embeddings(ids))

    m = Tied()
    fs(m.tok_embeddings)
    fs(m.output)  # ours raises here, torch at the first forward
    fs(m)
    m(torch.randint(0, 17, (2, 8)))


_FIRST_MESH: dict = {}


def _spmd(fs, placement, other_mesh: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.tensor import DTensor, Replicate, Shard

    # DTensors built on an equal mesh come back on the first such mesh of the process group (torch's spec
    # caching), so the params go on that first mesh and "another mesh" is a newer equal one
    key = id(dist.distributed_c10d._get_default_group())
    pmesh = _FIRST_MESH.setdefault(key, init_device_mesh("cpu", (4,), mesh_dim_names=("fsdp",)))
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("fsdp",)) if other_mesh else pmesh
    m = nn.Linear(16, 32)
    w = m.weight.data.chunk(4)[0] if isinstance(placement, Shard) else m.weight.data
    m.weight = nn.Parameter(DTensor.from_local(w, pmesh, [placement], run_check=False))
    m.bias = nn.Parameter(DTensor.from_local(m.bias.data, pmesh, [Replicate()], run_check=False))
    fs(m, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="fsdp"))


def _spmd_shard_on_dp_dim(fs):
    from torch.distributed.tensor import Shard

    _spmd(fs, Shard(0), other_mesh=False)


def _spmd_equal_but_other_mesh(fs):
    from torch.distributed.tensor import Replicate

    _spmd(fs, Replicate(), other_mesh=True)


_KEY = re.compile(
    r"is shared with a parameter already managed by another FSDP group\. For shared/tied parameters, use "
    r"fully_shard\(\[module_a, module_b\]\) to place them in the same FSDP group\.|Expected Replicate\(\) on "
    r"DP \w+ dim '\w+' \(index \d+\) but got \S+|Expected param's DTensor mesh to be the same mesh passed "
    r"to fully_shard, but got different mesh objects"
)


_KEYED = [_tied_in_two_units, _spmd_shard_on_dp_dim]


@pytest.mark.parametrize("misuse", _KEYED, ids=lambda f: f.__name__)
def test_misuse_raises_torch_type_and_key_sentence(fake_world, misuse):
    from torch.distributed.fsdp import fully_shard as torch_fs

    import raggedfsdp

    with pytest.raises(Exception) as theirs:
        misuse(torch_fs)
    with pytest.raises(Exception) as ours:
        misuse(raggedfsdp.fully_shard)
    assert isinstance(ours.value, type(theirs.value)), (type(ours.value), type(theirs.value))
    key = _KEY.search(str(theirs.value)).group(0)
    assert key in str(ours.value), (key, str(ours.value))


def test_equal_mesh_object_accepted_where_torch_raises(fake_world):
    """The one deliberate difference: torch compares the param's mesh and ``mesh=`` as objects, ours by
    value (torch then refuses a script that builds an equal mesh again: its DTensors come back on the first
    one). A param on another, unequal mesh raises torch's sentence in both."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.fsdp import fully_shard as torch_fs
    from torch.distributed.tensor import DTensor, Replicate

    import raggedfsdp

    with pytest.raises(ValueError, match="got different mesh objects"):
        _spmd_equal_but_other_mesh(torch_fs)
    _spmd_equal_but_other_mesh(raggedfsdp.fully_shard)  # no error
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("fsdp",))
    other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "fsdp"))
    for fs in (torch_fs, raggedfsdp.fully_shard):
        m = nn.Linear(4, 4, bias=False)
        m.weight = nn.Parameter(DTensor.from_local(m.weight.data, other, [Replicate()] * 2, run_check=False))
        with pytest.raises(ValueError, match="same mesh passed to fully_shard, but got different mesh"):
            fs(m, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="fsdp"))
