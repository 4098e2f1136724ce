"""Apply FSDP (ZeRO-3) to a model built from ``raggedfsdp.models``.

Two interchangeable backends with the same ``fully_shard`` signature:

- ``"ragged"``: ``raggedfsdp.fully_shard`` (RaggedShard DTensors, planner-chosen layout, DBuffers);
- ``"torch"``: ``torch.distributed.fsdp.fully_shard`` (torch's FSDP2, even ``Shard(0)``), useful as a
  numerical reference and as the baseline in benchmarks.

Wrapping (bottom-up, as ``fully_shard`` requires): one call per transformer block, so each block's
parameters are all-gathered just before its forward/backward and freed after; then one call on the
root, which owns what is left (embedding, final norm, output projection). The root keeps its
parameters unsharded after forward because backward needs the output projection first.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

BACKENDS = ("ragged", "torch")

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


def apply_fsdp(
    model: nn.Module,
    mesh: Any,
    *,
    backend: str = "ragged",
    mp_policy: Any = None,
    reshard_after_forward: bool = True,
    shard_placement_fn: Any = None,
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

    Returns:
        ``model`` (now an FSDP module; its parameters are DTensors).
    """
    fully_shard, policy_cls = _backend_api(backend)
    if mp_policy is None:
        mp_policy = policy_cls()
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"apply_fsdp expects model.layers to be an nn.ModuleList, got {type(layers)}")
    kw: dict[str, Any] = {}
    if shard_placement_fn is not None:
        if backend != "ragged":
            raise ValueError(
                f"apply_fsdp: shard_placement_fn is a raggedfsdp block policy; backend={backend!r} cannot honour it "
                "(use backend 'ragged')"
            )
        kw["shard_placement_fn"] = shard_placement_fn
    for block in layers:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward, **kw)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False, **kw)
    return model
