"""Helpers of ``fully_shard``: mesh, managed params, device checks, block policy, load hook."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from raggedfsdp.fsdp._common import FSDPTypeError, FSDPValueError
from raggedfsdp.fsdp._param_group import FSDPParamGroup
from raggedfsdp.placement._redistribute import has_ragged, local_piece_of_full


def _init_mesh(mesh: DeviceMesh | None) -> DeviceMesh:
    if mesh is None:
        if not dist.is_initialized():
            raise ValueError(
                "fully_shard: no mesh given and torch.distributed is not initialized; "
                "call dist.init_process_group(...) first or pass mesh="
            )
        dev = "cuda" if dist.get_backend() == "nccl" else "cpu"
        mesh = init_device_mesh(dev, (dist.get_world_size(),))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard: mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard: mesh must be 1-D (FSDP) or 2-D (HSDP: replicate, shard), got {mesh.ndim}-D"
        )
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:  # torch's fully_shard refuses it too (AssertionError)
        raise FSDPValueError(
            f"fully_shard: the 2-D (HSDP) mesh {mesh.mesh.tolist()} has no dim names; build it with "
            "init_device_mesh(device_type, (replicate, shard), mesh_dim_names=('replicate', 'shard'))"
        )
    if dist.is_initialized() and mesh.get_coordinate() is None:
        raise ValueError(
            f"fully_shard: rank {dist.get_rank()} is not part of mesh {mesh.mesh.tolist()}; every rank that "
            "calls fully_shard must belong to the mesh (build it over the ranks running this model)"
        )
    return mesh


def _managed_params(modules, ignored) -> list[tuple[nn.Parameter, str, list[tuple[nn.Module, str]]]]:
    """Params under ``modules`` not managed by a nested ``fully_shard``, in registration order, with
    owners."""
    out: dict[int, tuple[nn.Parameter, str, list]] = {}
    order: list[int] = []

    def visit(mod: nn.Module, prefix: str, top: bool):
        if not top and getattr(mod, "_raggedfsdp_state", None) is not None:
            return
        for name, p in mod._parameters.items():
            if p is None or p in ignored:
                continue
            fqn = f"{prefix}{name}"
            prev = getattr(p, "_raggedfsdp_owner", None)  # "Unit:fqn", set by the fully_shard that took it
            # a DTensor without RaggedShard is a TP/EP parameter: sharded again over the dp mesh (Note [FSDP
            # x TP])
            if prev is not None or (isinstance(p, DTensor) and has_ragged(p.placements)):
                here = type(modules[0]).__name__
                if prev is None:
                    prev = _owner_of(p, modules)
                unit, _, other_fqn = prev.partition(":")
                raise ValueError(
                    f"fully_shard: parameter {fqn!r} of {here} is the same parameter as {other_fqn!r} of the "
                    f"fully_shard unit {unit}, which already sharded it: a parameter shared (tied) across "
                    "units cannot be sharded twice (it would be silently untied). Apply fully_shard so that "
                    "both owners are in one unit (e.g. skip the inner call, or wrap their common parent), "
                    "or untie the parameter"
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
                if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.shape == fp.global_shape:
                    if fp.tp_spec is None:
                        a, b = group.layout.piece(i, group.shard_rank)
                        local = v.detach().reshape(-1)[a:b]
                    else:  # the ragged piece of this rank's TP-local block
                        local = local_piece_of_full(v.detach(), fp.spec.mesh, fp.spec.placements)
                    local = local.to(device=group.storage_device, dtype=fp.dtype)
                    state_dict[prefix + k] = DTensor(local, fp.spec, requires_grad=False)

    return hook


def _owner_of(p: nn.Parameter, modules) -> str:
    for top in modules:
        for name, mod in top.named_modules():
            st = getattr(mod, "_raggedfsdp_state", None)
            if st is not None and st.group is not None:
                for fp in st.group.fsdp_params:
                    if fp.sharded is p:
                        return f"{type(mod).__name__}:{fp.fqn}"
    return "an unknown unit:?"


def _mesh_device(mesh) -> torch.device:
    """The device a unit on ``mesh`` computes on: ``cuda:<current device>`` for a CUDA mesh (as FSDP2's
    ``_get_device_from_mesh``), else ``torch.device(mesh.device_type)``."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _states_to_move(modules, params, mesh, offload: bool = False) -> tuple[torch.device | None, list, list]:
    """What ``fully_shard`` moves to the mesh's device before sharding, as FSDP2 does
    (``torch/distributed/fsdp/_fully_shard/_fsdp_init.py``: ``_move_states_to_device``): a module built
    on the CPU and sharded over an accelerator mesh has its managed parameters and its buffers moved.

    Returns ``(target, params, buffers)``: ``params`` are the managed parameters (plain tensors, not
    DTensors) that sit on the CPU, ``buffers`` the ``(module, name)`` of CPU buffers of the unit's
    modules (not inside a nested ``fully_shard`` unit). Nothing moves when the mesh is on the CPU, for
    meta tensors, or for tensors already on another accelerator (``_device_of`` names those). With CPU
    offload the parameters stay on the CPU (their sharded master lives there) and only buffers move.
    ``target`` is ``None`` when nothing moves. Local."""
    if mesh.device_type == "cpu":
        return None, [], []
    target = _mesh_device(mesh)
    move_p = (
        [] if offload else [p for p, _, _ in params if not isinstance(p, DTensor) and p.device.type == "cpu"]
    )
    move_b = []

    def visit(mod: nn.Module, top: bool):
        if not top and getattr(mod, "_raggedfsdp_state", None) is not None:
            return
        for name, b in mod._buffers.items():
            if b is not None and not isinstance(b, DTensor) and b.device.type == "cpu":
                move_b.append((mod, name))
        for child in mod._modules.values():
            if child is not None:
                visit(child, False)

    for m in modules:
        visit(m, True)
    if not move_p and not move_b:
        return None, [], []
    return target, move_p, move_b


