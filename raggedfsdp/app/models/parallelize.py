"""Apply FSDP (ZeRO-3) to a model built from ``raggedfsdp.app.models``.

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
``raggedfsdp.app.models.wrap_bench``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

BACKENDS = ("ragged", "torch")
FSDP_UNITS = ("layer", "superblock", "layers:K")
"""The one FSDP-unit vocabulary, used by ``--fsdp.unit``, ``raggedfsdp plan / estimate-memory --unit``,
``raggedfsdp bench --wrap`` and the real-size tables of ``raggedfsdp.app.sizing``: ``layer`` (one unit per
block of ``model.layers``), ``superblock`` (hybrid models: one unit per super-block of
``superblock_size`` layers) or ``layers:K`` (one unit per ``K`` consecutive blocks)."""


def parse_unit(unit: str) -> int | None:
    """Blocks per FSDP unit: 1 for ``"layer"``, ``K`` for ``"layers:K"``, None for ``"superblock"`` (the
    model's own ``superblock_size``). ``ValueError`` naming ``unit`` and the vocabulary otherwise."""
    if unit == "layer":
        return 1
    if unit == "superblock":
        return None
    if unit.startswith("layers:") and unit[7:].isdigit() and int(unit[7:]) >= 1:
        return int(unit[7:])
    raise ValueError(
        f"unknown FSDP unit {unit!r} (unit=, --fsdp.unit, --unit); choose one of layer | superblock | "
        "layers:K (K >= 1)"
    )


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def backend_api(backend: str) -> tuple[Any, type]:
    """``(fully_shard, MixedPrecisionPolicy)`` of ``backend``."""
    if backend == "torch":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        return fully_shard, MixedPrecisionPolicy
    if backend == "ragged":
        from raggedfsdp import MixedPrecisionPolicy, fully_shard

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
    _, policy_cls = backend_api(backend)
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
    k = parse_unit(unit)
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"apply_fsdp expects model.layers to be an nn.ModuleList, got {type(layers)}")
    if k == 1:
        units = [(f"layers.{i}", [block]) for i, block in enumerate(layers)]
    else:
        k = k or getattr(model, "superblock_size", None)
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
    experts_mesh: Any = None,
    all_gather_dtype: str = "none",
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
        unit: ``"layer"`` (one unit per block), ``"superblock"`` (hybrid models: one unit per
            super-block) or ``"layers:K"`` (``K`` blocks per unit), see :func:`fsdp_unit_modules`.
        experts_mesh: expert parallel (after :func:`apply_ep`): the 1-D mesh of the data-parallel ranks
            that hold the same experts (torchtitan's ``dp_shard_mod_ep``, e.g. ``world["dp"]`` of a
            ``("dp", "ep")`` mesh, while ``mesh`` is the whole ``dp x ep`` group, e.g.
            ``world["dp", "ep"]._flatten()``). Each block's expert stacks then get their own FSDP unit
            over ``experts_mesh`` (sharded again along the dp dim, ``Shard(0)`` on ``ep`` kept), with
            the gradient divided by ``mesh.size()``: the backward all-to-all already summed the expert
            gradients over the EP group. Every other parameter is sharded over ``mesh``.
        all_gather_dtype: ``"ragged"`` only: ``"fp8_e4m3"`` or ``"int8"`` gives every unit a
            ``QuantizedAllGatherPolicy`` of that dtype (32x32 blocks; docs/quantized_comm.md); ``"none"``
            (the default) gathers in ``param_dtype``. Raises ``ValueError`` with the ``"torch"`` backend.

    Returns:
        ``model`` (now an FSDP module; its parameters are DTensors).
    """
    fully_shard, policy_cls = backend_api(backend)
    if mp_policy is None:
        mp_policy = policy_cls()
    kw: dict[str, Any] = {}
    if shard_placement_fn is not None:
        if backend != "ragged":
            raise ValueError(
                f"apply_fsdp: shard_placement_fn is a raggedfsdp block policy; backend={backend!r} cannot "
                "honour it (use backend 'ragged')"
            )
        kw["shard_placement_fn"] = shard_placement_fn
    if all_gather_dtype != "none":
        if backend != "ragged":
            raise ValueError(
                f"apply_fsdp: all_gather_dtype={all_gather_dtype!r} is a raggedfsdp extension; "
                f"backend={backend!r} cannot honour it (use backend 'ragged', or all_gather_dtype 'none')"
            )
        from raggedfsdp import QuantizedAllGatherPolicy

        kw["all_gather_policy"] = QuantizedAllGatherPolicy(all_gather_dtype)
    *units, _root = fsdp_unit_modules(model, unit)
    for _, modules in units:
        if experts_mesh is not None:
            _shard_experts(
                modules,
                experts_mesh,
                mesh.size(),
                backend,
                fully_shard,
                mp_policy=mp_policy,
                reshard_after_forward=reshard_after_forward,
                **kw,
            )
        target = modules[0] if len(modules) == 1 else modules
        fully_shard(target, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward, **kw)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False, **kw)
    return model


def apply_compile(model: nn.Module, **compile_kw: Any) -> nn.Module:
    """``block.compile(fullgraph=True)`` for each of ``model.layers``, in place: call it before
    ``fully_shard``.

    Per-block compilation as torchtitan's ``apply_compile``: each block body becomes one graph (the
    blocks share it when they are alike), the FSDP hooks stay eager around it (``fsdp/_compile.py``),
    and parameter names do not change (the module is compiled in place, not wrapped). ``compile_kw``
    goes to ``torch.compile`` (e.g. ``backend="aot_eager"``). Local; returns ``model``.

    Raises:
        ValueError: no ``model.layers`` ``ModuleList``.
    """
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"apply_compile expects model.layers to be an nn.ModuleList, got {type(layers)}")
    kw = {"fullgraph": True, **compile_kw}
    for block in layers:
        block.compile(**kw)
    return model


def _shard_experts(modules, experts_mesh, world: int, backend: str, fully_shard, **kw) -> None:
    """One ``fully_shard`` per expert-parallel ``FusedExperts`` in ``modules``, over ``experts_mesh``."""
    from raggedfsdp.app.models.moe import FusedExperts

    experts = [m for mod in modules for m in mod.modules() if isinstance(m, FusedExperts)]
    for ex in experts:
        if ex.ep_mesh is None:
            raise ValueError(
                "apply_fsdp: experts_mesh is given but the experts are not expert-parallel; call "
                "apply_ep(model, mesh['ep']) first, or drop experts_mesh"
            )
        fully_shard(ex, mesh=experts_mesh, **kw)
        ex.set_gradient_divide_factor(float(world))  # grads are already summed over EP by the all-to-all
        if backend == "torch":
            ex.set_force_sum_reduction_for_comms(True)  # SUM, then divide: no PREMUL_SUM (gloo lacks it)


def apply_ep(model: nn.Module, mesh: Any) -> nn.Module:
    """Split the routed experts of every MoE layer of ``model`` over the 1-D EP ``mesh``, in place.

    Each EP rank ``r`` of ``mesh`` (size ``ep``) keeps experts ``[r*X/ep, (r+1)*X/ep)`` whole: the fused
    stacks ``w1``, ``w3`` (X, D, F) and ``w2`` (X, F, D) become ``Shard(0)`` DTensors on ``mesh`` with
    local (X/ep, D, F) / (X/ep, F, D) pieces, sliced from this rank's own (identically initialised, or
    meta) tensors without communication. Forward then dispatches each token row to its expert's rank
    with ``all_to_all_single`` and combines the results back (``models/_ep.py``; torchtitan's
    ``ExpertParallel`` layout); router, shared expert, attention and embeddings are unchanged
    (replicated over EP: shard them with FSDP over the whole dp x ep group). Call it before
    ``fully_shard``/``init_weights`` (``init_weights`` fills DTensor shards). Every rank of ``mesh``
    must call it, and then run the same MoE layers in every forward/backward.

    Raises:
        TypeError: ``mesh`` is not a 1-D ``DeviceMesh``.
        ValueError: ``model`` has no MoE layer, a layer's experts are not ``experts="fused"``, or its
            ``n_experts`` is not divisible by the EP size.
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    from raggedfsdp.app.models.moe import FusedExperts, MoEFeedForward

    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise TypeError(f"apply_ep: mesh must be a 1-D DeviceMesh (e.g. mesh['ep']), got {mesh!r}")
    ep, r = mesh.size(), mesh.get_local_rank()
    layers = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    if not layers:
        raise ValueError(f"apply_ep: {type(model).__name__} has no MoE layer (MoEFeedForward) to split")
    for ff in layers:
        ex = ff.experts
        if not isinstance(ex, FusedExperts):
            raise ValueError(  # noqa: TRY004 - a config value (experts=), not an argument type
                f"apply_ep: expert parallelism needs fused expert stacks, got {type(ex).__name__}; "
                "build the model with experts='fused' (--model.experts fused)"
            )
        if ff.n_experts % ep:
            raise ValueError(
                f"apply_ep: n_experts={ff.n_experts} is not divisible by the EP size {ep}; choose an EP size "
                f"that divides it"
            )
        if ex.ep_mesh is not None:
            raise ValueError("apply_ep: the experts are already expert-parallel (apply_ep called twice)")
        n = ff.n_experts // ep
        for name in ("w1", "w3", "w2"):
            p = getattr(ex, name)
            local = p.detach()[r * n : (r + 1) * n].clone()
            dt = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
            setattr(ex, name, nn.Parameter(dt, requires_grad=p.requires_grad))
        ex.ep_mesh = mesh
    return model


def tp_plan_errors(cfg: Any, tp: int) -> list[str]:
    """Why ``cfg`` cannot be split over ``tp`` tensor-parallel ranks (empty: it can). Pure, for checks
    before launch: query and key/value heads, the SwiGLU width and the vocabulary must divide by ``tp``."""
    errs = []
    if tp < 1:
        return [f"tp={tp} must be >= 1"]
    for name in ("n_heads", "n_kv_heads", "hidden_dim", "vocab_size"):
        v = getattr(cfg, name, None)
        if isinstance(v, int) and v % tp:
            errs.append(f"{name}={v} is not divisible by tp={tp}")
    return errs


def apply_tp(model: nn.Module, mesh: Any) -> nn.Module:
    """Tensor-parallel plan for ``raggedfsdp.app.models.Llama`` over the 1-D TP ``mesh``, in place (Megatron's
    column/row split, as torchtitan's ``parallelize_llama`` without sequence parallel or loss parallel).

    Per block: ``wq``/``wk``/``wv`` and the SwiGLU ``w1``/``w3`` are column-wise (``ColwiseParallel``:
    weight ``Shard(0)``, each rank computes its heads / hidden units), ``wo`` and ``w2`` row-wise
    (``RowwiseParallel``: weight ``Shard(1)``, one all-reduce of the block output); the attention then runs
    on ``n_heads / tp`` local heads (``n_kv_heads / tp`` key/value heads). The embedding is row-wise over
    the vocabulary (``Shard(0)``), the output projection column-wise with replicated logits, the final
    norm a ``Replicate()`` DTensor; the block norms stay plain tensors. Call it before ``fully_shard``
    (over the dp mesh: ``apply_fsdp(model, root["dp"])``) and before ``init_weights`` (which fills
    DTensor shards with the single-device values). Every rank of ``mesh`` must call it.

    Raises:
        TypeError: ``mesh`` is not a 1-D ``DeviceMesh``.
        ValueError: not a ``Llama`` (no ``layers`` of attention + feed-forward blocks), a mixture-of-experts
            layer (EP x TP is not supported), or heads, hidden width or vocabulary not divisible by the TP
            size
            (see :func:`tp_plan_errors`).
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, distribute_module
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise TypeError(f"apply_tp: mesh must be a 1-D DeviceMesh (e.g. root['tp']), got {mesh!r}")
    cfg = getattr(model, "cfg", None)
    layers = getattr(model, "layers", None)
    if (
        cfg is None
        or layers is None
        or not all(hasattr(b, "attention") and hasattr(b, "feed_forward") for b in layers)
    ):
        raise ValueError(
            f"apply_tp: {type(model).__name__} is not a raggedfsdp Llama (layers of attention + "
            "feed_forward blocks); write a parallelize_module plan for it"
        )
    moe = [i for i, b in enumerate(layers) if not all(hasattr(b.feed_forward, w) for w in ("w1", "w2", "w3"))]
    if moe:
        raise ValueError(
            f"apply_tp: layers {moe} of {type(model).__name__} are mixture-of-experts layers; EP x TP is not "
            "supported (this plan has no tensor-parallel split of experts or router): use apply_ep + "
            "apply_fsdp(experts_mesh=) for a mixture of experts, apply_tp for a dense Llama"
        )
    tp = mesh.size()
    errs = tp_plan_errors(cfg, tp)
    if errs:
        raise ValueError(f"apply_tp: cannot split {type(model).__name__} over tp={tp}: " + "; ".join(errs))
    if tp == 1:
        return model
    for block in layers:
        parallelize_module(
            block,
            mesh,
            {
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(),
            },
        )
        block.attention.n_heads //= tp
        block.attention.n_kv_heads //= tp
    plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate())}
    if model.output is not None:
        plan["output"] = ColwiseParallel(output_layouts=Replicate())
    parallelize_module(model, mesh, plan)

    def to_replicate(_mod, inputs, m):
        return tuple(DTensor.from_local(x, m, [Replicate()], run_check=False) for x in inputs)

    distribute_module(model.norm, mesh, input_fn=to_replicate, output_fn=lambda _mod, out, _m: out.to_local())
    return model
