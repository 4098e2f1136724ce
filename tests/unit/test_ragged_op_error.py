"""How refused ops and implicit redistributions of RaggedShard DTensors surface (README "What to expect").

Ops without a local RaggedShard rule redistribute like torch's ``Shard(0)`` (DTensor's contract);
under ``raggedfsdp.strict_ops()`` / ``RAGGEDFSDP_STRICT_OPS=1`` each such implicit redistribution
raises ``RaggedShardOpError`` naming the op, and ``implicit_redistribution_count()`` counts them.
Checked on a fake 3-rank group (no data moves; the values are tested in
``tests/dist/test_ragged_ops.py``) against a Shard(0) DTensor, where the same ops run."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=3)
    yield 3
    dist.destroy_process_group()


def _ragged(mesh):
    from torch.distributed.tensor import zeros

    from raggedfsdp import RaggedShard

    return zeros(
        6, 4, device_mesh=mesh, placements=[RaggedShard((0,), (1, 2, 3))]
    )  # rank 1 non-empty (fake pg)


@pytest.mark.parametrize("op", ["t", "select", "mm", "cat", "max0", "broadcast_add"])
def test_strict_mode_names_the_op_and_the_counter_counts(fake_world, op):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, zeros

    from raggedfsdp import RaggedShardOpError, implicit_redistribution_count, strict_ops
    from raggedfsdp.placement import implicit_redistributions_by_op

    mesh = init_device_mesh("cpu", (fake_world,))
    rep = distribute_tensor(torch.ones(4, 4), mesh, [Replicate()])
    fns = {
        "t": (lambda x: x.t(), "aten.t.default", 1),
        "select": (lambda x: x[0], "aten.select.int", 1),
        "mm": (lambda x: x @ rep, "aten.mm.default", 1),
        "cat": (lambda x: torch.cat([x, x]), "aten.cat.default", 2),  # one per redistributed operand
        "max0": (lambda x: x.max(0), "aten.max.dim", 1),
        "broadcast_add": (lambda x: x + rep[0], "aten.add.Tensor", 1),
    }
    fn, name, n = fns[op]
    fn(zeros(6, 4, device_mesh=mesh, placements=[Shard(0)]))  # torch's own placement: runs
    x = _ragged(mesh)
    before = implicit_redistribution_count()
    fn(x)  # runs: the RaggedShard operand is redistributed (counted)
    assert implicit_redistribution_count() == before + n
    assert implicit_redistributions_by_op().get(name, 0) >= n, implicit_redistributions_by_op()
    with strict_ops():
        with pytest.raises(RaggedShardOpError) as info:
            fn(x)
    msg = str(info.value)
    assert name in msg and "strict mode" in msg and "RaggedShard" in msg, msg
    assert "redistribute" in msg and "full_tensor" in msg  # the fix is named
    assert implicit_redistribution_count() == before + n  # a refused redistribution is not counted
    fn(x)  # strict mode ended with the context
    assert implicit_redistribution_count(reset=True) == before + 2 * n
    assert implicit_redistribution_count() == 0 and implicit_redistributions_by_op() == {}


def test_strict_mode_from_the_environment(fake_world, monkeypatch):
    from torch.distributed.device_mesh import init_device_mesh

    from raggedfsdp import RaggedShardOpError

    mesh = init_device_mesh("cpu", (fake_world,))
    x = _ragged(mesh)
    monkeypatch.setenv("RAGGEDFSDP_STRICT_OPS", "1")
    with pytest.raises(RaggedShardOpError, match=r"aten\.t\.default implicitly redistributes"):
        x.t()
    monkeypatch.setenv("RAGGEDFSDP_STRICT_OPS", "0")
    assert x.t().shape == (4, 6)


@pytest.mark.parametrize(
    "op", ["mul2", "sum", "mean", "max", "any", "sum1", "norm0", "view", "new_zeros", "clone"]
)
def test_local_rules_never_redistribute(fake_world, op):
    """Ops with a local rule run under strict mode and are not counted."""
    from torch.distributed.device_mesh import init_device_mesh

    from raggedfsdp import implicit_redistribution_count, strict_ops

    mesh = init_device_mesh("cpu", (fake_world,))
    x = _ragged(mesh)
    fns = {
        "mul2": lambda x: x.mul_(2).add(1),
        "sum": lambda x: x.sum(),
        "mean": lambda x: x.mean(),
        "max": lambda x: x.max(),
        "any": lambda x: (x > 0).any(),
        "sum1": lambda x: x.sum(1),
        "norm0": lambda x: torch.linalg.norm(x, dim=0),
        "view": lambda x: x.view(3, 2, 4).flatten(),
        "new_zeros": lambda x: x.new_zeros(6, 4),
        "clone": lambda x: x.clone(),
    }
    before = implicit_redistribution_count()
    with strict_ops():
        fns[op](x)
    assert implicit_redistribution_count() == before


def test_in_place_op_that_would_move_its_self_is_refused(fake_world):
    """An in-place op whose RaggedShard self would be redistributed would write into a temporary."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from raggedfsdp import RaggedShardOpError

    mesh = init_device_mesh("cpu", (fake_world,))
    x = _ragged(mesh)
    bias = distribute_tensor(torch.ones(4), mesh, [Replicate()])
    with pytest.raises(RuntimeError) as info:
        x.add_(bias)  # broadcasts a non-scalar operand: no local rule
    e = info.value
    cause = e if isinstance(e, RaggedShardOpError) else e.__cause__
    assert isinstance(cause, RaggedShardOpError), (type(e), e)
    assert "aten.add_.Tensor" in str(e) and "in-place" in str(e) and "copy_" in str(e), str(e)
    assert x.add(bias).shape == (6, 4)  # the out-of-place op runs


def test_unhandled_random_op_raises(fake_world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (fake_world,))
    x = _ragged(mesh)
    with pytest.raises(RuntimeError, match="random ops"):
        torch.bernoulli(x)  # aten.bernoulli.default: not one of placement/_random.py's ops
