"""Every patch raggedfsdp applies to torch internals, in one place (applied on ``import raggedfsdp``).

torch has no extension point for a new DTensor placement type (fsdp2-internals.md section 0.4,
pytorch issue #169320), so RaggedShard needs these small, guarded patches. Each one delegates to
torch's original function whenever no RaggedShard is involved, so non-ragged DTensors behave
exactly as before. Supported torch: 2.13.x and 2.14.x (checked at import; other versions raise
``RuntimeError``); the full RaggedShard test suite passes on 2.13.0+cpu and 2.14.1. :func:`apply` is idempotent; :func:`patched_symbols` lists what was replaced
and ``tests/unit/test_ragged_patches.py`` fails loudly if an upgrade moves or changes them.

Patched internals and why
-------------------------
1. ``torch.distributed.tensor._redistribute.redistribute_local_tensor`` (and the names imported
   from it in ``_api`` and ``_dispatch``): torch's dispatch branches on ``is_shard()`` and treats
   equal ``.dim`` as "no change", so RS <-> Shard(0) and RS -> RS with other local_units would be
   silent no-ops. Specs with a RaggedShard go to ``placement/_redistribute.redistribute_ragged``
   (padded all-gather, one all_to_all for ragged<->ragged, padded reduce-scatter); this also
   covers ``DTensor.redistribute``, ``full_tensor`` and their autograd backward.
2. ``torch.distributed.tensor.distribute_tensor`` (``_api`` + package namespace): torch raises
   "unsupported placements" for unknown placement types. RaggedShard is distributed as Replicate
   (broadcast from ``src_data_rank``) and sliced locally.
3. ``DTensor.from_local``: without ``shape``/``stride`` torch's C++ global-shape inference raises
   an opaque "placement type RaggedShard not supported!"; the wrapper raises a ``ValueError``
   explaining that a flat piece needs ``shape=`` and ``stride=``, and checks the local numel.
4. ``ShardingPropagator.propagate_op_sharding`` / ``propagate_op_sharding_non_cached`` of
   ``DTensor._op_dispatcher.sharding_propagator`` (instance attributes, the LRU cache rebuilt):
   torch propagates unknown placements blindly through view/matmul ops; the guard in
   ``placement/_ops.py`` raises ``RaggedShardOpError`` for every op that is not pointwise-like
   on same-shape operands or a full sum/p-norm reduction.
5. ``_ops.single_dim_strategy._fill_single_dim_strategy_placeholders`` (patch A): expands
   pointwise/foreach placeholder rules to RaggedShard so those ops (incl. in-place, i.e. torch.optim
   steps) run locally without a hidden all-gather.
   ``_ops.utils.is_tensor_shardable`` (patch C) answers False for placement tuples that are not a
   valid RaggedShard composition (two RaggedShards, local_units not matching the mesh dim), so
   the cross-mesh-dim strategy expansion never picks them.
6. ``_ops._math_ops.map_placements_after_reduction`` (patch B): maps RaggedShard to the
   reduction's Partial (``Partial('sum')`` / ``_NormPartial``) so sum/norm/``clip_grad_norm_`` give
   global results.
7. ``DTensor.__create_write_items__`` / ``__create_chunk_list__`` / ``__get_tensor_shard__``
   (torch/distributed/tensor/_api.py): DCP sees one chunk per DTensor from
   ``compute_local_shape_and_global_offset``, which treats unknown placements as Replicate. For
   RaggedShard they describe each rank's piece as N-D boxes (``placement/_checkpoint.py``), so no
   gather is needed and any layout can load any other. Dispatching on the placement (not on
   per-instance hooks) also covers optimizer states created by ``zeros_like``.
8. ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset`` (+ the names
   imported from it in ``checkpoint.planner_helpers`` / ``_state_dict_utils``) and
   ``_state_dict_utils.distribute_tensor`` / ``_distribute_tensors``: torch silently answers
   "Replicate" (whole tensor, offset 0) for unknown placements. Now exact whenever the ragged
   piece is an N-D box (always for ``dims=(0,)``), ``ValueError`` otherwise; the state-dict
   helpers slice the flat piece from the full tensor (``set_model_state_dict(full_state_dict=True
   [, broadcast_from_rank0=True])``).
9. ``DTensor._op_dispatcher._custom_op_handlers`` gets entries for the in-place random ops
   (``uniform_``, ``normal_``, ``bernoulli_``, ...) and ``rand_like``/``randn_like``/``randint_like``:
   torch runs random ops without sharding propagation, so every rank would fill its flat piece
   with the same leading numbers. For RaggedShard the handler draws the full tensor on every rank
   and keeps the rank's piece (same values as single-device code with the same seed, e.g.
   ``reset_parameters`` after meta init); other DTensors are dispatched to torch unchanged.
"""

