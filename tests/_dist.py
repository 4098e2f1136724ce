"""Multi-process test harness: real gloo process groups on CPU, one intra-op thread per rank.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes, initialises a gloo
process group through a ``FileStore`` in a fresh temporary directory (no ports), runs
``fn(rank, world_size, *args)`` on each rank and re-raises the first failure in the parent with the
rank and the remote traceback. A rank that fails makes the parent terminate the others, so a
collective mismatch never hangs the suite. Keep ``fn`` a module-level function (it is pickled) and
batch many sub-cases into one call.

Ranks start from a forkserver that has imported torch and its distributed packages once
(``rank_context()``): a spawned rank spent 3-4 CPU-seconds importing them, a forked one starts in
~0.1 s (a 4-rank group took 40 s to start on a loaded 2-core box, 0.2 s forked). Nothing else is
preloaded (raggedfsdp and the test modules are imported in each rank, as before); each rank gets the
parent's ``os.environ`` of the moment it starts. ``RAGGEDFSDP_TEST_START=spawn`` restores fresh
interpreters (``spawn``) for every rank.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import traceback
from datetime import timedelta

import torch.multiprocessing as mp

START_ENV = "RAGGEDFSDP_TEST_START"
# torch only, imported once in the forkserver: they start no thread, and the environment variables they
# read at import (TORCH_*, TORCHDYNAMO_*, TORCHINDUCTOR_*) are the pytest process's when the first rank
# starts (no test sets them for its ranks; RAGGEDFSDP_TEST_START=spawn if one must)
PRELOAD = (
    "torch",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torch._dynamo",
    "torch.testing",
)


def rank_context():
    """The multiprocessing context of test ranks: a forkserver preloading ``PRELOAD`` (``spawn`` when
    ``RAGGEDFSDP_TEST_START=spawn``). A rank must call ``adopt_environ(env)`` with the parent's
    ``dict(os.environ)`` first: a forked rank has the forkserver's environment, not the parent's."""
    if os.environ.get(START_ENV, "forkserver") == "spawn":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def adopt_environ(env: dict) -> None:
    """Make this process's environment ``env`` (the parent's when it started the rank)."""
    if env != os.environ:
        os.environ.clear()
        os.environ.update(env)


def exit_through_finalization(forked: bool) -> None:
    """Call last in a rank (``forked``: started by the forkserver): it then ends as a spawned rank does,
    through the interpreter's finalization (atexit handlers, module teardown, C++ static destructors),
    not the forkserver's bare ``os._exit``, so a rank that aborts at exit (Note [gloo release]) still
    fails its test. The forkserver's child returns to ``os._exit(code)``, which now raises
    ``SystemExit(code)`` out of the forkserver's loop, as ``spawn_main`` ends a spawned rank."""
    if forked:
        os._exit = sys.exit


def _worker(fn, rank, world_size, store_path, args, err_q, env, forked):
    adopt_environ(env)
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=120)
        )
        fn(rank, world_size, *args)
        from raggedfsdp.teardown import shutdown_process_group

        shutdown_process_group()  # barrier + store check-in, then destroy (no SIGABRT in a peer)
        err_q.put((rank, None))
    except BaseException:  # noqa: BLE001 - forwarded to the parent with the traceback
        err_q.put((rank, traceback.format_exc()))
    finally:
        exit_through_finalization(forked)


def run_distributed(fn, world_size: int, *args, timeout: float = 300.0) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; raise on any rank's failure."""
    ctx = rank_context()
    env, forked = dict(os.environ), ctx.get_start_method() == "forkserver"
    err_q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_worker,
                args=(fn, r, world_size, store_path, args, err_q, env, forked),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        failures: list[tuple[int, str]] = []
        reported: set[int] = set()
        import queue
        import time

        deadline = time.monotonic() + timeout
        try:
            while len(reported) < world_size:
                try:
                    rank, tb = err_q.get(timeout=0.5)
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if r not in reported and p.exitcode is not None]
                    if dead:
                        time.sleep(1.0)  # a report may still be in flight
                        while not err_q.empty():
                            rank, tb = err_q.get()
                            reported.add(rank)
                            if tb is not None:
                                failures.append((rank, tb))
                        dead = [r for r in dead if r not in reported]
                        if dead or failures:
                            if not failures:
                                failures.append(
                                    (
                                        dead[0],
                                        f"process exited with code {procs[dead[0]].exitcode} without a "
                                        f"report",
                                    )
                                )
                            break
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"distributed test timed out after {timeout}s ({len(reported)}/{world_size} "
                            f"ranks finished)"
                        )
                    continue
                reported.add(rank)
                if tb is not None:
                    failures.append((rank, tb))
                    break  # one failing rank ends the job: the others would hang in a collective
        finally:
            if failures:
                for p in procs:
                    p.terminate()
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
                    p.join()
        if not failures:
            # a rank that reported success but then died (e.g. SIGABRT, "terminate called without an
            # active exception", at teardown) is a failure too: the test suite must see the abort
            for r, p in enumerate(procs):
                if p.exitcode:
                    how = (
                        f"signal {signal.Signals(-p.exitcode).name}"
                        if p.exitcode < 0
                        else f"code {p.exitcode}"
                    )
                    failures.append((r, f"rank {r} reported success, then exited with {how} (teardown)"))
                    break
        if failures:
            rank, tb = failures[0]
            raise AssertionError(f"rank {rank} of {world_size} failed:\n{tb}")
