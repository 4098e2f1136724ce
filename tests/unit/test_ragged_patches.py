"""The torch-internal patches of raggedfsdp/placement/_patches.py: lazy, complete at every alias, guarded.

These fail loudly when a torch upgrade moves, renames or changes a patched internal, when an alias
of a patched function still holds torch's original code, or when importing raggedfsdp changes torch.
"""

import importlib
import inspect
import re
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from raggedfsdp import RaggedShard
from raggedfsdp.placement import _patches as tp


def _run(code: str) -> str:
    """Run ``code`` in a fresh interpreter; return its stdout (fails with its stderr)."""
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return r.stdout


def test_import_and_plan_apply_nothing():
    """``import raggedfsdp`` and ``raggedfsdp plan`` leave torch's code untouched; RaggedShard() patches."""
    out = _run("""
        import contextlib, io
        import torch.distributed.tensor as T
        from torch.distributed.tensor import _utils
        codes = (T.distribute_tensor.__code__, _utils._compute_local_shape_and_global_offset.__code__)
        import raggedfsdp
        from raggedfsdp.placement import _patches as tp
        from raggedfsdp.app.cli import main
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(["plan", "--model", "llama3-8b", "--world-size", "8", "--json"]) == 0
        assert not tp.is_applied() and tp.patched_symbols() == []
        assert (T.distribute_tensor.__code__, _utils._compute_local_shape_and_global_offset.__code__) == codes
        assert not any("raggedfsdp" in k for k in T.distribute_tensor.__globals__)
        raggedfsdp.RaggedShard((0,), (1, 2))
        assert tp.is_applied() and T.distribute_tensor.__code__ is not codes[0]
        print("ok")
    """)
    assert out.strip() == "ok"


def test_all_targets_patched_in_place():
    from torch.distributed.tensor import DTensor

    from raggedfsdp.placement import _foreach, _implicit, _ops, _random, _reductions

    RaggedShard((0,), (1,))
    keys = {f"{m}:{q}" for m, q, _, _ in tp.TARGETS}
    syms = set(tp.patched_symbols())
    assert keys <= syms and len(keys) == len(tp.TARGETS) == 16
    handlers = {s for s in syms if "_custom_op_handlers[" in s}
    assert syms == keys | handlers | {tp._VIEW_TAG}  # item 12: the per-thread view of the handler dict
    assert type(DTensor._op_dispatcher).__ragged_patched__
    fast = _foreach.supported_ops() if _foreach.wanted() else []  # patch 10, on unless turned off
    assert len(handlers) == len(_random.RANDOM_INPLACE_OPS) + len(_random.RANDOM_LIKE_OPS) + len(
        _ops.NORM_OPS
    ) + len(_reductions.REDUCTION_OPS) + 1 + len(fast) + len(
        _implicit._DIM_VIEW_OPS
    )  # + 1: _local_scalar_dense
    for op in fast:
        assert DTensor._op_dispatcher._custom_op_handlers[op] is _foreach.foreach_handler
    for op in _ops.NORM_OPS:
        assert DTensor._op_dispatcher._custom_op_handlers[op] is _ops.inf_norm_handler
    for op in _reductions.REDUCTION_OPS:
        assert DTensor._op_dispatcher._custom_op_handlers[op] is _reductions.reduction_handler
    for op in _implicit._DIM_VIEW_OPS:
        assert DTensor._op_dispatcher._custom_op_handlers[op] is _implicit.dim_view_handler
    for module, qualname, params, _ in tp.TARGETS:
        fn = tp._resolve(module, qualname)
        assert fn.__ragged_patched__ and fn.__code__.co_filename.startswith("<raggedfsdp patch of"), qualname
        # the trampoline keeps torch's exact signature (defaults live on the function object)
        assert inspect.signature(fn) == inspect.signature(fn.__ragged_original__), qualname
        assert fn.__ragged_original__.__code__ is tp.stock_codes()[f"{module}:{qualname}"]


