"""Random init of RaggedShard DTensors equals single-device init with the same seed, and on CPU the
full tensor is generated in bounded chunks (placement/_random.py), checked on a fake 4-rank group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=2, world_size=4)
    yield 4, 2
    dist.destroy_process_group()


def test_chunks_cover_and_keep_tail_long():
    from raggedfsdp.placement._random import _chunks

    for n in (1, 7, 16, 64, 65, 69, 80, 1000):
        ch = _chunks(n, 64)
        assert ch[0][0] == 0 and ch[-1][1] == n
        assert all(b == c for (_, b), (c, _) in zip(ch, ch[1:]))
        assert all((a % 64) == 0 for a, _ in ch)
        assert len(ch) == 1 or ch[-1][1] - ch[-1][0] >= 16


@pytest.mark.parametrize("op", ["uniform_", "normal_", "bernoulli_", "random_"])
def test_chunked_random_fill_equals_single_device(fake_world, monkeypatch, op):
    import raggedfsdp  # noqa: F401  (installs the DTensor handlers)
    from torch.distributed.device_mesh import init_device_mesh

    from raggedfsdp.placement import RaggedShard
    from raggedfsdp.placement import _random

    ws, rank = fake_world
    monkeypatch.setattr(_random, "CHUNK_ELEMS", 64)
    mesh = init_device_mesh("cpu", (ws,))
    sizes = []
    orig = torch.empty

    def tracking_empty(*a, **k):
        t = orig(*a, **k)
        sizes.append(t.numel())
        return t

    args = {"uniform_": (-0.5, 0.5), "normal_": (0.0, 2.0), "bernoulli_": (0.3,), "random_": (0, 100)}[op]
    for shape, units in (((13, 11), (3, 0, 5, 5)), ((69,), (20, 9, 30, 10)), ((7, 3), (0, 0, 7, 0))):
        full_numel = shape[0] * (shape[1] if len(shape) > 1 else 1)
        pl = RaggedShard((0,), units)
        a, b = pl.flat_range(shape, rank)
        d = _make(mesh, pl, shape, b - a)
        torch.manual_seed(5)
        sizes.clear()
        monkeypatch.setattr(torch, "empty", tracking_empty)
        getattr(d, op)(*args)
        monkeypatch.setattr(torch, "empty", orig)
        torch.manual_seed(5)
        want = getattr(torch.empty(shape), op)(*args).reshape(-1)[a:b]
        assert torch.equal(d._local_tensor, want), (op, shape)
        if full_numel > 64 + 16:
            assert max(sizes) < full_numel, f"{op} {shape}: a full-size temporary was allocated"


def _make(mesh, pl, shape, n):
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    stride = tuple(
        int(torch.tensor(shape[i + 1 :]).prod().item()) if i + 1 < len(shape) else 1
        for i in range(len(shape))
    )
    spec = DTensorSpec(mesh, (pl,), tensor_meta=TensorMeta(torch.Size(shape), stride, torch.float32))
    return DTensor(torch.zeros(n), spec, requires_grad=False)
