"""raggedfsdp/_compat.py: the private torch names raggedfsdp reads exist on the installed torch and give
what the public mesh API gives; a torch without them fails loudly naming the file to port (monkeypatched
absence), instead of an AttributeError deep inside fully_shard."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from raggedfsdp import _compat


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=6)
    yield 6
    dist.destroy_process_group()


def test_mesh_readers_match_the_mesh_they_slice(fake_world):
    root = init_device_mesh("cpu", (3, 2), mesh_dim_names=("dp", "tp"))
    assert _compat.root_mesh(root["dp"]) is root and _compat.root_mesh(root) is root
    both = _compat.concatenate_meshes([root["dp"], root["tp"]])
    assert both.mesh_dim_names == ("dp", "tp") and both.mesh.tolist() == root.mesh.tolist()
    flipped = _compat.concatenate_meshes([root["tp"], root["dp"]])
    assert flipped.mesh_dim_names == ("tp", "dp") and flipped.mesh.tolist() == root.mesh.T.tolist()
    flat = _compat.flatten_mesh(root["dp", "tp"], "dp_tp")
    assert flat.mesh_dim_names == ("dp_tp",) and flat.mesh.tolist() == root.mesh.flatten().tolist()


def test_missing_torch_internals_raise_naming_the_port(monkeypatch):
    class NoRoot:
        pass

    with pytest.raises(RuntimeError, match=r"DeviceMesh\._get_root_mesh.*raggedfsdp/_compat\.py"):
        _compat.root_mesh(NoRoot())
    monkeypatch.delattr(DeviceMesh, "_concatenate")
    with pytest.raises(RuntimeError, match=r"DeviceMesh\._concatenate.*raggedfsdp/_compat\.py"):
        _compat.concatenate_meshes([])
    with pytest.raises(RuntimeError, match=r"DeviceMesh\._flatten.*raggedfsdp/_compat\.py"):
        _compat.flatten_mesh(NoRoot(), "x")


def test_single_tensor_collectives_by_torch_minor(monkeypatch):
    gather, scatter = _compat.single_tensor_collectives()
    if _compat.torch_minor() >= (2, 13):  # the new names; the old ones emit FutureWarnings there
        assert (gather, scatter) == (dist.all_gather_single, dist.reduce_scatter_single)
    else:  # 2.11: only the old names exist
        assert (gather, scatter) == (dist.all_gather_into_tensor, dist.reduce_scatter_tensor)
    old = dist.all_gather_into_tensor, dist.reduce_scatter_tensor
    for name in ("all_gather_single", "reduce_scatter_single"):
        monkeypatch.delattr(dist, name, raising=False)
    assert _compat.single_tensor_collectives() == old
    monkeypatch.delattr(dist, "all_gather_into_tensor")
    with pytest.raises(RuntimeError, match=r"all_gather_single.*raggedfsdp/_compat\.py"):
        _compat.single_tensor_collectives()


def test_dtensor_wrapper_builds_what_the_constructor_builds(fake_world):
    """The sharded-grad install skips ``DTensor.__init__``: on this torch that must build the very
    tensor ``DTensor(local, spec, requires_grad=False)`` builds (same spec and local tensor objects,
    metadata, no extra state), or a torch whose ``__init__`` does real work would be missed."""
    import torch
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from raggedfsdp.placement import RaggedShard

    mesh = init_device_mesh("cpu", (6,))
    for placement in (Shard(0), RaggedShard((0,), (1, 0, 2, 1, 1, 1))):
        ref = distribute_tensor(torch.zeros(12, 5), mesh, [Shard(0)])
        spec = (
            ref._spec
            if isinstance(placement, Shard)
            else ref._spec.__class__(mesh, (placement,), tensor_meta=ref._spec.tensor_meta)
        )
        local = torch.arange(10.0)
        a = DTensor(local, spec, requires_grad=False)
        b = _compat.dtensor_wrapper()(local, spec)
        assert type(b) is DTensor and b._spec is spec and b._local_tensor is local
        for attr in ("shape", "dtype", "device", "requires_grad", "layout"):
            assert getattr(a, attr) == getattr(b, attr), attr
        assert a.stride() == b.stride() and a.placements == b.placements
        slots = lambda t: {k: getattr(t, k, None) for k in DTensor.__slots__}  # noqa: E731
        assert slots(a) == slots(b) and vars(a) == vars(b)
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.delattr(DTensor, "__new__")
    try:
        with pytest.raises(RuntimeError, match=r"DTensor\.__new__.*raggedfsdp/_compat\.py"):
            _compat.dtensor_wrapper()
    finally:
        monkeypatch.undo()


def test_subclass_torch_function_off_reads_what_the_attributes_read(fake_world, monkeypatch):
    """The per-step scans read ``requires_grad`` / ``grad`` / ``_version`` of sharded DTensor params and
    set their ``.grad`` inside ``subclass_torch_function_off()``: there the values must be the very ones
    read outside, and a subclass's ``__torch_function__`` must not be consulted (else the context does not
    do what the scans rely on, and the 2.7x saving is gone)."""
    import torch
    import torch.nn as nn
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (6,))
    ps = [
        nn.Parameter(DTensor.from_local(torch.randn(4), mesh, [Shard(0)]), requires_grad=rg)
        for rg in (True, False)
    ]
    with torch.no_grad():
        ps[0].add_(1.0)
    grad = DTensor.from_local(torch.ones(4), mesh, [Shard(0)])
    ps[0].grad = grad
    outside = [(p.requires_grad, p.grad, p._version, p._post_accumulate_grad_hooks) for p in ps]
    ctx = _compat.subclass_torch_function_off()
    with ctx():
        assert not torch._C._is_torch_function_enabled()
        inside = [(p.requires_grad, p.grad, p._version, p._post_accumulate_grad_hooks) for p in ps]
        ps[1].grad = grad  # the setter as well
    assert torch._C._is_torch_function_enabled()
    assert [(a, b is None or id(b), c, d) for a, b, c, d in inside] == [
        (a, b is None or id(b), c, d) for a, b, c, d in outside
    ]
    assert outside[0][2] == 1 and ps[1].grad is grad

    calls = []

    class Seen(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            calls.append(func)
            return super().__torch_function__(func, types, args, kwargs or {})

    s = torch.zeros(2).as_subclass(Seen)
    s.requires_grad
    assert calls, "a subclass getter consults __torch_function__ outside the context"
    calls.clear()
    with ctx():
        s.requires_grad
    assert not calls
    monkeypatch.delattr(torch._C, "DisableTorchFunctionSubclass")
    with pytest.raises(RuntimeError, match=r"DisableTorchFunctionSubclass.*raggedfsdp/_compat\.py"):
        _compat.subclass_torch_function_off()


def test_disable_functorch_if_active_runs_outside_the_transform(monkeypatch):
    """Inside ``torch.func.jvp`` the wrapped function may write in place into a captured tensor (what the
    unshard's cast copy-in does); unwrapped, the same write is refused by the transform."""
    import torch

    buf = torch.zeros(3)

    def write(a):
        buf.copy_(torch.arange(3.0))
        return buf

    wrapped = _compat.disable_functorch_if_active(write)
    x, v = torch.arange(3.0), torch.ones(3)
    out, tan = torch.func.jvp(lambda a: a * wrapped(a).sum(), (x,), (v,))
    assert buf.tolist() == [0.0, 1.0, 2.0] and out.tolist() == [0.0, 3.0, 6.0] and tan.tolist() == [3.0] * 3
    with pytest.raises(RuntimeError, match="in-place operation"):
        torch.func.jvp(lambda a: a * write(a).sum(), (x,), (v,))
    assert wrapped(x) is buf  # outside a transform: called directly
    monkeypatch.delattr(torch._C, "_DisableFuncTorch")
    with pytest.raises(RuntimeError, match=r"_DisableFuncTorch.*raggedfsdp/_compat\.py"):
        _compat.disable_functorch_if_active(write)
