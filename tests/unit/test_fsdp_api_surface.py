"""raggedfsdp's FSDP2 surface against the installed torch's, diffed programmatically (a name torch adds
fails here), and the ``patch_torch`` switch (issue 39). Single process, no process group."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch.distributed.fsdp as torch_fsdp
import torch.distributed.fsdp._fully_shard as torch_fsdp2
import torch.distributed.fsdp._fully_shard._fully_shard as torch_fsdp2_impl

import raggedfsdp
import raggedfsdp.fsdp as ours
from raggedfsdp.fsdp import _fully_shard as ours_impl

_SWAPPED = {
    "torch.distributed.fsdp": ("fully_shard", "share_comm_ctx"),
    "torch.distributed.fsdp._fully_shard": ("fully_shard", "share_comm_ctx"),
    "torch.distributed.fsdp._fully_shard._fully_shard": ("fully_shard", "share_comm_ctx"),
    "torch.distributed._composable.fsdp": ("fully_shard",),
    "torch.distributed._composable.fsdp.fully_shard": ("fully_shard",),
}


def test_every_fsdp2_public_name_is_exported():
    torch_names = set(torch_fsdp2.__all__) | set(torch_fsdp2_impl.__all__)
    assert set(torch_fsdp2.__all__) <= set(torch_fsdp.__all__)  # the FSDP2 part of torch's public API
    missing = sorted(n for n in torch_names if not hasattr(ours, n))
    assert not missing, f"torch FSDP2 names raggedfsdp.fsdp lacks: {missing}"
    top = sorted(n for n in torch_fsdp2.__all__ if not hasattr(raggedfsdp, n))
    assert not top, f"torch FSDP2 names the raggedfsdp package lacks: {top}"
    assert ours.get_cls_to_fsdp_cls() is ours_impl._cls_cache


def test_fsdp_module_overrides_every_torch_method():
    for torch_cls, our_cls in (
        (torch_fsdp.FSDPModule, ours.FSDPModule),
        (torch_fsdp.UnshardHandle, ours.UnshardHandle),
    ):
        assert issubclass(our_cls, torch_cls)  # isinstance checks in accelerate / transformers pass
        missing = [
            n
            for n in dir(torch_cls)
            if not n.startswith("__") and callable(getattr(torch_cls, n)) and n not in our_cls.__dict__
        ]
        assert not missing, f"{torch_cls.__name__} methods that would run torch's code on ours: {missing}"
        for n in dir(torch_cls):
            if not n.startswith("_") and callable(getattr(torch_cls, n)):
                t, o = inspect.signature(getattr(torch_cls, n)), inspect.signature(getattr(our_cls, n))
                assert list(t.parameters) == list(o.parameters), (n, t, o)


def test_fully_shard_signature_matches_torch():
    t = inspect.signature(ours_impl._TORCH_FULLY_SHARD).parameters
    o = inspect.signature(ours.fully_shard).parameters
    for name, p in t.items():
        assert name in o, f"fully_shard lacks torch's argument {name!r}"
        assert o[name].kind == p.kind, (name, o[name].kind, p.kind)
        assert o[name].default == p.default, (name, o[name].default, p.default)


def test_later_torch_arguments_are_gated_by_torch_signature(monkeypatch):
    import torch.nn as nn

    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        ours.fully_shard(nn.Linear(2, 2), bogus=1)

    def later_torch(module, *, mesh=None, some_2_16_arg=None): ...

    later_torch.state = ours_impl._TORCH_FULLY_SHARD.state
    monkeypatch.setattr(ours_impl, "_TORCH_FULLY_SHARD", later_torch)
    with pytest.raises(NotImplementedError, match="some_2_16_arg="):
        ours.fully_shard(nn.Linear(2, 2), some_2_16_arg=1)


def _values():
    return {(m, a): getattr(importlib.import_module(m), a) for m, attrs in _SWAPPED.items() for a in attrs}


def test_patch_torch_swaps_and_restores():
    before = _values()
    assert not raggedfsdp.fsdp.torch_is_patched()
    fsdp_module, unshard_handle = torch_fsdp.FSDPModule, torch_fsdp.UnshardHandle
    h = raggedfsdp.patch_torch()
    try:
        for (m, a), v in _values().items():
            want = ours.fully_shard if a == "fully_shard" else ours.share_comm_ctx
            assert v is want, (m, a)
        from torch.distributed.fsdp import fully_shard  # what a framework does after the patch

        assert fully_shard is raggedfsdp.fully_shard
        assert torch_fsdp.FSDPModule is fsdp_module and torch_fsdp.UnshardHandle is unshard_handle
        with raggedfsdp.patch_torch() as inner:  # nested: still patched after the inner one ends
            assert inner.active
        assert not inner.active and raggedfsdp.fsdp.torch_is_patched()
    finally:
        h.undo()
    assert _values() == before and not h.active
    h.undo()  # idempotent
    assert _values() == before
    a, b = raggedfsdp.patch_torch(), raggedfsdp.patch_torch()
    a.undo()  # out of order: the other patch is still active
    assert raggedfsdp.fsdp.torch_is_patched()
    b.undo()
    assert _values() == before
    raggedfsdp.patch_torch()
    raggedfsdp.patch_torch()
    raggedfsdp.unpatch_torch()  # ends every patch
    assert _values() == before
    raggedfsdp.unpatch_torch()  # no-op
    assert _values() == before


def test_state_falls_back_to_torch_for_modules_torch_sharded(monkeypatch):
    """torch's fully_shard body calls its module-global ``fully_shard.state``, which patch_torch points at
    ours: ours must answer with torch's state for a module raggedfsdp did not shard (the ws-3 spawn in
    tests/dist/test_fsdp_api.py trains torch's fully_shard while patched)."""
    import torch.nn as nn

    assert ours.fully_shard.state(nn.Linear(2, 2)) is None
    sentinel = object()
    monkeypatch.setattr(ours_impl._TORCH_FULLY_SHARD, "state", lambda module: sentinel)
    assert ours.fully_shard.state(nn.Linear(2, 2)) is sentinel