def _move_states_to_device(modules, params, mesh, offload: bool = False) -> None:
    """Move what :func:`_states_to_move` names, in place in ``params``. A parameter keeps its identity
    (``p.data`` is replaced, as FSDP2 does) where torch allows it (CPU -> CUDA); otherwise it is replaced
    by a new ``nn.Parameter`` in every owning module and in ``params``. Local."""
    target, move_p, move_b = _states_to_move(modules, params, mesh, offload)
    if target is None:
        return
    ids = {id(p) for p in move_p}
    with torch.no_grad():
        for i, (p, fqn, owners) in enumerate(params):
            if id(p) not in ids:
                continue
            moved, grad = p.data.to(target), (p.grad.to(target) if p.grad is not None else None)
            try:
                p.data = moved
                if grad is not None:
                    p.grad = grad
            except RuntimeError:  # incompatible tensor types (e.g. CPU -> meta): a new parameter
                new = nn.Parameter(moved, requires_grad=p.requires_grad)
                new.grad = grad
                for mod, name in owners:
                    mod._parameters[name] = new
                params[i] = (new, fqn, owners)
        for mod, name in move_b:
            mod._buffers[name] = mod._buffers[name].to(target)


def _device_of(params, mesh: DeviceMesh, offload: bool = False) -> torch.device:
    metas = [fqn for p, fqn, _ in params if p.device.type == "meta"]
    if metas and len(metas) != len(params):
        raise ValueError(
            f"fully_shard: parameters {metas} are on the meta device while others are materialized; a unit "
            "must be all-meta (then call module.to_empty(device=...) and initialize after fully_shard) or "
            "all-materialized"
        )
    devices = {p.device.type for p, _, _ in params} - {"meta"}
    if len(devices) > 1:
        raise ValueError(
            f"fully_shard: parameters are on several devices {sorted(devices)}; move the module to one "
            f"device first"
        )
    if params and all(p.device.type == "meta" for p, _, _ in params):
        return torch.device("meta")
    if offload:
        devices = devices - {"cpu"}
    if devices and devices != {mesh.device_type}:
        raise ValueError(
            f"fully_shard: parameters are on {sorted(devices)} but the mesh is on {mesh.device_type!r}; move "
            f"the module with module.to({mesh.device_type!r}) or build the mesh on the parameters' device"
        )
    return _mesh_device(mesh)


def _granularity_fn(shard_placement_fn):
    """Map ``shard_placement_fn(param)`` to a block size in elements. ``None`` (or no
    ``shard_placement_fn``): ``planner.DEFAULT_BLOCK``, element granularity, the least padding (issue 22);
    ``Shard(0)``: row blocks (what the user asked torch's fully_shard for); TP/EP DTensors: the same,
    on the TP-local tensor."""
    from torch.distributed.tensor import Shard

    from raggedfsdp.planner.policy import BlockSpec, granularity_for, granularity_for_local

    def fn(p: nn.Parameter, fqn: str = ""):
        r = shard_placement_fn(p) if shard_placement_fn is not None else None
        if isinstance(p, DTensor):  # TP/EP: blocks of the global shape, seen in the TP-local tensor
            if isinstance(r, Shard) and r.dim == 0:  # FSDP2: Shard(0) of the TP-local tensor, one local row
                return granularity_for(p._local_tensor.shape, "row", name=fqn)[0]
            if r is None or isinstance(r, (str, tuple, BlockSpec)):
                return granularity_for_local(p.shape, p._local_tensor.shape, r, name=fqn)[0]
        if r is None:
            return granularity_for(p.shape, None, name=fqn)[0]
        if isinstance(r, bool) or not isinstance(r, (int, str, tuple, BlockSpec, Shard)):
            raise FSDPTypeError(
                f"fully_shard: shard_placement_fn returned {r!r} for {fqn!r}; return None, Shard(0), an int "
                "block size in elements, or a block spec such as 'element', 'row', 'rows:32', 'tile:32x32', "
                "'matrix'"
            )
        if isinstance(r, Shard):
            if r.dim != 0:
                raise NotImplementedError(
                    f"fully_shard: shard_placement_fn returned {r} for {fqn!r} of shape {tuple(p.shape)}; "
                    f"raggedfsdp "
                    "lays parameters out flat, so only Shard(0) (row blocks) or a block spec is supported"
                )
            return granularity_for(p.shape, "row", name=fqn)[0]
        if isinstance(r, int):
            return r
        return granularity_for(p.shape, r, name=fqn)[0]

    return fn
