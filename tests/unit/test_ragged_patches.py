"""The torch-internal patches of raggedfsdp/_torch_patches.py: present, idempotent, still behaving.

These fail loudly when a torch upgrade moves, renames or changes a patched internal.
"""

import inspect
import re

import pytest
import torch

import raggedfsdp  # noqa: F401
from raggedfsdp import RaggedShard, _torch_patches as tp

EXPECTED = {
    "torch.distributed.tensor._redistribute:redistribute_local_tensor",
    "torch.distributed.tensor._api:redistribute_local_tensor",
    "torch.distributed.tensor._dispatch:redistribute_local_tensor",
    "torch.distributed.tensor._api:distribute_tensor",
    "torch.distributed.tensor:distribute_tensor",
    "torch.distributed.tensor._api:DTensor.from_local",
    "torch.distributed.tensor._sharding_prop:ShardingPropagator.propagate_op_sharding",
    "torch.distributed.tensor._ops.single_dim_strategy:_fill_single_dim_strategy_placeholders",
    "torch.distributed.tensor._ops._math_ops:map_placements_after_reduction",
    "torch.distributed.tensor._ops.utils:is_tensor_shardable",
    "torch.distributed.tensor._api:DTensor.__create_write_items__",
    "torch.distributed.tensor._api:DTensor.__create_chunk_list__",
    "torch.distributed.tensor._api:DTensor.__get_tensor_shard__",
    "torch.distributed.tensor._utils:compute_local_shape_and_global_offset",
    "torch.distributed.checkpoint.planner_helpers:compute_local_shape_and_global_offset",
    "torch.distributed._state_dict_utils:compute_local_shape_and_global_offset",
    "torch.distributed._state_dict_utils:distribute_tensor",
    "torch.distributed._state_dict_utils:_distribute_tensors",
}


def test_all_patches_installed():
    from torch.distributed.tensor import DTensor

    from raggedfsdp.placement import _random

    syms = set(tp.patched_symbols())
    handlers = {s for s in syms if "_custom_op_handlers[" in s}
    assert syms - handlers == EXPECTED
    assert len(handlers) == len(_random.RANDOM_INPLACE_OPS) + len(_random.RANDOM_LIKE_OPS) >= 12
    for op in (*_random.RANDOM_INPLACE_OPS, *_random.RANDOM_LIKE_OPS):
        assert DTensor._op_dispatcher._custom_op_handlers[op] is _random.random_inplace_handler, op
    import importlib

    for sym in EXPECTED:
        mod, attr = sym.split(":")
        if attr == "ShardingPropagator.propagate_op_sharding":
            from torch.distributed.tensor import DTensor

            obj = DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding_non_cached
        else:
            obj = importlib.import_module(mod)
            for part in attr.split("."):
                obj = getattr(obj, part)
            obj = getattr(obj, "__func__", obj)
        assert getattr(obj, "__ragged_patched__", False), f"{sym} is not patched"


def test_apply_is_idempotent():
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import _redistribute

    before = (_redistribute.redistribute_local_tensor, DTensor.__dict__["from_local"],
              DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding)
    tp._APPLIED = False
    tp.apply()
    tp.apply()
    after = (_redistribute.redistribute_local_tensor, DTensor.__dict__["from_local"],
             DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding)
    assert before[0] is after[0] and before[2] is after[2]
    assert after[1].__func__.__ragged_original__.__name__ == "from_local"
    assert not getattr(tp.original("torch.distributed.tensor._redistribute", "redistribute_local_tensor"),
                       "__ragged_patched__", False)


@pytest.mark.parametrize("version", ["2.12.1", "2.15.0+cu128", "3.0.0"])
def test_version_guard(monkeypatch, version):
    monkeypatch.setattr(torch, "__version__", version)
    with pytest.raises(RuntimeError, match=r"supports torch 2\.13\.x and 2\.14\.x only; found torch " + re.escape(version)):
        tp.check_torch_version()