from __future__ import annotations

import functools
import importlib

import torch

SUPPORTED_TORCH = ((2, 13), (2, 14))
_PATCHED: dict[str, object] = {}  # "module:attr" -> original object


def _torch_version() -> tuple[int, int]:
    v = torch.__version__.split("+")[0].split(".")
    return int(v[0]), int(v[1])


def check_torch_version() -> None:
    """Raise ``RuntimeError`` unless the installed torch minor is one raggedfsdp has patches for."""
    if _torch_version() not in SUPPORTED_TORCH:
        raise RuntimeError(
            f"raggedfsdp patches DTensor internals and supports torch 2.13.x and 2.14.x only; found torch "
            f"{torch.__version__}. Install a supported torch (pip install 'torch>=2.13,<2.15') or port "
            "raggedfsdp/_torch_patches.py to this version."
        )


def _set(module_name: str, attr: str, new) -> None:
    mod = importlib.import_module(module_name)
    old = getattr(mod, attr)  # AttributeError here == torch moved the symbol: fail loudly
    if getattr(old, "__ragged_patched__", False):
        # already ours (e.g. a module imported after the patch picked up the patched name)
        _PATCHED.setdefault(f"{module_name}:{attr}", getattr(old, "__ragged_original__", old))
        return
    new.__ragged_patched__ = True
    new.__ragged_original__ = old
    _PATCHED[f"{module_name}:{attr}"] = old
    setattr(mod, attr, new)


def original(module_name: str, attr: str):
    """torch's original object for a patched ``module:attr`` (the current one if unpatched)."""
    cur = getattr(importlib.import_module(module_name), attr)
    return getattr(cur, "__ragged_original__", cur)


def patched_symbols() -> list[str]:
    """``"module:attr"`` of every torch symbol replaced by :func:`apply`."""
    return sorted(_PATCHED)


# ---------------------------------------------------------------------------------------------
def _patch_redistribute() -> None:
    from raggedfsdp.placement._redistribute import has_ragged, redistribute_ragged

    stock = original("torch.distributed.tensor._redistribute", "redistribute_local_tensor")

    @functools.wraps(stock)
    def redistribute_local_tensor(local_tensor, current_spec, target_spec, *args, **kwargs):
        if has_ragged(current_spec.placements) or has_ragged(target_spec.placements):
            return redistribute_ragged(local_tensor, current_spec, target_spec, stock)
        return stock(local_tensor, current_spec, target_spec, *args, **kwargs)

    for mod in ("torch.distributed.tensor._redistribute", "torch.distributed.tensor._api",
                "torch.distributed.tensor._dispatch"):
        _set(mod, "redistribute_local_tensor", redistribute_local_tensor)


