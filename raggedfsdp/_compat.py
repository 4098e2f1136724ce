"""Version facts of the installed torch, and the private torch names raggedfsdp reads whose spelling
differs between (or may vanish after) the supported minors 2.11 - 2.15. Each reader below names the
torch internal it uses and raises ``RuntimeError`` naming this file when that internal is gone, so an
upgrade fails loudly here instead of somewhere downstream. Nothing here changes torch (the patches of
torch's internals live in one module, ``raggedfsdp/placement/_patches.py``) and torch is imported only
inside the functions (``import raggedfsdp`` imports no torch).

Checked on 2.11.0, 2.13.0, 2.14.1, 2.15.0 (docs/raggedshard.md "torch versions"):

* ``DeviceMesh._get_root_mesh``, ``DeviceMesh._concatenate`` and ``DeviceMesh._flatten`` exist on all of
  them;
* ``dist.all_gather_single`` / ``dist.reduce_scatter_single`` exist on 2.13 - 2.15; 2.11 has only
  ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (same arguments).
"""

from __future__ import annotations


def torch_minor(version: str | None = None) -> tuple[int, int]:
    """``(major, minor)`` of ``version`` (default: the installed ``torch.__version__``)."""
    if version is None:
        import torch

        version = torch.__version__
    v = version.split("+")[0].split(".")
    return int(v[0]), int(v[1])


def _gone(what: str) -> RuntimeError:
    import torch

    return RuntimeError(
        f"raggedfsdp: torch {torch.__version__} has no {what}, which raggedfsdp reads on torch 2.11 - 2.15; "
        "port raggedfsdp/_compat.py to this torch (or use torch 2.11 - 2.15)"
    )


def root_mesh(mesh):
    """The root ``DeviceMesh`` that ``mesh`` was sliced from (``mesh`` itself for a root). Local.

    torch internal: ``DeviceMesh._get_root_mesh`` (torch/distributed/device_mesh.py). Raises
    ``RuntimeError`` if this torch lacks it.
    """
    get = getattr(mesh, "_get_root_mesh", None)
    if get is None:
        raise _gone("DeviceMesh._get_root_mesh")
    return get()


def concatenate_meshes(meshes):
    """One ``DeviceMesh`` over the dims of ``meshes`` (sub-meshes of one root), in order. Local.

    torch internal: ``DeviceMesh._concatenate`` (what FSDP2's ``_fsdp_param.py: _spmd_mesh`` uses).
    Raises ``RuntimeError`` if this torch lacks it.
    """
    from torch.distributed.device_mesh import DeviceMesh

    concat = getattr(DeviceMesh, "_concatenate", None)
    if concat is None:
        raise _gone("DeviceMesh._concatenate")
    return concat(list(meshes))


def flatten_mesh(mesh, name: str):
    """``mesh`` (a multi-dim sub-mesh) as one 1-D mesh named ``name`` over the same ranks. Collective the
    first time (it makes a process group), over every rank of the root mesh.

    torch internal: ``DeviceMesh._flatten`` (what FSDP2's ``_fsdp_init.py: _get_mesh_info_from_named_dims``
    uses for ``DataParallelMeshDims`` with several shard or replicate dims). Raises ``RuntimeError`` if
    this torch lacks it.
    """
    flat = getattr(mesh, "_flatten", None)
    if flat is None:
        raise _gone("DeviceMesh._flatten")
    return flat(name)


def single_tensor_collectives():
    """``(all_gather_single, reduce_scatter_single)`` of ``torch.distributed`` under this torch's names.

    torch 2.13 - 2.15 name them ``all_gather_single`` / ``reduce_scatter_single`` (the old names emit
    FutureWarnings there); 2.11 has only ``all_gather_into_tensor`` / ``reduce_scatter_tensor``.
    """
    import torch.distributed as dist

    if hasattr(dist, "all_gather_single") and hasattr(dist, "reduce_scatter_single"):
        return dist.all_gather_single, dist.reduce_scatter_single
    if hasattr(dist, "all_gather_into_tensor") and hasattr(dist, "reduce_scatter_tensor"):
        return dist.all_gather_into_tensor, dist.reduce_scatter_tensor
    raise _gone("torch.distributed.all_gather_single / all_gather_into_tensor")