@pytest.mark.parametrize("version", ["2.13.0+cpu", "2.14.1"])
def test_version_guard_accepts(monkeypatch, version):
    monkeypatch.setattr(torch, "__version__", version)
    tp.check_torch_version()


def test_original_signatures_unchanged():
    """The internals we wrap still take the arguments our wrappers pass through."""
    sig = lambda m, a: list(inspect.signature(tp.original(m, a)).parameters)  # noqa: E731
    assert sig("torch.distributed.tensor._redistribute", "redistribute_local_tensor")[:3] == [
        "local_tensor", "current_spec", "target_spec"]
    assert sig("torch.distributed.tensor._ops.single_dim_strategy", "_fill_single_dim_strategy_placeholders") == [
        "unique_input_placements", "single_dim_strategies_with_placeholders"]
    assert sig("torch.distributed.tensor._ops._math_ops", "map_placements_after_reduction") == [
        "placements", "reduction_dims", "reduction_dims_map", "reduction_op"]
    assert sig("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset")[:3] == [
        "global_shape", "mesh", "placements"]
    assert sig("torch.distributed.tensor._ops.utils", "is_tensor_shardable")[:2] == ["shape", "spec"]
    assert sig("torch.distributed._state_dict_utils", "_distribute_tensors")[:3] == [
        "local_state_dict", "keys", "device"]
    assert "src_data_rank" in sig("torch.distributed.tensor._api", "distribute_tensor")
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._sharding_prop import LocalLRUCache, ShardingPropagator

    assert callable(DTensor._raise_if_contains_partial_placements)
    assert isinstance(DTensor._op_dispatcher._custom_op_handlers, dict)

    assert hasattr(ShardingPropagator, "propagate_op_sharding_non_cached") and callable(LocalLRUCache)


def test_patch_a_expands_placeholders_to_ragged():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._ops import single_dim_strategy as sds

    rs = RaggedShard((0,), (1, 2))
    rules = [[sds._ShardingPlaceholder(0), sds._ShardingPlaceholder(0), Replicate()],
             [sds._ShardingPlaceholder(1), sds._ShardingPlaceholder(1), Replicate()]]
    out = sds._fill_single_dim_strategy_placeholders({rs, Shard(0)}, rules)
    assert [rs, rs, Replicate()] in out and [Shard(0), Shard(0), Replicate()] in out
    assert [rs, rs, Replicate()] == out[-1] and all(p != rs for s in out[:-1] for p in s)


def test_patch_b_maps_ragged_to_partial():
    from torch.distributed.tensor import Partial, Replicate
    from torch.distributed.tensor._ops import _math_ops as mo

    rs = RaggedShard((0, 1), (1, 2))
    assert mo.map_placements_after_reduction((rs,), [0, 1], [-1, -1], "sum") == (Partial("sum"),)
    out = mo.map_placements_after_reduction((Replicate(), rs), [0, 1], [-1, -1], mo.NormReduction(2))
    assert out[0] == Replicate() and isinstance(out[1], mo._NormPartial) and out[1].norm_type == 2
    with pytest.raises(RuntimeError, match="does not cover the ragged dims"):
        mo.map_placements_after_reduction((rs,), [1], [0, -1], "sum")


def test_op_classification():
    from raggedfsdp.placement._ops import classify

    aten = torch.ops.aten
    for op in (aten.add.Tensor, aten.mul_.Tensor, aten._foreach_lerp_.Scalar, aten.clone.default,
               aten.zeros_like.default, aten.addcdiv_.default, aten._foreach_addcmul_.Scalar, aten.copy_.default):
        assert classify(op) == "pointwise", op
    for op in (aten.sum.default, aten.linalg_vector_norm.default, aten._foreach_norm.Scalar):
        assert classify(op) == "reduction", op
    for op in (aten.view.default, aten.t.default, aten.mm.default, aten.select.int, aten.slice.Tensor,
               aten.permute.default, aten.mean.default, aten.rand_like.default, aten.native_dropout.default,
               aten.addmm.default, aten.index.Tensor, aten._foreach_max.default, aten.cat.default):
        assert classify(op) is None, op