def _torch_modules():
    import torch.distributed.checkpoint
    import torch.distributed.checkpoint.state_dict
    import torch.distributed.fsdp
    import torch.distributed.tensor.debug
    import torch.distributed.tensor.parallel  # noqa: F401

    return [
        (n, m)
        for n, m in list(sys.modules.items())
        if m is not None and (n == "torch" or n.startswith("torch.")) and isinstance(m, types.ModuleType)
    ]


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_no_alias_keeps_torch_original_code():
    """Scan every loaded torch module (and its classes) for a name still bound to an unpatched original.

    A name counts as an alias of a patched function when it is the same function (``__module__`` +
    ``__qualname__``) or carries its original code object. With module-attribute patching (before
    this design) this found 11 stale aliases on torch 2.13, e.g.
    ``tensor._api.compute_local_shape_and_global_offset``.
    """
    RaggedShard((0,), (1,))
    targets = {}
    for module, qualname, _, _ in tp.TARGETS:
        fn = tp._resolve(module, qualname)
        targets[(fn.__module__, fn.__qualname__)] = f"{module}:{qualname}"
    stock = {id(c): k for k, c in tp.stock_codes().items()}
    seen, bad = 0, []

    def check(where, v):
        nonlocal seen
        v = v.__func__ if isinstance(v, (staticmethod, classmethod)) else v
        if not isinstance(v, types.FunctionType):
            return
        key = targets.get((v.__module__, v.__qualname__))
        if key is not None:
            seen += 1
            if not getattr(v, "__ragged_patched__", False) or id(v.__code__) in stock:
                bad.append(f"{where} -> {key}")
        elif id(v.__code__) in stock and v is not tp._STOCK[stock[id(v.__code__)]]:
            bad.append(f"{where} (copy of the original code of {stock[id(v.__code__)]})")

    for name, mod in _torch_modules():
        for attr, v in list(vars(mod).items()):
            check(f"{name}.{attr}", v)
            if isinstance(v, type) and getattr(v, "__module__", "") == name:
                for a2, v2 in list(vars(v).items()):
                    check(f"{name}.{attr}.{a2}", v2)
    assert not bad, "unpatched aliases of patched torch functions:\n" + "\n".join(bad)
    assert seen > len(tp.TARGETS) + 5, seen  # the scan did see the targets and torch's own aliases of them


def test_apply_is_idempotent():
    from torch.distributed.tensor import _redistribute

    RaggedShard((0,), (1,))
    fn = _redistribute.redistribute_local_tensor
    code, orig = fn.__code__, fn.__ragged_original__
    tp._APPLIED = False
    tp.apply()
    tp.apply()
    assert fn.__code__ is code and fn.__ragged_original__ is orig
    assert tp.original("torch.distributed.tensor._redistribute", "redistribute_local_tensor") is orig
    assert not getattr(orig, "__ragged_patched__", False)


@pytest.mark.parametrize(
    "version, known",
    [
        ("2.11.0", True),
        ("2.12.1+cu126", True),
        ("2.13.0+cpu", True),
        ("2.14.1", True),
        ("2.15.0+cu132", True),
    ],
)
def test_version_policy_tested_minors(version, known):
    assert tp.check_torch_version(version) is known


def test_version_policy_new_and_old_minors():
    with pytest.warns(
        UserWarning, match=r"torch 2\.16\.0 is newer than the tested 2\.11 - 2\.15.*self-checked"
    ):
        assert tp.check_torch_version("2.16.0") is False
    with pytest.raises(RuntimeError, match=r"needs torch >= 2\.11.*found torch 2\.10\.2"):
        tp.check_torch_version("2.10.2")


def test_unknown_minor_runs_self_check(monkeypatch):
    """A newer torch warns, applies and self-checks; a broken patch makes the self-check raise."""
    out = _run("""
        import warnings, torch
        torch.__version__ = "2.16.0"
        import raggedfsdp
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            raggedfsdp.RaggedShard((0,), (1, 2))
        assert raggedfsdp.placement._patches.is_applied()
        print([str(x.message)[:40] for x in w if "newer than the tested" in str(x.message)])
    """)
    assert "torch 2.16.0 is newer" in out
    RaggedShard((0,), (1,))
    tp.self_check()
    from torch.distributed.tensor._ops import single_dim_strategy as sds

    fn = sds._fill_single_dim_strategy_placeholders
    monkeypatch.setattr(fn, "__code__", fn.__ragged_original__.__code__)  # as if torch moved the call
    with pytest.raises(RuntimeError, match=r"do not work on torch .*patch A.*not patched"):
        tp.self_check()


