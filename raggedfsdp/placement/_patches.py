"""Every patch raggedfsdp applies to torch internals, in one place, applied lazily.

torch has no extension point for a new DTensor placement type (fsdp2-internals.md section 0.4,
pytorch issue #169320), so RaggedShard needs a few guarded patches. Each one delegates to torch's
original code whenever no RaggedShard is involved, so other DTensors behave exactly as before.

When patches apply
------------------
``import raggedfsdp`` applies **nothing**: the planner, the CLI's pure-Python commands and torch's
own ``fully_shard`` run on unmodified torch. :func:`apply` runs on the first construction of a
:class:`~raggedfsdp.placement.RaggedShard` (which every RaggedShard DTensor, every raggedfsdp
``fully_shard`` and every unpickled RaggedShard goes through) and is idempotent and thread-safe.
Besides the patches it registers ``RaggedShard`` as a ``torch.load(weights_only=True)`` safe global
(public API, as torch registers its own placements).

How they apply: at the code object, so every alias is patched
-------------------------------------------------------------
A module-attribute patch misses every name bound before it (``from torch.distributed.tensor import
distribute_tensor`` in user code, or the many ``from ._utils import ...`` copies inside torch).
So each patched torch *function object* keeps its identity and gets a new ``__code__``: a
trampoline with the identical signature (defaults stay on the function) that calls
``placement/_api.py`` / ``_ops.py`` / ``_checkpoint.py`` / ``_redistribute.py``, which call
torch's original code (a copy of the function with the original ``__code__``,
``fn.__ragged_original__``) for non-ragged inputs. Every alias, whenever it was bound, reaches the
new code; ``tests/unit/test_ragged_patches.py`` scans all loaded torch modules to prove it.
Targets must be plain Python functions without closures, else :func:`apply` raises naming it.

Patched torch functions (``module:qualname``) and why
------------------------------------------------------
1. ``tensor._redistribute:redistribute_local_tensor``: torch dispatches on ``is_shard()`` and
   treats equal ``.dim`` as "no change"; ragged specs go to ``placement/_redistribute.py``.
   Covers ``redistribute``, ``full_tensor`` and their backward.
2. ``tensor._api:distribute_tensor``: torch raises for unknown placements; RS = broadcast + slice.
3. ``tensor._api:DTensor.from_local``: clear error without ``shape``/``stride``; numel check.
4. ``tensor._api:_dtensor_init_helper``: the factories ``zeros/ones/empty/full/rand/randn``
   (+ ``linspace/logspace`` on 2.15) would build a full-shape local tensor; RS gets its flat piece.
5. ``tensor._sharding_prop:ShardingPropagator.propagate_op_sharding_non_cached``: the op guard
   of ``placement/_ops.py``: ops with a local rule (pointwise-like ops, full sum/p-norm
   reductions, ``new_*`` factories, views) run on the RS pieces; every other op redistributes its
   RS inputs to what torch's strategy wants for a ``Shard(0)`` stand-in (``placement/_implicit.py``).
6. ``tensor._ops.single_dim_strategy:_fill_single_dim_strategy_placeholders`` (patch A: pointwise
   and foreach rules keep RS), ``tensor._ops.utils:is_tensor_shardable`` (patch C: invalid RS
   tuples are no strategy candidates), ``tensor._ops._math_ops:map_placements_after_reduction``
   (patch B: RS -> the reduction's Partial), ``tensor._ops.utils:map_placements_after_broadcast``
   (patch D: 2.11/2.12 map pointwise outputs onto operands with it and assert ``Shard``; RS stays
   RS on same-shape operands, Replicate on scalars).
7. ``tensor._utils:_compute_local_shape_and_global_offset`` (and so the public
   ``compute_local_shape_and_global_offset`` that calls it): torch silently answers "Replicate"
   for unknown placements. For RS: ``skip_offset=True`` (callers sizing the local tensor) gives
   the flat local shape ``(numel,)``; otherwise the piece as one N-D box in global coordinates
   (exact for ``dims=(0,)``), ``ValueError`` if the piece is not a rectangle.
8. ``tensor._api:DTensor.__create_write_items__`` / ``__create_chunk_list__`` /
   ``__get_tensor_shard__`` and ``_state_dict_utils:_distribute_tensors``: DCP boxes and
   full-state-dict loading (``placement/_checkpoint.py``).
   ``checkpoint.filesystem:_FileSystemWriter._write_data`` (the safetensors format:
   ``HuggingFaceStorageWriter``): a safetensors file maps a name to one tensor and torch's writer keeps
   the last chunk of a name per file, so a non-rectangular RaggedShard piece (several chunks) was
   saved wrong, silently; the extra chunks of a name now go to ``*.part<k>.safetensors`` files next
   to it (``_checkpoint.split_safetensors_files``), which torch's HF reader and consolidation merge.
9. ``DTensor._op_dispatcher._custom_op_handlers`` gains entries (a dict torch reads per call):
   random ops (``placement/_random.py``: draw the full tensor, keep the piece), the inf-norms
   ``linalg_vector_norm`` / ``_foreach_norm`` (``placement/_ops.py``: empty pieces contribute 0),
   and the reductions ``sum.dim_IntList`` / ``mean`` / ``max`` / ``min`` / ``amax`` / ``amin`` /
   ``any`` / ``all`` plus ``_local_scalar_dense`` (``placement/_reductions.py``: per-row and
   ragged-dim reductions on the pieces; ``.item()`` of a RaggedPartial reads the global value).
10. The same dict gains the element-wise ``_foreach_*`` ops of ``torch.optim``
   (``placement/_foreach.py``; ``RAGGEDFSDP_FOREACH_FAST_PATH=0`` turns it off): lists of RaggedShard
   DTensors with matching specs run on their local tensors, skipping torch's sharding propagation
   (quadratic in the list length on 2.13/2.14: tens of seconds per new list of 785 params) and
   2.11/2.12's Python dispatch.

11. ``tensor._utils:ExplicitRedistributionContext.observe_redistribution`` (torch calls it for every
   implicit redistribution an op's dispatch performs): counts those of RS DTensors and raises under
   ``raggedfsdp.strict_ops()`` / ``RAGGEDFSDP_STRICT_OPS=1`` (``placement/_implicit.py``).
12. ``tensor._dispatch:OpDispatcher._custom_op_handlers`` becomes a per-thread view
   (:func:`dispatch_without_handler`): a handler that hands a call back to torch's dispatch
   (``placement/_ops.py call_torch_dispatch``) needs torch's dispatch with its own entry absent, and
   torch's C++ dispatch (``dispatchDTensorOp``, torch 2.11 - 2.13) reads the attribute
   ``DTensor._op_dispatcher._custom_op_handlers`` on every call, so the one ``OpDispatcher`` instance
   gets a subclass whose property returns this thread's view: the shared dict (the one object torch
   created, where items 9 and 10 live), or for the duration of a hand-back a copy of it without that
   op, on that thread only. Other threads keep every handler, and the shared dict is never mutated
   per call (the earlier pop-and-restore left a window in which another thread's call of the same op
   missed the handler: ``tests/unit/test_ragged_handler_threads.py``). Assigning the attribute (torch's
   ``context_parallel`` swaps the dict) replaces the shared dict, as before.

Supported torch: 2.11 - 2.15 (:data:`SUPPORTED`). Every target's signature is checked before it is
patched (a moved or changed internal raises ``RuntimeError`` naming it). A newer minor warns and
runs :func:`self_check` (local behaviour checks, no process group) instead of refusing.
"""