def dtensor_wrapper():
    """``wrap(local, spec) -> DTensor`` (``requires_grad=False``), the same object ``DTensor(local, spec,
    requires_grad=False)`` builds, for the per-step sharded ``.grad`` install of hundreds of params.

    torch internal: ``DTensor.__new__`` (torch/distributed/tensor/_api.py; on 2.13 - 2.15 the C++
    ``torch.Tensor._dtensor__new__``), called without ``DTensor.__init__``, which only runs
    ``Tensor.__init__`` behind ``torch._disable_dynamo`` -- about 2 us of dynamo's wrapper per tensor
    (measured on 2.13, CPU). ``tests/unit/test_compat.py`` checks that both build the same tensor on the
    installed torch, so a torch whose ``__init__`` starts doing real work fails there. Raises
    ``RuntimeError`` if this torch's DTensor has no ``__new__`` of its own.
    """
    import functools

    from torch.distributed.tensor import DTensor

    if "__new__" not in vars(DTensor):
        raise _gone("DTensor.__new__")
    return functools.partial(DTensor.__new__, DTensor, requires_grad=False)


def subclass_torch_function_off():
    """The context manager class that turns ``__torch_function__`` of tensor subclasses off for its block,
    for the per-step attribute scans over hundreds of sharded ``DTensor`` params.

    Reading ``requires_grad`` / ``grad`` / ``_version`` of a tensor subclass first looks up its
    ``__torch_function__`` (``check_has_torch_function`` in torch/csrc/utils/python_arg_parser.h); for
    ``DTensor``, whose ``__torch_function__`` is torch's ``_disabled_torch_function_impl``, that lookup is
    all the extra cost: 0.40 vs 0.14 us a read, 0.81 vs 0.44 ms to set 785 ``.grad`` (torch 2.13, CPU).
    Inside the block the getters and setters run as on a plain tensor and return the same values.

    torch internal: ``torch._C.DisableTorchFunctionSubclass`` (the context ``_disabled_torch_function_impl``
    itself enters; torch/_C/__init__.pyi). ``tests/unit/test_compat.py`` checks it on the installed torch.
    Raises ``RuntimeError`` if this torch has none.
    """
    import torch

    ctx = getattr(torch._C, "DisableTorchFunctionSubclass", None)
    if ctx is None:
        raise _gone("torch._C.DisableTorchFunctionSubclass")
    return ctx


def disable_functorch_if_active(fn):
    """Decorator: run ``fn`` with torch.func's transforms turned off when one is active (``torch.func.jvp``,
    ``grad``, ``vmap`` through an FSDP unit), as torch's FSDP2 runs its ``unshard`` / ``wait_for_unshard``
    / ``reshard`` (``_disable_functorch_if_active`` in torch/distributed/fsdp/_fully_shard/_fsdp_common.py).
    The all-gather's cast copy-in and the in-place collective write into the unit's flat buffer, which a
    transform would reject as a mutation of a captured tensor; the gathered params are buffers, not
    inputs of the transformed function, so no transform has to see these writes. Outside a transform it
    calls ``fn`` directly (one C call of overhead).

    torch internals: ``torch._C._are_functorch_transforms_active`` and ``torch._C._DisableFuncTorch``.
    ``tests/unit/test_compat.py`` checks both on the installed torch. Raises ``RuntimeError`` (at
    decoration) if this torch has neither.
    """
    import functools

    import torch

    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    off = getattr(torch._C, "_DisableFuncTorch", None)
    if active is None or off is None:
        raise _gone("torch._C._are_functorch_transforms_active / torch._C._DisableFuncTorch")

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if active():
            with off():
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper
