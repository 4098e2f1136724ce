"""raggedfsdp's DTensor op handlers under threads sharing one process.

raggedfsdp's handlers live in torch's process-wide ``DTensor._op_dispatcher._custom_op_handlers``
(``placement/_patches.py`` items 9, 10, 12). A handler that hands a call back to torch's dispatch
(``placement/_ops.py call_torch_dispatch``: a non-RaggedShard operand, or a RaggedShard operand that
must be redistributed) must not take its handler away from other threads while it does: a call of
the same op on another thread, on a RaggedShard DTensor, needs the handler at that moment (threads
in one process: torch's ``MultiThreadedTestCase`` runs its ranks so, data-loader and pin-memory
threads, tensor-parallel helpers).

Checked on a fake 3-rank group (no data moves; rank 0 holds an EMPTY RaggedShard piece, whose
inf-norm only raggedfsdp's handler computes: torch's kernel raises on an empty tensor), against the
same call made on one thread (the reference) and a float64 oracle of the local value.
"""

from __future__ import annotations

import sys
import threading

import pytest
import torch
import torch.distributed as dist

_INF = float("inf")


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torch._subclasses.fake_tensor import FakeTensorMode

    # torch 2.11 (CUDA build, no GPU) segfaults in FakeTensorMode.__enter__
    # (torch._C._ensureCUDADeviceGuardSet) on the main thread when the first FakeTensorMode of the
    # process was entered on another thread (reproduced without raggedfsdp); DTensor's sharding
    # propagation enters one, so the main thread enters it first
    with FakeTensorMode():
        torch.empty(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=3)
    yield 3
    dist.destroy_process_group()


def _tensors(world):
    """A RaggedShard DTensor whose rank-0 piece is empty, and a Shard(0) DTensor of a shape no other
    test uses (its first dispatch misses every sharding cache)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from raggedfsdp import RaggedShard

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4) - 11.5
    rs = DTensor.from_local(
        full[:0].reshape(-1), mesh, [RaggedShard((0,), (0, 2, 4))], shape=(6, 4), stride=(4, 1)
    )
    sh = distribute_tensor(torch.randn(9, 7, dtype=torch.float64), mesh, [Shard(0)])
    return rs, sh


def _check_rs_norm(out, ref):
    """``out`` = ``linalg.vector_norm(rs, inf)`` as the handler computes it (``ref``: on one thread)."""
    assert out.placements == ref.placements, (out.placements, ref.placements)
    assert type(out.placements[0]).__name__ == "InfNormPartial", out.placements
    # rank 0's piece is empty: it contributes the identity of max (0), checked in float64
    assert torch.equal(out.to_local().double(), torch.zeros((), dtype=torch.float64))
    assert torch.equal(out.to_local(), ref.to_local())


def _norm_case(world):
    """(op, A's call: handed back, B's call: needs the handler, check of B's result against one thread's)"""
    rs, sh = _tensors(world)
    ref = torch.linalg.vector_norm(rs, _INF)  # one thread: the handler's result
    _check_rs_norm(ref, ref)
    return (
        torch.ops.aten.linalg_vector_norm.default,
        lambda: torch.linalg.vector_norm(sh),
        lambda: torch.linalg.vector_norm(rs, _INF),
        lambda out: _check_rs_norm(out, ref),
    )


def _uniform_case(world):
    """``uniform_`` of a Shard(0) DTensor (handed back) and of a RaggedShard DTensor: the handler draws
    the full tensor and keeps rank 0's flat piece; torch's dispatch refuses a random op on it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor, zeros

    from raggedfsdp import RaggedShard

    mesh = init_device_mesh("cpu", (world,))
    rs = zeros(5, 3, device_mesh=mesh, placements=[RaggedShard((0,), (2, 1, 2))])  # rank 0: rows 0-1
    sh = distribute_tensor(torch.zeros(11, 2), mesh, [Shard(0)])
    torch.manual_seed(7)
    want = torch.empty(5, 3).uniform_().reshape(-1)[:6]  # oracle: the full draw, rank 0's rows

    def b_call():
        torch.manual_seed(7)  # A is held before its own draw, so nothing else draws meanwhile
        return rs.uniform_()

    def check(out):
        assert out is rs and out.placements == (RaggedShard((0,), (2, 1, 2)),), out.placements
        assert torch.equal(out.to_local(), want)

    check(b_call())  # one thread: the handler's result
    return torch.ops.aten.uniform_.default, lambda: sh.uniform_(), b_call, check