def test_target_guard_fails_loudly():
    def decorated():
        x = 1

        def inner(a, b):
            return a + b + x

        return inner

    with pytest.raises(RuntimeError, match=r"mod:f is a closure.*must be ported"):
        tp._check_target("mod:f", decorated(), ("a", "b"))
    with pytest.raises(RuntimeError, match=r"mod:g has parameters \('a', 'c'\), expected them to start with"):
        tp._check_target("mod:g", lambda a, c: None, ("a", "b"))
    with pytest.raises(RuntimeError, match=r"has no torch.distributed.tensor._api:nope"):
        tp._resolve("torch.distributed.tensor._api", "nope")


def test_trampoline_keeps_any_signature():
    def f(a, b=2, /, c=3, *args, d, e=5, **kw):
        return a, b, c, args, d, e, kw

    glob = {}
    g = types.FunctionType(f.__code__, glob, "f", f.__defaults__)
    g.__kwdefaults__ = f.__kwdefaults__
    glob[tp.HOOKS] = {"k": lambda *a, **k: ("hook", a, k)}
    g.__code__ = tp._trampoline(g, "k")
    assert g(1, d=4) == ("hook", (1, 2, 3), {"d": 4, "e": 5})
    assert g(1, 7, 8, 9, d=4, z=0) == ("hook", (1, 7, 8, 9), {"d": 4, "e": 5, "z": 0})
    assert str(inspect.signature(g)) == str(inspect.signature(f))


def test_is_shard_poses_as_sharding_but_shard_methods_raise():
    from torch.distributed.tensor import Shard

    rs = RaggedShard((0, 1), (1, 2))
    assert rs.is_shard() and rs.is_shard(1) and not rs.is_shard(2) and rs.dim == 0
    assert rs != Shard(0) and Shard(0) != rs
    shard_only = [
        n
        for n in dir(Shard)
        if n.startswith("_")
        and not n.startswith("__")
        and n not in type(rs).__dict__
        and n not in dir(type(rs))
    ]
    assert "_split_tensor" in shard_only and "_local_shard_size_and_offset" in shard_only
    for n in shard_only:
        with pytest.raises(AttributeError, match=r"treated RaggedShard.*as an even Shard\(0\)"):
            getattr(rs, n)
    assert not hasattr(rs, "_split_tensor")


def test_original_signatures_unchanged():
    """The internals we wrap still take the arguments our implementations pass through."""
    for module, qualname, params, _ in tp.TARGETS:
        got = list(inspect.signature(tp.original(module, qualname)).parameters)
        assert got[: len(params)] == list(params), (qualname, got)
    from torch.distributed.tensor import DTensor

    assert callable(DTensor._raise_if_contains_partial_placements)
    assert isinstance(DTensor._op_dispatcher._custom_op_handlers, dict)
    assert (
        "get_placement_from_reduction_op"
        in tp.original(
            "torch.distributed.tensor._ops._math_ops", "map_placements_after_reduction"
        ).__globals__
    )
    from torch.distributed.device_mesh import _mesh_resources

    assert callable(_mesh_resources.get_current_mesh)


def test_patch_a_expands_placeholders_to_ragged():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._ops import single_dim_strategy as sds

    rs = RaggedShard((0,), (1, 2))
    rules = [
        [sds._ShardingPlaceholder(0), sds._ShardingPlaceholder(0), Replicate()],
        [sds._ShardingPlaceholder(1), sds._ShardingPlaceholder(1), Replicate()],
    ]
    out = sds._fill_single_dim_strategy_placeholders({rs, Shard(0)}, rules)
    assert [rs, rs, Replicate()] in out and [Shard(0), Shard(0), Replicate()] in out
    assert [rs, rs, Replicate()] == out[-1] and all(p != rs for s in out[:-1] for p in s)