def _patch_distribute_tensor() -> None:
    from torch.distributed.tensor import DTensor

    from raggedfsdp.placement._redistribute import (
        _coord,
        base_placements,
        check_placements,
        has_ragged,
        make_spec,
        ragged_mesh_dim,
    )

    stock = original("torch.distributed.tensor._api", "distribute_tensor")

    @functools.wraps(stock)
    def distribute_tensor(tensor, device_mesh=None, placements=None, *, src_data_rank=0):
        if placements is None or not has_ragged(placements):
            return stock(tensor, device_mesh, placements, src_data_rank=src_data_rank)
        mesh = device_mesh
        if mesh is None:
            raise ValueError("distribute_tensor with RaggedShard needs an explicit device_mesh")
        placements = tuple(placements)
        check_placements(placements, tuple(tensor.shape), mesh)
        base = stock(tensor.detach(), mesh, base_placements(placements), src_data_rank=src_data_rank)
        i = ragged_mesh_dim(placements)
        local = placements[i].shard_full(base._local_tensor, _coord(mesh, i))
        spec = make_spec(mesh, placements, tensor.shape, tensor.stride(), tensor.dtype)
        return DTensor(local.requires_grad_(tensor.requires_grad), spec, requires_grad=tensor.requires_grad)

    _set("torch.distributed.tensor._api", "distribute_tensor", distribute_tensor)
    _set("torch.distributed.tensor", "distribute_tensor", distribute_tensor)


def _patch_from_local() -> None:
    from torch.distributed.tensor import DTensor

    from raggedfsdp.placement._redistribute import (
        base_local_shape,
        check_placements,
        has_ragged,
        _coord,
        ragged_mesh_dim,
    )

    stock = DTensor.__dict__["from_local"].__func__
    if getattr(stock, "__ragged_patched__", False):
        return

    @functools.wraps(stock)
    def from_local(local_tensor, device_mesh=None, placements=None, *, run_check=False, shape=None,
                   stride=None, **kwargs):
        if placements is not None and has_ragged(placements):
            if shape is None or stride is None:
                raise ValueError(
                    f"DTensor.from_local with {tuple(placements)}: a RaggedShard local tensor is a flat piece, so "
                    "the global shape cannot be inferred; pass shape=<global shape> and "
                    "stride=<global contiguous stride>"
                )
            mesh = device_mesh
            if mesh is not None:
                check_placements(tuple(placements), tuple(shape), mesh)
                i = ragged_mesh_dim(placements)
                base = base_local_shape(tuple(shape), mesh, placements)
                want = placements[i].local_numel(base, _coord(mesh, i))
                if local_tensor.dim() != 1 or local_tensor.numel() != want:
                    raise ValueError(
                        f"DTensor.from_local with {placements[i]}: local_tensor must be 1-D with {want} elements "
                        f"on this rank for global shape {tuple(shape)}, got shape {tuple(local_tensor.shape)}; "
                        "use local_tensor.reshape(-1) of the rows placement.row_range(shape, rank)"
                    )
        return stock(local_tensor, device_mesh, placements, run_check=run_check, shape=shape, stride=stride,
                     **kwargs)

    from_local.__ragged_patched__ = True
    from_local.__ragged_original__ = stock
    _PATCHED["torch.distributed.tensor._api:DTensor.from_local"] = stock
    DTensor.from_local = staticmethod(from_local)


def _patch_propagation() -> None:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._sharding_prop import LocalLRUCache

    from raggedfsdp.placement._ops import guard_propagation

    sp = DTensor._op_dispatcher.sharding_propagator
    cur = sp.propagate_op_sharding_non_cached
    if getattr(cur, "__ragged_patched__", False):
        return
    guarded = guard_propagation(cur)
    guarded.__ragged_patched__ = True
    sp.propagate_op_sharding_non_cached = guarded
    sp.propagate_op_sharding = LocalLRUCache(guarded)
    _PATCHED["torch.distributed.tensor._sharding_prop:ShardingPropagator.propagate_op_sharding"] = cur