@pytest.mark.parametrize("case", [_norm_case, _uniform_case], ids=["inf_norm", "uniform_"])
def test_hand_back_keeps_the_handler_for_other_threads(fake_world, monkeypatch, case):
    """Deterministic interleaving: thread A's call on a Shard(0) DTensor is handed back to torch's
    dispatch (the handler's non-RaggedShard path) and stopped inside it, in torch's sharding
    propagation; thread B then calls the same op on a RaggedShard DTensor, which needs the handler.
    B must get the handler's result, and see the handler in the dict torch reads, while A is inside."""
    from torch.distributed.tensor import DTensor

    op, a_call, b_call, check_b = case(fake_world)
    disp = DTensor._op_dispatcher
    handler = disp._custom_op_handlers[op]
    assert handler.__module__.startswith("raggedfsdp.placement."), handler

    stock = disp._propagate_op_sharding_dispatch_slow_path  # torch's C++ dispatch calls it by name
    inside, b_done = threading.Event(), threading.Event()
    state: dict = {}

    def hold_a(op_call, *args, **kwargs):
        if op_call is op and threading.get_ident() == state.get("a") and not inside.is_set():
            inside.set()  # A is inside torch's dispatch of a handed-back call
            state["b_finished"] = b_done.wait(timeout=20)
        return stock(op_call, *args, **kwargs)

    monkeypatch.setattr(disp, "_propagate_op_sharding_dispatch_slow_path", hold_a, raising=False)

    def run_a():
        state["a"] = threading.get_ident()
        try:
            state["a_out"] = a_call()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            state["a_err"] = e

    def run_b():
        try:
            if not inside.wait(timeout=20):
                state["b_err"] = AssertionError("thread A never reached torch's dispatch")
                return
            state["b_sees_handler"] = disp._custom_op_handlers.get(op) is handler
            state["b_out"] = b_call()
        except BaseException as e:  # noqa: BLE001
            state["b_err"] = e
        finally:
            b_done.set()

    ta, tb = threading.Thread(target=run_a), threading.Thread(target=run_b)
    tb.start()
    ta.start()
    ta.join(30)
    tb.join(30)
    assert not ta.is_alive() and not tb.is_alive()
    assert state.get("b_finished"), "thread A was not held while B ran"
    assert "a_err" not in state, state["a_err"]
    assert "b_err" not in state, repr(state["b_err"])
    assert state["b_sees_handler"], "another thread's hand-back took the handler out of torch's dict"
    check_b(state["b_out"])
    # A got torch's own dispatch: the same call on one thread, with no handler in the way
    monkeypatch.undo()
    assert disp._custom_op_handlers.get(op) is handler
    if op is torch.ops.aten.linalg_vector_norm.default:
        want = a_call()
        assert state["a_out"].placements == want.placements
        assert torch.equal(state["a_out"].to_local(), want.to_local())


def test_threads_hammering_a_handled_op(fake_world):
    """No instrumentation: two threads call the same handled op, one on a Shard(0) DTensor (handed back
    every call), one on the RaggedShard DTensor (needs the handler), with a tiny GIL switch interval.
    Every RaggedShard call must give the handler's result."""
    rs, sh = _tensors(fake_world)
    ref = torch.linalg.vector_norm(rs, _INF)
    want = torch.linalg.vector_norm(sh)
    stop = threading.Event()
    errors: list = []
    outs: list = []

    def hand_back():
        while not stop.is_set():
            try:
                torch.linalg.vector_norm(sh)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                return

    def ragged(n):
        try:
            for _ in range(n):
                outs.append(torch.linalg.vector_norm(rs, _INF))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
        finally:
            stop.set()

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        ts = [threading.Thread(target=hand_back), threading.Thread(target=ragged, args=(400,))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
    finally:
        sys.setswitchinterval(old)
    assert not any(t.is_alive() for t in ts)
    assert not errors, f"{len(errors)} failed calls, first: {errors[0]!r}"
    assert len(outs) == 400
    for out in outs:
        _check_rs_norm(out, ref)
    assert torch.equal(torch.linalg.vector_norm(sh).to_local(), want.to_local())
