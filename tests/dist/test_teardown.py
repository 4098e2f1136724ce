"""The test harness sees a rank that dies at teardown (issue 11 item 7).

A rank that finishes its work, reports success and then aborts at exit (SIGABRT, "terminate called
without an active exception": the gloo teardown bug) must fail the test, or the suite cannot show
that the abort is gone. ``benchmarks/teardown_soak.py`` counts such aborts over many launches.
"""

from __future__ import annotations

import pytest
from _dist import run_distributed


def _abort_at_exit(rank, world):
    import atexit
    import ctypes

    if rank == 1:  # after the harness's shutdown and report, at interpreter exit
        atexit.register(lambda: ctypes.CDLL("libstdc++.so.6")["_ZSt9terminatev"]())


def test_harness_fails_a_rank_that_aborts_after_reporting_success():
    with pytest.raises(AssertionError, match=r"rank 1 reported success, then exited with signal SIGABRT"):
        run_distributed(_abort_at_exit, 2)


def _no_tensor_left_owned_by_a_work(rank, world):
    """Note [gloo release] (raggedfsdp/_release.py): a gloo worker thread may hold a finished work a
    while after ``wait()`` returned, and its release of a tensor that has a Python object may need the
    GIL. Simulate a worker that never lets go (every tensor handed to a collective is also kept by a C++
    reference: another tensor's ``.grad``) and check, after fully_shard training steps (a zero-numel
    parameter, a cast all-gather, a DTensor redistribute), that every tensor a collective got is an
    alias from ``handoff`` that the library still holds (so its use count cannot fall to 1 on the
    worker) and is owned by Python, not by the work alone. Then, once the "worker" lets go, nothing
    stays held."""
    import gc
    import sys
    import weakref

    import torch
    import torch.distributed as dist
    from _toy_models import ToyLM, batches, lm_loss, shard_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import raggedfsdp.buffer.dbuffer as dbuffer
    import raggedfsdp.placement._redistribute as redistribute
    from raggedfsdp import _release, fully_shard

    held, seen = [], []  # the simulated worker's references; weakrefs of what it was given

    def slow_worker(fn):
        def run(*args, **kwargs):
            out = fn(*args, **kwargs)
            for a in args[:2]:
                if isinstance(a, torch.Tensor):
                    keeper = torch.empty_like(a)
                    keeper.grad = a  # a C++ reference to the TensorImpl, as a pending gloo work holds
                    held.append(keeper)
                    seen.append((weakref.ref(a), fn.__name__))
            return out

        return run

    patches = [(dist, "all_reduce"), (dist, "all_to_all_single"), (dbuffer, "_all_gather_single"),
               (dbuffer, "_reduce_scatter_single"), (redistribute, "_all_gather_single")]  # fmt: skip
    saved = [(m, n, getattr(m, n)) for m, n in patches]
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    model = ToyLM(n_layers=2)
    model.layers[0].empty = torch.nn.Parameter(torch.zeros(0))  # the zero-numel parameter
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard_model(model, fully_shard, mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    try:
        for m, n, f in saved:
            setattr(m, n, slow_worker(f))
        for tok, tgt in batches(2, 2 * world):
            sl = slice(2 * rank, 2 * rank + 2)
            lm_loss(model, tok[sl], tgt[sl]).backward()
            opt.step()
            opt.zero_grad()
        model.head.weight.full_tensor()  # a RaggedShard -> Replicate redistribute (placement's all-gather)
    finally:
        for m, n, f in saved:
            setattr(m, n, f)
    gc.collect()
    names = {n for _, n in seen}
    assert {"all_reduce", "all_gather_into_tensor"} <= names or {
        "all_reduce",
        "all_gather_single",
    } <= names, names
    orphans, not_handed = [], []
    aliases = {id(al) for al, _ in _release._HELD}
    for wr, name in seen:
        t = wr()
        assert t is not None, "a tensor held by a work died"
        if id(t) not in aliases:  # given to the backend as it is: its release may take the GIL
            not_handed.append(f"{name}: {tuple(t.shape)} {t.dtype}")
        # a tensor only the work (C++) keeps alive has no Python referrer but the ones made here
        if not [r for r in gc.get_referrers(t) if r is not seen and r is not sys._getframe()]:
            orphans.append(f"{name}: {tuple(t.shape)} {t.dtype}")
        del t
    assert not orphans, f"left owned by a pending work alone (Note [gloo release]): {orphans}"
    assert not not_handed, f"given to a collective without handoff (Note [gloo release]): {not_handed}"
    assert _release.unreleased() > 0  # the simulated worker still holds them
    held.clear()
    assert _release.unreleased() == 0, "a tensor stayed held after every work let go of it"


def test_no_tensor_is_left_owned_by_a_gloo_work_after_fully_shard_steps():
    run_distributed(_no_tensor_left_owned_by_a_work, 2)


def _launch_exit_release(case: str, tmp_path) -> tuple[int, str]:
    """Both ranks of ``_exit_release_rank.py CASE`` (fresh interpreters, env:// rendezvous on a free
    port); rank 1's exit status and both ranks' output. Rank 0 must succeed."""
    import os
    import socket
    import subprocess
    import sys

    fifo = str(tmp_path / f"fifo-{case}")
    os.mkfifo(fifo)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    cmd = [sys.executable, os.path.join(here, "_exit_release_rank.py"), case, fifo]
    procs = []
    for r in range(2):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   OMP_NUM_THREADS="1", PYTHONPATH=path)  # fmt: skip
        procs.append(
            subprocess.Popen(cmd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        )
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[0].returncode == 0, outs[0][-2000:]
    return procs[1].returncode, "".join(outs)


def test_a_gloo_worker_releasing_at_exit_needs_no_gil(tmp_path):
    """Note [gloo release] made certain (``tests/dist/_exit_release_rank.py``): rank 1 exits while its
    gloo worker still holds an all-gather's work on tensors Python holds; the worker releases it while
    the last exit handler keeps the GIL, just before finalization. Reference: torch's own
    ``all_gather_into_tensor`` on such tensors aborts there (SIGABRT, "terminate called without an
    active exception": the worker's 2 -> 1 decref asks for the GIL); the library's all-gather
    (``DBuffer.all_gather_from``, fully_shard's unshard) hands the worker aliases it keeps by a C++
    reference, and rank 1 exits cleanly."""
    import signal

    rc, out = _launch_exit_release("plain", tmp_path)
    if rc == 0:
        pytest.skip(
            "this torch / CPython lets a worker release a work at exit without the GIL: nothing to show"
        )
    assert rc == -signal.SIGABRT and "terminate called" in out, (
        f"control: rank 1 exited with {rc}\n{out[-2000:]}"
    )
    rc, out = _launch_exit_release("ragged", tmp_path)
    assert rc == 0, (
        f"rank 1 exited with {rc} after the library's all-gather (Note [gloo release])\n{out[-2000:]}"
    )