from __future__ import annotations

import importlib
import inspect
import threading
import types
import warnings

import torch

from raggedfsdp._compat import torch_minor  # noqa: F401 (re-exported: the patch tests use it)

SUPPORTED = ((2, 11), (2, 12), (2, 13), (2, 14), (2, 15))
HOOKS = "__raggedfsdp_hooks__"  # the one name added to a patched function's module globals

# (module, qualname, leading parameter names torch must still have, impl factory "module:name")
_P = "raggedfsdp.placement."
TARGETS = (
    (
        "torch.distributed.tensor._redistribute",
        "redistribute_local_tensor",
        ("local_tensor", "current_spec", "target_spec"),
        _P + "_redistribute:make_redistribute_local_tensor",
    ),
    (
        "torch.distributed.tensor._api",
        "distribute_tensor",
        ("tensor", "device_mesh", "placements", "src_data_rank"),
        _P + "_api:make_distribute_tensor",
    ),
    (
        "torch.distributed.tensor._api",
        "DTensor.from_local",
        ("local_tensor", "device_mesh", "placements", "run_check", "shape", "stride"),
        _P + "_api:make_from_local",
    ),
    (
        "torch.distributed.tensor._api",
        "_dtensor_init_helper",
        ("init_op", "size", "device_mesh", "placements", "kwargs"),
        _P + "_api:make_dtensor_init_helper",
    ),
    (
        "torch.distributed.tensor._sharding_prop",
        "ShardingPropagator.propagate_op_sharding_non_cached",
        ("self", "op_schema"),
        _P + "_ops:make_guarded_propagation",
    ),
    (
        "torch.distributed.tensor._ops.single_dim_strategy",
        "_fill_single_dim_strategy_placeholders",
        ("unique_input_placements", "single_dim_strategies_with_placeholders"),
        _P + "_ops:make_fill_placeholders",
    ),
    (
        "torch.distributed.tensor._ops.utils",
        "is_tensor_shardable",
        ("shape", "spec"),
        _P + "_ops:make_is_tensor_shardable",
    ),
    (
        "torch.distributed.tensor._ops._math_ops",
        "map_placements_after_reduction",
        ("placements", "reduction_dims", "reduction_dims_map", "reduction_op"),
        _P + "_ops:make_map_after_reduction",
    ),
    (
        "torch.distributed.tensor._ops.utils",
        "map_placements_after_broadcast",
        ("placements", "shape", "broadcast_dims_map"),
        _P + "_ops:make_map_placements_after_broadcast",
    ),
    (
        "torch.distributed.tensor._utils",
        "_compute_local_shape_and_global_offset",
        ("global_shape", "mesh_shape", "my_coordinate", "placements", "skip_offset"),
        _P + "_checkpoint:make_compute_local_shape_and_global_offset",
    ),
    (
        "torch.distributed.tensor._api",
        "DTensor.__create_write_items__",
        ("self", "fqn", "object"),
        _P + "_checkpoint:make_create_write_items",
    ),
    (
        "torch.distributed.tensor._api",
        "DTensor.__create_chunk_list__",
        ("self",),
        _P + "_checkpoint:make_create_chunk_list",
    ),
    (
        "torch.distributed.tensor._api",
        "DTensor.__get_tensor_shard__",
        ("self", "index"),
        _P + "_checkpoint:make_get_tensor_shard",
    ),
    (
        "torch.distributed.tensor._utils",
        "ExplicitRedistributionContext.observe_redistribution",
        ("cls", "src_spec", "dst_spec", "redistribution_msg"),
        _P + "_implicit:make_observe_redistribution",
    ),
    (
        "torch.distributed._state_dict_utils",
        "_distribute_tensors",
        ("local_state_dict", "keys", "device"),
        _P + "_checkpoint:make_distribute_tensors",
    ),
    (
        "torch.distributed.checkpoint.filesystem",
        "_FileSystemWriter._write_data",
        ("self", "planner", "file_queue"),
        _P + "_checkpoint:make_write_data",
    ),
)

