"""``fully_shard``: torch 2.13's FSDP2 API on RaggedShard + planner + DBuffer.

Source of the API and semantics: ``torch/distributed/fsdp/_fully_shard/_fully_shard.py`` (torch 2.13).
Layout of this package (one file per lifecycle role, as torch's ``_fully_shard``): ``_module.py``
(``FSDPModule`` methods, ``set_runtime_options``), ``_init.py`` (argument and module checks),
``_state.py`` (hooks, ``TrainingState``), ``_param_group.py`` (a unit: layout, unshard / reshard, the
``ParamState`` machine), ``_grads.py`` (``UnitGrads``: the gradient side and its ``GradState``
machine), ``_reduce.py`` (in-flight reductions), ``_agreement.py`` (unit agreement), ``_comm.py``
(state shared under a root); the buffers are ``raggedfsdp/buffer/``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, overload

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.fsdp._fully_shard import _fully_shard as _torch_fsdp_impl

from raggedfsdp.buffer.quant_gather import QuantizedAllGatherPolicy
from raggedfsdp.fsdp._common import FSDPTypeError, FSDPValueError, state_of
from raggedfsdp.fsdp._compile import eager_hook
from raggedfsdp.fsdp._module import FSDPModule, UnshardHandle
from raggedfsdp.fsdp._init import (
    _check_no_all_gather_extension,
    _device_of,
    _granularity_fn,
    _init_mesh,
    _make_load_pre_hook,
    _managed_params,
    _move_states_to_device,
    _spmd_dp_mesh,
    _spmd_params,
)
from raggedfsdp.fsdp._param_group import FSDPParamGroup, _mark_units_stepped
from raggedfsdp.fsdp._state import FSDPState

_cls_cache: dict[type, type] = {}
# torch's own fully_shard, captured before raggedfsdp.patch_torch() can point torch's names at ours
_TORCH_FULLY_SHARD = _torch_fsdp_impl.fully_shard


def _picklable_state_dict(module, state_dict, prefix, local_metadata) -> None:
    """Make this unit's state-dict DTensors ``torch.save``-able, in place (nothing is copied).

    A RaggedShard parameter's local piece is a view into the unit's flat shard (the DBuffer), so it
    starts at a storage offset, and DTensor's wrapper copies that offset: its ``data_ptr()`` is then
    non-zero although it has no storage, ``Tensor.__reduce_ex__`` takes the plain-tensor path and
    ``torch.save(model.state_dict())`` raised "Attempted to access the data pointer on an invalid python
    storage" (torch's ``fully_shard`` keeps its local shards at offset 0; a ``DTensor.from_local`` of a
    view at an offset fails the same way in torch 2.13). The entry is re-wrapped with offset 0 around
    the same local view, as torch FSDP2 itself re-points ``_local_tensor`` (``_fsdp_param.py``:
    ``reset_sharded_param``).
    """
    from torch.distributed.tensor import DTensor

    for key, value in state_dict.items():
        if key.startswith(prefix) and isinstance(value, DTensor) and value.storage_offset() != 0:
            local = value._local_tensor
            out = DTensor(local.new_empty(0), value._spec, requires_grad=value.requires_grad)
            out._local_tensor = local
            state_dict[key] = out


def _after_load(group: FSDPParamGroup) -> None:
    group.adopt_registered_params()  # load_state_dict(assign=True) replaced the sharded params
    group.mark_master_changed()


__all__ = ["FSDPModule", "UnshardHandle", "fully_shard", "get_cls_to_fsdp_cls"]


_OPTIMIZER_HOOK = None


def _register_optimizer_hook() -> None:
    """Register the global ``torch.optim`` step hooks once per process, on the first ``fully_shard`` call
    (so ``import raggedfsdp`` changes nothing global): the post-hook ``_mark_units_stepped`` and the
    pre-hook ``_refuse_replaced_params``."""
    global _OPTIMIZER_HOOK
    if _OPTIMIZER_HOOK is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        _OPTIMIZER_HOOK = (
            register_optimizer_step_post_hook(_mark_units_stepped),
            register_optimizer_step_pre_hook(_refuse_replaced_params),
        )


def _refuse_replaced_params(optimizer, *_args, **_kwargs) -> None:
    """Global ``torch.optim`` step pre-hook: refuse an optimizer that holds parameters
    ``fully_shard`` replaced, i.e. one built before ``fully_shard``. Those tensors are no longer the
    module's: they never get a gradient, so ``step()`` would silently change nothing (torch's
    ``fully_shard`` behaves the same, silently). Checked on an optimizer's first step and again after
    ``add_param_group``; afterwards one ``len`` per step. Local. Raises ``ValueError`` naming the
    optimizer, how many of its parameters were replaced, the first one, and the fix."""
    n = len(optimizer.param_groups)
    if optimizer.__dict__.get("_raggedfsdp_params_checked") == n:
        return
    replaced = [
        owner
        for pg in optimizer.param_groups
        for owner in map(
            getattr, pg["params"], itertools.repeat("_raggedfsdp_replaced"), itertools.repeat(None)
        )
        if owner is not None
    ]
    if replaced:
        raise ValueError(
            f"{type(optimizer).__name__}.step(): {len(replaced)} of its parameters were replaced by "
            f"fully_shard (e.g. {replaced[0]}) after the optimizer was built; they get no gradients, so "
            "the step would change nothing: build the optimizer after fully_shard, from "
            "model.parameters() (the sharded DTensors)"
        )
    optimizer.__dict__["_raggedfsdp_params_checked"] = n


def _check_later_kwargs(kwargs: dict, mp_policy) -> None:
    """Arguments of a later torch's ``fully_shard`` (read from the installed torch's signature): raise
    ``NotImplementedError`` naming them; anything else ``TypeError``, as Python. Also a
    ``MixedPrecisionPolicy`` field raggedfsdp does not implement (2.15's ``param_dtype_override_fn``)."""
    import inspect

    import torch

    known = inspect.signature(_TORCH_FULLY_SHARD).parameters
    for name in kwargs:
        if name in known:
            raise NotImplementedError(
                f"fully_shard: argument {name}= of torch {torch.__version__}'s fully_shard is not "
                "implemented by raggedfsdp yet; drop it or use torch's fully_shard for this module"
            )
        raise TypeError(f"fully_shard() got an unexpected keyword argument {name!r}")
    if getattr(mp_policy, "param_dtype_override_fn", None) is not None:
        raise NotImplementedError(
            "fully_shard: MixedPrecisionPolicy(param_dtype_override_fn=...) (torch 2.15) is not implemented "
            "by raggedfsdp: a unit's parameters share one param_dtype; shard the parameters kept in their "
            "own dtype as a separate unit (fully_shard on their submodule with its own mp_policy)"
        )


@overload
def fully_shard(module: nn.Module, **kwargs: Any) -> FSDPModule: ...
@overload
def fully_shard(module: list[nn.Module], **kwargs: Any) -> list[FSDPModule]: ...


def fully_shard(
    module,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: Any = None,
    zero_stage: int = 3,
    all_gather_policy: QuantizedAllGatherPolicy | None = None,
    **later_torch_kwargs: Any,
):
    """Shard ``module``'s parameters (those not already managed by a nested ``fully_shard``) as one FSDP unit.

    Same signature and semantics as torch 2.13's ``torch.distributed.fsdp.fully_shard``: call it
    bottom-up (each transformer block, then the root). Afterwards ``module.parameters()`` are
    ``nn.Parameter(DTensor)`` with placement ``RaggedShard`` (HSDP: ``(Replicate(), RaggedShard)``)
    whose local tensors are 1-D views into the unit's flat sharded buffer; a stock optimizer trains
    them. Before forward the unit is all-gathered in place into one flat buffer (params are views of
    it); after backward its flat grad buffer is reduce-scattered in place and averaged.

    Args:
        module: module or list of modules forming one unit (a list shares one communication group).
        mesh: 1-D mesh (FSDP) or 2-D ``(replicate, shard)`` mesh (HSDP). Default: all ranks, 1-D,
            on CUDA if NCCL is the default backend else CPU.
        reshard_after_forward: ``True`` frees params after forward, ``False`` keeps them for backward,
            ``None`` means ``True`` except for the root. An ``int`` ``k`` (a divisor of the shard world
            size ``m``, 1-D meshes) keeps a ``1/k`` slice of the unsharded buffer after forward, so the
            backward all-gather runs within consecutive groups of ``k`` ranks (e.g. one node);
            ``k == m`` is ``True`` and ``k == 1`` is ``False``.
        shard_placement_fn: the per-parameter block policy (the paper's ``orig_param_policy``):
            ``fn(param) -> None | Shard(0) | int | str | BlockSpec``. ``None`` (and no
            ``shard_placement_fn`` at all) gives element granularity, the least padding: element-wise
            optimizers (AdamW, SGD) and ``raggedfsdp.optim.Muon`` need no blocks, and the optimizers
            that do declare them (``AdamW8bit.shard_placement_fn``, ``Shampoo.shard_placement_fn``).
            ``Shard(0)`` gives row blocks (``shape[-1]`` elements, 1 for vectors), as torch's
            ``fully_shard`` keeps whole rows; an ``int`` is a block size in elements; a
            block spec ``"element"``, ``"row"``, ``"rows:K"``, ``"tile:RxC"`` (e.g. 32x32 quantization
            tiles) or ``"matrix"`` is resolved by ``raggedfsdp.planner.granularity_for``. No rank
            boundary ever cuts a block.
        mp_policy: ``MixedPrecisionPolicy(param_dtype, reduce_dtype, output_dtype, cast_forward_inputs)``.
        offload_policy: ``OffloadPolicy()`` (none) or ``CPUOffloadPolicy(pin_memory=True)``: sharded
            params, sharded grads and hence optimizer state live on the CPU; each all-gather starts
            with one H2D copy (fused with the ``param_dtype`` cast), each reduce-scatter ends with
            one D2H copy. (On a CPU-only mesh it changes nothing.)
        ignored_params: parameters left unsharded and unreduced.
        dp_mesh_dims: ``None`` or a ``torch.distributed.fsdp.DataParallelMeshDims(shard=, replicate=)``:
            ``mesh`` is then the full SPMD mesh and every managed parameter a DTensor on it with
            ``Replicate()`` on the named DP dims (torchtitan's ``full_dtensor`` mode); several shard (or
            replicate) dims are flattened into one, as torch does. The unsharded parameters keep their
            SPMD placements; the sharded ones are ``([Replicate(),] RaggedShard, *other dims)``. Needs
            the DP dims first in the mesh (replicate then shard) and a shard dim (Note [dp_mesh_dims] in
            ``fsdp/_init.py``).
        zero_stage: raggedfsdp extension (keyword-only, default 3). ``3`` shards params, grads and
            optimizer state (ZeRO-3). ``2`` keeps params unsharded from forward to backward
            (``reshard_after_forward=False``: no all-gather in backward). ``1`` keeps params
            unsharded between steps too; a unit is re-gathered only after its sharded master changed:
            a ``torch.optim`` step whose param groups hold one of its params, ``load_state_dict``, or
            an in-place edit its params' version counters see (per-unit, so a rank-local optimizer
            step over other params never makes ranks disagree). Grads are always
            reduce-scattered (RS + AG moves the same bytes as ZeRO-1's all-reduce) and optimizer
            state is always sharded.
        all_gather_policy: raggedfsdp extension (keyword-only, default ``None``: all-gather in
            ``param_dtype``). A :class:`~raggedfsdp.fsdp.QuantizedAllGatherPolicy` all-gathers this unit's
            matrices as 8-bit block codes (``fp8_e4m3`` or ``int8``) plus one fp32 scale per block,
            quantized by each block's one owner from the sharded master once per optimizer step and
            dequantized to ``param_dtype`` for compute; gradients reach the full-precision master
            unchanged (straight-through). Their blocks are kept whole on one rank (the granularity is
            raised to whole block rows). Note [quantized all-gather] in
            ``raggedfsdp/buffer/quant_gather.py``; ``docs/quantized_comm.md``.
        **later_torch_kwargs: an argument a later torch's ``fully_shard`` has and raggedfsdp does not
            implement raises ``NotImplementedError`` naming it (checked against the installed torch's
            signature); any other unknown argument raises ``TypeError``, as Python does. (torch 2.14
            and 2.15 add no ``fully_shard`` argument.)

    Which ranks: every rank of ``mesh`` must call it, in the same order, on the same module tree.

    Raises (the exception types of torch's ``fully_shard`` for the same misuse; where torch raises
    ``AssertionError`` or ``ValueError`` and the project's rule asks ``ValueError`` / ``TypeError``, the
    error is
    both: ``raggedfsdp.fsdp._common.FSDPValueError`` / ``FSDPTypeError``):
        ValueError: module already fully_shard'ed (also ``AssertionError``), mesh of the wrong dims, a 2-D
            mesh without dim names (also ``AssertionError``), a mesh not containing this rank,
            params on several devices (or partly on meta), mixed dtypes in one unit, 0-dim params,
            a granularity that does not divide a param, an int ``reshard_after_forward`` that does
            not divide the shard world size, a parameter tied across units, bad ``zero_stage``.
        TypeError: a non-module, a non-DeviceMesh mesh, a non-bool/int ``reshard_after_forward``, an
            unsupported ``shard_placement_fn`` result and a non-int (or bool) ``zero_stage`` (these three
            also ``ValueError``), an ``mp_policy`` or ``offload_policy`` of the wrong type.
        NotImplementedError: a non-contiguous (e.g. ``channels_last``) parameter, a
            ``ShardPlacementResult`` on a mesh other than the unit's, ``dp_mesh_dims`` without a shard dim
            or with the DP dims not leading the mesh, int ``reshard_after_forward`` with ``dp_mesh_dims``
            (torch raises it too), a later torch's argument (above), a parameter whose tensor subclass
            defines ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` (torch's all-gather extension).
    """
    _check_later_kwargs(later_torch_kwargs, mp_policy)
    _register_optimizer_hook()
    modules = tuple(module) if isinstance(module, (list, tuple)) else (module,)
    if not modules:
        raise ValueError("fully_shard: got an empty list of modules")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard: expects nn.Module or a list of them, got {type(m).__name__}")
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward:
            raise ValueError(
                "fully_shard does not support containers that do not implement forward: "
                f"{type(m).__name__} has no forward, so its hooks would never run; "
                "call fully_shard on each child module instead"
            )
        if state_of(m) is not None:
            raise FSDPValueError(
                "Each distinct composable distributed API can only be applied to a module once. "
                f"fully_shard: {type(m).__name__} is already fully_shard'ed; call fully_shard once per module"
            )
    if isinstance(reshard_after_forward, bool) or reshard_after_forward is None:
        pass
    elif not isinstance(reshard_after_forward, int):
        raise FSDPTypeError(
            f"fully_shard: reshard_after_forward must be None, a bool or an int, got "
            f"{reshard_after_forward!r}"
        )
    if isinstance(zero_stage, bool) or not isinstance(zero_stage, int):  # True == 1 passed as ZeRO-1
        raise FSDPTypeError(
            f"fully_shard: zero_stage must be an int (1, 2 or 3), got {type(zero_stage).__name__} "
            f"{zero_stage!r}; e.g. zero_stage=3"
        )
    if zero_stage not in (1, 2, 3):
        raise ValueError(f"fully_shard: zero_stage={zero_stage!r} must be 1, 2 or 3")
    # a dict failed later with "'dict' object has no attribute 'param_dtype'"
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(
            f"fully_shard: mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}; "
            "pass raggedfsdp.MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...) (the same class as "
            "torch.distributed.fsdp.MixedPrecisionPolicy)"
        )
    if zero_stage < 3:
        if reshard_after_forward:
            raise ValueError(
                f"fully_shard: zero_stage={zero_stage} keeps params unsharded after forward, which "
                "contradicts reshard_after_forward=True; drop one of the two"
            )
        reshard_after_forward = False
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(
            f"fully_shard: offload_policy must be an OffloadPolicy, got {type(offload_policy).__name__}"
        )
    if all_gather_policy is not None and not isinstance(all_gather_policy, QuantizedAllGatherPolicy):
        raise TypeError(
            f"fully_shard: all_gather_policy must be None or a QuantizedAllGatherPolicy, got "
            f"{type(all_gather_policy).__name__}; e.g. all_gather_policy=QuantizedAllGatherPolicy('fp8_e4m3')"
        )
    offload = isinstance(offload_policy, CPUOffloadPolicy)
    spmd_mesh, n_dp = None, 0
    if dp_mesh_dims is not None:  # Note [dp_mesh_dims] in _init.py: mesh is the full SPMD mesh
        spmd_mesh = mesh
        mesh, n_dp = _spmd_dp_mesh(mesh, dp_mesh_dims)
        if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
            raise NotImplementedError(  # torch's message (_fully_shard.py)
                "reshard_after_forward as int is not yet supported with SPMD mesh (dp_mesh_dims)"
            )
    mesh = _init_mesh(mesh)
    post_forward_mesh = None
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        k, m = reshard_after_forward, mesh.size(mesh.ndim - 1)
        if k < 1 or m % k != 0:
            raise ValueError(
                f"fully_shard: reshard_after_forward={k} must be a positive divisor of the shard world size "
                f"{m} (the size of the smaller group params are resharded to after forward)"
            )
        if k == m:
            reshard_after_forward = True
        elif k == 1:
            reshard_after_forward = False
        else:
            # consecutive groups of k ranks (e.g. one node), over the whole mesh as FSDP2's
            # _get_post_forward_mesh_info (HSDP: k divides the shard size, so each group lies in one
            # replica; replicas hold equal unsharded params). Collective: every rank builds the same mesh
            post_forward_mesh = DeviceMesh(mesh.device_type, mesh.mesh.view(-1, k))
            reshard_after_forward = True
    ignored = set(ignored_params or ())
    params = _managed_params(modules, ignored)
    for p, fqn, _ in params:
        _check_no_all_gather_extension(p, fqn, type(modules[0]).__name__)
    planned, spmd_specs = params, None
    if spmd_mesh is not None:
        planned, spmd_specs = _spmd_params(params, spmd_mesh, n_dp, tuple(dp_mesh_dims.shard_names))
    _move_states_to_device(modules, planned, mesh, offload)  # a CPU-built module on a CUDA mesh, like FSDP2
    device = _device_of(planned, mesh, offload)
    gran_fn = _granularity_fn(shard_placement_fn, mesh)
    group = (
        FSDPParamGroup(
            planned,
            mesh,
            mp_policy,
            device,
            gran_fn,
            offload=offload,
            pin_memory=getattr(offload_policy, "pin_memory", True),
            spmd_specs=spmd_specs,
            all_gather_policy=all_gather_policy,
        )
        if params
        else None
    )
    unit = type(modules[0]).__name__
    for p, fqn, _ in params:
        p._raggedfsdp_owner = f"{unit}:{fqn}"  # the original tensor, now replaced by a DTensor
        p._raggedfsdp_replaced = f"{fqn!r} of {unit}"  # an optimizer still holding it trains nothing
    for fp in group.fsdp_params if group is not None else ():
        fp.sharded._raggedfsdp_owner = f"{unit}:{fp.fqn}"  # and the DTensor that replaced it
    if group is not None and post_forward_mesh is not None:
        group.set_post_forward_mesh(post_forward_mesh)
    if group is not None and zero_stage == 1:
        group.reshard_after_backward = False
    state = FSDPState(modules, group, mp_policy, reshard_after_forward)
    for m in modules:
        m._raggedfsdp_state = state
        m.register_forward_pre_hook(
            eager_hook(lambda mod, a, k: state._pre_forward(mod, a, k)), prepend=True, with_kwargs=True
        )
        m.register_forward_hook(eager_hook(lambda mod, a, o: state._post_forward(mod, a, o)))
        if group is not None:
            # state dicts hold the sharded RaggedShard DTensors; loading invalidates a kept gather
            m.register_state_dict_pre_hook(lambda mod, prefix, keep_vars, g=group: g.reshard(free=False))
            m.register_state_dict_post_hook(_picklable_state_dict)
            m.register_load_state_dict_pre_hook(_make_load_pre_hook(m, group))
            m.register_load_state_dict_post_hook(lambda mod, keys, g=group: _after_load(g))
        m.__class__ = _fsdp_class(type(m))
    return list(modules) if isinstance(module, (list, tuple)) else module


def _fsdp_class(cls: type) -> type:
    """``FSDP<Cls>(FSDPModule, Cls)``: torch's naming (``repr``/``type(m).__name__`` read as under torch's
    ``fully_shard``, and name-based checks keep working), but defined in ``raggedfsdp.fsdp`` so
    ``type(m)`` shows which library sharded the module."""
    if cls not in _cls_cache:
        name = f"FSDP{cls.__name__}"
        _cls_cache[cls] = type(
            name, (FSDPModule, cls), {"__module__": "raggedfsdp.fsdp", "__qualname__": name}
        )
    return _cls_cache[cls]


def get_cls_to_fsdp_cls() -> dict[type, type]:
    """The ``{Cls: FSDP<Cls>}`` classes raggedfsdp's ``fully_shard`` made so far, as torch's
    ``get_cls_to_fsdp_cls`` returns its own (the live dict). Local."""
    return _cls_cache


def _state_of(module: nn.Module):
    """``fully_shard.state(module)``: the module's raggedfsdp ``FSDPState``, as torch's ``fully_shard.state``;
    for a module raggedfsdp did not shard, torch's ``fully_shard.state(module)`` (``None`` for an unsharded
    one), so torch's own ``fully_shard``, whose body looks its module-global ``fully_shard.state`` up,
    keeps working while :func:`raggedfsdp.patch_torch` points that global here. Local."""
    st = state_of(module)
    return st if st is not None else _TORCH_FULLY_SHARD.state(module)


fully_shard.state = _state_of  # type: ignore[attr-defined]
