"""``fully_shard``: torch 2.13's FSDP2 API on RaggedShard + planner + DBuffer.

Source of the API and semantics: ``torch/distributed/fsdp/_fully_shard/_fully_shard.py`` (torch 2.13).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, overload

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor

from raggedfsdp.fsdp._param_group import FSDPParamGroup, bump_master_epoch
from raggedfsdp.fsdp._state import FSDPState

_cls_cache: dict[type, type] = {}


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` completes the all-gather."""

    def __init__(self, group: FSDPParamGroup | None):
        self._group = group

    def wait(self) -> None:
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group = None


class FSDPModule:
    """Mixin swapped into a ``fully_shard``'ed module's class (like torch's ``FSDPModule``)."""

    def __new__(cls, *args, **kwargs):
        # indexing into e.g. a fully_shard'ed ModuleList builds the original class, not the FSDP one
        orig = cls.__mro__[2]
        self = orig.__new__(orig, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    def _fsdp_state(self) -> FSDPState:
        return self._raggedfsdp_state  # type: ignore[attr-defined]

    def _fsdp_states(self, recurse: bool) -> list[FSDPState]:
        if not recurse:
            return [self._fsdp_state()]
        out = []
        for m in self.modules():  # type: ignore[attr-defined]
            st = getattr(m, "_raggedfsdp_state", None)
            if st is not None and st not in out:
                out.append(st)
        return out

    def reshard(self) -> None:
        """Free this unit's unsharded params (not recursive). Local."""
        g = self._fsdp_state().group
        if g is not None:
            g.reshard()

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this unit's params (collective over its shard group); ``async_op`` returns a handle."""
        st = self._fsdp_state()
        g = st.group
        if g is None:
            return UnshardHandle(None) if async_op else None
        g.unshard(async_op=async_op)
        handle = UnshardHandle(g)
        if async_op:
            return handle
        handle.wait()
        return None

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Turn reduce-scatter (and HSDP all-reduce) on or off; off accumulates unsharded grads locally."""
        for st in self._fsdp_states(recurse):
            if st.group is not None:
                st.group.reduce_grads = requires_gradient_sync
                st.group.all_reduce_grads = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: ``False`` reduce-scatters but defers the replicate-dim all-reduce (the shard-reduced sum
        is kept and added to the next synced backward). Local setting; no effect on 1-D meshes."""
        for st in self._fsdp_states(recurse):
            if st.group is not None:
                st.group.all_reduce_grads = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Free (``True``) or keep (``False``) the unsharded params between forward and backward.

        Raises ``TypeError`` for a non-bool. Local setting (every rank should set the same value).
        """
        if not isinstance(reshard_after_forward, bool):
            raise TypeError(f"set_reshard_after_forward: expects a bool, got {reshard_after_forward!r}")
        for st in self._fsdp_states(recurse):
            st.reshard_after_forward = reshard_after_forward
            st._auto_reshard = False

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """``False`` keeps the all-gathered params after backward; the next forward reuses them unless an
        optimizer step or ``load_state_dict`` happened since (then it re-gathers). Local setting."""
        for st in self._fsdp_states(recurse):
            if st.group is not None:
                st.group.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Unshard ``modules`` (async) right after this module's own unshard in forward."""
        _check_fsdp_modules(modules, "set_modules_to_forward_prefetch")
        self._fsdp_state().forward_prefetch = [m._fsdp_state() for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Unshard ``modules`` (async) right after this module's own unshard in backward."""
        _check_fsdp_modules(modules, "set_modules_to_backward_prefetch")
        self._fsdp_state().backward_prefetch = [m._fsdp_state() for m in modules]

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Kept for API parity; the final callback always completes reduce-scatters that were launched."""
        self._fsdp_state()._is_last_backward = is_last_backward

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide reduced grads by ``factor`` instead of the data-parallel world size (recursive)."""
        if factor <= 0:
            raise ValueError(f"set_gradient_divide_factor: factor={factor} must be > 0")
        for st in self._fsdp_states(True):
            if st.group is not None:
                st.group.gradient_divide_factor = float(factor)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """``False`` skips the backward all-gather of this unit (only valid if its backward does not read
        its parameters, e.g. an embedding; it must then reshard after forward)."""
        self._fsdp_state().unshard_in_backward = unshard_in_backward

    def set_post_optim_event(self, event) -> None:
        """Accepted for API parity; collectives are ordered by ``Work.wait()`` on the current stream."""
        self._fsdp_state()._post_optim_event = event

    def reset_iter_state(self) -> None:
        """Recover after an exception mid-iteration: reshard everything and drop pending state."""
        for st in self._fsdp_states(True):
            st.forward_order.clear()
            st._final_callback_queued = False
            if st.group is not None:
                st.group.pending_reduce = None
                st.group.reshard()

    def _apply(self, *args, **kwargs):
        # `.to()`, `.to_empty()`, `.float()` replace local tensors: reshard, then re-point sharded params
        # at a fresh flat buffer (torch's FSDP2 does the same via reset_sharded_param)
        for st in self._fsdp_states(True):
            if st.group is not None:
                st.group.reshard()
        ret = super()._apply(*args, **kwargs)  # type: ignore[misc]
        for st in self._fsdp_states(True):
            if st.group is not None:
                st.group.reset_sharded_storage()
        return ret

    def __deepcopy__(self, memo):
        raise RuntimeError("raggedfsdp: deepcopy of a fully_shard'ed module is not supported; deepcopy before")


def _check_fsdp_modules(modules, name: str) -> None:
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise TypeError(f"{name}: {type(m).__name__} is not a fully_shard'ed module; call fully_shard on it first")


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
    zero_stage: int = 3,
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
            ``fn(param) -> None | Shard(0) | int | str | BlockSpec``. ``None`` / ``Shard(0)`` give row
            blocks (``shape[-1]`` elements, 1 for vectors); an ``int`` is a block size in elements; a
            block spec ``"element"``, ``"row"``, ``"rows:K"``, ``"tile:RxC"`` (e.g. 32x32 quantization
            tiles) or ``"matrix"`` is resolved by ``raggedfsdp.planner.granularity_for``. No rank
            boundary ever cuts a block.
        mp_policy: ``MixedPrecisionPolicy(param_dtype, reduce_dtype, output_dtype, cast_forward_inputs)``.
        offload_policy: ``OffloadPolicy()`` (none) or ``CPUOffloadPolicy(pin_memory=True)``: sharded
            params, sharded grads and hence optimizer state live on the CPU; each all-gather starts
            with one H2D copy (fused with the ``param_dtype`` cast), each reduce-scatter ends with
            one D2H copy. (On a CPU-only mesh it changes nothing.)
        ignored_params: parameters left unsharded and unreduced.
        zero_stage: raggedfsdp extension (keyword-only, default 3). ``3`` shards params, grads and
            optimizer state (ZeRO-3). ``2`` keeps params unsharded from forward to backward
            (``reshard_after_forward=False``: no all-gather in backward). ``1`` keeps params
            unsharded between steps too; they are re-gathered once per step, after any
            ``torch.optim`` step or ``load_state_dict`` changed the sharded master. Grads are always
            reduce-scattered (RS + AG moves the same bytes as ZeRO-1's all-reduce) and optimizer
            state is always sharded.

    Which ranks: every rank of ``mesh`` must call it, in the same order, on the same module tree.

    Raises:
        ValueError: module already fully_shard'ed, mesh of the wrong dims or not containing this rank,
            params on several devices (or partly on meta), mixed dtypes in one unit, 0-dim params,
            a granularity that does not divide a param, an int ``reshard_after_forward`` that does
            not divide the shard world size, a parameter tied across units, bad ``zero_stage``.
        TypeError: a non-module, a non-DeviceMesh mesh, a non-bool/int ``reshard_after_forward``, an
            unsupported ``shard_placement_fn`` result.
        NotImplementedError: int ``reshard_after_forward`` on a 2-D mesh, ``Shard(dim>0)`` placements.
    """
    modules = tuple(module) if isinstance(module, (list, tuple)) else (module,)
    if not modules:
        raise ValueError("fully_shard: got an empty list of modules")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard: expects nn.Module or a list of them, got {type(m).__name__}")
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward:
            raise ValueError(
                f"fully_shard: {type(m).__name__} has no forward, so its hooks would never run; "
                "call fully_shard on each child module instead"
            )
        if getattr(m, "_raggedfsdp_state", None) is not None:
            raise ValueError(
                f"fully_shard: {type(m).__name__} is already fully_shard'ed; call fully_shard once per module"
            )
    if isinstance(reshard_after_forward, bool) or reshard_after_forward is None:
        pass
    elif not isinstance(reshard_after_forward, int):
        raise TypeError(
            f"fully_shard: reshard_after_forward must be None, a bool or an int, got {reshard_after_forward!r}"
        )
    if zero_stage not in (1, 2, 3):
        raise ValueError(f"fully_shard: zero_stage={zero_stage!r} must be 1, 2 or 3")
    if zero_stage < 3:
        if reshard_after_forward:
            raise ValueError(
                f"fully_shard: zero_stage={zero_stage} keeps params unsharded after forward, which contradicts "
                "reshard_after_forward=True; drop one of the two"
            )
        reshard_after_forward = False
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"fully_shard: offload_policy must be an OffloadPolicy, got {type(offload_policy).__name__}")
    offload = isinstance(offload_policy, CPUOffloadPolicy)
    mesh = _init_mesh(mesh)
    post_forward_mesh = None
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        k, m = reshard_after_forward, mesh.size(mesh.ndim - 1)
        if k < 1 or m % k != 0:
            raise ValueError(
                f"fully_shard: reshard_after_forward={k} must be a positive divisor of the shard world size {m} "
                "(the size of the smaller group params are resharded to after forward)"
            )
        if mesh.ndim != 1:
            raise NotImplementedError(
                f"fully_shard: int reshard_after_forward={k} is supported on 1-D meshes only (got {mesh.ndim}-D); "
                "with HSDP use reshard_after_forward=True/False"
            )
        if k == m:
            reshard_after_forward = True
        elif k == 1:
            reshard_after_forward = False
        else:
            # consecutive groups of k ranks (e.g. one node): collective, every rank builds the same mesh
            post_forward_mesh = DeviceMesh(mesh.device_type, mesh.mesh.view(-1, k))
            reshard_after_forward = True
    ignored = set(ignored_params or ())
    params = _managed_params(modules, ignored)
    device = _device_of(params, mesh, offload)
    gran_fn = _granularity_fn(shard_placement_fn)
    group = (
        FSDPParamGroup(params, mesh, mp_policy, device, gran_fn, offload=offload,
                       pin_memory=getattr(offload_policy, "pin_memory", True))
        if params else None
    )
    unit = type(modules[0]).__name__
    for p, fqn, _ in params:
        p._raggedfsdp_owner = f"{unit}:{fqn}"  # the original tensor, now replaced by a DTensor
    if group is not None and post_forward_mesh is not None:
        group.set_post_forward_mesh(post_forward_mesh)
    if group is not None and zero_stage == 1:
        group.reshard_after_backward = False
    state = FSDPState(modules, group, mp_policy, reshard_after_forward)
    for m in modules:
        m._raggedfsdp_state = state
        m.register_forward_pre_hook(lambda mod, a, k: state._pre_forward(mod, a, k), prepend=True, with_kwargs=True)
        m.register_forward_hook(lambda mod, a, o: state._post_forward(mod, a, o))
        if group is not None:
            # state dicts hold the sharded RaggedShard DTensors; loading invalidates a kept gather
            m.register_state_dict_pre_hook(lambda mod, prefix, keep_vars, g=group: g.reshard(free=False))
            m.register_load_state_dict_pre_hook(_make_load_pre_hook(m, group))
            m.register_load_state_dict_post_hook(lambda mod, keys: bump_master_epoch())
        cls = type(m)
        if cls not in _cls_cache:
            _cls_cache[cls] = type(f"RaggedFSDP{cls.__name__}", (FSDPModule, cls), {})
        m.__class__ = _cls_cache[cls]
    return list(modules) if isinstance(module, (list, tuple)) else module


def _init_mesh(mesh: DeviceMesh | None) -> DeviceMesh:
    if mesh is None:
        if not dist.is_initialized():
            raise ValueError("fully_shard: no mesh given and torch.distributed is not initialized; "
                             "call dist.init_process_group(...) first or pass mesh=")
        dev = "cuda" if dist.get_backend() == "nccl" else "cpu"
        mesh = init_device_mesh(dev, (dist.get_world_size(),))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard: mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard: mesh must be 1-D (FSDP) or 2-D (HSDP: replicate, shard), got {mesh.ndim}-D")
    if dist.is_initialized() and mesh.get_coordinate() is None:
        raise ValueError(
            f"fully_shard: rank {dist.get_rank()} is not part of mesh {mesh.mesh.tolist()}; every rank that calls "
            "fully_shard must belong to the mesh (build it over the ranks running this model)"
        )
    return mesh


def _managed_params(modules, ignored) -> list[tuple[nn.Parameter, str, list[tuple[nn.Module, str]]]]:
    """Params under ``modules`` not managed by a nested ``fully_shard``, in registration order, with owners."""
    out: dict[int, tuple[nn.Parameter, str, list]] = {}
    order: list[int] = []

    def visit(mod: nn.Module, prefix: str, top: bool):
        if not top and getattr(mod, "_raggedfsdp_state", None) is not None:
            return
        for name, p in mod._parameters.items():
            if p is None or p in ignored:
                continue
            fqn = f"{prefix}{name}"
            if isinstance(p, DTensor):
                other = _owner_of(p, modules)
                raise ValueError(
                    f"fully_shard: parameter {fqn!r} is already sharded by another fully_shard unit ({other}): "
                    "a parameter shared (tied) across units cannot be sharded twice; apply fully_shard so that "
                    "both owners are in one unit (e.g. skip the inner call), or untie the parameter"
                )
            prev = getattr(p, "_raggedfsdp_owner", None)
            if prev is not None:
                raise ValueError(
                    f"fully_shard: parameter {fqn!r} was already sharded by another fully_shard unit (owner {prev}); "
                    "it is shared (tied) across units and would be silently untied. Apply fully_shard so that both "
                    "owners are in one unit (e.g. skip the inner call), or untie the parameter"
                )
            if id(p) not in out:
                out[id(p)] = (p, fqn, [])
                order.append(id(p))
            out[id(p)][2].append((mod, name))
        for cname, child in mod._modules.items():
            if child is not None:
                visit(child, f"{prefix}{cname}.", False)

    for i, m in enumerate(modules):
        visit(m, "" if len(modules) == 1 else f"{i}.", True)
    return [out[k] for k in order]


def _make_load_pre_hook(unit_module: nn.Module, group: FSDPParamGroup):
    """``load_state_dict`` pre-hook: register the sharded params, and accept plain full tensors for them.

    A plain tensor of a managed parameter's global shape (e.g. from an unsharded checkpoint or a HF
    model) is turned into this rank's RaggedShard piece by local slicing (no communication), so
    ``model.load_state_dict(full_sd)`` works as on an unsharded model. Not collective.
    """
    names = {id(mod): name for name, mod in unit_module.named_modules(remove_duplicate=False)}
    keys: list[tuple[int, list[str]]] = []
    for i, fp in enumerate(group.fsdp_params):
        ks = []
        for mod, attr in fp.owners:
            if id(mod) in names:
                base = names[id(mod)]
                ks.append(f"{base}.{attr}" if base else attr)
        keys.append((i, ks))

    def hook(module, state_dict, prefix, *args):
        group.reshard(free=False)
        for i, ks in keys:
            fp = group.fsdp_params[i]
            for k in ks:
                v = state_dict.get(prefix + k)
                if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.shape == fp.shape:
                    a, b = group.layout.piece(i, group.shard_rank)
                    local = v.detach().reshape(-1)[a:b].to(device=group.storage_device, dtype=fp.dtype)
                    state_dict[prefix + k] = DTensor(local, fp.spec, requires_grad=False)

    return hook


def _owner_of(p: nn.Parameter, modules) -> str:
    for top in modules:
        for name, mod in top.named_modules():
            st = getattr(mod, "_raggedfsdp_state", None)
            if st is not None and st.group is not None:
                for fp in st.group.fsdp_params:
                    if fp.sharded is p:
                        return f"owner {name + '.' if name else ''}{fp.fqn}"
    return "an unknown unit"


def _device_of(params, mesh: DeviceMesh, offload: bool = False) -> torch.device:
    metas = [fqn for p, fqn, _ in params if p.device.type == "meta"]
    if metas and len(metas) != len(params):
        raise ValueError(
            f"fully_shard: parameters {metas} are on the meta device while others are materialized; a unit must be "
            "all-meta (then call module.to_empty(device=...) and initialize after fully_shard) or all-materialized"
        )
    devices = {p.device.type for p, _, _ in params} - {"meta"}
    if len(devices) > 1:
        raise ValueError(
            f"fully_shard: parameters are on several devices {sorted(devices)}; move the module to one device first"
        )
    if params and all(p.device.type == "meta" for p, _, _ in params):
        return torch.device("meta")
    if offload:
        devices = devices - {"cpu"}
    if devices and devices != {mesh.device_type}:
        raise ValueError(
            f"fully_shard: parameters are on {sorted(devices)} but the mesh is on {mesh.device_type!r}; move the "
            f"module with module.to({mesh.device_type!r}) or build the mesh on the parameters' device"
        )
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _granularity_fn(shard_placement_fn):
    """Map ``shard_placement_fn(param)`` to a block size in elements (``None``: default row blocks)."""
    from torch.distributed.tensor import Shard

    from raggedfsdp.planner.policy import BlockSpec, granularity_for

    def fn(p: nn.Parameter, fqn: str = ""):
        r = shard_placement_fn(p) if shard_placement_fn is not None else None
        if r is None:
            return granularity_for(p.shape, None, name=fqn)[0]
        if isinstance(r, bool) or not isinstance(r, (int, str, tuple, BlockSpec, Shard)):
            raise TypeError(
                f"fully_shard: shard_placement_fn returned {r!r} for {fqn!r}; return None, Shard(0), an int block "
                "size in elements, or a block spec such as 'element', 'row', 'rows:32', 'tile:32x32', 'matrix'"
            )
        if isinstance(r, Shard):
            if r.dim != 0:
                raise NotImplementedError(
                    f"fully_shard: shard_placement_fn returned {r} for {fqn!r} of shape {tuple(p.shape)}; raggedfsdp "
                    "lays parameters out flat, so only Shard(0) (row blocks) or a block spec is supported"
                )
            return granularity_for(p.shape, None, name=fqn)[0]
        if isinstance(r, int):
            return r
        return granularity_for(p.shape, r, name=fqn)[0]

    return fn