_LOCK = threading.RLock()
_APPLIED = False
_APPLYING = False
_STOCK: dict[str, types.FunctionType] = {}  # "module:qualname" -> copy of torch's original function
_HANDLERS: list[str] = []


def check_torch_version(version: str | None = None) -> bool:
    """True for a tested minor, False (after a ``UserWarning``) for a newer one; ``RuntimeError`` if older.

    Called by :func:`apply`, never at import. For a newer minor :func:`apply` also runs
    :func:`self_check`, which raises if a patch no longer behaves.
    """
    version = version or torch.__version__
    minor = torch_minor(version)
    if minor in SUPPORTED:
        return True
    if minor < SUPPORTED[0]:
        raise RuntimeError(
            f"raggedfsdp's RaggedShard needs torch >= 2.11 (tested 2.11 - 2.15); found torch {version}. "
            "Upgrade torch (pip install 'torch>=2.11,<2.16')."
        )
    warnings.warn(
        f"raggedfsdp: torch {version} is newer than the tested 2.11 - 2.15; the RaggedShard patches are "
        "applied and self-checked (raggedfsdp.placement._patches.self_check), but run the test suite before "
        "trusting results on this version.",
        UserWarning,
        stacklevel=3,
    )
    return False


def _resolve(module: str, qualname: str):
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        try:
            obj = inspect.getattr_static(obj, part)
        except AttributeError:
            raise RuntimeError(
                f"raggedfsdp: torch {torch.__version__} has no {module}:{qualname}; the RaggedShard patches "
                "must be ported to this torch (raggedfsdp/placement/_patches.py)"
            ) from None
    return obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj


def _check_target(key: str, fn, params: tuple[str, ...]) -> None:
    why = None
    if not isinstance(fn, types.FunctionType):
        why = f"is a {type(fn).__name__}, not a plain Python function"
    elif fn.__closure__ or fn.__code__.co_freevars:
        why = "is a closure (decorated?), so its code cannot be swapped"
    elif fn.__code__.co_flags & (inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR):
        why = "is a generator or coroutine"
    else:
        got = tuple(inspect.signature(fn, follow_wrapped=False).parameters)
        if got[: len(params)] != params:
            why = f"has parameters {got}, expected them to start with {params}"
    if why:
        raise RuntimeError(
            f"raggedfsdp: torch {torch.__version__}'s {key} {why}; the RaggedShard patch for it must be "
            "ported (raggedfsdp/placement/_patches.py)"
        )


def _trampoline(fn: types.FunctionType, key: str) -> types.CodeType:
    """A code object with ``fn``'s exact parameters that calls ``HOOKS[key]`` with them."""
    sig = inspect.signature(fn, follow_wrapped=False)
    P = inspect.Parameter
    decl, call, star = [], [], False
    kinds = [p.kind for p in sig.parameters.values()]
    for i, p in enumerate(sig.parameters.values()):
        if p.kind is P.VAR_POSITIONAL:
            decl.append(f"*{p.name}")
            call.append(f"*{p.name}")
            star = True
        elif p.kind is P.VAR_KEYWORD:
            decl.append(f"**{p.name}")
            call.append(f"**{p.name}")
        elif p.kind is P.KEYWORD_ONLY:
            if not star:
                decl.append("*")
                star = True
            decl.append(f"{p.name}=None")  # placeholder: the real defaults stay on fn
            call.append(f"{p.name}={p.name}")
        else:
            decl.append(f"{p.name}=None")
            call.append(p.name)
        if p.kind is P.POSITIONAL_ONLY and (i + 1 == len(kinds) or kinds[i + 1] is not P.POSITIONAL_ONLY):
            decl.append("/")
    src = f"def {fn.__name__}({', '.join(decl)}):\n    return {HOOKS}[{key!r}]({', '.join(call)})\n"
    ns: dict = {}
    exec(compile(src, f"<raggedfsdp patch of {key}>", "exec"), ns)  # noqa: S102 - generated trampoline
    code = (
        ns[fn.__name__].__code__.replace(co_qualname=fn.__qualname__)
        if hasattr(fn.__code__, "co_qualname")
        else ns[fn.__name__].__code__
    )
    assert code.co_argcount == fn.__code__.co_argcount
    assert code.co_kwonlyargcount == fn.__code__.co_kwonlyargcount
    return code


def _swap(module: str, qualname: str, params: tuple[str, ...], factory: str) -> None:
    key = f"{module}:{qualname}"
    fn = _resolve(module, qualname)
    if getattr(fn, "__ragged_patched__", False):
        _STOCK.setdefault(key, fn.__ragged_original__)
        return
    _check_target(key, fn, params)
    stock = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, None)
    stock.__kwdefaults__ = dict(fn.__kwdefaults__) if fn.__kwdefaults__ else None
    stock.__qualname__, stock.__doc__, stock.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
    stock.__annotations__ = dict(fn.__annotations__)
    mod_name, _, maker = factory.partition(":")
    impl = getattr(importlib.import_module(mod_name), maker)(stock)
    fn.__globals__.setdefault(HOOKS, {})[key] = impl
    fn.__code__ = _trampoline(fn, key)
    fn.__ragged_patched__ = True
    fn.__ragged_original__ = stock
    _STOCK[key] = stock


