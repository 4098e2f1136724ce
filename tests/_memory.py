"""Shared pieces of the peak-memory tests: the model, the two backends' builders, a fake-PG runner.

Memory is measured with ``raggedfsdp.app.bench.memory.measure_train_step`` (the documented method). The
multi-rank runs use torch's single-threaded *fake* process group: collectives are no-ops, so the
numbers are exactly what each FSDP runtime allocates and frees (identical to a real backend minus
backend scratch, and deterministic), for any rank of any world size, in one process.
"""

from __future__ import annotations

import torch
from torch import nn

D, N_BLOCKS, BATCH = 512, 8, 16


class Block(nn.Module):
    def __init__(self, d: int = D):
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class MemNet(nn.Module):
    """``n`` blocks of two ``Linear(d, d)`` (one FSDP unit each) and a root ``Linear(d, d)`` head."""

    def __init__(self, d: int = D, n: int = N_BLOCKS):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, d)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def loss_fn(x):
    return lambda model: model(x).float().pow(2).mean()


def backends():
    """``{name: (fully_shard, MixedPrecisionPolicy class)}`` for raggedfsdp and torch's FSDP2."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import raggedfsdp

    return {
        "ragged": (raggedfsdp.fully_shard, raggedfsdp.MixedPrecisionPolicy),
        "torch": (torch_fully_shard, TorchMP),
    }


def builder(backend: str, init: dict, mesh, param_dtype=None, *, d: int = D, n: int = N_BLOCKS, lr=1e-3):
    """A ``build()`` for ``measure_train_step``: MemNet from ``init``, sharded per block + root, AdamW."""
    fs, mp_cls = backends()[backend]
    mp_policy = mp_cls(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)

    def build():
        model = MemNet(d, n)
        model.load_state_dict(init)
        for b in model.blocks:
            fs(b, mesh=mesh, mp_policy=mp_policy)
        fs(model, mesh=mesh, mp_policy=mp_policy)
        return model, torch.optim.AdamW(model.parameters(), lr=lr, foreach=True)

    return build


def comm_completion(mode: str):
    """Context manager fixing what raggedfsdp's collectives report to its early-free poll
    (``CommHandle.is_done``; Note [early free] in ``raggedfsdp/fsdp/_reduce.py``): ``"never"`` -- no
    collective reports completion before it is waited (a network slower than the backward: the worst
    case), ``"done"`` -- every collective reports completion at once (communication that keeps up).
    Only raggedfsdp polls completion; torch's FSDP2 frees at fixed points, so it is unaffected. (Do not
    rely on the fake process group's own works: their ``is_completed()`` is False on torch 2.11-2.14 and
    True on 2.15.)"""
    import contextlib

    from raggedfsdp.buffer.streams import CommHandle

    if mode not in ("never", "done"):
        raise ValueError(f"comm_completion(mode={mode!r}): use 'never' or 'done'")

    @contextlib.contextmanager
    def cm():
        orig = CommHandle.is_done
        # "never": no *collective* reports completion; a purely local copy on the compute stream (world
        # size 1: no work, no side stream) is done when issued, on any network
        CommHandle.is_done = (
            (lambda self: True)
            if mode == "done"
            else (lambda self: self.work is None and self.stream is None)
        )
        try:
            yield
        finally:
            CommHandle.is_done = orig

    return cm()


def _fake_worker(fn, rank, ws, args, q, env, forked):
    import os
    import traceback

    from _dist import adopt_environ, exit_through_finalization

    adopt_environ(env)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=ws)
        q.put((rank, ws, fn(rank, ws, *args), None))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - forwarded to the parent
        q.put((rank, ws, None, traceback.format_exc()))
    finally:
        exit_through_finalization(forked)


def run_fake_ranks(fn, ranks, *args, timeout: float = 300.0) -> list:
    """Run ``fn(rank, ws, *args)`` for every ``(ws, rank)`` of ``ranks``, each in its own process on a
    fake process group, all at once (each is single-threaded and alone in its process group: what one
    measures does not depend on the others); their results in the order of ``ranks``. Processes start
    as ``tests/_dist.py``'s ranks do (``rank_context``)."""
    import os

    from _dist import rank_context

    ctx = rank_context()
    env, forked = dict(os.environ), ctx.get_start_method() == "forkserver"
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_fake_worker, args=(fn, rank, ws, args, q, env, forked), daemon=True)
        for ws, rank in ranks
    ]
    for p in procs:
        p.start()
    results, failures = {}, []
    try:
        for _ in procs:
            rank, ws, result, tb = q.get(timeout=timeout)
            if tb is not None:
                failures.append(f"fake-PG rank {rank} of {ws} failed:\n{tb}")
                break
            results[(ws, rank)] = result
    finally:
        for p in procs:
            if failures:
                p.kill()
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if failures:
        raise AssertionError(failures[0])
    return [results[(ws, rank)] for ws, rank in ranks]


def run_fake_rank(fn, ws: int, rank: int, *args, timeout: float = 300.0):
    """Run ``fn(rank, ws, *args)`` in its own process on a fake process group; return its result."""
    return run_fake_ranks(fn, [(ws, rank)], *args, timeout=timeout)[0]
