"""Helpers of ``fully_shard``: mesh, managed params, device checks, block policy, load hook."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from raggedfsdp.fsdp._common import FSDPTypeError, FSDPValueError, state_of
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
            f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}: "
            f"fully_shard: mesh must be 1-D (FSDP) or 2-D (HSDP: replicate, shard), got {mesh.ndim}-D"
        )
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:  # torch's fully_shard refuses it too (AssertionError)
        raise FSDPValueError(
            "Please init the 2D mesh for HSDP with mesh_dim_names specified: "
            f"fully_shard: the 2-D (HSDP) mesh {mesh.mesh.tolist()} has no dim names; build it with "
            "init_device_mesh(device_type, (replicate, shard), mesh_dim_names=('replicate', 'shard'))"
        )
    if dist.is_initialized() and mesh.get_coordinate() is None:
        raise ValueError(
            f"fully_shard: rank {dist.get_rank()} is not part of mesh {mesh.mesh.tolist()}; every rank that "
            "calls fully_shard must belong to the mesh (build it over the ranks running this model)"
        )
    return mesh


_EXTENSION_HOOKS = ("fsdp_pre_all_gather", "fsdp_post_all_gather")


def _check_no_all_gather_extension(tensor: torch.Tensor, name: str, unit: str) -> None:
    """Raise ``NotImplementedError`` if ``tensor`` (a parameter, or a DTensor parameter's local tensor)
    defines torch FSDP2's tensor-subclass all-gather extension (``fsdp_pre_all_gather`` /
    ``fsdp_post_all_gather``, torch/distributed/fsdp/_fully_shard/_fsdp_param.py). raggedfsdp's
    all-gather runs in place on the unit's flat buffer and would silently ignore the extension, so ranks
    would train something other than what the subclass asks for. Every rank holds the same parameter
    types, so every rank raises (no rank is left waiting in a collective)."""
    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    hooks = [h for h in _EXTENSION_HOOKS if hasattr(local, h)]
    if hooks:
        raise NotImplementedError(
            f"fully_shard: parameter {name!r} of {unit} is a {type(local).__name__} that defines "
            f"{' / '.join(hooks)} (torch FSDP2's tensor-subclass all-gather extension), which raggedfsdp "
            "does not support: its all-gather runs in place on the unit's flat buffer. Use plain tensor "
            "parameters (e.g. keep the subclass outside the parameter), all_gather_policy="
            "QuantizedAllGatherPolicy(...) for 8-bit all-gathers, or torch.distributed.fsdp.fully_shard "
            "for this module"
        )


def _managed_params(modules, ignored) -> list[tuple[nn.Parameter, str, list[tuple[nn.Module, str]]]]:
    """Params under ``modules`` not managed by a nested ``fully_shard``, in registration order, with
    owners."""
    out: dict[int, tuple[nn.Parameter, str, list]] = {}
    order: list[int] = []

    def visit(mod: nn.Module, prefix: str, top: bool):
        if not top and state_of(mod) is not None:
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
                raise ValueError(  # torch's sentence first (its _fsdp_state.py raises it at lazy init)
                    f"Parameter {fqn!r} is shared with a parameter already managed by another FSDP group. "
                    "For shared/tied parameters, use fully_shard([module_a, module_b]) to place them in the "
                    f"same FSDP group. fully_shard: parameter {fqn!r} of {here} is the same parameter as "
                    f"{other_fqn!r} of the "
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
            st = state_of(mod)
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
        if not top and state_of(mod) is not None:
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


def _granularity_fn(shard_placement_fn, mesh: DeviceMesh | None = None):
    """Map ``shard_placement_fn(param)`` to a block size in elements. ``None`` (or no
    ``shard_placement_fn``): ``planner.DEFAULT_BLOCK``, element granularity, the least padding;
    ``Shard(0)``: row blocks (what the user asked torch's fully_shard for); ``Shard(d)``, ``d > 0``:
    blocks of ``prod(shape[d+1:])`` elements (see :func:`_shard_dim_block`); a torch
    ``ShardPlacementResult`` whose mesh is the unit's ``mesh``: its placement; TP/EP DTensors: the
    same, on the TP-local tensor."""
    from torch.distributed.tensor import Shard

    from raggedfsdp.planner.policy import BlockSpec, granularity_for, granularity_for_local

    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise TypeError(
            f"fully_shard: shard_placement_fn must be a callable param -> placement or block spec, got "
            f"{type(shard_placement_fn).__name__} {shard_placement_fn!r}; e.g. "
            f"shard_placement_fn=lambda p: {shard_placement_fn!r}"
        )

    def fn(p: nn.Parameter, fqn: str = ""):
        r = shard_placement_fn(p) if shard_placement_fn is not None else None
        r = _unwrap_placement_result(r, p, fqn, mesh)
        local_shape = p._local_tensor.shape if isinstance(p, DTensor) else p.shape
        if isinstance(r, Shard):
            return _shard_dim_block(local_shape, r.dim, fqn)
        if isinstance(p, DTensor):  # TP/EP: blocks of the global shape, seen in the TP-local tensor
            if r is None or isinstance(r, (str, tuple, BlockSpec)):
                return granularity_for_local(p.shape, p._local_tensor.shape, r, name=fqn)[0]
        if r is None:
            return granularity_for(p.shape, None, name=fqn)[0]
        if isinstance(r, bool) or not isinstance(r, (int, str, tuple, BlockSpec)):
            raise FSDPTypeError(
                f"fully_shard: shard_placement_fn returned {r!r} for {fqn!r}; return None, Shard(d), an int "
                "block size in elements, or a block spec such as 'element', 'row', 'rows:32', 'tile:32x32', "
                "'matrix'"
            )
        if isinstance(r, int):
            return r
        return granularity_for(p.shape, r, name=fqn)[0]

    return fn


def _shard_dim_block(shape: torch.Size, dim: int, fqn: str) -> int:
    """The block size (elements) that stands for torch's ``Shard(dim)`` in raggedfsdp's flat row-major
    layout. ``Shard(0)``: one row (``shape[-1]`` elements; 1 for a vector), as before. ``Shard(d)``,
    ``d > 0``: torch keeps every ``shape[d+1:]`` slice of a parameter whole on one rank (it splits dim
    ``d`` itself, strided in memory); a contiguous RaggedShard piece cannot hold a strided column slice,
    so the unit is planned in blocks of ``prod(shape[d+1:])`` elements (1 for the last dim): no rank
    boundary cuts such a slice, the values and ``full_tensor()`` are the same, only the placement is
    ``RaggedShard`` and every rank gets contiguous whole slices. Never refused (torch even needs
    ``shape[d]`` divisible by the shard world size; this layout does not). Raises ``ValueError`` for a
    ``dim`` out of range."""
    from raggedfsdp.planner.policy import granularity_for

    nd = len(shape)
    if not -nd <= dim < nd:
        raise ValueError(
            f"fully_shard: shard_placement_fn returned Shard({dim}) for {fqn!r} of shape {tuple(shape)}: dim "
            f"out of range; return Shard(d) with -{nd} <= d < {nd}"
        )
    d = dim % nd
    if d == 0:
        return granularity_for(shape, "row", name=fqn)[0]
    return max(math.prod(shape[d + 1 :]), 1)


def _unwrap_placement_result(r, p, fqn: str, mesh: DeviceMesh | None):
    """torch 2.13's ``ShardPlacementResult(placement, mesh_info)`` (``_fsdp_common.py``): its placement when
    ``mesh_info.mesh`` is the unit's mesh. A parameter on another mesh (torch then makes a second param
    group with its own collectives) raises ``NotImplementedError``: a raggedfsdp unit is one flat buffer
    sharded over one mesh. Other results pass through. Local."""
    if not (hasattr(r, "mesh_info") and hasattr(r, "placement")):
        return r
    other = getattr(r.mesh_info, "mesh", None)
    if mesh is not None and other is not None and other != mesh:
        raise NotImplementedError(
            f"fully_shard: shard_placement_fn returned a ShardPlacementResult for {fqn!r} on mesh {other}, "
            f"which is not this unit's mesh {mesh}: per-parameter meshes within one unit are not supported "
            "(a raggedfsdp unit is one flat buffer sharded over one mesh). Call fully_shard(..., mesh=...) "
            "separately on the submodules whose parameters use the other mesh (e.g. the experts)"
        )
    return r.placement


# Note [dp_mesh_dims]
#     torch 2.13's ``fully_shard(module, mesh=spmd_mesh, dp_mesh_dims=DataParallelMeshDims(shard=,
#     replicate=))`` (``_fsdp_init.py: _get_mesh_info_from_named_dims``, ``_fsdp_param.py:
#     _init_sharding_spec_spmd``; torchtitan's ``full_dtensor`` mode): ``mesh`` is the full SPMD mesh,
#     every managed parameter is already a DTensor on it with ``Replicate()`` on the DP dims. As torch:
#
#     * the DP mesh is ``mesh[shard]`` (several shard dims flattened, ``_compat.flatten_mesh``); with
#       ``replicate`` it is the 2-D HSDP mesh ``(replicate, shard)`` (several replicate dims flattened);
#     * the sharded parameter is one DTensor on ``(dp dims..., other dims...)`` with placements
#       ``([Replicate(),] RaggedShard, *other)``: raggedfsdp plans the parameter's local tensor over the
#       other (TP / CP / EP) dims exactly as Note [FSDP x TP] does, so the other dims' placements act as
#       the TP placements;
#     * the unsharded parameter in forward / backward is the DTensor on the full SPMD mesh with the
#       original placements (``FSDPParam.spmd_spec``), and its gradient is redistributed on the other dims
#       only (a ``Partial`` on a DP dim is what the reduce-scatter / all-reduce reduces), as FSDP2's
#       ``_get_grad_inner_tensor``.
#
#     Not supported (``NotImplementedError`` naming the case): ``shard=None`` (pure replication, torch's
#     ``DDPMeshInfo``: raggedfsdp always shards) and DP dims that do not lead the mesh in the order
#     ``replicate..., shard...`` (the sharded spec keeps the dp dims first, as ``(Replicate, RaggedShard,
#     *tp)``; torchtitan's ``(dp_replicate, dp_shard, cp, tp)`` meets it); int ``reshard_after_forward``
#     raises as in torch.


def _spmd_dp_mesh(mesh: DeviceMesh | None, dp_mesh_dims):
    """Note [dp_mesh_dims]: validate ``dp_mesh_dims`` against the full SPMD ``mesh`` (torch's messages and
    exception types, ``_fsdp_init.py: _validate_mesh``) and return ``(dp_mesh, n_dp)``: the 1-D shard or
    2-D ``(replicate, shard)`` mesh FSDP runs on and the number of leading DP dims of ``mesh``.
    Collective when several dims are flattened (a new process group), over every rank of ``mesh``."""
    import torch.distributed.fsdp as torch_fsdp

    from raggedfsdp._compat import concatenate_meshes, flatten_mesh

    DataParallelMeshDims = getattr(torch_fsdp, "DataParallelMeshDims", None)
    if DataParallelMeshDims is None:
        raise FSDPTypeError(
            f"fully_shard: dp_mesh_dims={dp_mesh_dims!r} needs torch >= 2.13 (torch.distributed.fsdp."
            f"DataParallelMeshDims); this is torch {torch.__version__}: pass dp_mesh_dims=None and a 1-D "
            "or 2-D mesh"
        )
    if not isinstance(dp_mesh_dims, DataParallelMeshDims):
        raise FSDPTypeError(
            f"fully_shard: dp_mesh_dims must be None or a torch.distributed.fsdp.DataParallelMeshDims, got "
            f"{type(dp_mesh_dims).__name__} {dp_mesh_dims!r}; e.g. DataParallelMeshDims(shard='dp')"
        )
    if mesh is None or not isinstance(mesh, DeviceMesh):
        raise FSDPTypeError(
            f"fully_shard: dp_mesh_dims={dp_mesh_dims} needs mesh= the full SPMD DeviceMesh its dim names "
            f"refer to, got {mesh!r}"
        )
    if dp_mesh_dims.shard is None and dp_mesh_dims.replicate is None:
        raise ValueError("At least one of shard or replicate must be set in dp_mesh_dims")
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError("mesh must have mesh_dim_names when dp_mesh_dims is provided")
    shard, rep = tuple(dp_mesh_dims.shard_names), tuple(dp_mesh_dims.replicate_names)
    for name in shard + rep:
        if name not in names:
            raise ValueError(f"Mesh dim name '{name}' not found in mesh.mesh_dim_names {names}")
    if not shard:
        raise NotImplementedError(
            f"fully_shard: dp_mesh_dims={dp_mesh_dims} has no shard dim (pure replication, torch's "
            "DDPMeshInfo); raggedfsdp always shards: name a shard dim (a size-1 one is fine, as torchtitan "
            "keeps dp_shard), or use torch's fully_shard / replicate for this module"
        )
    if names[: len(rep) + len(shard)] != rep + shard:
        want = rep + shard + tuple(n for n in names if n not in rep + shard)
        raise NotImplementedError(
            f"fully_shard: dp_mesh_dims={dp_mesh_dims} on a mesh with dims {names}: raggedfsdp needs the DP "
            f"dims first, replicate then shard ({want}), as torchtitan orders them (dp_replicate, "
            "dp_shard, cp, tp); the sharded parameters keep their DP dims first. Build the mesh in that order"
        )

    def sub(ns: tuple[str, ...]) -> DeviceMesh:
        return mesh[ns[0]] if len(ns) == 1 else flatten_mesh(mesh[ns], "_".join(ns))

    dp = sub(shard) if not rep else concatenate_meshes([sub(rep), sub(shard)])
    return dp, len(rep) + len(shard)


def _spmd_params(params, mesh: DeviceMesh, n_dp: int, shard_names: tuple[str, ...] = ()):
    """Note [dp_mesh_dims]: each managed parameter (a DTensor on ``mesh``, ``Replicate()`` on its first
    ``n_dp`` dims) as the tensor the unit plans: a DTensor on the other dims with the other placements
    (the TP path), or its local tensor when there are none. Returns ``(planned params, spmd_specs)`` for
    ``FSDPParamGroup``. Raises ``ValueError`` (torch's messages) for a plain tensor, another mesh or a
    non-Replicate DP placement. Local."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    names = mesh.mesh_dim_names
    others = names[n_dp:]
    other_mesh = None if not others else (mesh[others[0]] if len(others) == 1 else mesh[others])
    planned, specs = [], []
    for p, fqn, owners in params:
        if not isinstance(p, DTensor):
            raise ValueError(
                "When dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD mesh (e.g. "
                f"via distribute_module). Got plain tensor for parameter '{fqn}'."
            )
        # by value: torch (_fsdp_param.py) compares the objects, and then refuses the same script run twice,
        # since DTensors built on a new but equal mesh come back on the first one (benchmarks/torch_suite.md)
        if p.device_mesh != mesh:
            raise ValueError(
                "Expected param's DTensor mesh to be the same mesh passed to fully_shard, but got different "
                f"mesh objects: parameter {fqn!r} is on {p.device_mesh} and fully_shard got {mesh}; pass "
                "the DeviceMesh object the parameters were distributed on"
            )
        for i in range(n_dp):
            if not isinstance(p.placements[i], Replicate):
                kind = "shard" if names[i] in shard_names else "replicate"
                raise ValueError(
                    f"Expected Replicate() on DP {kind} dim '{names[i]}' (index {i}) but got "
                    f"{p.placements[i]} for parameter {fqn!r}"
                )
        spec = p._spec
        if other_mesh is None:
            proxy = p._local_tensor
        else:
            proxy = DTensor(
                p._local_tensor,
                DTensorSpec(other_mesh, tuple(spec.placements[n_dp:]), tensor_meta=spec.tensor_meta),
                requires_grad=False,
            )
        proxy = nn.Parameter(proxy, requires_grad=p.requires_grad)
        planned.append((proxy, fqn, owners))
        specs.append((spec, frozenset(range(n_dp))))
    return planned, specs
