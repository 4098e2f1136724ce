"""NCCL harness for tests/gpu: one process per GPU, ``torch.cuda.set_device(rank)``, results back.

``run_nccl(fn, *args)`` spawns ``torch.cuda.device_count()`` processes (or ``world_size``), inits an
NCCL process group through a ``FileStore`` (no ports), runs ``fn(rank, world_size, *args)`` and
returns the list of per-rank return values; the first failing rank's traceback is re-raised in the
parent and the other ranks are terminated, so a collective mismatch never hangs the run.
"""

from __future__ import annotations

import json
import os
import queue
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.multiprocessing as mp


def _worker(fn, rank, ws, store_path, args, q):
    try:
        import torch.distributed as dist

        torch.cuda.set_device(rank)
        store = dist.FileStore(store_path, ws)
        dist.init_process_group(
            "nccl",
            store=store,
            rank=rank,
            world_size=ws,
            timeout=timedelta(seconds=120),
            device_id=torch.device("cuda", rank),
        )
        out = fn(rank, ws, *args)
        dist.barrier()
        dist.destroy_process_group()
        q.put((rank, out, None))
    except BaseException:  # noqa: BLE001 - forwarded to the parent
        q.put((rank, None, traceback.format_exc()))


def world_size() -> int:
    return torch.cuda.device_count()


def run_nccl(fn, *args, world_size: int | None = None, timeout: float = 240.0) -> list:
    ws = world_size or torch.cuda.device_count()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    results: dict[int, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=_worker, args=(fn, r, ws, os.path.join(tmp, "store"), args, q), daemon=True)
            for r in range(ws)
        ]
        for p in procs:
            p.start()
        failure = None
        deadline = time.monotonic() + timeout
        try:
            while len(results) < ws and failure is None:
                try:
                    rank, out, tb = q.get(timeout=1.0)
                except queue.Empty:
                    dead = [
                        r for r, p in enumerate(procs) if r not in results and p.exitcode not in (None, 0)
                    ]
                    if dead:
                        failure = (dead[0], f"exited with code {procs[dead[0]].exitcode} without a report")
                    elif time.monotonic() > deadline:
                        failure = (-1, f"timed out after {timeout}s ({len(results)}/{ws} ranks finished)")
                    continue
                if tb is not None:
                    failure = (rank, tb)
                else:
                    results[rank] = out
        finally:
            for p in procs:
                if failure is not None and p.is_alive():
                    p.terminate()
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    if failure is not None:
        raise AssertionError(f"rank {failure[0]} of {ws} failed:\n{failure[1]}")
    return [results[r] for r in range(ws)]


def record(name: str, data) -> None:
    """Write ``data`` (JSON-serialisable) to ``$RAGGEDFSDP_GPU_RESULTS/<name>.json`` when set; print it."""
    print(f"[gpu-result] {name}: {json.dumps(data)}")
    out = os.environ.get("RAGGEDFSDP_GPU_RESULTS")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump(data, f, indent=1)
