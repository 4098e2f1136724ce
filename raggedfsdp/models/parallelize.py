"""Apply FSDP (ZeRO-3) to a model built from ``raggedfsdp.models``.

Two interchangeable backends with the same ``fully_shard`` signature:

- ``"ragged"``: ``raggedfsdp.fully_shard`` (RaggedShard DTensors, planner-chosen layout, DBuffers);
- ``"torch"``: ``torch.distributed.fsdp.fully_shard`` (torch's FSDP2, even ``Shard(0)``), useful as a
  numerical reference and as the baseline in benchmarks.

Wrapping (bottom-up, as ``fully_shard`` requires): one call per FSDP unit, so each unit's
parameters are all-gathered just before its forward/backward and freed after; then one call on the
root, which owns what is left (embedding, final norm, output projection). The root keeps its
parameters unsharded after forward because backward needs the output projection first.

The unit (``unit=``, ``--fsdp.unit``): ``"layer"`` wraps each of ``model.layers``; ``"superblock"``
wraps each run of ``model.superblock_size`` consecutive layers as one unit (``fully_shard`` on the
list of layers: one all-gather and one reduce-scatter per super-block; parameter names unchanged),
for hybrid models whose super-block is 3 linear-attention layers + 1 full-attention layer. Fewer,
larger collectives against a larger unsharded working set: the choice is measured by
``raggedfsdp.models.wrap_bench``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

BACKENDS = ("ragged", "torch")
FSDP_UNITS = ("layer", "superblock")

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _backend_api(backend: str) -> tuple[Any, type]:
    """``(fully_shard, MixedPrecisionPolicy)`` of ``backend``."""
    if backend == "torch":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        return fully_shard, MixedPrecisionPolicy
    if backend == "ragged":
        try:
            from raggedfsdp import MixedPrecisionPolicy, fully_shard
        except ImportError as e:
            raise ImportError(
                "backend 'ragged' needs raggedfsdp.fully_shard, which this installation does not "
                f"provide ({e}); use backend 'torch' (--backend torch) meanwhile"
            ) from e
        return fully_shard, MixedPrecisionPolicy
    raise ValueError(f"unknown FSDP backend {backend!r}; choose one of {BACKENDS}")


def parse_dtype(name: str) -> torch.dtype:
    """``"fp32"`` / ``"bf16"`` -> torch dtype."""
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def make_mp_policy(backend: str, *, param_dtype: str = "fp32", reduce_dtype: str = "fp32") -> Any:
    """The ``MixedPrecisionPolicy`` of ``backend`` for the given compute and gradient-reduce dtypes.

    Parameters are always *stored* (sharded, and in the optimizer) in fp32. ``param_dtype`` is the
    dtype of the all-gathered parameters used in forward/backward; ``reduce_dtype`` the dtype of
    the gradient reduce-scatter. fp32/fp32 is the default policy (no casts at all).
    """
    _, policy_cls = _backend_api(backend)
    pd, rd = parse_dtype(param_dtype), parse_dtype(reduce_dtype)
    if pd == torch.float32 and rd == torch.float32:
        return policy_cls()
    return policy_cls(param_dtype=pd, reduce_dtype=rd)


def fsdp_unit_modules(model: nn.Module, unit: str = "layer") -> list[tuple[str, list[nn.Module]]]:
    """``(unit name, modules)`` per ``fully_shard`` call of :func:`apply_fsdp`, bottom-up, root last.

    Raises:
        ValueError: ``unit`` not in :data:`FSDP_UNITS`, no ``model.layers`` ``ModuleList``, or
            ``"superblock"`` on a model without ``superblock_size`` (not a hybrid model).
    """
    if unit not in FSDP_UNITS:
        raise ValueError(f"unknown FSDP unit {unit!r} (--fsdp.unit); choose one of {FSDP_UNITS}")
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"apply_fsdp expects model.layers to be an nn.ModuleList, got {type(layers)}")
    if unit == "layer":
        units = [(f"layers.{i}", [block]) for i, block in enumerate(layers)]
    else:
        k = getattr(model, "superblock_size", None)
        if not k:
            raise ValueError(
                f"--fsdp.unit superblock needs a hybrid model (one with super-blocks); "
                f"{type(model).__name__} has plain layers: use --fsdp.unit layer or --model.name hybrid"
            )
        n = len(layers)
        units = [(f"layers.{s}-{min(s + k, n) - 1}", list(layers[s : s + k])) for s in range(0, n, k)]
    return [*units, ("root", [model])]


def apply_fsdp(
    model: nn.Module,
    mesh: Any,
    *,
    backend: str = "ragged",
    mp_policy: Any = None,
    reshard_after_forward: bool = True,
    shard_placement_fn: Any = None,
    unit: str = "layer",
) -> nn.Module:
    """Shard ``model`` in place with ``backend``'s ``fully_shard``: each of ``model.layers``, then the root.

    Args:
        model: a module with a ``layers`` ``nn.ModuleList`` (the transformer blocks).
        mesh: 1-D ``DeviceMesh`` over the data-parallel ranks.
        backend: ``"ragged"`` or ``"torch"``.
        mp_policy: a ``MixedPrecisionPolicy`` *of that backend* (see ``make_mp_policy``); ``None``
            means the default policy (no casting).
        reshard_after_forward: free each block's unsharded parameters after its forward (ZeRO-3,
            re-gathered in backward) or keep them until backward (ZeRO-2-like, more memory).
        shard_placement_fn: ``"ragged"`` only: the block policy (e.g. ``AdamW8bit.shard_placement_fn``);
            ``None`` is the default layout. Raises ``ValueError`` with the ``"torch"`` backend.
        unit: ``"layer"`` (one unit per block) or ``"superblock"`` (hybrid models: one unit per
            super-block), see :func:`fsdp_unit_modules`.

    Returns:
        ``model`` (now an FSDP module; its parameters are DTensors).
    """
    fully_shard, policy_cls = _backend_api(backend)
    if mp_policy is None:
        mp_policy = policy_cls()
    kw: dict[str, Any] = {}
    if shard_placement_fn is not None:
        if backend != "ragged":
            raise ValueError(
                f"apply_fsdp: shard_placement_fn is a raggedfsdp block policy; backend={backend!r} cannot honour it "
                "(use backend 'ragged')"
            )
        kw["shard_placement_fn"] = shard_placement_fn
    *units, _root = fsdp_unit_modules(model, unit)
    for _, modules in units:
        target = modules[0] if len(modules) == 1 else modules
        fully_shard(target, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward, **kw)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False, **kw)
    return model