def _patch_strategies() -> None:
    from raggedfsdp.placement._ops import make_fill_placeholders, make_is_tensor_shardable, make_map_after_reduction

    sds = "torch.distributed.tensor._ops.single_dim_strategy"
    _set(sds, "_fill_single_dim_strategy_placeholders",
         make_fill_placeholders(original(sds, "_fill_single_dim_strategy_placeholders")))
    ut = "torch.distributed.tensor._ops.utils"
    _set(ut, "is_tensor_shardable", make_is_tensor_shardable(original(ut, "is_tensor_shardable")))
    mo = "torch.distributed.tensor._ops._math_ops"
    mod = importlib.import_module(mo)
    _set(mo, "map_placements_after_reduction",
         make_map_after_reduction(original(mo, "map_placements_after_reduction"),
                                  mod.get_placement_from_reduction_op))


def _patch_checkpoint() -> None:
    from raggedfsdp.placement import _checkpoint

    _checkpoint.install(_set, original, _PATCHED)


def _patch_random_ops() -> None:
    from torch.distributed.tensor import DTensor

    from raggedfsdp.placement import _random

    handlers = DTensor._op_dispatcher._custom_op_handlers
    for op in _random.install(handlers):  # idempotent; raises if torch gained its own handler
        _PATCHED[f"torch.distributed.tensor._dispatch:OpDispatcher._custom_op_handlers[{op}]"] = None


_APPLIED = False


def apply() -> None:
    """Install every patch (idempotent). Raises ``RuntimeError`` on an unsupported torch version."""
    global _APPLIED
    check_torch_version()
    if _APPLIED:
        return
    _patch_redistribute()
    _patch_distribute_tensor()
    _patch_from_local()
    _patch_propagation()
    _patch_strategies()
    _patch_checkpoint()
    _patch_random_ops()
    _APPLIED = True


apply()


# ---------------------------------------------------------------------------------------------
# Not applied on import: c10's process-wide CPU allocation accounting, for the peak-memory method
# (raggedfsdp/fsdp/memory.py). c10's ``ProfiledCPUMemoryReporter`` (c10/core/CPUAllocator.cpp) keeps
# its table of live CPU blocks, and the running total it stamps on every profiler memory event
# (``total_allocated``), only while the *calling thread* profiles -- unless the c10 flag
# ``FLAGS_caffe2_report_cpu_memory_usage`` is set. With the flag set, every thread's allocations
# and frees update the total (gloo's worker threads free collective scratch the main thread
# allocated), and frees of blocks allocated before a profiler session are reported with their
# size. torch has no Python setter for c10 flags, so this writes the exported global with ctypes.
# Cost: one mutex + hash-map update per CPU allocation for the rest of the process; with
# TORCH_CPP_LOG_LEVEL=INFO c10 also logs every allocation (the default level, WARNING, does not).
_CPU_ACCOUNTING: bool | None = None


def enable_cpu_allocator_accounting() -> bool:
    """Set c10's ``FLAGS_caffe2_report_cpu_memory_usage`` for this process; True when it is set.

    Idempotent, local, never raises: returns False (and the caller falls back to per-thread
    accounting) when this torch build does not export the flag (e.g. a static or non-Linux build).
    ``tests/unit/test_memory.py`` asserts it returns True on the supported Linux wheels.
    """
    global _CPU_ACCOUNTING
    if _CPU_ACCOUNTING is not None:
        return _CPU_ACCOUNTING
    import ctypes
    import glob
    import os

    libdir = os.path.join(os.path.dirname(torch.__file__), "lib")
    _CPU_ACCOUNTING = False
    for path in sorted(glob.glob(os.path.join(libdir, "libc10.*")) + glob.glob(os.path.join(libdir, "c10.dll"))):
        try:
            flag = ctypes.c_bool.in_dll(ctypes.CDLL(path), "FLAGS_caffe2_report_cpu_memory_usage")
        except (OSError, ValueError):
            continue
        flag.value = True
        _CPU_ACCOUNTING = bool(flag.value)
        break
    return _CPU_ACCOUNTING