def _install_handlers() -> None:
    from torch.distributed.tensor import DTensor

    from raggedfsdp.placement import _foreach, _implicit, _ops, _random, _reductions

    handlers = DTensor._op_dispatcher._custom_op_handlers
    for name, install in (
        ("_random", _random.install),
        ("_ops", _ops.install_norm_handlers),
        ("_reductions", _reductions.install),
        ("_implicit", _implicit.install_view_handlers),
        ("_foreach", _foreach.install),
    ):
        for op in install(handlers):  # idempotent; raises if torch gained its own handler
            tag = f"torch.distributed.tensor._dispatch:OpDispatcher._custom_op_handlers[{op}]"
            if tag not in _HANDLERS:
                _HANDLERS.append(tag)


# ---- item 12: a per-thread view of DTensor's op-handler dict -----------------------------------
_VIEW_TAG = "torch.distributed.tensor._dispatch:OpDispatcher._custom_op_handlers (per-thread view)"


class _HandlerView(threading.local):
    """``current``: the op-handler dict torch's DTensor dispatch reads on this thread. The class
    attribute is the shared dict; :func:`dispatch_without_handler` sets a per-thread copy."""

    current: dict = {}


_VIEW = _HandlerView()


def _view_get(self) -> dict:
    return _VIEW.current


def _view_set(self, value) -> None:
    _HandlerView.current = value  # the shared dict, for every thread without a hand-back in progress


def _install_handler_view() -> None:
    """Give ``DTensor._op_dispatcher`` a subclass whose ``_custom_op_handlers`` is :data:`_VIEW`'s
    (idempotent). Raises ``RuntimeError`` if torch's dispatcher no longer holds the dict as a plain
    instance attribute."""
    from torch.distributed.tensor import DTensor

    disp = DTensor._op_dispatcher
    cls = type(disp)
    if getattr(cls, "__ragged_patched__", False):
        return
    shared = vars(disp).get("_custom_op_handlers")
    if type(shared) is not dict or any("_custom_op_handlers" in vars(c) for c in cls.__mro__):
        raise RuntimeError(
            f"raggedfsdp: torch {torch.__version__}'s DTensor._op_dispatcher no longer holds "
            "_custom_op_handlers as a plain instance dict; the per-thread handler view must be ported "
            "(raggedfsdp/placement/_patches.py item 12)"
        )
    _HandlerView.current = shared
    view_cls = type(
        cls.__name__,
        (cls,),
        {
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
            "__ragged_patched__": True,
            "_custom_op_handlers": property(_view_get, _view_set, doc="this thread's op-handler dict"),
        },
    )
    # the class first: its property then wins over the instance attribute, so a dispatch on another
    # thread always finds the dict
    disp.__class__ = view_cls
    del vars(disp)["_custom_op_handlers"]
    if _VIEW_TAG not in _HANDLERS:
        _HANDLERS.append(_VIEW_TAG)


def dispatch_without_handler(op_call, args, kwargs):
    """``op_call(*args, **kwargs)`` through torch's DTensor dispatch with ``op_call``'s custom handler
    left out on this thread only (its sharding propagation, redistribution and local op; other threads
    keep every handler). Handlers of other ops stay in place, nested hand-backs stack.

    Raises ``RuntimeError`` if torch called a raggedfsdp handler of ``op_call`` although this thread's
    view lacks it (torch no longer reads the view: item 12 must be ported)."""
    local = _VIEW.__dict__  # this thread's attributes of the threading.local
    prev = local.get("current")
    cur = _HandlerView.current if prev is None else prev
    if op_call not in cur:
        if prev is not None:
            raise RuntimeError(
                f"raggedfsdp: torch {torch.__version__}'s DTensor dispatch called raggedfsdp's handler of "
                f"{op_call} although this thread's _custom_op_handlers lacks it: torch no longer reads "
                "DTensor._op_dispatcher._custom_op_handlers per call; port raggedfsdp/placement/_patches.py "
                "item 12"
            )
        return op_call(*args, **kwargs)  # the handler was taken out of the shared dict: torch's dispatch
    view = cur.copy()  # ~0.7 us for torch's + raggedfsdp's ~120 entries
    del view[op_call]
    local["current"] = view
    try:
        return op_call(*args, **kwargs)
    finally:
        if prev is None:
            del local["current"]
        else:
            local["current"] = prev


