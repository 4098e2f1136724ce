"""Tear a process group down without aborting a peer: ``raggedfsdp.shutdown_process_group()``.

A gloo rank that closes its sockets while a peer is still inside the last collective (its final
receive not yet returned) can make the peer's gloo thread call ``std::terminate`` ("terminate called
without an active exception", SIGABRT after a successful run). A collective ``barrier()`` alone
narrows that window but does not close it: a rank returns from the barrier as soon as *it* has what
it needs. So after the barrier every rank also checks in on the rendezvous store (a key-value
store, no gloo sockets) and waits until all have, i.e. until every rank has *returned* from its last
collective; only then does any rank destroy the group.

A plain ``dist.barrier(); dist.destroy_process_group()`` after raggedfsdp code is safe too: the
abort seen there came from a gloo worker releasing a finished work at interpreter exit, whose
release of a tensor with a Python object asked for the GIL; the library hands collectives aliases
it keeps by a C++ reference, whose release needs no GIL (Note [gloo release],
``raggedfsdp/_release.py``). Collectives a script issues itself on its own tensors are not covered.
"""

from __future__ import annotations

import itertools
import time

import torch.distributed as dist

_calls = itertools.count()


def shutdown_process_group(*, synchronize: bool = True, timeout_s: float = 60.0) -> None:
    """Destroy the default process group; with ``synchronize`` (every rank must call it then), first a
    barrier and a store check-in so that no rank tears down while a peer is still in a collective.
    ``synchronize=False`` (a failing rank) destroys at once. Never raises from the synchronisation:
    a peer that is gone makes it give up after ``timeout_s`` and destroy anyway."""
    if not dist.is_initialized():
        return
    try:
        if synchronize and dist.get_world_size() > 1:
            dist.barrier()
            store = dist.distributed_c10d._get_default_store()
            key = f"raggedfsdp/teardown/{next(_calls)}"
            store.add(key, 1)
            deadline = time.monotonic() + timeout_s
            while int(store.add(key, 0)) < dist.get_world_size() and time.monotonic() < deadline:
                time.sleep(0.005)
    except Exception:  # noqa: BLE001 - teardown must not mask the run's own result
        pass
    finally:
        dist.destroy_process_group()


__all__ = ["shutdown_process_group"]
