"""``fully_shard(module)`` with no ``mesh``: like torch's (``_init_default_fully_shard_mesh``), a 1-D
mesh over the whole world on the process group's device type (issue 24, rough edge 8). Reference:
torch's own ``fully_shard`` on the same module, on a fake 3-rank group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=3)
    yield 3
    dist.destroy_process_group()


def test_no_mesh_builds_torchs_default_mesh(fake_world):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from raggedfsdp import fully_shard

    torch.manual_seed(0)
    ours, theirs = nn.Linear(4, 5), nn.Linear(4, 5)
    fully_shard(ours)
    torch_fully_shard(theirs)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        ma, mb = a.device_mesh, b.device_mesh
        assert (ma.device_type, ma.mesh.tolist(), ma.ndim) == (mb.device_type, mb.mesh.tolist(), mb.ndim)
        assert ma.mesh.tolist() == list(range(fake_world))
        assert a.shape == b.shape


def test_no_mesh_without_a_process_group_names_the_fix():
    from raggedfsdp import fully_shard

    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=r"no mesh given.*init_process_group"):
        fully_shard(nn.Linear(2, 2))
