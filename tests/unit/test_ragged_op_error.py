"""How an unsupported op on a RaggedShard DTensor surfaces (README "What to expect"): DTensor's
sharding propagation (torch/distributed/tensor/_dispatch.py) re-raises every propagation error as a
plain ``RuntimeError`` ``from`` the original, so user code catches ``RuntimeError`` and finds our
``RaggedShardOpError`` as its ``__cause__`` (a deliberate choice: catching it by name would need one
more patched torch internal). Checked on a fake 3-rank group against a Shard(0) DTensor, where the
same op runs."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=3)
    yield 3
    dist.destroy_process_group()


def test_unsupported_op_error_is_a_runtime_error_caused_by_ragged_shard_op_error(fake_world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, zeros

    from raggedfsdp import RaggedShard, RaggedShardOpError

    mesh = init_device_mesh("cpu", (fake_world,))
    zeros(6, 4, device_mesh=mesh, placements=[Shard(0)]).view(-1)  # torch's own placement: runs
    x = zeros(6, 4, device_mesh=mesh, placements=[RaggedShard((0,), (1, 0, 2))])
    with pytest.raises(RuntimeError) as info:
        x.view(-1)
    err = info.value
    cause = err if isinstance(err, RaggedShardOpError) else err.__cause__
    assert isinstance(cause, RaggedShardOpError), (type(err), type(err.__cause__))
    assert "aten.view.default is not supported on RaggedShard" in str(err)
    assert "redistribute" in str(err) and "full_tensor" in str(err)  # the fix is named


@pytest.mark.parametrize("op", ["mean", "max", "argmax", "sum0"])
def test_refused_reductions_match_the_readme_check(fake_world, op):
    """A user trial: ``argmax`` raised RaggedShardOpError itself while ``mean`` raised it as the cause:
    the README's check covers both, and the message says which reductions run."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import zeros

    from raggedfsdp import RaggedShard, RaggedShardOpError

    mesh = init_device_mesh("cpu", (fake_world,))
    x = zeros(6, 4, device_mesh=mesh, placements=[RaggedShard((0,), (1, 0, 2))])
    fn = {"mean": x.mean, "max": x.max, "argmax": x.argmax, "sum0": lambda: x.sum(0)}[op]
    with pytest.raises(RuntimeError) as info:
        fn()
    e = info.value
    assert isinstance(e, RaggedShardOpError) or isinstance(e.__cause__, RaggedShardOpError), (type(e), e)
    assert "redistribute" in str(e) and "full_tensor" in str(e), str(e)
    if op == "sum0":
        assert "sum, nansum or a p-norm" in str(e), str(e)
    assert float(x.sum()) == 0.0  # the full sum runs
