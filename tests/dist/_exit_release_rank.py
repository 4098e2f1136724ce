"""One rank of ``test_teardown.py::test_a_worker_release_at_exit_takes_no_gil`` (Note [gloo release]).

``python _exit_release_rank.py CASE FIFO`` with env:// variables for 2 ranks. Rank 1 leaves one
collective pending at exit, on a tensor Python still holds; rank 0 completes it only while rank 1's
last exit handler keeps the GIL (a blocking ``read`` of ``FIFO`` through ``ctypes.PyDLL``: no bytecode
runs, so the GIL is not handed over), then lets rank 1 go on into finalization. Rank 1's gloo worker
releases the work meanwhile; if that release needs the GIL, the worker asks for it before
finalization and gets it only during it (a finalizer below sleeps), and CPython ends the thread
inside a ``noexcept`` destructor: SIGABRT, "terminate called without an active exception" -- the
report's abort, made certain instead of rare. ``CASE``:

- ``plain``: ``dist.all_gather_into_tensor(out, inp, async_op=True)`` on tensors kept in a global,
  its work dropped (torch alone: the control, must abort);
- ``ragged``: the same all-gather through the library, ``DBuffer.all_gather_from(inp, group,
  async_op=True)`` (the unsharded-parameter gather of ``fully_shard``), buffer and input kept.

Rank 1 drops the returned work at once, as the library does after ``wait()``: the state the report's
runs were in when the worker had not yet let go of the last collective's work.
"""

import atexit
import ctypes
import os
import sys
import time

# Handlers registered at interpreter start (site .pth files) would run after the hold below.
atexit._clear()
_STATE: dict = {}


def _tell_rank0() -> None:  # the second-to-last exit handler
    if _STATE:
        _STATE["store"].set("rank1-exiting", "1")


if os.environ.get("RANK") == "1":
    # The last exit handler: libc read(2) of the FIFO, called by atexit itself through ctypes.PyDLL
    # (the GIL stays held; a Python wrapper would run bytecode after it, handing the GIL over).
    atexit.register(
        ctypes.PyDLL(None).read, os.open(sys.argv[2], os.O_RDWR), ctypes.create_string_buffer(1), 1
    )
atexit.register(_tell_rank0)


class _SleepWhenFinalized:
    """Freed by the garbage collection of module teardown (after finalization began): sleeping
    releases the GIL to a worker waiting for it."""

    def __del__(self, _sleep=time.sleep) -> None:
        _sleep(0.3)


def main(case: str, fifo: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    held = globals().setdefault("HELD", [])  # what Python still holds at exit
    out, inp = torch.empty(16), torch.full((8,), float(rank))
    if case == "plain":
        held += [out, inp]
        start = lambda: dist.all_gather_into_tensor(out, inp, async_op=True)  # noqa: E731
    else:
        from raggedfsdp.buffer import DBuffer
        from raggedfsdp.planner import plan_layout

        buf = DBuffer(plan_layout([16], [1], 2), sharded=False, rank=rank, dtype=torch.float32,
                      device=torch.device("cpu"), shapes=[(16,)])  # fmt: skip
        held += [buf, inp]
        start = lambda: buf.all_gather_from(inp, dist.group.WORLD, async_op=True)  # noqa: E731
    if rank == 1:
        _STATE["store"] = store
        start()  # its work is dropped at once, as after a wait(): only the gloo worker holds it
        _STATE["sleeper"] = _SleepWhenFinalized()
        print("rank 1: exiting with the collective pending", flush=True)
    else:
        store.wait(["rank1-exiting"])
        time.sleep(0.3)  # rank 1 is in its last exit handler by now
        start().wait()  # completes rank 1's pending collective
        time.sleep(1.0)  # rank 1's worker releases the work meanwhile
        fd = os.open(fifo, os.O_WRONLY)
        os.write(fd, b"x")
        os.close(fd)
        print("rank 0: done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