def _allow_in_weights_only_load() -> None:
    """Let ``torch.load`` (``weights_only=True``, its default since 2.6) rebuild ``RaggedShard``, as torch
    lets it rebuild its own placements (``torch/distributed/tensor/__init__.py`` registers ``Shard``,
    ``Replicate``, ``Partial``, ``DTensorSpec`` with ``torch.serialization.add_safe_globals``): a
    ``torch.save``'d state dict of a raggedfsdp model then loads like FSDP2's. ``RaggedShard`` holds only
    tuples of ints."""
    import torch.serialization

    from raggedfsdp.placement.ragged_shard import RaggedShard

    torch.serialization.add_safe_globals([RaggedShard])


def is_applied() -> bool:
    """Whether :func:`apply` has installed the patches in this process."""
    return _APPLIED


def apply() -> None:
    """Install every patch (idempotent, thread-safe). Called by ``RaggedShard.__init__``.

    Raises ``RuntimeError`` for torch < 2.11 or when a target moved/changed; warns and runs
    :func:`self_check` on a minor newer than 2.15.
    """
    global _APPLIED, _APPLYING
    if _APPLIED or _APPLYING:
        return
    with _LOCK:
        if _APPLIED or _APPLYING:
            return
        _APPLYING = True
        try:
            known = check_torch_version()
            for module, qualname, params, factory in TARGETS:
                _swap(module, qualname, params, factory)
            _install_handler_view()
            _install_handlers()
            _allow_in_weights_only_load()
            if not known:
                self_check()
            _APPLIED = True
        finally:
            _APPLYING = False


def original(module_name: str, qualname: str):
    """torch's original function for a patched ``module:qualname`` (the current one if unpatched)."""
    fn = _resolve(module_name, qualname)
    return getattr(fn, "__ragged_original__", fn)


def patched_symbols() -> list[str]:
    """``"module:qualname"`` of every torch function patched by :func:`apply`, plus the op handlers."""
    return sorted(_STOCK) + sorted(_HANDLERS)


def stock_codes() -> dict[str, types.CodeType]:
    """``"module:qualname"`` -> torch's original code object (for the alias scan in the tests)."""
    return {k: f.__code__ for k, f in _STOCK.items()}


def self_check() -> None:
    """Local behaviour checks of the patches (no process group needed); ``RuntimeError`` on failure.

    Run by :func:`apply` on an untested torch minor; the test suite checks the same behaviours
    (and the distributed ones) on each tested minor.
    """
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor._ops import _math_ops as mo
    from torch.distributed.tensor._ops import single_dim_strategy as sds
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset as clsgo

    from raggedfsdp.placement.ragged_shard import RaggedShard

    rs = RaggedShard((0,), (1, 0, 2))
    problems = []
    try:
        rules = [[sds._ShardingPlaceholder(0), sds._ShardingPlaceholder(0)]]
        if [rs, rs] not in sds._fill_single_dim_strategy_placeholders({rs, Shard(0)}, rules):
            problems.append("pointwise strategies no longer keep RaggedShard (patch A)")
        if mo.map_placements_after_reduction((rs,), [0, 1], [-1, -1], "sum") != (Partial("sum"),):
            problems.append("reductions no longer map RaggedShard to Partial (patch B)")
        if (
            clsgo((6, 4), (3,), [2], [rs], True) != ((16,), ())
            or clsgo((6, 4), (3,), [2], [rs]) != ((4, 4), (2, 0))
            or clsgo((6, 4), (3,), [1], [Replicate()]) != ((6, 4), (0, 0))
        ):
            problems.append("local shapes of RaggedShard are wrong (_compute_local_shape_and_global_offset)")
    except Exception as e:  # noqa: BLE001 - any failure here means the patch no longer fits
        problems.append(f"{type(e).__name__}: {e}")
    from torch.distributed.tensor import DTensor

    disp = DTensor._op_dispatcher
    if not getattr(type(disp), "__ragged_patched__", False) or disp._custom_op_handlers is not _VIEW.current:
        problems.append("DTensor's op-handler dict is not raggedfsdp's per-thread view (item 12)")
    for key in _STOCK:
        if not _resolve(*key.split(":")).__code__.co_filename.startswith("<raggedfsdp patch of"):
            problems.append(f"{key} is not patched")
    if problems:
        raise RuntimeError(
            f"raggedfsdp: the RaggedShard patches do not work on torch {torch.__version__}: "
            + "; ".join(problems)
            + ". Use torch 2.11 - 2.15 or port raggedfsdp/placement/_patches.py."
        )
