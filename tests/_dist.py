"""Multi-process test harness: real gloo process groups on CPU, one intra-op thread per rank.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes, initialises a gloo
process group through a ``FileStore`` in a fresh temporary directory (no ports), runs
``fn(rank, world_size, *args)`` on each rank and re-raises the first failure in the parent with the
rank and the remote traceback. A rank that fails makes the parent terminate the others, so a
collective mismatch never hangs the suite. Keep ``fn`` a module-level function (it is pickled) and
batch many sub-cases into one call: spawning costs ~2-3 s per process group on this machine.
"""

from __future__ import annotations

import os
import signal
import tempfile
import traceback
from datetime import timedelta

import torch.multiprocessing as mp


def _worker(fn, rank, world_size, store_path, args, err_q):
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


def run_distributed(fn, world_size: int, *args, timeout: float = 300.0) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; raise on any rank's failure."""
    ctx = mp.get_context("spawn")
    err_q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_worker, args=(fn, r, world_size, store_path, args, err_q), daemon=True)
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