def test_patch_b_maps_ragged_to_partial():
    from torch.distributed.tensor import Partial, Replicate
    from torch.distributed.tensor._ops import _math_ops as mo

    rs = RaggedShard((0, 1), (1, 2))
    assert mo.map_placements_after_reduction((rs,), [0, 1], [-1, -1], "sum") == (Partial("sum"),)
    out = mo.map_placements_after_reduction((Replicate(), rs), [0, 1], [-1, -1], mo.NormReduction(2))
    assert out[0] == Replicate() and isinstance(out[1], mo._NormPartial) and out[1].norm_type == 2
    with pytest.raises(RuntimeError, match="does not cover the ragged dims"):
        mo.map_placements_after_reduction((rs,), [1], [0, -1], "sum")


def test_local_shape_and_offset_of_ragged_pieces():
    """torch's local-shape function: flat shape for sizing, one N-D box with offsets, ValueError otherwise."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset as f

    rs = RaggedShard((0,), (1, 0, 2))  # 6 rows: [0, 2), [], [2, 6)
    assert f((6, 4), (3,), [0], [rs], True) == ((8,), ())
    assert f((6, 4), (3,), [1], [rs], True) == ((0,), ())
    assert f((6, 4), (3,), [2], [rs]) == ((4, 4), (2, 0))
    assert f((6, 4), (3,), [1], [rs]) == ((0, 4), (2, 0))
    # composed with Shard(1) on a 2x3 mesh: the ragged rows of the column block
    assert f((6, 4), (2, 3), [1, 2], [Shard(1), rs]) == ((4, 2), (2, 2))
    assert f((6, 4), (2, 3), [1, 2], [Shard(1), rs], True) == ((8,), ())
    el = RaggedShard((0, 1), (3, 3, 2))  # element granularity: rank 0 holds 9 of 24 elements
    with pytest.raises(ValueError, match="is not a rectangle"):
        f((6, 4), (3,), [0], [el])
    with pytest.raises(
        ValueError, match="has 3 entries but mesh dim 0 of mesh of shape \\(2,\\) has 2 ranks"
    ):
        f((6, 4), (2,), [0], [rs])
    assert f((6, 4), (3,), [2], [Replicate()]) == ((6, 4), (0, 0))


def test_op_classification():
    from raggedfsdp.placement._ops import classify

    aten = torch.ops.aten
    for op in (
        aten.add.Tensor,
        aten.mul_.Tensor,
        aten._foreach_lerp_.Scalar,
        aten.clone.default,
        aten.zeros_like.default,
        aten.addcdiv_.default,
        aten._foreach_addcmul_.Scalar,
        aten.copy_.default,
    ):
        assert classify(op) == "pointwise", op
    for op in (aten.sum.default, aten.linalg_vector_norm.default, aten._foreach_norm.Scalar):
        assert classify(op) == "reduction", op
    for op in (
        aten.view.default,
        aten.t.default,
        aten.mm.default,
        aten.select.int,
        aten.slice.Tensor,
        aten.permute.default,
        aten.mean.default,
        aten.addmm.default,
        aten.index.Tensor,
        aten._foreach_max.default,
        aten.cat.default,
    ):
        assert classify(op) is None, op  # no local rule in the guard: views/reductions have their own
    for op in (aten.rand_like.default, aten.native_dropout.default):
        assert classify(op) == "random", op
    for op in (aten.new_empty.default, aten.new_zeros.default, aten.new_full.default):
        assert classify(op) == "factory", op


def test_module_docstring_lists_every_target():
    doc = tp.__doc__
    for _, qualname, _, _ in tp.TARGETS:
        assert qualname.split(".")[-1] in doc, qualname
    assert re.search(r"2\.11 - 2\.15", doc)
    importlib.import_module("raggedfsdp.placement._api")


def test_torch_load_weights_only_rebuilds_ragged_shard(tmp_path):
    """A ``torch.save``'d state dict of a raggedfsdp model loads with ``torch.load``'s default
    ``weights_only=True`` once raggedfsdp is in use (``fully_shard`` or any ``RaggedShard``), as FSDP2's
    do: ``apply`` registers RaggedShard as a safe global, the way torch registers its placements. Before
    any RaggedShard exists nothing is registered (importing raggedfsdp changes nothing), and
    ``weights_only`` refuses it naming the class."""
    path = tmp_path / "sd.pt"
    out = _run(f"""
        import os, torch, torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore
        import raggedfsdp
        from raggedfsdp.placement import _patches as tp
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import distribute_tensor
        assert not tp.is_applied()
        t = distribute_tensor(torch.arange(12.0).view(4, 3), init_device_mesh("cpu", (1,)),
                              [raggedfsdp.RaggedShard((0,), (4,))])
        torch.save({{"w": t}}, {str(path)!r})
        back = torch.load({str(path)!r})  # weights_only=True by default
        assert back["w"].placements == t.placements and torch.equal(back["w"].to_local(), t.to_local())
        print("ok")
    """)
    assert out.strip() == "ok"
    refused = _run(f"""
        import torch, pickle
        import torch.distributed.tensor  # torch's own DTensor globals
        import raggedfsdp  # no RaggedShard built in this process: nothing registered
        try:
            torch.load({str(path)!r}, weights_only=True)
        except pickle.UnpicklingError as e:
            print("refused" if "RaggedShard" in str(e) else str(e))
    """)
    assert refused.strip() == "refused"


def test_handler_view_is_what_torch_dispatch_reads(monkeypatch):
    """Item 12: torch's DTensor dispatch reads ``DTensor._op_dispatcher._custom_op_handlers`` per call,
    so a per-thread view leaves a handler out of one call on one thread. A handler handing its op back
    with ``dispatch_without_handler`` gets torch's own dispatch (the result of the op with no handler),
    once, no recursion. Fails loudly if torch stops reading the attribute per call or stops holding it
    as a plain instance dict."""
    import threading

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    RaggedShard((0,), (1,))
    op = torch.ops.aten.sgn.default  # no handler of torch's or raggedfsdp's
    disp = DTensor._op_dispatcher
    shared = disp._custom_op_handlers
    assert op not in shared and shared is tp._HandlerView.current and "_custom_op_handlers" not in vars(disp)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        x = distribute_tensor(torch.tensor([[-2.0, 0.0, 3.0]]), init_device_mesh("cpu", (1,)), [Shard(1)])
        want = torch.sgn(x)  # torch's dispatch
        calls = []

        def spy(op_call, args, kwargs):
            calls.append(threading.get_ident())
            return tp.dispatch_without_handler(op_call, args, kwargs)

        shared[op] = spy
        out = torch.sgn(x)
        assert calls == [threading.get_ident()], calls  # the handler ran once: the hand-back skipped it
        assert out.placements == want.placements and torch.equal(out.to_local(), want.to_local())
        assert disp._custom_op_handlers is shared and shared[op] is spy  # nothing moved
        # a view without the handler, on this thread only: torch skips it; another thread still has it
        tp._VIEW.current = {k: v for k, v in shared.items() if k is not op}
        try:
            assert torch.equal(torch.sgn(x).to_local(), want.to_local()) and len(calls) == 1
            seen = []
            t = threading.Thread(target=lambda: seen.append(disp._custom_op_handlers.get(op)))
            t.start()
            t.join()
            assert seen == [spy]
            # torch calling a handler the thread's view lacks: torch no longer reads the view
            with pytest.raises(RuntimeError, match="no longer reads.*item 12"):
                spy(op, (x,), {})
        finally:
            del tp._VIEW.current
        assert disp._custom_op_handlers is shared
    finally:
        shared.pop(op, None)
        dist.destroy_process_group()
    # assigning the attribute (torch's context_parallel swaps the dict) replaces the shared dict
    swapped = {**shared, op: spy}
    disp._custom_op_handlers = swapped
    try:
        assert disp._custom_op_handlers is swapped and tp._HandlerView.current is swapped
    finally:
        disp._custom_op_handlers = shared
    assert disp._custom_op_handlers is shared
    # a torch whose dispatcher no longer holds a plain instance dict is refused, naming item 12
    odd = type("OpDispatcher", (), {"_custom_op_handlers": property(lambda self: {})})()
    monkeypatch.setattr(DTensor, "_op_dispatcher", odd)
    with pytest.raises(RuntimeError, match="_custom_op_handlers as a plain instance dict.*item 12"):
        tp._install_handler_view()
